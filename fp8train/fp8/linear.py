"""FP8Linear: the three GEMMs of nn.Linear in FP8 with FP32 accumulation.

For y = x @ W.T + b with x [M, K] (M tokens) and W [N, K]:

    GEMM          computes          a (row-major)            b (operand layout)      contraction
    output        y  = x  @ W.T     input        [M, K]      weight    [N, K]        K  (features)
    grad_input    dx = dy @ W       grad_output  [M, N]      weight.T  [K, N]        N  (features)
    grad_weight   dW = dy.T @ x     grad_output.T[N, M]      input.T   [K, M]        M  (tokens)

Every operand is stored row-major with its contraction dimension last, so one routine, `_fp8_mm(a, b)
= a @ b.T`, runs all three and every recipe block is a block of that layout: the hybrid recipe's
1x128 tiles of input.T / grad_output.T are its "token-dim" Wgrad tiles. The transposed copies are
quantized from the high-precision tensor in the same pass as the row copies, and the forward saves the
FP8 input.T (not the BF16 input) for backward: half the activation bytes, no double quantization.

On Hopper the GEMMs run on cuBLAS via `torch.nn.functional.scaled_mm` (FP32 accumulation, no fast
accumulation); elsewhere they are emulated as dequantize + FP32 matmul, the same function up to
FP32 summation order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from . import ops
from .ops import _pad_for, operand_key, unpack
from .quant import Fp8Tensor
from .recipe import Fp8Recipe, make_recipe

__all__ = ["FP8Linear"]


@torch.compiler.assume_constant_result  # a constant of the device: torch.compile does not trace it
def _has_fp8_gemm(device_index: int) -> bool:
    return hasattr(F, "scaled_mm") and torch.cuda.get_device_capability(device_index) >= (9, 0)


def _use_cublas(t: torch.Tensor) -> bool:
    return t.is_cuda and _has_fp8_gemm(t.device.index)


@dataclass(frozen=True)
class _Plan:
    """What a layer's recipe fixes about its GEMMs, as the constants the ops take (operand keys, padding)."""

    x: str        # input, rows: operand a of `output`
    w: str        # weight: operand b of `output`
    w_t: str      # weight.T: operand b of `grad_input`
    g: str        # grad_output, rows: operand a of `grad_input`
    g_t: str      # grad_output.T: operand a of `grad_weight`
    x_t: str      # input.T: operand b of `grad_weight`
    pow2: bool
    emulate: bool
    pads: tuple[int, int, int]  # contraction padding of output, grad_input, grad_weight on cuBLAS

    @classmethod
    def of(cls, r: Fp8Recipe) -> "_Plan":
        keys = [operand_key(c) for c in (r.output.a, r.output.b, r.grad_input.b, r.grad_input.a, r.grad_weight.a,
                                         r.grad_weight.b)]
        pads = tuple(_pad_for(True, gemm) for gemm in (r.output, r.grad_input, r.grad_weight))
        return cls(*keys, pow2=r.pow2_scale, emulate=r.emulate, pads=pads)

    def pad(self, gemm: int, cublas: bool) -> int:
        return self.pads[gemm] if cublas else 1


def _operand_health(x2d, q):
    from .health import operand_health

    return operand_health(x2d, q)


