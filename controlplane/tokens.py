"""tokens routes (being written)."""

from fastapi import APIRouter

router = APIRouter()


def bootstrap_admin(state: object) -> None:
    """Placeholder until tokens are written."""
