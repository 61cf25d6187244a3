"""What the server serves: a loaded, validated model, and the slot that swaps models atomically.

A request takes a reference to the slot's current model and keeps it until it has answered;
``swap`` replaces the current model in one step under a lock, so every request is answered by
exactly one version and none fails during a switch. The old model is *retired*: once its last
request returns, ``drained`` is set and the server drops it, which frees its memory.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gpu_loader.hf import BuiltModel, ModelCard, build_model, load_model
from gpu_loader.inference import generate_tokens
from gpu_loader.loader import Loader, LoadStats, VerifyMode
from gpu_loader.validation import TensorStats, ValidationOutcome, validate
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
    #: the loaded model; ``None`` once retired and drained
    model: BuiltModel | None
    card: ModelCard
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
    known: Mapping[str, TensorStats] | None = None,
) -> Prepared:
    """Load the version in ``directory`` onto ``device`` and validate it (blocking).

    ``known``: tensor statistics the load already computed (a streaming load fills it as it goes).
    """
    stats: LoadStats | None = None
    label = digest or str(directory)
    try:
        version = open_version(directory, digest=digest)
        label = version.digest
        built = build_model(version, dtype)
        stats = load_model(loader, built, version, device=device, dtype=dtype, verify=verify)
        runner = built.logits_module if built.card.task == "causal-lm" else None
        outcome = validate(built.module, version, runner=runner, known=known)
    except WeightshipError as exc:
        event(_log, "serve.load_failed", logging.WARNING, digest=label, error=exc.message)
        return Prepared(label, None, stats, None, f"{type(exc).__name__}: {exc.message}")
    except Exception as exc:  # transformers or torch failing on a model: refuse the version, keep serving
        event(_log, "serve.load_failed", logging.WARNING, digest=label, error=repr(exc))
        return Prepared(label, None, stats, None, f"{type(exc).__name__}: {exc}")
    if not outcome.passed:
        return Prepared(label, None, stats, outcome, None)
    served = ServedModel(label, epoch, Path(directory), built, built.card, stats, outcome)
    return Prepared(label, served, stats, outcome, None)