class _Fp8LinearFn(torch.autograd.Function):
    """y = x @ W.T + b from FP8 operands: x_* = rows of x and (if a grad_weight will be needed) cols of x.T,
    made by the caller (quantized now, or taken from the input cache); w_* = W and W.T, pre-made (the step's
    cache, FSDP's FP8 all-gather) or None, and then quantized here, in one op with the GEMM. Forward saves
    the FP8 W.T and x.T; backward is one op: grad_output quantized in both layouts, then both GEMMs."""

    @staticmethod
    def forward(ctx, x, weight, bias, xr, xr_s, xc, xc_s, w, w_s, wt, wt_s, plan: _Plan, cublas: bool,
                out_dtype: torch.dtype, health: dict | None):
        p = plan
        # output: y [M, N] = x [M, Kp] @ W [N, Kp].T
        if wt is None:
            y, wt, wt_s = ops.linear_forward(xr, xr_s, weight.detach(), p.x, p.w, p.w_t, p.pow2, p.pad(0, cublas),
                                             p.pad(1, cublas), out_dtype, cublas)
        else:
            y = ops.fp8_mm(xr, xr_s, w, w_s, p.x, p.w, out_dtype, cublas)
        if bias is not None:
            y = y + bias.to(out_dtype)
        # save_for_backward (not ctx attributes) so activation checkpointing can drop and recompute them
        ctx.save_for_backward(wt, wt_s, xc, xc_s)
        ctx.plan, ctx.cublas, ctx.health = plan, cublas, health
        ctx.b_dtype = bias.dtype if bias is not None else None
        ctx.x_dtype, ctx.x_shape, ctx.w_dtype = x.dtype, x.shape, weight.dtype
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        p, cublas = ctx.plan, ctx.cublas
        wt, wt_s, xc, xc_s = ctx.saved_tensors
        dy2d = dy.reshape(-1, dy.shape[-1])
        want_dx = ctx.needs_input_grad[0]
        want_dw = ctx.needs_input_grad[1] and xc.numel() > 0  # no cols copy: no grad_weight was planned
        dx, dw, g, g_s = ops.linear_backward(dy2d, wt, wt_s, xc, xc_s, p.g, p.g_t, p.w_t, p.x_t, p.pow2,
                                             p.pad(1, cublas), p.pad(2, cublas), want_dx, want_dw, ctx.x_dtype, cublas)
        if ctx.health is not None:
            ctx.health["grad_output"] = _operand_health(dy2d, unpack(g, g_s, p.g))
        db = None
        if ctx.b_dtype is not None and ctx.needs_input_grad[2]:
            db = dy2d.float().sum(0).to(ctx.b_dtype)
        return (dx.view(ctx.x_shape) if want_dx else None, dw.to(ctx.w_dtype) if want_dw else None, db) + (None,) * 12


