"""Any model ``transformers`` can build from its ``config.json``, built on ``meta`` and loaded by gpu_loader.

``build_model`` reads the version's ``config.json`` (checked against its SHA-256 like every side
file) and decides what it is:

* a **causal LM** when ``architectures`` names a ``...ForCausalLM`` / ``...LMHeadModel`` class
  (or, without ``architectures``, when ``transformers`` has a causal-LM class for the model type);
* an **embedding model** when the version is a sentence-transformers directory (``modules.json``)
  or any other encoder; its vectors are pooled as ``gpu_loader.pooling`` says.

The untied plain Llama that ``gpu_loader.modelgen`` writes runs on the built-in implementation
(``gpu_loader.model``), which computes the same and starts without importing ``transformers``.
Everything else is built by ``transformers`` with every *parameter* on the ``meta`` device (no
memory, no random init) while buffers (rotary frequencies, position ids) are computed for real;
``load_model`` then reads the weights through ``Loader.load_into`` (the same verification modes),
ties what the config ties, and moves the buffers to the device.

Before any weight byte is read the checkpoint is compared with the module: a parameter that no
tensor provides (tied aliases count as provided) or a tensor the module has no place for is
refused with a ``TensorMismatchError`` naming the model and the tensors. Encoder-decoder models
and configurations that need the publisher's own code (``auto_map``) are refused the same way.
"""

from __future__ import annotations

import json
import re
import tempfile
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from gpu_loader.dtypes import torch_dtype
from gpu_loader.errors import TensorMismatchError
from gpu_loader.loader import Loader, LoadStats, VerifyMode
from gpu_loader.model import LlamaConfig
from gpu_loader.model import build_model as build_reference
from gpu_loader.model import runs as reference_runs
from gpu_loader.pooling import Pooling, parse_pooling
from gpu_loader.version import Version

__all__ = ["BuiltModel", "ModelCard", "Task", "build_model", "load_model"]

Task = Literal["causal-lm", "embedding"]

#: Files a tokenizer may need; copied (verified) into a private directory for ``AutoTokenizer``.
_TOKENIZER_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "chat_template.jinja",
)
_TOKENIZER_MARKERS = ("tokenizer.json", "vocab.txt", "vocab.json", "tokenizer.model", "spiece.model")


@dataclass(frozen=True)
class ModelCard:
    """What a served model is and what it accepts (shown on ``/v1/status``)."""

    #: the model name the version was published under
    name: str
    architecture: str
    model_type: str
    task: Task
    #: ``transformers`` or ``built-in``
    implementation: str
    dtype: str
    vocab_size: int
    max_positions: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    #: parameters that share another one's tensor (``lm_head.weight`` in a tied model)
    tied: tuple[str, ...]
    pooling: Pooling | None
    has_tokenizer: bool

    def to_json(self) -> dict[str, Any]:
        """The card as a JSON object."""
        pooling = self.pooling
        return {
            "name": self.name,
            "architecture": self.architecture,
            "model_type": self.model_type,
            "task": self.task,
            "implementation": self.implementation,
            "dtype": self.dtype,
            "vocab_size": self.vocab_size,
            "max_positions": self.max_positions,
            "tied": list(self.tied),
            "tokenizer": self.has_tokenizer,
            "pooling": None
            if pooling is None
            else {
                "modes": list(pooling.modes),
                "normalize": pooling.normalize,
                "max_seq_length": pooling.max_seq_length,
                "source": pooling.source,
            },
        }


class CausalLogits(nn.Module):
    """Token ids in, float32 logits out: the interface the golden check and ``/v1/generate`` use."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits ``[batch, seq, vocab]`` without a KV cache."""
        out = self.inner(input_ids=input_ids, use_cache=False)
        logits: torch.Tensor = out.logits
        return logits.float()


@dataclass(eq=False)
class BuiltModel:
    """A module built on ``meta`` (then loaded) with what serving it needs."""

    module: nn.Module
    card: ModelCard
    #: a ``transformers`` tokenizer when the version ships one
    tokenizer: Any | None = None
    #: fast tokenizers refuse concurrent calls that change their truncation settings
    tokenizer_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def logits_module(self) -> nn.Module:
        """A module mapping token ids to logits (causal LMs only)."""
        if self.card.implementation == "built-in":
            return self.module
        return CausalLogits(self.module)

    @property
    def hf(self) -> bool:
        """Whether ``transformers`` built the module."""
        return self.card.implementation == "transformers"


def _optional(version: Version, path: str) -> bytes | None:
    return version.read_file(path) if version.has_file(path) else None


def _stored_dtype(version: Version) -> torch.dtype:
    """The floating dtype most of the checkpoint's values are stored in (float32 when none)."""
    counts: Counter[torch.dtype] = Counter()
    for entry in version.weight_files():
        assert entry.safetensors is not None
        for info in entry.safetensors.tensors:
            dtype = torch_dtype(info.dtype, info.name, entry.path)
            if dtype.is_floating_point:
                counts[dtype] += info.end - info.begin
    return counts.most_common(1)[0][0] if counts else torch.float32


