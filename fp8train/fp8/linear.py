"""FP8Linear: nn.Linear whose output, grad_input and grad_weight GEMMs run in FP8 with FP32 accumulation.

The arithmetic is in ops.py (its docstring has the three GEMMs and `reference_fp8_linear`, what they
compute). This module owns a layer's state, changed only through its methods:

    plans           the recipe's `LinearPlan` for the cuBLAS and the emulated path
    input cache     shared with its siblings (q/k/v, gate/up read one tensor: one quantization, eagerly)
    weight cache    `cache_weight(True)`: W quantized once for the micro-batches of one optimizer step
    frozen weight   `freeze_weight(True)`: a frozen W (LoRA's base) quantized once for good, W itself
                    optionally moved to host memory, W.T's operand optionally kept too (`keep_t`)
    held weight     `hold_weight(True)`: a W that trains, its FP8 operand kept between steps and rewritten
                    by the optimizer's step as it updates W (`TritonAdamW.write_fp8_blocks`)
    health          `track_health(True)`: underflow / saturation / scale range of its operands
    FSDP            `prepare_fsdp(...)`: FSDP2 refills the weight every step; optionally gathers it in FP8

`FP8InputLinear` is a high-precision Linear beside a frozen FP8Linear (a LoRA adapter's A beside its base)
that keeps, for its grad_weight, the FP8 rows of their common input the base made, not the input itself.

Health tracking only observes: it quantizes the operands again with the reference (which the kernels
equal bit for bit) and hands the statistics out of the backward as the gradient of a small "sink"
tensor, so the compute path is the same and a compiled layer stays one graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary

from . import ops
from .health import health_dict, operand_health_stats
from .operands import LinearPlan
from .recipe import Fp8Format, Fp8Recipe, make_recipe

__all__ = ["FP8Linear", "FP8InputLinear", "output_dtype", "runs_on_cublas"]


@torch.compiler.assume_constant_result  # a constant of the device: torch.compile does not trace it
def _has_fp8_gemm(device_index: int) -> bool:
    return hasattr(F, "scaled_mm") and torch.cuda.get_device_capability(device_index) >= (9, 0)


def _use_cublas(t: Tensor) -> bool:
    return t.is_cuda and _has_fp8_gemm(t.device.index)


def output_dtype(x: Tensor) -> torch.dtype:
    """The dtype a Linear's output has for input `x`: autocast's where it is on, else x's."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


def runs_on_cublas(x: Tensor, recipe: Fp8Recipe) -> bool:
    """Whether `recipe`'s GEMMs on tensors like `x` run on cuBLAS (SM90, not `emulate`); else emulated."""
    return _use_cublas(x) and not recipe.emulate


def _quantize_shared(cache: WeakIdKeyDictionary | None, x: Tensor, x2d: Tensor, plan: LinearPlan,
                     make_cols: bool) -> tuple[Tensor, ...]:
    """x's (rows data, scale, cols data, scale); the layers reading one tensor (q/k/v, gate/up, a LoRA adapter
    beside its base) share one quantization: eagerly through their input cache, compiled through CSE /
    compile_options()' pass."""
    if cache is None or torch.compiler.is_compiling():
        return ops.quantize_input(x2d.detach(), plan, make_cols)
    key = (x._version, plan.key)
    hit = cache.get(x)
    if hit is not None and hit[0] == key and (hit[1][2].numel() or not make_cols):
        return hit[1]  # (a copy with cols serves a sibling that needs none)
    out = ops.quantize_input(x2d.detach(), plan, make_cols)
    cache[x] = (key, out)
    return out


