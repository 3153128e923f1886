"""LoRA fine-tuning with PEFT on top of the FP8 conversion (the `model.lora` config section).

Order: `convert_to_fp8` first, then PEFT's LoRA wraps each target projection, whose frozen base layer is
then the FP8Linear (a frozen FP8Linear skips its grad_weight GEMM and the quantization only that needs);
the adapters stay BF16 (FP32 masters) and train. The frozen base is held in BF16 (`base_dtype`), as Hugging Face
checkpoints ship it: an FP32 copy of weights that never change would only double their memory and cost a cast
to BF16 in every step of a BF16 base. While the trainer trains, the base's FP8 weights are made
once (`freeze_fp8_weights`; with `keep_weight_t` their transposes too), and on a GPU the base's own weights wait in
host memory (`offload_base`). With `inputs_fp8` the adapters keep for backward the FP8 rows their base made of
the input, not the input (`FP8InputLinear`). Activation checkpointing, compile and sharding follow
(`parallelize_model`). Only the adapters are trainable, so the optimizer sees only them.

A LoRA checkpoint's `model/` directory holds the frozen base as a plain Hugging Face model (the weights
under their usual names) and the adapter in `model/lora/` in PEFT's format
(`PeftModel.from_pretrained(base, "model/lora")` reads it). Exports merge: W + (alpha / rank) * B @ A.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from ..fp8.convert import DECODER_PROJECTIONS
from ..fp8.linear import FP8InputLinear, FP8Linear

__all__ = ["LoraConfig", "apply_lora", "is_lora", "base_model", "keep_adapter_inputs_fp8", "save_lora_model",
           "load_lora_model", "merged_model", "merge_adapter_tensors", "merge_saved_adapter", "ADAPTER_DIR"]

ADAPTER_DIR = "lora"
_ADAPTER = "default"  # PEFT's adapter name


@dataclass
class LoraConfig:
    """LoRA adapters (the `model.lora` section); rank 0 trains every parameter instead."""

    rank: int = 0
    """LoRA rank r; 0 = no adapters (full fine-tuning). With r > 0 only the adapters train."""
    alpha: float | None = None
    """Scaling numerator: the update is (alpha / rank) * B @ A; null = 2 x rank."""
    dropout: float = 0.0
    """Dropout on the adapters' input (0 = none)."""
    target_modules: list[str] = field(default_factory=lambda: list(DECODER_PROJECTIONS))
    """Module names (last dotted part) that get adapters; the default is the seven decoder projections."""
    base_dtype: Literal["bf16", "fp32"] = "bf16"
    """The frozen base's parameters (projections, embeddings, norms, LM head): bf16, as checkpoints ship them and
    PEFT users load them (the residual stream then runs in BF16); fp32 keeps FP32 copies (twice the memory; the
    exports are BF16 either way)."""
    offload_base: bool = True
    """While training on a GPU, keep the frozen base projections' weights in host memory: the GPU holds only
    their FP8 copies, made once (`fp8train.freeze_fp8_weights`). false keeps both on the GPU."""
    keep_weight_t: bool = False
    """Also keep each frozen base projection's W.T in FP8 (grad_input's operand: Hopper's FP8 GEMMs read both
    operands K-major): 1 more byte per base parameter on the GPU, and no backward transposes W."""
    inputs_fp8: bool = False
    """The adapters keep their input for backward as the FP8 copy their frozen base made of it (1 byte per
    element, not BF16's 2; `fp8train.FP8InputLinear`): adapter A's gradient then reads E4M3's rounding of the
    input, as the base's output GEMM does. FP8 recipes and adapters without dropout; a BF16 run keeps BF16."""

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"config key 'model.lora.rank' must be an integer >= 0, got {self.rank!r}")
        if self.alpha is not None and not self.alpha > 0:
            raise ValueError(f"config key 'model.lora.alpha' must be > 0 or null, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"config key 'model.lora.dropout' must be in [0, 1), got {self.dropout!r}")
        if self.base_dtype not in ("bf16", "fp32"):
            raise ValueError(f"config key 'model.lora.base_dtype' must be bf16 or fp32, got {self.base_dtype!r}")
        if self.rank and not self.target_modules:
            raise ValueError("config key 'model.lora.target_modules' is empty: name the modules that get adapters")
        for key in ("keep_weight_t", "inputs_fp8"):
            if getattr(self, key) and not self.rank:
                raise ValueError(f"config key 'model.lora.{key}' needs 'model.lora.rank' > 0 (adapters on a "
                                 "frozen base)")
        if self.inputs_fp8 and self.dropout:
            raise ValueError("config key 'model.lora.inputs_fp8' needs 'model.lora.dropout' 0: with dropout the "
                             "adapters read another tensor than their base")

    @property
    def enabled(self) -> bool:
        return self.rank > 0


def is_lora(model: nn.Module) -> bool:
    """Whether `model` is wrapped by PEFT (a `PeftModel`)."""
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def base_model(model: nn.Module) -> nn.Module:
    """The Hugging Face model inside a PEFT wrapper (its LoRA layers in place); `model` itself otherwise."""
    return model.get_base_model() if is_lora(model) else model


def apply_lora(model: nn.Module, cfg: LoraConfig, *, sharded: bool = False) -> nn.Module:
    """Wrap `model` (already converted to FP8) with PEFT LoRA adapters; `model` itself when rank is 0."""
    if not cfg.enabled:
        return model
    if sharded:
        raise ValueError("config key 'model.lora.rank': LoRA runs in one process for now, not under FSDP "
                         "(distributed.fsdp); a 7B model with adapters fits one GPU")
    try:
        import peft
    except ImportError:
        raise ImportError("config key 'model.lora.rank' needs PEFT: pip install 'fp8train[hf]'") from None
    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    missing = [t for t in cfg.target_modules if t not in names]
    if missing:
        raise ValueError(f"config key 'model.lora.target_modules': {missing} name no module of the model")
    config = peft.LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha if cfg.alpha is not None else 2 * cfg.rank,
                             lora_dropout=cfg.dropout, target_modules=list(cfg.target_modules), bias="none",
                             task_type="CAUSAL_LM")
    model = peft.get_peft_model(model, config)
    if cfg.base_dtype == "bf16":
        for p in model.parameters():
            if not p.requires_grad:
                p.data = p.data.to(torch.bfloat16)
    if cfg.inputs_fp8:
        keep_adapter_inputs_fp8(model)
    return model