def _label(version: Version, doc: dict[str, Any]) -> str:
    arch = (doc.get("architectures") or ["?"])[0]
    return f"{version.manifest.model} ({arch}, model_type={doc.get('model_type')!r})"


def build_model(version: Version, dtype: torch.dtype | None = None) -> BuiltModel:
    """The version's model with uninitialised weights on ``meta``, to be filled by ``load_model``."""
    try:
        doc = json.loads(version.read_file("config.json"))
    except ValueError as exc:
        raise TensorMismatchError(f"config.json of {version.digest} is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise TensorMismatchError(f"config.json of {version.digest} is not a JSON object")
    pooling = parse_pooling(lambda p: _optional(version, p)) if version.has_file("modules.json") else None
    if pooling is None and reference_runs(doc):
        return _build_reference(version, doc, dtype)
    return _build_transformers(version, doc, dtype, pooling)


def _eos_ids(value: object) -> tuple[int, ...]:
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, list):
        return tuple(v for v in value if isinstance(v, int) and not isinstance(v, bool))
    return ()


def _build_reference(version: Version, doc: dict[str, Any], dtype: torch.dtype | None) -> BuiltModel:
    config = LlamaConfig.from_json(json.dumps(doc))
    module = build_reference(config, dtype=dtype)
    tokenizer = _tokenizer(version, _label(version, doc))
    generation = json.loads(_optional(version, "generation_config.json") or b"{}")
    eos = _eos_ids(generation.get("eos_token_id", doc.get("eos_token_id")))
    card = ModelCard(
        name=version.manifest.model,
        architecture="LlamaForCausalLM",
        model_type="llama",
        task="causal-lm",
        implementation="built-in",
        dtype=str(dtype or config.dtype).removeprefix("torch."),
        vocab_size=config.vocab_size,
        max_positions=config.max_position_embeddings,
        eos_token_ids=eos,
        pad_token_id=_pad_id(doc, generation, tokenizer, eos),
        tied=(),
        pooling=None,
        has_tokenizer=tokenizer is not None,
    )
    return BuiltModel(module, card, tokenizer)


def _pad_id(doc: dict[str, Any], generation: dict[str, Any], tokenizer: Any | None, eos: tuple[int, ...]) -> int:
    for value in (generation.get("pad_token_id"), doc.get("pad_token_id"), getattr(tokenizer, "pad_token_id", None)):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return eos[0] if eos else 0


def _task(doc: dict[str, Any], pooling: Pooling | None) -> Task:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if pooling is not None:
        return "embedding"
    architectures = doc.get("architectures") or []
    if architectures:
        return "causal-lm" if str(architectures[0]).endswith(("ForCausalLM", "LMHeadModel")) else "embedding"
    return "causal-lm" if doc.get("model_type") in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES else "embedding"


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside goes to ``meta``; buffers stay real (they are not in checkpoints)."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def _build_transformers(
    version: Version, doc: dict[str, Any], dtype: torch.dtype | None, pooling: Pooling | None
) -> BuiltModel:
    import transformers
    from transformers import AutoModel, AutoModelForCausalLM, GenerationConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    label = _label(version, doc)
    model_type = doc.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise TensorMismatchError(
            f"{label}: transformers {transformers.__version__} does not know model_type {model_type!r}; "
            "weightship-serve runs the architectures transformers ships"
        )
    architectures = [str(a) for a in doc.get("architectures") or []]
    arch_class = getattr(transformers, architectures[0], None) if architectures else None
    if architectures and arch_class is None and doc.get("auto_map"):
        raise TensorMismatchError(
            f"{label}: config.json needs the publisher's own code (auto_map {sorted(doc['auto_map'])}); "
            "weightship-serve runs only architectures transformers ships, never code from a version"
        )
    config = CONFIG_MAPPING[model_type].from_dict(doc)
    if getattr(config, "is_encoder_decoder", False):
        raise TensorMismatchError(f"{label}: encoder-decoder models are not served; serve a causal LM or an encoder")
    task = _task(doc, pooling)
    chosen = dtype or _stored_dtype(version)
    builder: Any
    if arch_class is not None and (task == "embedding" or architectures[0].endswith(("ForCausalLM", "LMHeadModel"))):
        builder = arch_class._from_config
    else:
        builder = (AutoModelForCausalLM if task == "causal-lm" else AutoModel).from_config
    try:
        with _parameters_on_meta():
            module: nn.Module = builder(config, dtype=chosen)
    except (ValueError, TypeError, KeyError, AttributeError, RuntimeError) as exc:
        raise TensorMismatchError(f"{label}: transformers cannot build it from config.json: {exc}") from None
    module.eval().requires_grad_(False)
    tokenizer = _tokenizer(version, label)
    generation: dict[str, Any] = {}
    if task == "causal-lm":
        generation = json.loads(_optional(version, "generation_config.json") or b"{}")
        if not generation:
            generation = GenerationConfig.from_model_config(config).to_dict()
    eos = _eos_ids(generation.get("eos_token_id", doc.get("eos_token_id")))
    tied = _tied_aliases(module)
    card = ModelCard(
        name=version.manifest.model,
        architecture=type(module).__name__,
        model_type=model_type,
        task=task,
        implementation="transformers",
        dtype=str(chosen).removeprefix("torch."),
        vocab_size=int(getattr(config, "vocab_size", 0) or 0),
        max_positions=_max_positions(config),
        eos_token_ids=eos,
        pad_token_id=_pad_id(doc, generation, tokenizer, eos),
        tied=tuple(tied),
        pooling=(pooling or Pooling()) if task == "embedding" else None,
        has_tokenizer=tokenizer is not None,
    )
    return BuiltModel(module, card, tokenizer)


