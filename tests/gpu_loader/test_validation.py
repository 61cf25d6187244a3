"""Validation hooks: NaN/Inf scan, per-tensor statistics, the golden smoke check, the report."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import cast

import pytest

pytest.importorskip("pydantic", reason="the agent API schemas need pydantic")
import torch

from gpu_loader.agent_api import validation_report
from gpu_loader.golden import GOLDEN_FILE
from gpu_loader.loader import Loader, LoadStats
from gpu_loader.model import DecoderLayer, LlamaConfig, LlamaForCausalLM, build_model
from gpu_loader.validation import ValidationOutcome, validate
from gpu_loader.version import open_version
from tests.gpu_loader.conftest import Versions
from tests.gpu_loader.staged_versions import manifest_of, stage


def loaded(version: Path, dtype: torch.dtype | None = None) -> tuple[LlamaForCausalLM, LoadStats]:
    config = LlamaConfig.from_json((version / "config.json").read_bytes())
    model = build_model(config, dtype=dtype)
    with Loader() as loader:
        stats = loader.load_into(model, version, dtype=dtype, verify="full").stats
    return model, stats


def verdicts(outcome: ValidationOutcome) -> dict[str, bool]:
    return {c.name: c.passed for c in outcome.checks}


@pytest.mark.parametrize("dtype", [None, torch.float32, torch.float16])
def test_good_version_passes_in_each_dtype(versions: Versions, dtype: torch.dtype | None) -> None:
    model, _ = loaded(versions.sharded, dtype)
    outcome = validate(model, open_version(versions.sharded))
    assert verdicts(outcome) == {"finite": True, "weights": True, "golden": True}, outcome.checks
    assert len(outcome.stats) == len(model.state_dict())


def test_nan_weights_fail_the_scan_and_the_smoke_check(versions: Versions) -> None:
    model, _ = loaded(versions.nan)
    outcome = validate(model, open_version(versions.nan))
    assert verdicts(outcome) == {"finite": False, "weights": True, "golden": False}
    assert "mlp.down_proj.weight" in outcome.checks[0].detail
    assert not outcome.passed


def test_finite_but_wrong_weights_fail_the_smoke_check(versions: Versions) -> None:
    model, _ = loaded(versions.noise)
    outcome = validate(model, open_version(versions.noise))
    assert verdicts(outcome) == {"finite": True, "weights": True, "golden": False}
    assert "max deviation" in outcome.failures()[0].detail


def test_zeroed_weight_matrix_fails_the_statistics_check(versions: Versions) -> None:
    model, _ = loaded(versions.single)
    cast(DecoderLayer, model.model.layers[0]).mlp.up_proj.weight.zero_()
    outcome = validate(model, open_version(versions.single))
    assert not verdicts(outcome)["weights"]
    assert "model.layers.0.mlp.up_proj.weight" in outcome.failures()[0].detail


def test_statistics_describe_each_tensor(versions: Versions) -> None:
    model, _ = loaded(versions.single, torch.float32)
    stats = {s.name: s for s in validate(model, open_version(versions.single)).stats}
    weight = cast(DecoderLayer, model.model.layers[0]).self_attn.q_proj.weight
    s = stats["model.layers.0.self_attn.q_proj.weight"]
    assert s.mean == pytest.approx(float(weight.double().mean()), abs=1e-6)
    assert s.std == pytest.approx(float(weight.double().std(correction=0)), rel=1e-4)
    assert s.absmax == pytest.approx(float(weight.abs().max()))
    assert s.nonfinite == 0


def test_version_without_golden_file_skips_the_smoke_check(versions: Versions, tmp_path: Path) -> None:
    source = tmp_path / "model"
    shutil.copytree(versions.single, source, ignore=shutil.ignore_patterns(".weightship", GOLDEN_FILE))
    version = stage(source, tmp_path)
    model, _ = loaded(version)
    outcome = validate(model, open_version(version))
    assert outcome.passed
    assert "skipped" in next(c.detail for c in outcome.checks if c.name == "golden")


def test_malformed_golden_file_fails_the_smoke_check(versions: Versions, tmp_path: Path) -> None:
    source = tmp_path / "model"
    shutil.copytree(versions.single, source, ignore=shutil.ignore_patterns(".weightship"))
    (source / GOLDEN_FILE).write_text(json.dumps({"schema": "something else"}))
    version = stage(source, tmp_path)
    model, _ = loaded(version)
    outcome = validate(model, open_version(version))
    assert verdicts(outcome)["golden"] is False
    assert "GoldenFileError" in outcome.failures()[0].detail


def test_report_carries_every_check_and_the_load_figures(versions: Versions) -> None:
    model, stats = loaded(versions.nan)
    digest = manifest_of(versions.nan).digest
    report = validation_report("chat", digest, outcome=validate(model, open_version(versions.nan)), stats=stats)
    assert report.digest == digest
    assert not report.passed
    assert [c.name for c in report.checks] == ["load", "finite", "weights", "golden"]
    assert report.load_seconds == stats.seconds
    failed_load = validation_report("chat", digest, outcome=None, stats=None, error="ChunkMismatchError: chunk 3 ...")
    assert not failed_load.passed
    assert failed_load.checks[0].name == "load"