def keep_adapter_inputs_fp8(model: nn.Module) -> int:
    """In a PEFT LoRA model on FP8 bases, in place: each adapter A beside an enabled FP8Linear becomes an
    FP8InputLinear (its Parameters and names kept), which keeps for backward the FP8 rows its base made of
    their input (`model.lora.inputs_fp8`), and its layer hands it the input the base read (PEFT casts it to the
    adapter's dtype first: a new tensor, whose FP8 rows would be made again). Layers with dropout on the
    adapters' input are left as they are. Returns how many layers changed."""
    from peft.tuners.lora import LoraLayer

    changed = 0
    for layer in model.modules():
        base = getattr(layer, "base_layer", None)
        if not (isinstance(layer, LoraLayer) and isinstance(base, FP8Linear) and base.recipe.enabled):
            continue
        if not all(isinstance(d, nn.Identity) for d in layer.lora_dropout.values()):
            continue  # the adapters read dropout(x), not x
        for name, a in layer.lora_A.items():
            layer.lora_A[name] = FP8InputLinear.beside(a, base)
        layer.cast_input_dtype_enabled = False  # FP8InputLinear casts as PEFT would
        changed += 1
    return changed


def _scaling(config: dict) -> float:
    if config.get("use_dora") or config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ValueError("LoRA merge: DoRA and per-module rank/alpha patterns are not supported")
    r, alpha = config["r"], config["lora_alpha"]
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def _plain(name: str) -> str:
    return name.replace(".base_layer", "")


