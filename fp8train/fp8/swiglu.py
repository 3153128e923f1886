"""The SwiGLU MLP converted as one piece: its activation quantized inside its producers, its inputs
optionally saved in FP8.

A Llama/Qwen2 MLP computes `down_proj(silu(gate_proj(x)) * up_proj(x))`. Run as three FP8Linears, the
SwiGLU output h = silu(g) * u ([tokens, intermediate], the widest activation) is written in BF16 only for
the down projection's quantization to read it again, and in the backward the SwiGLU's input gradients
dg and du are written in BF16 only for the gate and up projections to quantize them. `FP8SwiGLUMLP` fuses
both (the recipe's `fuse_swiglu`):

    forward    x -> FP8 rows (+ input.T) once -> g, u GEMMs (BF16)
               h's FP8 rows (+ h.T) made from g and u in one kernel    (h never written)
               down GEMM from those operands
    backward   [`input_t_in_backward`: h.T made here from g and u instead, so the forward saves none]
               dh = down's grad_input (BF16), down's grad_weight
               dg's and du's FP8 rows (+ their .T) made from dh, g, u, one launch each (dg, du never written)
               gate's and up's grad_input (summed) and grad_weight GEMMs from those operands

all in one autograd Function (`_SwiGLUMLPFn`), with the same BF16 arithmetic (`ops.swiglu_reference`,
`ops.swiglu_grads_reference`): on the CPU bit for bit the three FP8Linears' numbers; on CUDA the kernels
compute the sigmoid as inductor's code does (the GPU's fast exp and division) and round to BF16 where
autograd's ops round. With `swiglu_inputs_fp8`, g and u are saved for backward as E4M3 1x128 tiles
instead of BF16 (COAT's trick), half the bytes (at Qwen2.5-7B 75 KB per token per layer in BF16, the largest
activation a decoder layer saves); the backward's derivatives then read their dequantized values (off by
E4M3's rounding, relative 2^-4 at most).

The module keeps the replaced MLP's children (and so every parameter name); `convert_to_fp8` swaps it in.
Where a projection is no plain FP8Linear any more (PEFT wraps it), tracks FP8 health, or has its weight
frozen to FP8 or gathered by FSDP in FP8, it runs the three Linears as they are.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from . import ops
from .linear import FP8Linear, output_dtype, runs_on_cublas
from .operands import LinearPlan, dequantize_operand

__all__ = ["FP8SwiGLUMLP", "swiglu_mlp_applies"]


def _save_fp8(t: Tensor, plan: LinearPlan) -> list[Tensor]:
    """t's FP8 rows and scale (`plan`'s input operand: the down projection's), what is saved for backward."""
    return list(ops.quantize_input(t.detach().reshape(-1, t.shape[-1]), plan, False)[:2])


def _load_fp8(data: Tensor, scale: Tensor, plan: LinearPlan, shape: torch.Size, dtype: torch.dtype) -> Tensor:
    """The values `_save_fp8` kept, dequantized, in `shape` and `dtype`."""
    return dequantize_operand(data, scale, plan.x)[:, : shape[-1]].to(dtype).view(shape)


class _SwiGLUFn(torch.autograd.Function):
    """h = silu(g) * u, saving g and u as FP8 tiles of `plan`'s input operand (the down projection's)."""

    @staticmethod
    def forward(ctx, g: Tensor, u: Tensor, plan: LinearPlan) -> Tensor:
        ctx.save_for_backward(*_save_fp8(g, plan), *_save_fp8(u, plan))
        ctx.plan, ctx.shape, ctx.dtypes = plan, g.shape, (g.dtype, u.dtype)
        return ops.swiglu_reference(g, u)

    @staticmethod
    def backward(ctx, dh: Tensor):
        gd, gs, ud, us = ctx.saved_tensors
        g = _load_fp8(gd, gs, ctx.plan, ctx.shape, ctx.dtypes[0])
        u = _load_fp8(ud, us, ctx.plan, ctx.shape, ctx.dtypes[1])
        grad_g, grad_u = ops.swiglu_grads_reference(dh, g, u)
        return grad_g if ctx.needs_input_grad[0] else None, grad_u if ctx.needs_input_grad[1] else None, None