class FP8Linear(nn.Linear):
    """nn.Linear whose output, grad_input and grad_weight GEMMs run in FP8 per `recipe`.

    Holds the same `weight`/`bias` Parameters as the Linear it replaces (see `from_linear`), so
    optimizers and state_dicts are unaffected. Inside `fp8train.convert.cache_fp8_weights(model)` (the
    trainer wraps each optimizer step's micro-batches in it) the FP8 copies of the weight are made once
    and reused; outside it every forward re-quantizes the current weight.

    Under torch.compile the layer traces into the surrounding graph (on CUDA down to the Triton kernels and
    `scaled_mm`, elsewhere as custom ops): no graph break, no eager caches; the weight is quantized once
    per forward there.
    """

    def __init__(self, in_features, out_features, bias=True, recipe="hybrid", device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.recipe = make_recipe(recipe)
        self._plan = _Plan.of(self.recipe) if self.recipe.enabled else None
        self._weight_cache = None
        # Off by default: optimizers may update weights without bumping their version counter (fused
        # AdamW does not), so a cache keyed on it can go stale. `cache_fp8_weights` turns it on for the
        # micro-batches of one optimizer step, when the weights cannot change.
        self._cache_weight = False
        self._input_cache: WeakIdKeyDictionary | None = None
        self._health: dict | None = None
        self._fp8_all_gather = False  # FSDP2 all-gathers the weight in FP8 (fp8train._fsdp_fp8)

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe="hybrid", input_cache: WeakIdKeyDictionary | None = None):
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, recipe=recipe, device="meta")
        new.weight, new.bias = linear.weight, linear.bias
        new._input_cache = input_cache
        new.train(linear.training)
        return new

    def _weight_operands(self, weight: torch.Tensor, cublas: bool, lazy: bool = True) -> tuple | None:
        """(W data, scale, W.T data, scale) from FSDP's FP8 all-gather or the step's cache; None when `lazy`
        and neither applies: the forward then quantizes the weight in one op with its GEMM."""
        p = self._plan
        gathered = getattr(weight, "fp8_operands", None)
        if gathered is not None:  # FSDP all-gathered it already in FP8 (fp8train._fsdp_fp8): use those blocks
            return ops.pack_pair(*gathered(self.recipe, cublas), weight)
        args = (weight.detach(), p.w, p.w_t, p.pow2, p.pad(0, cublas), p.pad(1, cublas), cublas)
        if not self._cache_weight or torch.compiler.is_compiling():
            return None if lazy else ops.quantize_weight(*args)
        key = (weight.data_ptr(), weight._version, weight.dtype, cublas, id(self.recipe))
        if self._weight_cache is None or self._weight_cache[0] != key:
            self._weight_cache = None  # free the stale copies before making new ones
            self._weight_cache = (key, ops.quantize_weight(*args))
        return self._weight_cache[1]

    def _quantize_input(self, x: torch.Tensor, x2d: torch.Tensor, cublas: bool, cols: bool) -> tuple[torch.Tensor, ...]:
        """(rows data, scale, cols data, scale); siblings reading the same tensor (q/k/v, gate/up) share one
        quantization: eagerly through `_input_cache`, compiled through CSE of the identical ops."""
        p = self._plan
        args = (x2d.detach(), p.x, p.x_t, p.pow2, p.pad(0, cublas), p.pad(2, cublas), cols, cublas)
        cache = self._input_cache
        if cache is None or torch.compiler.is_compiling():
            return ops.quantize_activation(*args)
        key = (x._version, args[1:6], cublas)  # siblings may differ in recipe
        hit = cache.get(x)
        if hit is not None and hit[0] == key and (hit[1][2].numel() or not cols):
            return hit[1]  # (a copy with cols serves a sibling that needs none)
        out = ops.quantize_activation(*args)
        cache[x] = (key, out)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.recipe.enabled:
            return super().forward(x)
        if not x.is_floating_point():
            raise ValueError(f"FP8Linear: expected a floating-point input, got {x.dtype}")
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"FP8Linear: input's last dim must be in_features={self.in_features}, got shape {tuple(x.shape)}")
        # whether a backward will compute dW: without it the FP8 input.T is neither made nor saved
        grad_weight = torch.is_grad_enabled() and self.weight.requires_grad
        if torch.compiler.is_compiling() and (self._health is not None or self._fp8_all_gather):
            return _forward_outside_graph(self, x, grad_weight)  # health statistics, FSDP's FP8 weights
        return self._forward(x, grad_weight)

    def _forward(self, x: torch.Tensor, grad_weight: bool) -> torch.Tensor:
        x2d = x.reshape(-1, x.shape[-1])
        cublas = _use_cublas(x2d) and not self.recipe.emulate
        dev = x.device.type
        out_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        xq = self._quantize_input(x, x2d, cublas, grad_weight)
        wq = self._weight_operands(self.weight, cublas, lazy=self._health is None)
        if self._health is not None:
            p = self._plan
            self._health["input"] = _operand_health(x2d, unpack(xq[0], xq[1], p.x))
            self._health["weight"] = _operand_health(self.weight.detach(), unpack(wq[0], wq[1], p.w))
        wq = wq or (None,) * 4
        return _Fp8LinearFn.apply(x, self.weight, self.bias, *xq, *wq, self._plan, cublas, out_dtype, self._health)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.name.value}, pow2_scale={self.recipe.pow2_scale}"


@torch.compiler.disable  # eager inside a compiled model: health statistics, FSDP's FP8-gathered weights
def _forward_outside_graph(module: FP8Linear, x: torch.Tensor, grad_weight: bool) -> torch.Tensor:
    return module._forward(x, grad_weight)
