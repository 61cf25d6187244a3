"""Sentence-transformers pooling: what the configuration files say, and what each mode computes."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping

import pytest
import torch

from gpu_loader.errors import TensorMismatchError
from gpu_loader.pooling import Pooling, parse_pooling

# Two inputs of 3 and 2 tokens (the second padded), hidden size 2.
STATES = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [5.0, 0.0]], [[2.0, 2.0], [4.0, -2.0], [99.0, 99.0]]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def reader(files: Mapping[str, object]) -> Callable[[str], bytes | None]:
    def read(path: str) -> bytes | None:
        return json.dumps(files[path]).encode() if path in files else None

    return read


MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
]


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("cls_token", [[1.0, 2.0], [2.0, 2.0]]),
        ("mean_tokens", [[3.0, 2.0], [3.0, 0.0]]),
        ("max_tokens", [[5.0, 4.0], [4.0, 2.0]]),
        ("mean_sqrt_len_tokens", [[9.0 / 3**0.5, 6.0 / 3**0.5], [6.0 / 2**0.5, 0.0]]),
        ("lasttoken", [[5.0, 0.0], [4.0, -2.0]]),
    ],
)
def test_each_pooling_mode_ignores_padding(mode: str, expected: list[list[float]]) -> None:
    files = {"modules.json": MODULES, "1_Pooling/config.json": {f"pooling_mode_{mode}": True}}
    pooling = parse_pooling(reader(files))
    assert pooling.modes == (mode,)
    assert torch.allclose(pooling(STATES, MASK), torch.tensor(expected))


def test_normalize_module_and_max_seq_length_are_read() -> None:
    files = {
        "modules.json": [*MODULES, {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}],
        "1_Pooling/config.json": {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True},
        "sentence_bert_config.json": {"max_seq_length": 128},
    }
    pooling = parse_pooling(reader(files))
    assert (pooling.modes, pooling.normalize, pooling.max_seq_length) == (("cls_token", "mean_tokens"), True, 128)
    pooled = pooling(STATES, MASK)
    assert pooled.shape == (2, 4)  # CLS and mean, concatenated
    assert torch.allclose(pooled.norm(dim=-1), torch.ones(2))


def test_without_modules_json_it_is_mean_pooling_unnormalised() -> None:
    assert parse_pooling(reader({})) == Pooling()


@pytest.mark.parametrize(
    ("files", "detail"),
    [
        ({"modules.json": [*MODULES, {"path": "2_Dense", "type": "sentence_transformers.models.Dense"}]}, "Dense"),
        ({"modules.json": MODULES}, "1_Pooling/config.json is missing"),
        ({"modules.json": MODULES, "1_Pooling/config.json": {}}, "turns on no pooling mode"),
        ({"modules.json": {"not": "a list"}}, "modules.json is malformed"),
    ],
)
def test_configurations_it_cannot_run_are_refused(files: dict[str, object], detail: str) -> None:
    with pytest.raises(TensorMismatchError, match=detail):
        parse_pooling(reader(files))
