"""Model conversion: swap the decoder's projection Linears for FP8Linear, in place.

Converted (the recipe's list): q, k, v, o projections and the MLP's gate, up, down projections.
Left in BF16: embeddings, the LM head, norms and everything that is not an nn.Linear. A Linear whose
dimensions are not multiples of 16 (the FP8 tensor-core alignment) is skipped and reported. With the
recipe's `fuse_swiglu` or `swiglu_inputs_fp8`, each SwiGLU MLP of converted projections
becomes an `FP8SwiGLUMLP` (swiglu.py: the same children and arithmetic, the SwiGLU fused into its FP8
producers and/or its inputs saved for backward in FP8).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from .gemm import load_deep_gemm
from .linear import FP8Linear
from .recipe import Fp8Recipe, make_recipe
from .swiglu import FP8SwiGLUMLP, swiglu_mlp_applies

__all__ = ["ConversionReport", "convert_to_fp8", "compile_options", "cache_fp8_weights", "freeze_fp8_weights",
           "hold_fp8_weights", "DECODER_PROJECTIONS"]

DECODER_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_ALREADY = "already FP8Linear"


@dataclass
class ConversionReport:
    recipe: str
    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    swiglu_mlps: list[str] = field(default_factory=list)
    """MLPs converted as one piece (`FP8SwiGLUMLP`: the recipe's `fuse_swiglu` or `swiglu_inputs_fp8`)."""
    swiglu_conversion: str = ""
    """What converting them changed, in words (`FP8SwiGLUMLP.conversion`)."""

    def __str__(self) -> str:
        reasons = defaultdict(list)
        for name, why in self.skipped.items():
            reasons[why].append(name)
        already = reasons.pop(_ALREADY, [])  # converted before (with their own recipe): in FP8, not "kept in BF16"
        lines = [f"fp8train: recipe {self.recipe}: {len(self.converted)} Linear layers in FP8, "
                 f"{len(self.skipped) - len(already)} kept in BF16"
                 + (f"; {len(already)} arrived as FP8Linear, left as they are" if already else "")]
        if self.swiglu_mlps:
            lines.append(f"  {len(self.swiglu_mlps)} SwiGLU MLPs converted whole ({self.swiglu_conversion})")
        for why, names in reasons.items():
            shown = ", ".join(names[:3]) + (f", ... ({len(names)} in all)" if len(names) > 3 else "")
            lines.append(f"  kept in BF16 ({why}): {shown}")
        return "\n".join(lines)


def _is_decoder_projection(module: nn.Module, fqn: str) -> bool:
    return fqn.rsplit(".", 1)[-1] in DECODER_PROJECTIONS


def _decoder_layer_prefixes(model: nn.Module, indices: Sequence[int]) -> dict[str, int]:
    """{"model.layers.3.": 3, ...} for the decoder layer `indices` (negative ones count from the end)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"bf16_layers: {type(model).__name__} has no `model.layers` decoder list")
    n = len(layers)
    out = {}
    for i in indices:
        if isinstance(i, bool) or not isinstance(i, int) or not -n <= i < n:
            raise ValueError(f"bf16_layers: {i!r} is not a decoder layer index of a {n}-layer model ({-n}..{n - 1})")
        out[f"model.layers.{i % n}."] = i % n
    return out


def convert_to_fp8(
    model: nn.Module,
    recipe: "str | Fp8Recipe" = "hybrid",
    module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
    *,
    bf16_layers: Sequence[int] = (),
) -> ConversionReport:
    """Swap eligible nn.Linear modules of `model` for FP8Linear, keeping the same Parameter objects.

    module_filter_fn(module, fqn) -> bool picks the Linears to convert; the default picks the decoder
    projections (q/k/v/o, gate/up/down). `bf16_layers` keeps the listed decoder layers (indices into
    `model.model.layers`; -1 is the last) entirely in BF16. The LM head is never converted. Returns a report
    of what was converted and why the rest was skipped. With recipe "bf16" nothing is converted. A recipe with
    `deep_gemm` on a model on CUDA loads DeepGEMM here (`load_deep_gemm`: a ValueError if it does not import).
    """
    recipe = make_recipe(recipe)
    report = ConversionReport(recipe.spec)
    if not recipe.enabled:
        return report
    if recipe.deep_gemm and any(p.is_cuda for p in model.parameters()):
        load_deep_gemm()  # missing: one error now; present: its device state made outside any CUDA graph
    kept_layers = _decoder_layer_prefixes(model, bf16_layers) if bf16_layers else {}
    wanted = module_filter_fn or _is_decoder_projection
    lm_head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    input_cache = WeakIdKeyDictionary()  # shared by siblings that read the same tensor (q/k/v, gate/up)
    for fqn, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        if isinstance(module, FP8Linear):
            report.skipped[fqn] = _ALREADY
        elif module is lm_head or fqn.rsplit(".", 1)[-1] == "lm_head":
            report.skipped[fqn] = "LM head stays BF16"
        elif not wanted(module, fqn):
            report.skipped[fqn] = "not selected by the filter"
        elif any(fqn.startswith(prefix) for prefix in kept_layers):
            report.skipped[fqn] = f"bf16_layers: decoder layers {sorted(kept_layers.values())}"
        elif module.in_features % 16 or module.out_features % 16:
            report.skipped[fqn] = "dims not multiples of 16"
        else:
            parent_name, _, child = fqn.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, FP8Linear.from_linear(module, recipe, input_cache))
            report.converted.append(fqn)
    if _converts_whole(recipe):
        for fqn, module in list(model.named_modules()):
            # (a bare MLP passed as the model cannot replace itself; Linears converted before keep their recipe)
            if fqn and swiglu_mlp_applies(module) and _converts_whole(module.down_proj.recipe):
                parent_name, _, child = fqn.rpartition(".")
                mlp = FP8SwiGLUMLP(module)
                setattr(model.get_submodule(parent_name) if parent_name else model, child, mlp)
                report.swiglu_mlps.append(fqn)
                report.swiglu_conversion = mlp.conversion
    return report


def _converts_whole(recipe: Fp8Recipe) -> bool:
    return recipe.fuse_swiglu or recipe.swiglu_inputs_fp8


def compile_options() -> dict:
    """Inductor options for torch.compile of a converted model or layer: `layer.compile(options=...)`.

    They add a joint-graph pass that quantizes an input once for all the FP8 Linears that read it (q/k/v,
    gate/up), as eager mode does; without it a compiled layer on CUDA quantizes (and saves for the
    backward) those inputs once per Linear. Harmless for a model without FP8 Linears."""
    from .compile import ShareQuantization

    return {"joint_custom_pre_pass": ShareQuantization()}


@contextlib.contextmanager
def cache_fp8_weights(model: nn.Module) -> Iterator[None]:
    """Quantize each FP8Linear's weight once for everything inside the context (the micro-batches of one
    optimizer step, their backward and activation-checkpointing recomputes), then drop the copies.

    Step the optimizer outside it: weights must not change while it is open (fused AdamW updates them
    without bumping their version counter, so a change would go unnoticed)."""
    layers = [m for m in model.modules() if isinstance(m, FP8Linear)]
    for m in layers:
        m.cache_weight(True)
    try:
        yield
    finally:
        for m in layers:
            m.cache_weight(False)


@contextlib.contextmanager
def freeze_fp8_weights(model: nn.Module, *, offload: bool = False, keep_t: bool = False) -> Iterator[int]:
    """Keep each frozen FP8Linear weight (requires_grad False: LoRA's base) in FP8 for everything inside the
    context: quantized once, not in every forward and backward; with `offload`, the high-precision weights
    wait in host memory meanwhile (the GPU holds 1 byte per parameter instead of 2 for BF16, 4 for FP32);
    with `keep_t`, W.T's FP8 operand is kept too, 1 more byte per parameter, so that no backward transposes W
    for grad_input (Hopper's FP8 GEMMs read both operands K-major). On exit the copies go and the weights
    come back. Yields how many layers were frozen.

    The frozen weights must not change inside it (a PEFT merge, a load): exit first."""
    layers = [m for m in model.modules() if isinstance(m, FP8Linear) and not m.weight.requires_grad]
    frozen = [m for m in layers if m.freeze_weight(True, offload=offload, keep_t=keep_t)]
    try:
        yield len(frozen)
    finally:
        for m in frozen:
            m.freeze_weight(False)


@contextlib.contextmanager
def hold_fp8_weights(model: nn.Module, optimizer) -> Iterator[int]:
    """Keep each trained FP8Linear weight's FP8 operand (128x128 blocks) between steps, written by `optimizer`
    (a `TritonAdamW`) as its step updates the weight: no forward or backward quantizes a weight, for 1 byte
    per parameter held. Yields how many layers hold one; on exit the copies go.

    Inside it, only that optimizer's `step` may change the weights (a load into them, a `.to()`: exit first). A
    layer holds a copy only where the optimizer steps its weight, as a whole tensor (not under FSDP: its layers
    hold none), and a weight shared by several layers is held by the first."""
    if not callable(getattr(optimizer, "write_fp8_blocks", None)):
        raise TypeError(f"{type(optimizer).__name__} cannot write FP8 weights; fp8train.train.adamw.TritonAdamW "
                        "(CUDA) can")
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    held = []
    try:
        for m in model.modules():
            if not isinstance(m, FP8Linear) or id(m.weight) not in stepped:
                continue
            stepped.discard(id(m.weight))  # one copy per weight, which the optimizer writes
            copy = m.hold_weight(True)
            if copy is not None:
                held.append(m)
                optimizer.write_fp8_blocks(m.weight, *copy, pow2=m.recipe.pow2_scale)
        yield len(held)
    finally:
        for m in held:
            optimizer.write_fp8_blocks(m.weight, None, None, pow2=m.recipe.pow2_scale)
            m.hold_weight(False)
