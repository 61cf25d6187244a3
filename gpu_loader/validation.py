"""Validation hooks run on a loaded model before it may serve.

Three checks, each reported by name with a one-line detail:

``finite``
    Every floating-point weight is scanned for NaN and Inf.
``weights``
    Per-tensor statistics (mean, std, absmax); fails if a weight matrix is all zeros, which no
    trained model has and which a zero-filled chunk produces.
``golden``
    The model-specific smoke check declared with the model: the version's golden file (see
    ``golden``) run on the model as loaded. A version without a golden file passes this check
    with a note saying so, since there is nothing to compare against.

The outcome is plain data here; ``agent_api.validation_report`` turns it into the
``weightship.schemas.ValidationReport`` the agent receives.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from gpu_loader.golden import GOLDEN_FILE, check_golden, parse_golden
from gpu_loader.version import Version
from weightship.logs import event

__all__ = ["Check", "TensorStats", "ValidationOutcome", "finite_check", "tensor_stats", "validate", "weights_check"]

_log = logging.getLogger(__name__)
_ROWS_PER_STEP = 1 << 14  # bounds the float32 temporaries of the scan


@dataclass(frozen=True)
class Check:
    """One named check and what it found."""

    name: str
    passed: bool
    detail: str


@dataclass(frozen=True)
class TensorStats:
    """Statistics of one tensor, computed in float64 from float32 slices."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    mean: float
    std: float
    absmax: float
    nonfinite: int


@dataclass(frozen=True)
class ValidationOutcome:
    """Every check, the per-tensor statistics and how long validation took."""

    checks: list[Check]
    stats: list[TensorStats] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        """Whether every check passed."""
        return all(c.passed for c in self.checks)

    def failures(self) -> list[Check]:
        """The checks that failed."""
        return [c for c in self.checks if not c.passed]


def _stats(name: str, tensor: torch.Tensor) -> TensorStats:
    rows = (
        tensor.detach().reshape(tensor.shape[0] if tensor.dim() else 1, -1) if tensor.numel() else tensor.reshape(0, 1)
    )
    count = 0
    s1 = s2 = absmax = 0.0
    nonfinite = 0
    for start in range(0, rows.shape[0], _ROWS_PER_STEP):
        part = rows[start : start + _ROWS_PER_STEP].float()
        total, norm = part.sum(), torch.linalg.vector_norm(part)
        if not (bool(torch.isfinite(total)) and bool(torch.isfinite(norm))):
            finite = torch.isfinite(part)
            nonfinite += part.numel() - int(finite.sum())
            part = part[finite]
            total, norm = part.sum(), torch.linalg.vector_norm(part)
        if part.numel():
            low, high = torch.aminmax(part)
            absmax = max(absmax, -float(low), float(high))
        count += part.numel()
        s1 += float(total)
        s2 += float(norm) ** 2
    mean = s1 / count if count else 0.0
    std = math.sqrt(max(0.0, s2 / count - mean * mean)) if count else 0.0
    return TensorStats(
        name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), mean, std, absmax, nonfinite
    )


def tensor_stats(tensors: Mapping[str, torch.Tensor]) -> list[TensorStats]:
    """Statistics of every tensor (NaN/Inf counted, then left out of mean, std and absmax)."""
    return [_stats(name, t) for name, t in tensors.items()]


def _scan(tensors: Mapping[str, torch.Tensor], known: Mapping[str, TensorStats]) -> list[TensorStats]:
    found: list[TensorStats] = []
    for name, tensor in tensors.items():
        seen = known.get(name)
        same = seen is not None and seen.shape == tuple(tensor.shape)
        if seen is not None and same and seen.dtype == str(tensor.dtype).removeprefix("torch."):
            found.append(seen)
        else:
            found.append(_stats(name, tensor))
    return found


def _mb(stats: list[TensorStats]) -> float:
    return sum(math.prod(s.shape) for s in stats) / 1e6


def finite_check(stats: list[TensorStats]) -> Check:
    """Fails when any tensor holds NaN or Inf, naming the worst ones."""
    bad = sorted((s for s in stats if s.nonfinite), key=lambda s: -s.nonfinite)
    if not bad:
        return Check("finite", True, f"scanned {len(stats)} tensors ({_mb(stats):.1f}M values): no NaN or Inf")
    shown = ", ".join(f"{s.name!r} ({s.nonfinite} of {math.prod(s.shape)})" for s in bad[:3])
    return Check("finite", False, f"{len(bad)} of {len(stats)} tensors hold NaN or Inf: {shown}")


def weights_check(stats: list[TensorStats]) -> Check:
    """Fails when a weight matrix is all zeros; otherwise summarises the statistics."""
    zeros = [
        s.name for s in stats if len(s.shape) >= 2 and math.prod(s.shape) > 1 and s.absmax == 0.0 and not s.nonfinite
    ]
    if zeros:
        return Check("weights", False, f"weight matrices that are all zeros: {zeros[:3]}")
    top = max(stats, key=lambda s: s.absmax, default=None)
    detail = f"{len(stats)} tensors; largest |value| {top.absmax:.4g} in {top.name!r}" if top else "no tensors"
    return Check("weights", True, detail)


def golden_check(model: nn.Module, version: Version) -> Check:
    """Run the version's golden file against ``model``."""
    if not version.has_file(GOLDEN_FILE):
        return Check("golden", True, f"skipped: the version declares no {GOLDEN_FILE}")
    result = check_golden(model, parse_golden(version.read_file(GOLDEN_FILE)))
    return Check("golden", result.passed, result.detail)


def validate(
    model: nn.Module,
    version: Version,
    *,
    runner: nn.Module | None = None,
    known: Mapping[str, TensorStats] | None = None,
) -> ValidationOutcome:
    """Run every check on a model loaded from ``version``.

    ``runner`` is what the golden check calls (token ids in, logits out) when ``model`` itself
    answers otherwise, as ``transformers`` models do; the scans always cover ``model``'s tensors.
    ``known``: statistics already computed per tensor as it was loaded (a streaming load scans each
    tensor while later chunks are still in flight); used where name, shape and dtype match.
    """
    started = time.perf_counter()
    stats = _scan(model.state_dict(), known or {})
    checks = [finite_check(stats), weights_check(stats)]
    try:
        checks.append(golden_check(runner if runner is not None else model, version))
    except Exception as exc:  # a malformed golden file or a model that cannot run is a failed check
        checks.append(Check("golden", False, f"{type(exc).__name__}: {exc}"))
    outcome = ValidationOutcome(checks=checks, stats=stats, seconds=time.perf_counter() - started)
    event(
        _log,
        "validation.done",
        logging.INFO if outcome.passed else logging.WARNING,
        digest=version.digest,
        passed=outcome.passed,
        failed=",".join(c.name for c in outcome.failures()) or "-",
        seconds=outcome.seconds,
    )
    return outcome
