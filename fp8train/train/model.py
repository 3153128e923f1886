"""Model and tokenizer loading, and the one place where parallelisms are applied.

A model comes from a local Hugging Face checkpoint directory (safetensors), a GGUF file (transformers
dequantizes it; needs the `gguf` package), or a named architecture preset with random init. Parameters
are FP32 master weights; the trainer computes in BF16 under autocast and `convert_to_fp8` swaps the
decoder projections for FP8 Linears afterwards.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..fp8.convert import compile_options
from .lora import LoraConfig, base_model

__all__ = ["ModelConfig", "PRESETS", "build_model", "load_model_tokenizer", "parallelize_model", "decoder_layers"]

log = logging.getLogger(__name__)

_QWEN_VOCAB = 151936  # Qwen2.5's embedding rows (151,665 tokens padded)
# HF config kwargs per preset. vocab_size None = the tokenizer's size rounded up to a multiple of 64.
PRESETS: dict[str, dict] = {
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=_QWEN_VOCAB,
                         tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6),
    "qwen2.5-1.5b": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=_QWEN_VOCAB,
                         tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6),
    "qwen2.5-7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=_QWEN_VOCAB,
                       tie_word_embeddings=False, rope_theta=1e6, rms_norm_eps=1e-6),
    "llama-3.2-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=None,
                         tie_word_embeddings=True, rope_theta=5e5, rms_norm_eps=1e-5),
    "llama-3-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=None,
                       tie_word_embeddings=False, rope_theta=5e5, rms_norm_eps=1e-5),
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=None,
                         tie_word_embeddings=True, rope_theta=1e5, rms_norm_eps=1e-5),
    # For tests and the CPU demo: every projection a multiple of 128 so FP8 blocks are whole.
    "tiny-qwen2": dict(model_type="qwen2", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=None,
                       tie_word_embeddings=True, rope_theta=1e4, rms_norm_eps=1e-6),
    "tiny-llama": dict(model_type="llama", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=None,
                       tie_word_embeddings=True, rope_theta=1e4, rms_norm_eps=1e-5),
}
_FAMILIES = ("qwen2", "llama")


@dataclass
class ModelConfig:
    """Which model to train and with which tokenizer (the `model` section)."""

    source: str = "tiny-qwen2"
    """A local Hugging Face checkpoint directory, a .gguf file, or a preset name (random init): qwen2.5-0.5b, qwen2.5-1.5b, qwen2.5-7b, llama-3.2-1b, llama-3-8b, smollm2-135m, tiny-qwen2, tiny-llama."""
    tokenizer: str | None = None
    """Tokenizer source for `load_tokenizer` ('qwen2.5' or a path); null = the checkpoint's own, else Qwen2.5."""
    num_layers: int | None = None
    """Presets only: override the number of decoder layers."""
    hidden_size: int | None = None
    """Presets only: override the hidden size (keep it a multiple of the head count, and of 128 for FP8)."""
    intermediate_size: int | None = None
    """Presets only: override the MLP width."""
    num_heads: int | None = None
    """Presets only: override the number of attention heads."""
    num_kv_heads: int | None = None
    """Presets only: override the number of key/value heads (grouped-query attention)."""
    vocab_size: int | None = None
    """Presets only: embedding rows; null = the preset's (Qwen: 151,936) or the tokenizer's size rounded to 64."""
    tie_embeddings: bool | None = None
    """Presets only: share the embedding and LM head weights; null = the preset's choice."""
    max_seq_len: int = 32768
    """Presets only: max_position_embeddings of the config."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters with PEFT (section); `model.lora.rank` > 0 trains only them, on the frozen FP8 base."""


def _source_kind(source: str) -> str:
    path = Path(source).expanduser()
    if source.endswith(".gguf"):
        if not path.is_file():
            raise FileNotFoundError(f"config key 'model.source': GGUF file {path} does not exist")
        return "gguf"
    if source in PRESETS:
        return "preset"
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"config key 'model.source': {path} is a directory without config.json "
                                    "(not a Hugging Face checkpoint)")
        return "hf"
    raise ValueError(f"config key 'model.source': {source!r} is neither an existing checkpoint directory, "
                     f"a .gguf file, nor a preset ({', '.join(PRESETS)})")


