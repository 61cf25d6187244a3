"""Blob URLs of a test origin, as the fetcher asks for them."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

from weightship.schemas import BlobURL


class URLs:
    """Blob URLs on a base; the first ``expired`` requests hand out URLs already past their expiry."""

    def __init__(self, base: str, expired: int = 0) -> None:
        self.base = base
        self.expired = expired
        self.requests = 0

    async def blob_urls(self, blobs: Sequence[str]) -> dict[str, BlobURL]:
        self.requests += 1
        # The origin sees an old timestamp; the agent's view of expiry is still in the future, so
        # only the origin's 403 tells it to refresh.
        stamp = 1 if self.requests <= self.expired else 4_000_000_000
        later = datetime.now(UTC) + timedelta(hours=1)
        return {b: BlobURL(url=f"{self.base}/blobs/{b}?expires={stamp}", expires_at=later) for b in blobs}
