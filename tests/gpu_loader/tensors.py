"""Tensor equality for the loader's tests: the same dtype, shape and bytes (NaNs and -0.0 included)."""

from __future__ import annotations

import torch


def same_bytes(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Whether ``got`` holds exactly ``want``: dtype, shape and every byte, wherever either lives."""
    got, want = got.cpu().contiguous(), want.cpu().contiguous()
    return got.dtype == want.dtype and got.shape == want.shape and torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """``got`` has exactly ``want``'s tensors, each with the same bytes."""
    assert set(got) == set(want), f"tensor names differ: {sorted(set(got) ^ set(want))[:5]}"
    wrong = [name for name, tensor in want.items() if not same_bytes(got[name], tensor)]
    assert not wrong, f"{len(wrong)} tensor(s) differ from the reference, e.g. {wrong[:3]}"
