"""What a served model computes for a request: greedy completions, embeddings, raw next tokens.

Each function runs in one of the server's inference threads on a loaded ``hf.BuiltModel``.
Completions are greedy: for a ``transformers`` model through its own ``generate`` (so a
completion is exactly what ``model.generate(do_sample=False)`` gives), for the built-in Llama
through a plain argmax loop. A completion stops at the model's end-of-sequence token (not
returned) or after ``max_tokens``. Embeddings run the encoder on a right-padded batch and pool
as the version's sentence-transformers configuration says (``pooling.Pooling``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gpu_loader.hf import BuiltModel

__all__ = ["Completion", "complete", "decode", "embed", "encode", "generate_tokens"]


@dataclass(frozen=True)
class Completion:
    """The tokens a prompt was continued with, and why it stopped (``stop`` or ``length``)."""

    token_ids: list[int]
    finish_reason: str


def _device(module: nn.Module) -> torch.device:
    return next(module.parameters()).device


def generate_tokens(model: nn.Module, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuation of each prompt by exactly ``max_new_tokens`` tokens (``model(ids)`` gives logits)."""
    device = _device(model)
    with torch.inference_mode():
        ids = torch.tensor(prompts, dtype=torch.long, device=device)
        start = ids.shape[1]
        for _ in range(max_new_tokens):
            next_ids = model(ids)[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, next_ids], dim=1)
        out: list[list[int]] = ids[:, start:].tolist()
    return out


def complete(built: BuiltModel, prompts: Sequence[list[int]], max_tokens: int) -> list[Completion]:
    """Greedy completion of each prompt, stopping at end-of-sequence or after ``max_tokens`` tokens."""
    eos = set(built.card.eos_token_ids)
    results: list[Completion] = []
    for prompt in prompts:
        produced = _hf_greedy(built, prompt, max_tokens) if built.hf else _loop_greedy(built, prompt, max_tokens, eos)
        cut = next((i for i, t in enumerate(produced) if t in eos), None)
        if cut is not None:
            results.append(Completion(produced[:cut], "stop"))
        else:
            results.append(Completion(produced, "length"))
    return results


def _hf_greedy(built: BuiltModel, prompt: list[int], max_tokens: int) -> list[int]:
    from transformers import GenerationConfig

    module: Any = built.module
    card = built.card
    config = GenerationConfig(  # type: ignore[no-untyped-call]
        max_new_tokens=max_tokens,
        do_sample=False,
        num_beams=1,
        eos_token_id=list(card.eos_token_ids) or None,
        pad_token_id=card.pad_token_id,
    )
    with torch.inference_mode():
        ids = torch.tensor([prompt], dtype=torch.long, device=_device(module))
        out = module.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
    produced: list[int] = out[0, len(prompt) :].tolist()
    return produced


def _loop_greedy(built: BuiltModel, prompt: list[int], max_tokens: int, eos: set[int]) -> list[int]:
    model = built.logits_module
    produced: list[int] = []
    with torch.inference_mode():
        ids = torch.tensor([prompt], dtype=torch.long, device=_device(model))
        for _ in range(max_tokens):
            token = int(model(ids)[0, -1].argmax())
            produced.append(token)
            if token in eos:
                break
            ids = torch.cat([ids, torch.tensor([[token]], dtype=torch.long, device=ids.device)], dim=1)
    return produced


def embed(built: BuiltModel, inputs: Sequence[list[int]]) -> torch.Tensor:
    """One pooled vector per input (float32, on the CPU), ``[len(inputs), dim]``."""
    pooling = built.card.pooling
    assert pooling is not None, "embedding models always have a pooling"
    module: Any = built.module
    base = getattr(module, "base_model", module)  # BertForMaskedLM etc.: the encoder inside
    width = max(len(ids) for ids in inputs)
    pad = built.card.pad_token_id
    device = _device(module)
    with torch.inference_mode():
        ids = torch.full((len(inputs), width), pad, dtype=torch.long, device=device)
        mask = torch.zeros((len(inputs), width), dtype=torch.long, device=device)
        for row, tokens in enumerate(inputs):
            ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            mask[row, : len(tokens)] = 1
        states = base(input_ids=ids, attention_mask=mask).last_hidden_state
        pooled = pooling(states, mask)
    return pooled.cpu()


def encode(built: BuiltModel, texts: Sequence[str], *, for_embedding: bool) -> list[list[int]]:
    """Token ids of each text with the version's tokenizer (special tokens added as it says)."""
    tokenizer = built.tokenizer
    assert tokenizer is not None
    limit = built.card.max_positions
    if for_embedding and built.card.pooling is not None and built.card.pooling.max_seq_length is not None:
        limit = built.card.pooling.max_seq_length
    with built.tokenizer_lock:
        if for_embedding:
            encoded = tokenizer(list(texts), truncation=limit is not None, max_length=limit)
        else:
            encoded = tokenizer(list(texts))
    ids: list[list[int]] = [list(map(int, row)) for row in encoded["input_ids"]]
    return ids


def decode(built: BuiltModel, token_ids: list[int]) -> str:
    """Text of generated tokens (special tokens left out)."""
    tokenizer = built.tokenizer
    assert tokenizer is not None
    with built.tokenizer_lock:
        text: str = tokenizer.decode(token_ids, skip_special_tokens=True)
    return text