def swiglu_mlp_applies(module: nn.Module) -> bool:
    """Whether `module` is a SwiGLU MLP this module computes the same: gate/up/down FP8Linears (same recipe,
    no biases), a SiLU, nothing else."""
    if isinstance(module, FP8SwiGLUMLP):
        return False
    children = dict(module.named_children())
    if set(children) != {"gate_proj", "up_proj", "down_proj", "act_fn"}:
        return False
    act = children["act_fn"]
    if not (isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"):
        return False
    linears = [children[n] for n in ("gate_proj", "up_proj", "down_proj")]
    return (all(isinstance(m, FP8Linear) and m.bias is None for m in linears)
            and len({m.recipe for m in linears}) == 1)


class _SwiGLUMLPFn(torch.autograd.Function):
    """The whole MLP, y = down(silu(gate(x)) * up(x)), from x: its input quantized once for gate and up, h's
    operands made from g and u by the producer, the down GEMM from them. Saves for backward the weights
    (and their given operands), x's grad_weight operand (or x itself, `x_t_later`), g and u (BF16, or FP8 tiles
    with `save_fp8`) and, unless the backward makes it from g and u (`h_t_later`), h's grad_weight operand."""

    @staticmethod
    def forward(ctx, x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, wg: Tensor | None,
                wg_scale: Tensor | None, wu: Tensor | None, wu_scale: Tensor | None, wd: Tensor | None,
                wd_scale: Tensor | None, plan: LinearPlan, out_dtype: torch.dtype, x_cols: bool, h_cols: bool,
                x_t_later: bool, h_t_later: bool, save_fp8: bool) -> Tensor:
        x2d = x.reshape(-1, x.shape[-1])
        xr, xr_s, xc, xc_s = ops.quantize_input(x2d.detach(), plan, x_cols)
        g = ops.linear_forward(xr, xr_s, w_gate.detach(), wg, wg_scale, plan, out_dtype)
        u = ops.linear_forward(xr, xr_s, w_up.detach(), wu, wu_scale, plan, out_dtype)
        hr, hr_s, hc, hc_s = ops.quantize_swiglu(g, u, plan, h_cols)
        y = ops.linear_forward(hr, hr_s, w_down.detach(), wd, wd_scale, plan, out_dtype)
        want_dw_gu = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        if want_dw_gu:
            x_saved = (x2d.detach(), None) if x_t_later else ops.wgrad_input(plan, xr, xr_s, xc, xc_s)
        else:
            x_saved = (None, None)
        keep_h = ctx.needs_input_grad[3] and not h_t_later
        h_saved = ops.wgrad_input(plan, hr, hr_s, hc, hc_s) if keep_h else (None, None)
        saved_gu = [*_save_fp8(g, plan), *_save_fp8(u, plan)] if save_fp8 else [g, None, u, None]
        ctx.save_for_backward(w_gate, w_up, w_down, wg, wg_scale, wu, wu_scale, wd, wd_scale, *x_saved, *h_saved,
                              *saved_gu)
        ctx.plan, ctx.x_shape, ctx.x_dtype, ctx.gu_shape, ctx.gu_dtype = plan, x.shape, x.dtype, g.shape, g.dtype
        ctx.h_t_later = h_t_later
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy: Tensor):
        (w_gate, w_up, w_down, wg, wg_scale, wu, wu_scale, wd, wd_scale, x_saved, x_saved_scale, h_saved,
         h_saved_scale, g, g_scale, u, u_scale) = ctx.saved_tensors
        p, (M, I) = ctx.plan, ctx.gu_shape
        if g_scale is not None:
            g = _load_fp8(g, g_scale, p, ctx.gu_shape, ctx.gu_dtype)
            u = _load_fp8(u, u_scale, p, ctx.gu_shape, ctx.gu_dtype)
        want_dx, want_dwg, want_dwu, want_dwd = ctx.needs_input_grad[:4]
        if want_dwg or want_dwu:
            x_saved, x_saved_scale = ops.saved_wgrad_input(p, x_saved, x_saved_scale)
        if want_dwd and ctx.h_t_later:  # h.T's operand from g and u, as the forward would have made it
            h_saved, h_saved_scale = ops.quantize_swiglu(g, u, p, True, make_rows=False)[2:]
        # the down projection: dh (grad_input, in g's dtype, as autograd's would be) and its grad_weight
        # (no kept W.T: a frozen projection runs unfused)
        dh, dwd = ops.linear_backward(dy.reshape(-1, dy.shape[-1]), w_down.detach(), wd, wd_scale, None, None,
                                      h_saved, h_saved_scale, p, True, want_dwd, ctx.gu_dtype)
        grads = ops.quantize_swiglu_grads(dh.reshape(M, I), g, u, p, want_dwg or want_dwu)
        dxg, dwg = ops.linear_backward_gemms(*grads[:4], w_gate.detach(), wg, wg_scale, None, None, x_saved,
                                             x_saved_scale, p, want_dx, want_dwg, ctx.x_dtype)
        dxu, dwu = ops.linear_backward_gemms(*grads[4:], w_up.detach(), wu, wu_scale, None, None, x_saved,
                                             x_saved_scale, p, want_dx, want_dwu, ctx.x_dtype)
        return ((dxg + dxu).view(ctx.x_shape) if want_dx else None, dwg.to(w_gate.dtype) if want_dwg else None,
                dwu.to(w_up.dtype) if want_dwu else None, dwd.to(w_down.dtype) if want_dwd else None,
                *([None] * 13))


