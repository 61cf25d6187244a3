"""The chunk feed's contract: which chunks of a version still being fetched a model server may read.

``GET /local/v1/versions/{digest}/chunks?after=N&feed=F&deployment=D&timeout=S`` (the agent's local
API, ``agent.chunkfeed``) answers a ``LocalChunkPage``: the chunks verified and written in place
since cursor ``N``, in the order they arrived. A chunk is listed only after its SHA-256 matched the
manifest and its bytes are written to the file being assembled, so a reader that reads exactly the
listed ranges reads only verified bytes. The cursor is valid within one ``feed`` (one assembly of the
version); when the answer's ``feed`` differs from the one asked for, the page starts again at 0 (an
agent restart, a retried fetch) and lists every chunk verified so far. ``complete`` means the version
is ready: every chunk is in ``path`` (the ready version directory).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from weightship.schemas import LocalVersionState

__all__ = ["LocalChunk", "LocalChunkPage"]

Count = Annotated[int, Field(ge=0, le=2**63 - 1)]
Digest = Annotated[str, Field(pattern=r"^sha256:[0-9a-f]{64}$")]


class _Schema(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LocalChunk(_Schema):
    """One verified chunk of a version being fetched: chunk ``chunk`` of manifest file ``file``."""

    file: str = Field(description="the file's relative path in the manifest")
    chunk: Count
    offset: Count
    length: Count
    path: str = Field(description="absolute path of the file being assembled that holds these bytes")


class LocalChunkPage(_Schema):
    """``GET /local/v1/versions/{digest}/chunks``: chunks verified since the cursor, in arrival order."""

    digest: Digest
    state: LocalVersionState
    reason: str = Field(default="", max_length=4096)
    feed: str = Field(default="", max_length=64, description="the assembly the cursor counts in")
    next: Count = Field(default=0, description="the cursor to ask with next")
    chunks: list[LocalChunk] = Field(default_factory=list)
    chunks_total: Count = 0
    complete: bool = Field(default=False, description="the version is ready: every chunk is in ``path``")
    path: str | None = Field(default=None, description="the ready version directory, once complete")