class _Fp8LinearFn(torch.autograd.Function):
    """y = x @ W.T + b from the input's FP8 rows (made by the caller). Saves for backward the weight (W.T is
    re-made from it, or from `w`, W's given operand, unless `w_t` is W.T's, kept), `x_saved` (input.T's operand,
    the rows with the plan's `x_t_from_fp8`, or with no scale the input itself: `input_t_later`) and the
    forward's health statistics."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, x_rows: Tensor, x_rows_scale: Tensor,
                x_saved: Tensor | None, x_saved_scale: Tensor | None, w: Tensor | None, w_scale: Tensor | None,
                w_t: Tensor | None, w_t_scale: Tensor | None, health_sink: Tensor | None,
                health_stats: Tensor | None, plan: LinearPlan, out_dtype: torch.dtype) -> Tensor:
        y = ops.linear_forward(x_rows, x_rows_scale, weight.detach(), w, w_scale, plan, out_dtype)
        if bias is not None:
            y = y + bias.to(out_dtype)
        # save_for_backward (not ctx attributes) so activation checkpointing can drop and recompute them
        ctx.save_for_backward(weight, w, w_scale, w_t, w_t_scale, x_saved, x_saved_scale, health_stats)
        ctx.plan, ctx.x_dtype, ctx.x_shape = plan, x.dtype, x.shape
        ctx.b_dtype = bias.dtype if bias is not None else None
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy: Tensor):
        weight, w, w_scale, w_t, w_t_scale, x_saved, x_saved_scale, health_stats = ctx.saved_tensors
        p = ctx.plan
        dy2d = dy.reshape(-1, dy.shape[-1])
        want_dx = ctx.needs_input_grad[0]
        want_dw = ctx.needs_input_grad[1] and x_saved is not None
        if want_dw:
            x_saved, x_saved_scale = ops.saved_wgrad_input(p, x_saved, x_saved_scale)
        dx, dw = ops.linear_backward(dy2d, weight.detach(), w, w_scale, w_t, w_t_scale, x_saved, x_saved_scale, p,
                                     want_dx, want_dw, ctx.x_dtype)
        db = dy2d.float().sum(0).to(ctx.b_dtype) if ctx.b_dtype is not None and ctx.needs_input_grad[2] else None
        sink = None
        if ctx.needs_input_grad[11]:  # health tracking: the statistics leave as the sink's gradient
            sink = torch.cat([health_stats, operand_health_stats(dy2d, p.g, p.pow2)[None]])
        return (dx.view(ctx.x_shape) if want_dx else None, dw.to(weight.dtype) if want_dw else None, db,
                None, None, None, None, None, None, None, None, sink, None, None, None)


class FP8Linear(nn.Linear):
    """nn.Linear whose output, grad_input and grad_weight GEMMs run in FP8 per `recipe`.

    Holds the same `weight`/`bias` Parameters as the Linear it replaces (see `from_linear`), so optimizers
    and state_dicts are unaffected. Every forward quantizes the current weight, except inside
    `fp8train.cache_fp8_weights(model)`, which quantizes it once for the micro-batches of an optimizer step.
    Under torch.compile the layer traces into the surrounding graph (on CUDA down to the Triton kernels and
    `scaled_mm`, elsewhere as custom ops): no graph break, no eager caches.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, recipe: str | Fp8Recipe = "hybrid",
                 device=None, dtype=None, *, input_cache: WeakIdKeyDictionary | None = None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.recipe = make_recipe(recipe)
        self._plans = LinearPlan.per_route(self.recipe) if self.recipe.enabled else None
        self._input_cache = input_cache
        # Off by default: optimizers may update weights without bumping their version counter (fused AdamW
        # does not), so a cache keyed on it can go stale. `cache_weight(True)` is for the micro-batches of
        # one optimizer step, when the weights cannot change.
        self._cache_weight = False
        self._weight_cache: tuple | None = None
        self._weight_refilled = False  # FSDP2 refills the gathered weight in place: never cache it
        self._fp8_all_gather = False   # FSDP2 all-gathers the weight in FP8 blocks (fsdp.py)
        self._health_sink: Tensor | None = None
        # freeze_weight(True) / hold_weight(True): W's FP8 operand kept (buffers: `.to()` moves them), the plan
        # it is for, and whether W trains (held: the optimizer rewrites the copy) or not (frozen)
        self.register_buffer("_fp8_w", None, persistent=False)
        self.register_buffer("_fp8_w_scale", None, persistent=False)
        self.register_buffer("_fp8_w_t", None, persistent=False)  # a frozen W's W.T operand (`keep_t`)
        self.register_buffer("_fp8_w_t_scale", None, persistent=False)
        self.register_buffer("_fp8_w_health", None, persistent=False)  # a frozen W's health statistics, made once
        self._fp8_plan: str | None = None
        self._fp8_w_trains = False

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: str | Fp8Recipe = "hybrid",
                    input_cache: WeakIdKeyDictionary | None = None) -> "FP8Linear":
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, recipe=recipe, device="meta",
                  input_cache=input_cache)
        new.weight, new.bias = linear.weight, linear.bias
        new.train(linear.training)
        return new

    # ------------------------------------------------------------------------------------------ state

    def cache_weight(self, enabled: bool) -> None:
        """Quantize the weight once and reuse it (True) until turned off (False, which drops the copy)."""
        self._cache_weight = enabled and not self._weight_refilled
        if not enabled:
            self._weight_cache = None

    def freeze_weight(self, enabled: bool, *, offload: bool = False, keep_t: bool = False) -> bool:
        """Quantize a frozen weight once and keep its FP8 operand for good (True): LoRA's base. Every forward
        uses it and grad_input's W.T is its exact transpose, so nothing reads the weight itself again; with
        `offload` the weight moves to host memory (it stays the exact weight that checkpoints save); with
        `keep_t` W.T's operand is kept too (1 more byte a weight), so no backward transposes W. False
        drops the copies and brings the weight back. Returns whether the layer is frozen: not where the
        recipe's W.T is no transpose of W (row-wise scales), nor under FSDP (it refills the weight)."""
        if not enabled:
            if not self.frozen:
                return False
            if self.weight.device != self._fp8_w.device:
                self.weight = nn.Parameter(self.weight.detach().to(self._fp8_w.device), requires_grad=False)
            self._drop_fp8_weight()
            return False
        if self.weight.requires_grad:
            raise ValueError("FP8Linear.freeze_weight: the weight requires grad; only a frozen weight can be kept in "
                             "FP8 (weight.requires_grad_(False) first)")
        if not self.frozen:  # (else frozen already; its weight may be offloaded: keep the copy made where it lived)
            plan = self.plan(self.weight) if self.recipe.enabled else None
            if plan is None or self._weight_refilled or not ops.weight_transposes(plan):
                return False
            self._keep_fp8_weight(plan, trains=False)
            self._fp8_w_health = operand_health_stats(self.weight.detach(), plan.w, plan.pow2)
        if keep_t and self._fp8_w_t is None:  # W.T's operand: the copy's exact transpose
            plan = LinearPlan.parse(self._fp8_plan)
            self._fp8_w_t, self._fp8_w_t_scale = ops.transpose_weight(self._fp8_w, self._fp8_w_scale, plan,
                                                                      self.in_features)
        if offload and self.weight.device.type != "cpu":
            self.weight = nn.Parameter(self.weight.detach().cpu(), requires_grad=False)
        return True

    def hold_weight(self, enabled: bool) -> tuple[Tensor, Tensor] | None:
        """Keep the FP8 operand of a weight that trains between optimizer steps (True): quantized here from the
        current weight, then used by every forward, and grad_input's W.T is its exact transpose, so no step
        quantizes the weight. Whatever changes the weight from then on must rewrite the copy in place: the
        optimizer's step does (`TritonAdamW.write_fp8_blocks`, set up by `fp8train.hold_fp8_weights`). Returns
        the copy's (data, scale) (E4M3 in 128x128 blocks, row-major scales) to hand to it, or None where the layer
        cannot hold one: a weight that does not train (`freeze_weight` keeps those), a recipe whose weight operand
        is not E4M3 in 128x128 blocks, FSDP (it refills the weight). False drops the copy."""
        if not enabled:
            if self.held:
                self._drop_fp8_weight()
            return None
        if self.held:
            return self._fp8_w, self._fp8_w_scale
        plan = self.plan(self.weight) if self.recipe.enabled else None
        if (plan is None or self.frozen or not self.weight.requires_grad or self._weight_refilled
                or not ops.weight_transposes(plan) or plan.w.block != (128, 128) or plan.w.fmt is not Fp8Format.E4M3
                or self.weight.dim() != 2):
            return None
        self._keep_fp8_weight(plan, trains=True)
        return self._fp8_w, self._fp8_w_scale

    def _keep_fp8_weight(self, plan: LinearPlan, trains: bool) -> None:
        self._fp8_w, self._fp8_w_scale = ops.quantize_weight(self.weight.detach(), plan.w, plan.pow2, False,
                                                             plan.cublas)
        self._fp8_plan, self._fp8_w_trains = plan.key, trains

    def _drop_fp8_weight(self) -> None:
        self._fp8_w = self._fp8_w_scale = self._fp8_w_t = self._fp8_w_t_scale = self._fp8_w_health = None
        self._fp8_plan = None
        self._fp8_w_trains = False

    @property
    def frozen(self) -> bool:
        """Whether the frozen weight is kept in FP8 (`freeze_weight`)."""
        return self._fp8_plan is not None and not self._fp8_w_trains

    @property
    def held(self) -> bool:
        """Whether the training weight's FP8 operand is kept between steps (`hold_weight`)."""
        return self._fp8_plan is not None and self._fp8_w_trains

    def track_health(self, enabled: bool) -> None:
        """Record operand health in the next forward + backward (read it with `health()`)."""
        self._health_sink = torch.zeros(3, 6, device=self.weight.device, requires_grad=True) if enabled else None

    @property
    def tracking_health(self) -> bool:
        return self._health_sink is not None

    def health(self) -> dict | None:
        """{"input" | "weight" | "grad_output": {underflow, saturation, scale_min, scale_max}} of the last
        forward + backward while tracking; None before one."""
        if self._health_sink is None or self._health_sink.grad is None:
            return None
        return health_dict(self._health_sink.grad)

    @property
    def gathers_fp8(self) -> bool:
        """Whether FSDP2 all-gathers the weight as FP8 blocks (`prepare_fsdp`)."""
        return self._fp8_all_gather

    def prepare_fsdp(self, world_size: int, fp8_all_gather: bool) -> str | None:
        """Before FSDP2 shards this layer: FSDP refills the gathered weight in place every step (no version
        bump), so the step's weight cache is turned off for good; with `fp8_all_gather` the weight's local
        shard becomes one FSDP gathers as FP8 blocks. Returns why the weight is gathered in BF16 instead."""
        from . import fsdp

        self._weight_refilled = True
        self.cache_weight(False)
        why = fsdp.fp8_gather_blocker(self, world_size) if fp8_all_gather else "FP8 all-gather not asked for"
        if why is None:
            self.weight = fsdp.fp8_gathered_parameter(self.weight, self.recipe)
            self._fp8_all_gather = True  # compiled, this layer runs outside the graph (the gathered weight is a subclass)
        return why

    # ---------------------------------------------------------------------------------------- forward

    def weight_operand(self, plan: LinearPlan) -> tuple[Tensor | None, Tensor | None]:
        """W's operand for `plan` where one is made already: the frozen or held copy, FSDP's FP8 all-gather or
        the step's cache (made here on first use); (None, None): the GEMM's op quantizes the weight itself."""
        if self._fp8_plan is not None:
            if self._fp8_plan != plan.key or (self.held and self._fp8_w.device != self.weight.device):
                how = "hold_weight" if self.held else "freeze_weight"
                raise RuntimeError(f"FP8Linear: the weight's FP8 copy was made for plan {self._fp8_plan}, this forward "
                                   f"runs {plan.key} (moved to another device?): {how}(False), then again")
            return self._fp8_w, self._fp8_w_scale
        weight = self.weight
        gathered = getattr(weight, "fp8_operand", None)
        if gathered is not None:  # FSDP all-gathered it already in FP8 blocks (fsdp.py): use those
            return gathered(plan.w, plan.pow2)
        if torch.compiler.is_compiling() or not self._cache_weight:  # (compiling first: no guard on the flag)
            return None, None
        key = (weight.data_ptr(), weight._version, weight.dtype, plan.key)
        if self._weight_cache is None or self._weight_cache[0] != key:
            self._weight_cache = None  # free the stale copy before making a new one
            self._weight_cache = (key, ops.quantize_weight(weight.detach(), plan.w, plan.pow2, False, plan.cublas))
        return self._weight_cache[1]

    def _quantize_input(self, x: Tensor, x2d: Tensor, plan: LinearPlan, make_cols: bool) -> tuple[Tensor, ...]:
        return _quantize_shared(self._input_cache, x, x2d, plan, make_cols)

    def forward(self, x: Tensor) -> Tensor:
        if not self.recipe.enabled:
            return super().forward(x)
        if not x.is_floating_point():
            raise ValueError(f"FP8Linear: expected a floating-point input, got {x.dtype}")
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"FP8Linear: input's last dim must be in_features={self.in_features}, got shape {tuple(x.shape)}")
        if self._fp8_all_gather and torch.compiler.is_compiling():
            return _forward_outside_graph(self, x)  # FSDP's FP8-gathered weight is a tensor subclass
        return self._forward(x)

    def plan(self, x: Tensor) -> LinearPlan:
        """The plan this layer's GEMMs follow for input `x` (cuBLAS where it runs, else emulated)."""
        return self._plans[runs_on_cublas(x, self.recipe)]

    def computes_grad_weight(self) -> bool:
        """Whether a backward of this forward computes dW (the weight trains and autograd records)."""
        return torch.is_grad_enabled() and self.weight.requires_grad

    def makes_input_t(self, plan: LinearPlan) -> bool:
        """Whether this forward makes input.T's operand: a backward computes dW, and from input.T made now
        (with the plan's `x_t_from_fp8` it is made in the backward from the saved FP8 rows, with
        `input_t_later` from the saved input)."""
        return self.computes_grad_weight() and not plan.x_t_from_fp8 and not self.input_t_later(plan)

    def input_t_later(self, plan: LinearPlan) -> bool:
        """Whether the backward makes input.T's operand from the input, saved by reference (the recipe's
        `input_t_in_backward`, compiled: the partitioner recomputes the input rather than store it)."""
        return (self.recipe.input_t_in_backward and torch.compiler.is_compiling() and self.computes_grad_weight()
                and not plan.x_t_from_fp8)

    def _forward(self, x: Tensor) -> Tensor:
        if self.frozen and self.weight.requires_grad:
            raise RuntimeError("FP8Linear: the weight was frozen to FP8 (freeze_weight) and now requires grad: "
                               "freeze_weight(False) before training it")
        x2d = x.reshape(-1, x.shape[-1])
        plan = self.plan(x2d)
        out_dtype = output_dtype(x)
        x_rows, x_rows_scale, x_t, x_t_scale = self._quantize_input(x, x2d, plan, self.makes_input_t(plan))
        if self.input_t_later(plan):
            x_saved = (x2d.detach(), None)
        elif self.computes_grad_weight():
            x_saved = ops.wgrad_input(plan, x_rows, x_rows_scale, x_t, x_t_scale)
        else:
            x_saved = (None, None)
        w, w_scale = self.weight_operand(plan)
        weight = self.weight
        if self.frozen:
            # nothing reads W again (W.T is the copy's transpose): a stand-in with its shape keeps an offloaded
            # weight out of the graph
            weight = torch.empty((), device=x.device, dtype=weight.dtype).expand(self.out_features, self.in_features)
        stats = None
        if self._health_sink is not None:
            w_stats = (self._fp8_w_health if self.frozen
                       else operand_health_stats(self.weight.detach(), plan.w, plan.pow2))
            stats = torch.stack([operand_health_stats(x2d.detach(), plan.x, plan.pow2), w_stats])
        return _Fp8LinearFn.apply(x, weight, self.bias, x_rows, x_rows_scale, *x_saved, w, w_scale, self._fp8_w_t,
                                  self._fp8_w_t_scale, self._health_sink, stats, plan, out_dtype)

    def extra_repr(self) -> str:
        kept = (", frozen in FP8" + (" with W.T" if self._fp8_w_t is not None else "") if self.frozen
                else ", held in FP8" if self.held else "")
        return f"{super().extra_repr()}, recipe={self.recipe.name.value}, pow2_scale={self.recipe.pow2_scale}{kept}"