def _has_tokenizer_files(path: Path) -> bool:
    return any((path / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


def load_model_tokenizer(cfg: ModelConfig):
    """The tokenizer named by `cfg.tokenizer`, else the checkpoint's own, else the Qwen2.5 tokenizer."""
    from ..data import load_tokenizer

    if cfg.tokenizer is not None:
        return load_tokenizer(cfg.tokenizer)
    kind = _source_kind(cfg.source)
    if kind == "gguf":
        from transformers import AutoTokenizer

        path = Path(cfg.source).expanduser()
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if kind == "hf" and _has_tokenizer_files(Path(cfg.source).expanduser()):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(Path(cfg.source).expanduser()))
    return load_tokenizer(None)


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def _preset_config(cfg: ModelConfig, vocab_len: int | None):
    from transformers import LlamaConfig, Qwen2Config

    p = dict(PRESETS[cfg.source])
    model_type = p.pop("model_type")
    rope_theta = p.pop("rope_theta")
    for key, hf_key in (("num_layers", "num_hidden_layers"), ("hidden_size", "hidden_size"),
                        ("intermediate_size", "intermediate_size"), ("num_heads", "num_attention_heads"),
                        ("num_kv_heads", "num_key_value_heads"), ("vocab_size", "vocab_size"),
                        ("tie_embeddings", "tie_word_embeddings")):
        if getattr(cfg, key) is not None:
            p[hf_key] = getattr(cfg, key)
    if p["vocab_size"] is None:
        if vocab_len is None:
            raise ValueError(f"preset {cfg.source!r} takes its vocabulary size from the tokenizer; pass one "
                             "or set model.vocab_size")
        p["vocab_size"] = _round_up(vocab_len, 64)
    if p["hidden_size"] % p["num_attention_heads"]:
        raise ValueError(f"config key 'model.hidden_size' ({p['hidden_size']}) must be a multiple of "
                         f"'model.num_heads' ({p['num_attention_heads']})")
    if p["num_attention_heads"] % p["num_key_value_heads"]:
        raise ValueError(f"config key 'model.num_heads' ({p['num_attention_heads']}) must be a multiple of "
                         f"'model.num_kv_heads' ({p['num_key_value_heads']})")
    cls = Qwen2Config if model_type == "qwen2" else LlamaConfig
    return cls(**p, max_position_embeddings=cfg.max_seq_len, use_cache=False,
               rope_parameters={"rope_type": "default", "rope_theta": rope_theta})


def build_model(cfg: ModelConfig, tokenizer=None) -> nn.Module:
    """A causal LM with FP32 parameters on the CPU and SDPA attention, in train mode.

    Random init (presets) draws from torch's global RNG: seed it first for a reproducible model.
    """
    from transformers import AutoModelForCausalLM

    kind = _source_kind(cfg.source)
    vocab_len = len(tokenizer) if tokenizer is not None else None
    if kind != "preset":
        set_keys = [k for k in ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads",
                                "vocab_size", "tie_embeddings") if getattr(cfg, k) is not None]
        if set_keys:
            raise ValueError(f"config keys {['model.' + k for k in set_keys]} apply to presets only, not to "
                             f"the checkpoint {cfg.source}")
    kwargs = dict(dtype=torch.float32, attn_implementation="sdpa")
    if kind == "preset":
        model = AutoModelForCausalLM.from_config(_preset_config(cfg, vocab_len), **kwargs)
    elif kind == "gguf":
        path = Path(cfg.source).expanduser()
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, **kwargs)
        # transformers dequantized every GGUF tensor to float: from here on it is a plain model that
        # trains and saves like any other, so drop the quantizer marker (save_pretrained refuses it).
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
    else:
        model = AutoModelForCausalLM.from_pretrained(str(Path(cfg.source).expanduser()), **kwargs)
    model.config.use_cache = False  # training: no KV cache
    if model.config.model_type not in _FAMILIES:
        log.warning("model type %r is not one of the tested families %s", model.config.model_type, _FAMILIES)
    rows = model.get_input_embeddings().weight.shape[0]
    if vocab_len is not None and vocab_len > rows:
        raise ValueError(f"the tokenizer has {vocab_len} tokens but the model {cfg.source!r} only {rows} "
                         "embedding rows; use the checkpoint's own tokenizer or a larger model.vocab_size")
    for name, param in model.named_parameters():  # FP32 master weights (`.float()` refuses GGUF-loaded models)
        if param.dtype != torch.float32:
            param.data = param.data.float()
    return model.train()


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layer list of an HF causal LM (Qwen2 and Llama keep it at `model.model.layers`), also
    inside a PEFT wrapper."""
    base = getattr(base_model(model), "model", None)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(model).__name__} has no `model.layers` decoder list")
    return layers


def parallelize_model(model: nn.Module, *, activation_checkpointing: bool = False, compile: bool = False,
                      cuda_graphs: bool = False, shard: Callable[[nn.Module], None] | None = None) -> nn.Module:
    """Apply the parallelisms, in place, in the one order that composes:

    1. activation checkpointing: HF gradient checkpointing around each decoder layer (non-reentrant,
       so it nests under compile and FSDP2);
    2. torch.compile of each decoder layer (`Module.compile` keeps parameter names, so checkpoints
       and exports do not see `_orig_mod`), with `compile_options()` (one input quantization per FP8
       GEMM input) and, with `cuda_graphs`, inductor's CUDA graphs (the caller marks each step's
       start with `torch.compiler.cudagraph_mark_step_begin`);
    3. `shard(model)`: the seam for FSDP2 (`fully_shard` per decoder layer, then the root), run last
       so that it wraps the checkpointed, compiled layers. A single process passes None.

    Before this, on the plain model: FP8 conversion, then PEFT LoRA (`fp8train.train.lora.apply_lora`), so
    that each adapter wraps an FP8Linear as its frozen base layer and the checkpointed, compiled layers
    include the adapters. (LoRA under FSDP is refused for now: the sharded checkpoint paths do not yet map
    PEFT's parameter names.)
    """
    if activation_checkpointing:
        kwargs = {"use_reentrant": False}
        hf = base_model(model)
        if hasattr(hf, "activation_checkpointing_enable"):  # transformers >= 5.2x renamed it
            hf.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if compile:
        options = compile_options() | ({"triton.cudagraphs": True} if cuda_graphs else {})
        for layer in decoder_layers(model):
            layer.compile(options=options)
    if shard is not None:
        shard(model)
    return model
