"""The golden file: a model-specific smoke check that ships inside the version.

``weightship_validation.json`` sits beside the weights, so it is published, hashed and rolled
out with them. It holds a few token-id prompts and, for every position, the expected top-k
next-token logits and the log-sum-exp over the whole vocabulary (which summarises the full
distribution). They are computed by running the model in float32 when the version is built.

A loaded model passes when, in its own dtype on its own device, every compared value is within
``tolerance[dtype] * scale`` of the expected one (``scale`` is the largest expected |logit|, at
least 1) and every output is finite. The tolerance allows for low-precision arithmetic, not for
wrong weights: NaNs, scaled or shuffled layers move the outputs far more.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gpu_loader.errors import GoldenFileError

__all__ = ["GOLDEN_FILE", "Golden", "GoldenResult", "check_golden", "compute_golden", "parse_golden"]

GOLDEN_FILE = "weightship_validation.json"
_SCHEMA = "weightship.golden/v1"
_DEFAULT_TOLERANCE = {"float32": 1e-3, "float16": 0.02, "bfloat16": 0.05}


@dataclass(frozen=True)
class Golden:
    """Prompts and the outputs the model must reproduce."""

    inputs: list[list[int]]
    top_ids: list[list[list[int]]]
    top_logits: list[list[list[float]]]
    logsumexp: list[list[float]]
    scale: float
    tolerance: dict[str, float]

    def to_json(self) -> dict[str, Any]:
        """The file's JSON document."""
        return {
            "schema": _SCHEMA,
            "kind": "causal-lm-logits",
            "inputs": self.inputs,
            "expected": {"top_ids": self.top_ids, "top_logits": self.top_logits, "logsumexp": self.logsumexp},
            "scale": self.scale,
            "tolerance": self.tolerance,
        }


@dataclass(frozen=True)
class GoldenResult:
    """How a model fared against its golden file."""

    passed: bool
    error: float
    limit: float
    detail: str


def _forward(model: nn.Module, inputs: Sequence[Sequence[int]]) -> torch.Tensor:
    device = next(model.parameters()).device
    with torch.inference_mode():
        logits: torch.Tensor = model(torch.tensor(inputs, dtype=torch.long, device=device))
    return logits.float().cpu()


def compute_golden(model: nn.Module, inputs: Sequence[Sequence[int]], top_k: int = 8) -> Golden:
    """Run ``model`` (float32 recommended) on ``inputs`` and record what it must reproduce."""
    logits = _forward(model, inputs)
    top = torch.topk(logits, top_k, dim=-1)
    lse = torch.logsumexp(logits, dim=-1)
    return Golden(
        inputs=[list(map(int, p)) for p in inputs],
        top_ids=top.indices.tolist(),
        top_logits=top.values.tolist(),
        logsumexp=lse.tolist(),
        scale=max(1.0, float(logits.abs().max())),
        tolerance=dict(_DEFAULT_TOLERANCE),
    )


def parse_golden(raw: bytes) -> Golden:
    """Parse and sanity-check a golden file."""
    try:
        doc = json.loads(raw)
        if doc.get("schema") != _SCHEMA or doc.get("kind") != "causal-lm-logits":
            raise GoldenFileError(f"{GOLDEN_FILE}: schema must be {_SCHEMA!r} with kind 'causal-lm-logits'")
        expected = doc["expected"]
        golden = Golden(
            inputs=[[int(t) for t in p] for p in doc["inputs"]],
            top_ids=[[[int(i) for i in pos] for pos in p] for p in expected["top_ids"]],
            top_logits=[[[float(v) for v in pos] for pos in p] for p in expected["top_logits"]],
            logsumexp=[[float(v) for v in p] for p in expected["logsumexp"]],
            scale=float(doc["scale"]),
            tolerance={str(k): float(v) for k, v in doc["tolerance"].items()},
        )
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise GoldenFileError(f"{GOLDEN_FILE} is malformed: {exc!r}") from None
    lengths = {len(p) for p in golden.inputs}
    if not golden.inputs or len(lengths) != 1 or len(golden.top_ids) != len(golden.inputs):
        raise GoldenFileError(f"{GOLDEN_FILE}: needs one or more prompts of equal length, with expectations for each")
    return golden


def check_golden(model: nn.Module, golden: Golden) -> GoldenResult:
    """Run ``model`` on the golden prompts and compare with the expected outputs."""
    dtype = next(model.parameters()).dtype
    name = str(dtype).removeprefix("torch.")
    limit = golden.tolerance.get(name, max(golden.tolerance.values())) * golden.scale
    logits = _forward(model, golden.inputs)
    if not bool(torch.isfinite(logits).all()):
        bad = int((~torch.isfinite(logits)).sum())
        return GoldenResult(False, math.inf, limit, f"{bad} of {logits.numel()} output logits are NaN or infinite")
    ids = torch.tensor(golden.top_ids)
    got = torch.gather(logits, -1, ids)
    error = float((got - torch.tensor(golden.top_logits)).abs().max())
    lse_error = float((torch.logsumexp(logits, dim=-1) - torch.tensor(golden.logsumexp)).abs().max())
    worst = max(error, lse_error)
    agree = float((logits.argmax(-1) == ids[..., 0]).float().mean())
    detail = (
        f"{len(golden.inputs)} prompt(s) x {len(golden.inputs[0])} positions in {name}: max deviation {worst:.4g} "
        f"(limit {limit:.4g}), top-1 agreement {agree:.0%}"
    )
    return GoldenResult(worst <= limit, worst, limit, detail)
