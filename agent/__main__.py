"""``weightship-agent`` / ``python -m agent``: run the node agent until SIGTERM or SIGINT."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence

from agent.config import check_disk, load_config
from agent.daemon import Agent, install_signal_handlers
from weightship.errors import WeightshipError
from weightship.logs import configure


async def _serve(agent: Agent) -> None:
    stop = asyncio.Event()
    install_signal_handlers(stop)
    await agent.run(stop)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    try:
        config = load_config(argv)
        check_disk(config)
    except WeightshipError as exc:
        print(f"weightship-agent: {exc.message}", file=sys.stderr)
        return 2
    configure(config.log_level)
    try:
        asyncio.run(_serve(Agent(config)))
    except WeightshipError as exc:
        print(f"weightship-agent: {exc.message}", file=sys.stderr)
        return 1
    except Exception:
        logging.getLogger("agent").exception("agent.crashed")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
