"""What the server serves: a loaded, validated model, and the slot that swaps models atomically.

A request takes a reference to the slot's current model and keeps it until it has answered;
``swap`` replaces the current model in one step under a lock, so every request is answered by
exactly one version and none fails during a switch. The old model is *retired*: once its last
request returns, ``drained`` is set and the server drops it, which frees its memory.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gpu_loader.loader import Loader, LoadStats, VerifyMode
from gpu_loader.model import LlamaConfig, LlamaForCausalLM, build_model
from gpu_loader.validation import ValidationOutcome, validate
from gpu_loader.version import open_version
from weightship.errors import WeightshipError
from weightship.logs import event

__all__ = ["ModelSlot", "Prepared", "ServedModel", "generate_tokens", "prepare"]

_log = logging.getLogger(__name__)


@dataclass(eq=False)
class ServedModel:
    """A model loaded from one version and validated."""

    digest: str
    epoch: int
    directory: Path
    model: LlamaForCausalLM | None
    stats: LoadStats
    outcome: ValidationOutcome
    refs: int = 0
    retired: bool = False
    drained: threading.Event = field(default_factory=threading.Event)


@dataclass
class Prepared:
    """The result of loading and validating a version: a model to serve, or why not."""

    digest: str
    served: ServedModel | None
    stats: LoadStats | None
    outcome: ValidationOutcome | None
    error: str | None

    @property
    def passed(self) -> bool:
        """Whether the version may serve."""
        return self.served is not None


class ModelSlot:
    """The model currently served, swapped atomically."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._current: ServedModel | None = None

    @property
    def current(self) -> ServedModel | None:
        """The model new requests go to."""
        return self._current

    def acquire(self) -> ServedModel | None:
        """Take a reference to the current model (``None`` when nothing is served)."""
        with self._lock:
            served = self._current
            if served is not None:
                served.refs += 1
            return served

    def release(self, served: ServedModel) -> None:
        """Give back a reference taken with ``acquire``."""
        with self._lock:
            served.refs -= 1
            if served.retired and served.refs == 0:
                served.drained.set()

    def swap(self, new: ServedModel) -> ServedModel | None:
        """Serve ``new`` from now on; the previous model (retired) is returned."""
        with self._lock:
            old, self._current = self._current, new
            if old is not None:
                old.retired = True
                if old.refs == 0:
                    old.drained.set()
            return old


def prepare(
    loader: Loader,
    directory: Path,
    *,
    digest: str | None,
    epoch: int,
    device: str,
    dtype: torch.dtype | None,
    verify: VerifyMode,
) -> Prepared:
    """Load the version in ``directory`` onto ``device`` and validate it (blocking)."""
    stats: LoadStats | None = None
    label = digest or str(directory)
    try:
        version = open_version(directory, digest=digest)
        label = version.digest
        config = LlamaConfig.from_json(version.read_file("config.json"))
        model = build_model(config, dtype=dtype)
        stats = loader.load_into(
            model, directory, manifest=version.manifest, device=device, dtype=dtype, verify=verify
        ).stats
        outcome = validate(model, version)
    except WeightshipError as exc:
        event(_log, "serve.load_failed", logging.WARNING, digest=label, error=exc.message)
        return Prepared(label, None, stats, None, f"{type(exc).__name__}: {exc.message}")
    if not outcome.passed:
        return Prepared(label, None, stats, outcome, None)
    served = ServedModel(label, epoch, Path(directory), model, stats, outcome)
    return Prepared(label, served, stats, outcome, None)


def generate_tokens(model: LlamaForCausalLM, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuation of each prompt by ``max_new_tokens`` tokens."""
    device = next(model.parameters()).device
    with torch.inference_mode():
        ids = torch.tensor(prompts, dtype=torch.long, device=device)
        start = ids.shape[1]
        for _ in range(max_new_tokens):
            next_ids = model(ids)[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, next_ids], dim=1)
        out: list[list[int]] = ids[:, start:].tolist()
    return out