@torch.compiler.disable  # eager inside a compiled model: FSDP's FP8-gathered weights
def _forward_outside_graph(module: FP8Linear, x: Tensor) -> Tensor:
    return module._forward(x)


class _FP8InputLinearFn(torch.autograd.Function):
    """y = x @ W.T + b in `dtype`, as nn.Linear computes it; the backward keeps the input's FP8 rows, not x."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, x_rows: Tensor, x_rows_scale: Tensor,
                plan: LinearPlan, dtype: torch.dtype) -> Tensor:
        y = F.linear(x.to(dtype), weight.to(dtype), bias.to(dtype) if bias is not None else None)
        ctx.save_for_backward(weight, x_rows, x_rows_scale)
        ctx.plan, ctx.dtype, ctx.x_shape, ctx.x_dtype = plan, dtype, x.shape, x.dtype
        ctx.b_dtype = bias.dtype if bias is not None else None
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        weight, x_rows, x_rows_scale = ctx.saved_tensors
        dy2d = dy.reshape(-1, dy.shape[-1])
        dx = dw = db = None
        if ctx.needs_input_grad[0]:  # grad_input: dy @ W, as nn.Linear's backward
            dx = (dy2d.to(ctx.dtype) @ weight.to(ctx.dtype)).view(ctx.x_shape).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:  # grad_weight: dy.T @ x, x from its FP8 rows
            dw = ops.rows_grad_weight(dy2d, x_rows, x_rows_scale, ctx.plan, weight.shape[1]).to(weight.dtype)
        if ctx.b_dtype is not None and ctx.needs_input_grad[2]:
            db = dy2d.float().sum(0).to(ctx.b_dtype)
        return dx, dw, db, None, None, None, None


class FP8InputLinear(nn.Linear):
    """A high-precision Linear beside a frozen FP8Linear reading the same input (a LoRA adapter's A beside its
    base): output and grad_input run as nn.Linear's (in the autocast dtype, else the weight's, the input cast
    to it as PEFT does); for the backward it keeps not the input but the FP8 rows its base made of it
    (shared: no second quantization), which grad_weight reads (`ops.rows_grad_weight`). 1 byte per input
    element kept instead of 2 (BF16); the weight's gradient sees E4M3's rounding of the input (relative 2^-4
    at most per element), as the base's own output GEMM does. Without a gradient to compute for its weight it
    is nn.Linear. Holds the replaced Linear's Parameters (`beside`)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, recipe: str | Fp8Recipe = "hybrid",
                 device=None, dtype=None, *, input_cache: WeakIdKeyDictionary | None = None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.recipe = make_recipe(recipe)
        if not self.recipe.enabled:
            raise ValueError("FP8InputLinear: the recipe quantizes no input (bf16)")
        self._plans = LinearPlan.per_route(self.recipe)
        self._input_cache = input_cache

    @classmethod
    def beside(cls, linear: nn.Linear, base: FP8Linear) -> "FP8InputLinear":
        """`linear` (its Parameters kept) as a Linear keeping the FP8 rows `base` makes of their common input."""
        if linear.in_features != base.in_features or not base.recipe.enabled:
            raise ValueError(f"FP8InputLinear.beside: a Linear of {linear.in_features} inputs beside an FP8Linear of "
                             f"{base.in_features} with recipe {base.recipe.name.value}")
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, recipe=base.recipe,
                  device="meta", input_cache=base._input_cache)
        new.weight, new.bias = linear.weight, linear.bias
        new.train(linear.training)
        return new

    def forward(self, x: Tensor) -> Tensor:
        if not (torch.is_grad_enabled() and self.weight.requires_grad):
            return super().forward(x.to(self.weight.dtype))
        x2d = x.reshape(-1, x.shape[-1])
        plan = self._plans[runs_on_cublas(x2d, self.recipe)]
        x_rows, x_rows_scale = _quantize_shared(self._input_cache, x, x2d, plan, False)[:2]
        dev = x.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else self.weight.dtype
        return _FP8InputLinearFn.apply(x, self.weight, self.bias, x_rows, x_rows_scale, plan, dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, input kept in FP8 ({self.recipe.name.value})"
