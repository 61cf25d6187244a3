"""Origin stores (being written)."""

from typing import Any


def open_store(settings: Any) -> Any:
    """Placeholder."""
    return None