def _max_positions(config: Any) -> int | None:
    for name in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _alias_groups(module: nn.Module) -> list[list[str]]:
    """Parameter names grouped by the parameter they name (a tied pair is one group of two)."""
    groups: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return list(groups.values())


def _tied_aliases(module: nn.Module) -> list[str]:
    return sorted(name for group in _alias_groups(module) for name in group[1:])


def _tokenizer(version: Version, label: str) -> Any | None:
    """The version's tokenizer, built from verified copies of its files; ``None`` when it ships none."""
    if not any(version.has_file(name) for name in _TOKENIZER_MARKERS):
        return None
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="ws-tokenizer-") as tmp:
        for name in _TOKENIZER_FILES:
            if version.has_file(name):
                (Path(tmp) / name).write_bytes(version.read_file(name))
        try:
            return AutoTokenizer.from_pretrained(tmp, local_files_only=True)
        except (OSError, ValueError, TypeError, KeyError, ImportError) as exc:
            raise TensorMismatchError(
                f"{label}: the tokenizer files it ships cannot be loaded ({type(exc).__name__}: {exc}); "
                "publish a version with a working tokenizer.json, or without tokenizer files to serve token ids"
            ) from None


def _some(names: list[str], shown: int = 8) -> str:
    head = ", ".join(repr(n) for n in names[:shown])
    return head + (f" and {len(names) - shown} more" if len(names) > shown else "")


def load_model(
    loader: Loader,
    built: BuiltModel,
    version: Version,
    *,
    device: str,
    dtype: torch.dtype | None,
    verify: VerifyMode,
) -> LoadStats:
    """Read the version's weights into ``built.module`` on ``device`` (verified), then tie and place buffers."""
    if not built.hf:
        return loader.load_into(
            built.module, version.directory, manifest=version.manifest, device=device, dtype=dtype, verify=verify
        ).stats
    module = built.module
    module_dtype = next((p.dtype for p in module.parameters() if p.dtype.is_floating_point), torch.float32)
    groups = _alias_groups(module)
    _check_names(module, groups, version, f"{version.manifest.model} ({built.card.architecture})")
    stats = loader.load_into(
        module,
        version.directory,
        manifest=version.manifest,
        device=device,
        dtype=dtype or module_dtype,
        verify=verify,
        strict=False,
    ).stats
    _retie(module, groups)
    module.to(device)
    left = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.device.type == "meta"]
    if left:
        raise TensorMismatchError(f"{version.manifest.model}: tensors {_some(left)} were not loaded")
    return stats


def _check_names(module: nn.Module, groups: list[list[str]], version: Version, label: str) -> None:
    available: set[str] = set()
    for entry in version.weight_files():
        assert entry.safetensors is not None
        available.update(info.name for info in entry.safetensors.tensors)
    missing = sorted(group[0] for group in groups if not any(n in available for n in group))
    known = set(module.state_dict()) | {n for n, _ in module.named_buffers(remove_duplicate=False)}
    known |= {n for n, _ in module.named_parameters(remove_duplicate=False)}
    ignore = [re.compile(p) for p in getattr(module, "_keys_to_ignore_on_load_unexpected", None) or []]
    unexpected = sorted(n for n in available - known if not any(p.search(n) for p in ignore))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensor(s) {_some(missing)}")
        if unexpected:
            parts.append(f"tensor(s) the model has no place for: {_some(unexpected)}")
        raise TensorMismatchError(
            f"{label} does not match the checkpoint in {version.digest}: {'; '.join(parts)}. "
            "Check that config.json's architectures names the class these weights were saved from"
        )


def _retie(module: nn.Module, groups: list[list[str]]) -> None:
    """Point every alias in ``groups`` (taken before loading) at the tensor loaded for its group."""
    for group in groups:
        if len(group) < 2:
            continue
        params = [module.get_parameter(name) for name in group]
        loaded = next((p for p in params if p.device.type != "meta"), None)
        if loaded is None:
            continue  # reported as not loaded by the caller
        for name in group:
            owner, _, leaf = name.rpartition(".")
            module.get_submodule(owner)._parameters[leaf] = loaded
