"""Model and tokenizer loading, and the one place where parallelisms are applied.

A model comes from a local Hugging Face checkpoint directory (safetensors), a GGUF file (transformers
dequantizes it; needs the `gguf` package), or a named architecture preset with random init. Parameters
are FP32 master weights; the trainer computes in BF16 under autocast and `convert_to_fp8` swaps the
decoder projections for FP8 Linears afterwards.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..fp8.convert import compile_options
from ..fp8.quant import round_up
from .schema import ConfigError
from .lora import LoraConfig, base_model

__all__ = ["ModelConfig", "PRESETS", "build_model", "check_weights_match", "decoder_layers", "index_weight_names",
           "load_model_tokenizer", "parallelize_model", "weight_files"]

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

    def __post_init__(self):
        for key in ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "vocab_size",
                    "max_seq_len"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ValueError(f"model.{key} must be >= 1, got {value}")


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
    if path.exists():
        raise ValueError(f"config key 'model.source': {path} is a file, not a checkpoint directory or a .gguf file")
    raise ValueError(f"config key 'model.source': {source!r} is neither an existing checkpoint directory, "
                     f"a .gguf file, nor a preset ({', '.join(PRESETS)})")


def load_model_tokenizer(cfg: ModelConfig):
    """The tokenizer named by `cfg.tokenizer`, else the checkpoint's own, else the Qwen2.5 tokenizer."""
    from ..data import load_tokenizer
    from ..data.tokenizer import has_tokenizer_files

    if cfg.tokenizer is not None:
        try:
            return load_tokenizer(cfg.tokenizer)
        except (FileNotFoundError, ValueError) as e:
            raise ConfigError(f"config key 'model.tokenizer': {e}", "model.tokenizer") from None
    kind = _source_kind(cfg.source)
    if kind == "gguf":
        from transformers import AutoTokenizer

        path = Path(cfg.source).expanduser()
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if kind == "hf" and has_tokenizer_files(Path(cfg.source).expanduser()):
        return load_tokenizer(str(Path(cfg.source).expanduser()))
    return load_tokenizer(None)


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
        p["vocab_size"] = round_up(vocab_len, 64)
    if p["hidden_size"] % p["num_attention_heads"]:
        raise ValueError(f"config key 'model.hidden_size' ({p['hidden_size']}) must be a multiple of "
                         f"'model.num_heads' ({p['num_attention_heads']})")
    if p["num_attention_heads"] % p["num_key_value_heads"]:
        raise ValueError(f"config key 'model.num_heads' ({p['num_attention_heads']}) must be a multiple of "
                         f"'model.num_kv_heads' ({p['num_key_value_heads']})")
    head_dim = p["hidden_size"] // p["num_attention_heads"]
    if head_dim % 2:
        raise ValueError(f"config key 'model.hidden_size' ({p['hidden_size']}) / 'model.num_heads' "
                         f"({p['num_attention_heads']}) gives a head dimension of {head_dim}; rotary position "
                         "embeddings need an even head dimension")
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
        model = _load_hf_dir(Path(cfg.source).expanduser(), kwargs)
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


# --------------------------------------------------------------------------- checkpoint files, checked


def index_weight_names(index: Path, what: str | None = None) -> list[str]:
    """The file names that a `model.safetensors.index.json` maps tensors to, sorted and without repeats.

    The index is untrusted, and a training checkpoint's manifest vouches only for the files it lists: a name
    with a path separator, "." or ".." would make fp8train read a file outside the folder it was handed. So
    each name must be a plain file name (read directly from the index's folder); an error names `what`, the
    index and the offending entry.
    """
    prefix = f"{what}: " if what else ""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        entries = list(weight_map.items())
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{prefix}{index} is not a safetensors index ({type(e).__name__}: {e})") from None
    for tensor, name in entries:
        if not (isinstance(name, str) and name not in ("", ".", "..") and not any(c in name for c in "/\\\0")):
            raise ValueError(f"{prefix}{index}: weight_map entry {tensor!r} -> {name!r} is not the name of a file "
                             f"directly inside {index.parent}")
    return sorted({name for _, name in entries})


def weight_files(model_dir: Path, what: str) -> list[Path]:
    """The safetensors files of a Hugging Face model directory, each checked to be complete (its header
    read and its size matching it) and, when an index names them, to lie directly inside the directory; an
    error names `what` (e.g. "config key 'model.source'") and the file."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = [model_dir / n for n in index_weight_names(index, what)]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{what}: {index} names shards that do not exist: {missing}")
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        other = [f.name for f in model_dir.glob("*.bin")] + [f.name for f in model_dir.glob("*.pt")]
        hint = f" (found {other}: fp8train reads safetensors only, never pickles)" if other else ""
        raise FileNotFoundError(f"{what}: {model_dir} has config.json but no *.safetensors weights{hint}")
    for f in files:
        _weight_shapes(f, what)
    return files


def _weight_shapes(path: Path, what: str) -> dict[str, tuple[int, ...]]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    except SafetensorError as e:
        raise ValueError(f"{what}: {path}: not a complete safetensors file ({e}); truncated or corrupt") from None


def check_weights_match(model: nn.Module, model_dir: Path, what: str, *, strict: bool = True) -> None:
    """Compare the tensor names and shapes in `model_dir`'s safetensors headers (no data read) with `model`.

    A shape that differs is an error; so is, with `strict`, a model tensor that no file holds (a tied
    alias counts as held) or a file tensor the model lacks. The error names `what`, the first few
    tensors and their two shapes.
    """
    shapes: dict[str, tuple[int, ...]] = {}
    for f in weight_files(model_dir, what):
        shapes.update(_weight_shapes(f, what))
    groups: dict[int, list[str]] = {}
    expected = {}
    for name, t in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(t), []).append(name)
        expected[name] = tuple(t.shape)
    problems = [f"{n}: file {list(shapes[n])} vs model {list(s)}" for n, s in expected.items()
                if n in shapes and shapes[n] != s]
    if strict:
        problems += [f"{names[0]}: missing" for names in groups.values() if not any(n in shapes for n in names)]
        problems += [f"{n}: not in the model" for n in shapes if n not in expected]
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ValueError(f"{what}: the weights in {model_dir} do not match the model: {'; '.join(problems[:3])}{more}")


def _load_hf_dir(path: Path, kwargs: dict) -> nn.Module:
    """from_pretrained of a checked directory: complete files whose tensors fit its config.json."""
    from transformers import AutoConfig, AutoModelForCausalLM

    what = "config key 'model.source'"
    try:
        config = AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{what}: {path / 'config.json'} is not a usable model config ({e})") from None
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    check_weights_match(skeleton, path, what, strict=config.model_type in _FAMILIES)
    try:
        return AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    except (OSError, RuntimeError) as e:
        raise ValueError(f"{what}: transformers could not load {path}: {str(e).splitlines()[0]}") from None


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
