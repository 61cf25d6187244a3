"""The reference model: a small but real Llama-style decoder, laid out like Hugging Face's.

Tensor names and shapes follow ``LlamaForCausalLM`` (``model.embed_tokens.weight``,
``model.layers.N.self_attn.q_proj.weight``, ..., ``lm_head.weight``) and the configuration is
an HF ``config.json``, so the files the demo generates look and load like a real checkpoint.
The forward pass is the usual one: RMSNorm, rotary position embeddings, grouped-query causal
attention, a SwiGLU MLP, untied output head. It exists to make validation and serving honest:
corrupted weights change its outputs.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gpu_loader.errors import TensorMismatchError

__all__ = ["LlamaConfig", "LlamaForCausalLM", "build_model", "column_parallel", "runs"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


#: config.json fields whose values change the computation, and the value this implementation assumes.
_ASSUMED: dict[str, Any] = {
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "rope_scaling": None,
    "pretraining_tp": 1,
}


def runs(doc: dict[str, Any]) -> bool:
    """Whether this implementation computes exactly what ``transformers`` would for ``doc``.

    The untied, plain-RoPE Llama that ``gpu_loader.modelgen`` writes, and real checkpoints of that
    exact shape. Serving them here skips importing ``transformers`` (seconds at start-up); every
    other configuration goes through ``gpu_loader.hf``.
    """
    if doc.get("model_type") != "llama" or doc.get("torch_dtype", doc.get("dtype", "bfloat16")) not in _DTYPES:
        return False
    if any(doc.get(key, value) != value for key, value in _ASSUMED.items()):
        return False
    rope = doc.get("rope_parameters")
    if isinstance(rope, dict) and rope.get("rope_type", "default") != "default":
        return False
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    if not all(isinstance(doc.get(key), int) for key in (*required, "num_key_value_heads")):
        return False
    hidden, heads = doc.get("hidden_size"), doc.get("num_attention_heads")
    if not isinstance(hidden, int) or not isinstance(heads, int) or heads <= 0:
        return False
    return bool(doc.get("head_dim", hidden // heads) == hidden // heads)


@dataclass(frozen=True)
class LlamaConfig:
    """The fields of an HF Llama ``config.json`` this model uses."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    torch_dtype: str = "bfloat16"

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden_size // self.num_attention_heads

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the weights are stored in."""
        return _DTYPES[self.torch_dtype]

    @classmethod
    def from_json(cls, raw: bytes | str) -> LlamaConfig:
        """Parse an HF ``config.json`` this implementation runs (see ``runs``); others are refused."""
        doc: dict[str, Any] = json.loads(raw)
        if not runs(doc):
            raise TensorMismatchError(
                f"config.json describes model_type={doc.get('model_type')!r} "
                f"(tie_word_embeddings={doc.get('tie_word_embeddings', False)}), which the built-in Llama "
                "does not compute exactly; build it with gpu_loader.hf.build_model (transformers) instead"
            )
        fields = {k: doc[k] for k in cls.__dataclass_fields__ if k in doc}
        if "torch_dtype" not in doc and "dtype" in doc:  # transformers 5's name for it
            fields["torch_dtype"] = doc["dtype"]
        rope = doc.get("rope_parameters")
        if isinstance(rope, dict) and "rope_theta" in rope:  # transformers 5 writes it there
            fields.setdefault("rope_theta", rope["rope_theta"])
        config = cls(**fields)
        if config.hidden_size % config.num_attention_heads or config.num_attention_heads % config.num_key_value_heads:
            raise TensorMismatchError("config.json: heads must divide hidden_size and kv heads must divide heads")
        if config.torch_dtype not in _DTYPES:
            raise TensorMismatchError(
                f"config.json: torch_dtype {config.torch_dtype!r} is not one of {sorted(_DTYPES)}"
            )
        return config

    def to_json(self) -> dict[str, Any]:
        """An HF-style ``config.json`` document."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "attention_bias": False,
            "bos_token_id": 1,
            "eos_token_id": 2,
            **asdict(self),
        }

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every weight's name and shape, in checkpoint order."""
        h, i, kv = self.hidden_size, self.intermediate_size, self.num_key_value_heads * self.head_dim
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, h)}
        for layer in range(self.num_hidden_layers):
            p = f"model.layers.{layer}."
            shapes.update(
                {
                    p + "input_layernorm.weight": (h,),
                    p + "self_attn.q_proj.weight": (h, h),
                    p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h),
                    p + "self_attn.o_proj.weight": (h, h),
                    p + "post_attention_layernorm.weight": (h,),
                    p + "mlp.gate_proj.weight": (i, h),
                    p + "mlp.up_proj.weight": (i, h),
                    p + "mlp.down_proj.weight": (h, i),
                }
            )
        shapes["model.norm.weight"] = (h,)
        shapes["lm_head.weight"] = (self.vocab_size, h)
        return shapes


def column_parallel(name: str) -> bool:
    """Whether a Llama weight is split on dim 0 under Megatron-style tensor parallelism."""
    return name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight"))


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise in float32, scale in the weight's dtype."""
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(self.weight.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    """Grouped-query causal self-attention with rotary embeddings."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        h, kv = config.hidden_size, config.num_key_value_heads * config.head_dim
        self.config = config
        self.q_proj = nn.Linear(h, h, bias=False)
        self.k_proj = nn.Linear(h, kv, bias=False)
        self.v_proj = nn.Linear(h, kv, bias=False)
        self.o_proj = nn.Linear(h, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Attend over the sequence, each position seeing only itself and earlier ones."""
        c = self.config
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        groups = c.num_attention_heads // c.num_key_value_heads
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        projected: torch.Tensor = self.o_proj(out.transpose(1, 2).reshape(batch, seq, c.hidden_size))
        return projected


class MLP(nn.Module):
    """SwiGLU feed-forward block."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``down(silu(gate(x)) * up(x))``."""
        out: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP with residual connections."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """One transformer block."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        out: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out


class LlamaModel(nn.Module):
    """Embedding, decoder stack and final norm."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        # An explicit (uninitialised) weight skips normal_(), whose meta-device kernel drags in
        # torch's symbolic-shape machinery and costs seconds at start-up; weights are loaded anyway.
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size, _weight=torch.empty(config.vocab_size, config.hidden_size)
        )
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Token ids in, next-token logits out."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def _rope(self, seq: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        inv_freq = 1.0 / (
            c.rope_theta ** (torch.arange(0, c.head_dim, 2, device=device, dtype=torch.float32) / c.head_dim)
        )
        freqs = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits of shape ``[batch, seq, vocab]`` (float32)."""
        if input_ids.shape[-1] > self.config.max_position_embeddings:
            raise ValueError(f"sequence of {input_ids.shape[-1]} tokens exceeds {self.config.max_position_embeddings}")
        x = self.model.embed_tokens(input_ids)
        cos, sin = self._rope(input_ids.shape[-1], x.device, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        logits: torch.Tensor = self.lm_head(self.model.norm(x))
        return logits.float()


def build_model(
    config: LlamaConfig, device: str | torch.device = "meta", dtype: torch.dtype | None = None
) -> LlamaForCausalLM:
    """A model with uninitialised weights (on ``meta`` by default, to be filled by ``load_into``)."""
    with torch.device(device):
        model = LlamaForCausalLM(config)
    model.to(dtype or config.dtype)
    return model.eval().requires_grad_(False)
