"""Request and response bodies of the OpenAI-style routes of ``weightship-serve``.

``POST /v1/completions`` (causal LMs) and ``POST /v1/embeddings`` (embedding and encoder models)
take the fields OpenAI's API defines where they mean something here, and refuse the rest with a
400 that says why: completions are greedy (``temperature`` is accepted and ignored, ``n`` must
be 1, no streaming), and inputs are text when the version ships a tokenizer, token ids always.
Every answer names the version that computed it: ``weightship_digest`` in the body and the
``X-Weightship-Digest`` header (set by the server).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

__all__ = [
    "MAX_BATCH",
    "MAX_NEW_TOKENS",
    "BadRequest",
    "CompletionRequest",
    "EmbeddingRequest",
    "completion_body",
    "embedding_body",
    "parse_completion",
    "parse_embedding",
]

MAX_BATCH = 32
MAX_NEW_TOKENS = 64
_DEFAULT_MAX_TOKENS = 16


class BadRequest(Exception):
    """The request body does not fit the route; the message is the 400's detail."""


@dataclass(frozen=True)
class CompletionRequest:
    """Prompts as text or as token ids (exactly one of the two), and how many tokens to add."""

    texts: list[str] | None
    token_ids: list[list[int]] | None
    max_tokens: int


@dataclass(frozen=True)
class EmbeddingRequest:
    """Inputs as text or as token ids (exactly one of the two)."""

    texts: list[str] | None
    token_ids: list[list[int]] | None


def _body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw or b"{}")
    except ValueError as exc:
        raise BadRequest(f"body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object")
    return body


def _is_ids(value: object) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)
    )


def _inputs(value: object, field: str) -> tuple[list[str] | None, list[list[int]] | None]:
    """A string, a list of strings, a list of token ids or a list of such lists."""
    if isinstance(value, str) or _is_ids(value):
        value = [value]
    if not isinstance(value, list) or not value or len(value) > MAX_BATCH:
        raise BadRequest(
            f"{field} must be a string, a list of 1 to {MAX_BATCH} strings, a list of token ids, "
            f"or a list of 1 to {MAX_BATCH} lists of token ids"
        )
    if all(isinstance(v, str) and v for v in value):
        return [str(v) for v in value], None
    if all(_is_ids(v) for v in value):
        return None, [list(v) for v in value]
    raise BadRequest(f"{field}: mix neither strings with token ids nor empty inputs; send one kind, each non-empty")


def parse_completion(raw: bytes) -> CompletionRequest:
    """The body of ``POST /v1/completions``."""
    body = _body(raw)
    if "prompt" not in body:
        raise BadRequest("prompt is required: a string, a list of strings, or token ids")
    texts, ids = _inputs(body["prompt"], "prompt")
    max_tokens = body.get("max_tokens", _DEFAULT_MAX_TOKENS)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or not 1 <= max_tokens <= MAX_NEW_TOKENS:
        raise BadRequest(f"max_tokens must be an integer from 1 to {MAX_NEW_TOKENS}")
    if body.get("stream"):
        raise BadRequest("stream is not supported: send stream=false (or leave it out)")
    if body.get("n", 1) != 1 or body.get("best_of", 1) != 1:
        raise BadRequest("n and best_of must be 1: completions are greedy, so every choice would be the same")
    return CompletionRequest(texts, ids, max_tokens)


def parse_embedding(raw: bytes) -> EmbeddingRequest:
    """The body of ``POST /v1/embeddings``."""
    body = _body(raw)
    if "input" not in body:
        raise BadRequest("input is required: a string, a list of strings, or token ids")
    texts, ids = _inputs(body["input"], "input")
    fmt = body.get("encoding_format", "float")
    if fmt != "float":
        raise BadRequest(f"encoding_format {fmt!r} is not supported: use 'float'")
    return EmbeddingRequest(texts, ids)


def _common(kind: str, model: str, digest: str, epoch: int) -> dict[str, Any]:
    return {
        "id": f"{kind}-{uuid.uuid4().hex}",
        "created": int(time.time()),
        "model": model,
        "weightship_digest": digest,
        "weightship_epoch": epoch,
    }


def completion_body(
    *,
    model: str,
    digest: str,
    epoch: int,
    prompt_tokens: list[list[int]],
    choices: list[tuple[list[int], str | None, str]],
) -> dict[str, Any]:
    """An OpenAI ``text_completion``; each choice is (token ids, text or None without a tokenizer, finish reason)."""
    completed = sum(len(ids) for ids, _, _ in choices)
    prompted = sum(len(p) for p in prompt_tokens)
    return {
        **_common("cmpl", model, digest, epoch),
        "object": "text_completion",
        "choices": [
            {"index": i, "text": text if text is not None else "", "token_ids": ids, "finish_reason": reason, "logprobs": None}
            for i, (ids, text, reason) in enumerate(choices)
        ],
        "usage": {"prompt_tokens": prompted, "completion_tokens": completed, "total_tokens": prompted + completed},
    }


def embedding_body(
    *, model: str, digest: str, epoch: int, prompt_tokens: list[list[int]], vectors: list[list[float]]
) -> dict[str, Any]:
    """An OpenAI embedding list."""
    prompted = sum(len(p) for p in prompt_tokens)
    return {
        **_common("emb", model, digest, epoch),
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)],
        "usage": {"prompt_tokens": prompted, "total_tokens": prompted},
    }