class FP8SwiGLUMLP(nn.Module):
    """`down_proj(silu(gate_proj(x)) * up_proj(x))` with the SwiGLU fused into its FP8 producers and/or its
    inputs saved in FP8 (module docstring). Holds the replaced MLP's children under their names, so state
    dicts and adapters see the same model."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        if not swiglu_mlp_applies(mlp):
            raise ValueError(f"FP8SwiGLUMLP: {type(mlp).__name__} is not a SwiGLU MLP of FP8Linears")
        self.gate_proj, self.up_proj, self.down_proj, self.act_fn = mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn
        self.mlp_class = type(mlp).__name__
        # the down projection's input operand quantizes g and u (fixed here: PEFT may wrap the projections later)
        self.recipe = mlp.down_proj.recipe
        self._plans = LinearPlan.per_route(self.recipe)

    def _fusable(self) -> bool:
        """Whether the three projections are still plain FP8Linears the fused path may run (module docstring)."""
        linears = (self.gate_proj, self.up_proj, self.down_proj)
        return (self.recipe.fuse_swiglu and all(isinstance(m, FP8Linear) for m in linears)
                and not any(m.tracking_health or m.frozen or m.gathers_fp8 for m in linears))

    def forward(self, x: Tensor) -> Tensor:
        down = self.down_proj
        if self._fusable():
            gate, up, plan = self.gate_proj, self.up_proj, down.plan(x)
            save_fp8 = self.recipe.swiglu_inputs_fp8 and torch.is_grad_enabled()
            # h.T made in the backward from the saved g and u (eagerly too): where those are the forward's
            # values and h.T comes from high precision (not with `wgrad_input_from_fp8`: from h's rows)
            h_t_later = self.recipe.input_t_in_backward and not save_fp8 and not plan.x_t_from_fp8
            return _SwiGLUMLPFn.apply(x, gate.weight, up.weight, down.weight, *gate.weight_operand(plan),
                                      *up.weight_operand(plan), *down.weight_operand(plan), plan, output_dtype(x),
                                      gate.makes_input_t(plan) or up.makes_input_t(plan),
                                      down.computes_grad_weight() and not plan.x_t_from_fp8 and not h_t_later,
                                      gate.input_t_later(plan) or up.input_t_later(plan), h_t_later, save_fp8)
        g, u = self.gate_proj(x), self.up_proj(x)
        if not self.recipe.swiglu_inputs_fp8 or not torch.is_grad_enabled() or not (g.requires_grad or u.requires_grad):
            return down(ops.swiglu_reference(g, u))
        return down(_SwiGLUFn.apply(g, u, self._plans[runs_on_cublas(g, self.recipe)]))

    @property
    def conversion(self) -> str:
        """What the conversion changed, in words (the conversion summary's)."""
        return ", ".join(w for w, on in (("SwiGLU fused into its FP8 producers", self.recipe.fuse_swiglu),
                                         ("SwiGLU inputs saved in FP8", self.recipe.swiglu_inputs_fp8)) if on)

    def extra_repr(self) -> str:
        return f"{self.mlp_class}, {self.conversion}"
