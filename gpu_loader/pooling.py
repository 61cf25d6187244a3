"""Sentence embeddings from token states, as sentence-transformers computes them.

A sentence-transformers model directory names its modules in ``modules.json``: the transformer
(``sentence_transformers.models.Transformer``), then ``Pooling`` (its settings in
``<path>/config.json``: which of CLS, mean, max, mean-sqrt-len or last-token pooling, several
concatenated when several are on), then optionally ``Normalize`` (unit L2 length). The input
length limit is ``max_seq_length`` in ``sentence_bert_config.json``.

A version without ``modules.json`` is pooled by mean over the attention mask and not normalised,
the usual default for encoders. Modules that carry weights of their own (``Dense``, ``CNN``, ...)
are refused: their weights live outside the checkpoint this server loads.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gpu_loader.errors import TensorMismatchError

__all__ = ["Pooling", "parse_pooling"]

_MODES = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "lasttoken")
_TRANSFORMER = "sentence_transformers.models.Transformer"
_POOLING = "sentence_transformers.models.Pooling"
_NORMALIZE = "sentence_transformers.models.Normalize"


@dataclass(frozen=True)
class Pooling:
    """How token states become one vector per input."""

    modes: tuple[str, ...] = ("mean_tokens",)
    normalize: bool = False
    max_seq_length: int | None = None
    #: where the settings came from, for the status page
    source: str = "default (mean pooling, no modules.json)"

    def __call__(self, states: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``states`` ``[batch, seq, hidden]`` and ``mask`` ``[batch, seq]`` (1 = token) to ``[batch, dim]``."""
        states = states.float()
        weights = mask.to(states.dtype).unsqueeze(-1)
        counts = weights.sum(1).clamp(min=1e-9)
        parts: list[torch.Tensor] = []
        for mode in self.modes:
            if mode == "cls_token":
                parts.append(states[:, 0])
            elif mode == "mean_tokens":
                parts.append((states * weights).sum(1) / counts)
            elif mode == "mean_sqrt_len_tokens":
                parts.append((states * weights).sum(1) / counts.sqrt())
            elif mode == "max_tokens":
                parts.append(states.masked_fill(weights == 0, -1e9).max(1).values)
            else:  # lasttoken: the last position the mask keeps
                last = mask.long().sum(1) - 1
                parts.append(states[torch.arange(states.shape[0], device=states.device), last.clamp(min=0)])
        pooled = torch.cat(parts, dim=-1)
        if self.normalize:
            pooled = torch.nn.functional.normalize(pooled, p=2, dim=-1)
        return pooled


def parse_pooling(read: Callable[[str], bytes | None]) -> Pooling:
    """The pooling a version declares; ``read(path)`` gives a side file's bytes or ``None`` when absent."""
    raw = read("modules.json")
    if raw is None:
        return Pooling()
    try:
        modules = json.loads(raw)
        kinds = [(str(m["type"]), str(m.get("path", ""))) for m in modules]
    except (ValueError, KeyError, TypeError) as exc:
        raise TensorMismatchError(f"modules.json is malformed ({exc!r}): expected a list of {{type, path}} objects") from None
    unknown = [t for t, _ in kinds if t not in (_TRANSFORMER, _POOLING, _NORMALIZE)]
    if unknown:
        raise TensorMismatchError(
            f"modules.json names sentence-transformers module(s) {unknown} that weightship-serve does not run "
            "(it runs Transformer, Pooling and Normalize); serve the model with sentence-transformers instead"
        )
    modes: tuple[str, ...] = ("mean_tokens",)
    for kind, path in kinds:
        if kind != _POOLING:
            continue
        where = f"{path}/config.json" if path else "config.json"
        settings = read(where)
        if settings is None:
            raise TensorMismatchError(f"modules.json names a Pooling module at {path!r} but {where} is missing")
        try:
            doc = json.loads(settings)
        except ValueError as exc:
            raise TensorMismatchError(f"{where} is not JSON: {exc}") from None
        modes = tuple(m for m in _MODES if doc.get(f"pooling_mode_{m}"))
        if doc.get("pooling_mode_weightedmean_tokens"):
            raise TensorMismatchError(f"{where}: weighted-mean pooling is not supported; use mean, CLS, max or last-token")
        if not modes:
            raise TensorMismatchError(f"{where} turns on no pooling mode: set one pooling_mode_* to true")
    max_len: int | None = None
    bert = read("sentence_bert_config.json")
    if bert is not None:
        try:
            value = json.loads(bert).get("max_seq_length")
        except (ValueError, AttributeError):
            value = None
        max_len = value if isinstance(value, int) and value > 0 else None
    normalize = any(kind == _NORMALIZE for kind, _ in kinds)
    return Pooling(modes=modes, normalize=normalize, max_seq_length=max_len, source="modules.json")
