"""The environment a control plane process starts with in the start-up tests."""

from __future__ import annotations

import os
from pathlib import Path

STRONG_ADMIN = "ws_startup-test-admin-0123456789abcdef"


def _env(workdir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WEIGHTSHIP_")}
    env.update(
        {
            "WEIGHTSHIP_DATABASE_URL": f"sqlite:///{workdir / 'cp.db'}",
            "WEIGHTSHIP_STORE": f"local:{workdir / 'origin'}",
            "WEIGHTSHIP_ADMIN_TOKEN": STRONG_ADMIN,
            **extra,
        }
    )
    return env