def _split(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """A PEFT model's state dict (base-model names) -> (base weights by plain name, {module: {"A", "B"}})."""
    base, adapters = {}, {}
    for name, t in state.items():
        for part in ("lora_A", "lora_B"):
            tag = f".{part}.{_ADAPTER}.weight"
            if name.endswith(tag):
                adapters.setdefault(name[: -len(tag)], {})[part[-1]] = t
                break
        else:
            base[_plain(name)] = t
    return base, adapters


def merge_adapter_tensors(tensors: Iterable[tuple[str, torch.Tensor]], adapters: dict[str, dict[str, torch.Tensor]],
                          scaling: float) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of the base with `{module: {"A", "B"}}` merged into `module.weight` in FP32:
    W + scaling * (B @ A), as PEFT merges. Every adapter must find its weight."""
    unused = set(adapters)
    for name, t in tensors:
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        if module in adapters:
            ab = adapters[module]
            delta = (ab["B"].float() @ ab["A"].float()) * scaling
            if delta.shape != t.shape:
                raise ValueError(f"LoRA merge: the adapter of {module} makes {tuple(delta.shape)}, the weight is "
                                 f"{tuple(t.shape)}")
            t = t.float() + delta
            unused.discard(module)
        yield name, t
    if unused:
        raise ValueError(f"LoRA merge: adapters for modules the base model lacks: {sorted(unused)[:3]}")


# -------------------------------------------------------------------------------- in-memory model


def merged_model(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """A plain Hugging Face model (no PEFT) holding the merged weights of a LoRA `model`: merged projections
    in `dtype`, every other tensor shared with the source (nothing else copied). For exports."""
    from transformers import AutoModelForCausalLM

    base, adapters = _split(base_model(model).state_dict())
    scaling = _scaling(model.peft_config[_ADAPTER].to_dict())
    out = {n: (t.to(dtype) if n.removesuffix(".weight") in adapters else t.detach())
           for n, t in merge_adapter_tensors(base.items(), adapters, scaling)}
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(base_model(model).config, dtype=torch.float32)
    plain.load_state_dict(out, assign=True, strict=False)
    plain.tie_weights()
    missing = [n for n, p in plain.state_dict().items() if p.is_meta]
    if missing:
        raise RuntimeError(f"LoRA merge: the merged state lacks {missing[:3]}")
    return plain


def save_lora_model(model: nn.Module, out_dir: Path) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """Write the adapter to `out_dir/lora` (PEFT format) and return (the base model, its weights under their
    plain names): the caller writes those as the Hugging Face directory `out_dir`."""
    model.save_pretrained(out_dir / ADAPTER_DIR)
    base, _ = _split(base_model(model).state_dict())
    return base_model(model), base


def load_lora_model(model: nn.Module, model_dir: Path) -> None:
    """Restore a LoRA model saved by `save_lora_model`: the base weights, then the adapter, both strictly."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from .checkpoint import read_model_weights

    adapter_file = model_dir / ADAPTER_DIR / "adapter_model.safetensors"
    if not adapter_file.is_file():
        raise FileNotFoundError(f"{adapter_file} is missing: the checkpoint was not written by a LoRA run "
                                "(config key 'model.lora.rank')")
    hf = base_model(model)
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(hf.config)
    weights = read_model_weights(plain, model_dir)  # checks the names against a plain model of this config
    targets = {_plain(n): p for n, p in hf.state_dict(keep_vars=True).items() if ".lora_" not in n}
    with torch.no_grad():
        for name, value in weights.items():
            targets[name].copy_(value)
    result = set_peft_model_state_dict(model, load_file(adapter_file))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    missing = [n for n in getattr(result, "missing_keys", []) if n in trainable]
    if result.unexpected_keys or missing:
        raise RuntimeError(f"{adapter_file} does not match the model's adapters: missing {missing[:3]}, "
                           f"unexpected {result.unexpected_keys[:3]}")


# ------------------------------------------------------------------------------------ on disk (export)


def _adapter_on_disk(model_dir: Path) -> tuple[dict[str, dict[str, torch.Tensor]], float] | None:
    """The adapter saved beside a base model (`model_dir/lora`): ({module: {"A", "B"}}, scaling), or None."""
    from safetensors.torch import load_file

    folder = model_dir / ADAPTER_DIR
    if not (folder / "adapter_config.json").is_file():
        return None
    config = json.loads((folder / "adapter_config.json").read_text())
    adapters: dict = {}
    prefix = "base_model.model."
    for name, t in load_file(folder / "adapter_model.safetensors").items():
        module, _, tail = name.removeprefix(prefix).rpartition(".lora_")
        if tail not in ("A.weight", "B.weight"):
            raise ValueError(f"{folder}: unexpected adapter tensor {name!r}")
        adapters.setdefault(module, {})[tail[0]] = t
    return adapters, _scaling(config)


def merge_saved_adapter(model_dir: Path, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
    """The (name, tensor) stream of the base model in `model_dir` with the adapter saved beside it
    (`model_dir/lora`, a LoRA checkpoint) merged in; the stream unchanged when there is none."""
    found = _adapter_on_disk(Path(model_dir))
    return merge_adapter_tensors(tensors, *found) if found else tensors
