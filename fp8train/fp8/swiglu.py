"""The SwiGLU MLP with its inputs saved for backward in FP8 (the recipe's `swiglu_inputs_fp8`).

A Llama/Qwen2 MLP computes `down_proj(silu(gate_proj(x)) * up_proj(x))`. For backward, autograd keeps
the SwiGLU's two inputs g = gate_proj(x) and u = up_proj(x), [tokens, intermediate] each in BF16: at
Qwen2.5-7B that is 75 KB per token per layer, the largest activation a decoder layer saves. Here they are
saved as E4M3 1x128 tiles (the recipe's input operand, with its scales: COAT's trick), half the bytes:

    forward    h = silu(g) * u                      BF16, exactly as the Hugging Face module computes it
               save Q(g), Q(u)                      the same quantization as an FP8Linear input's rows
    backward   g~, u~ = dequantize(Q(g), Q(u))
               grad_u = dh * silu(g~)               as autograd's mul and silu backward compute them,
               grad_g = silu_backward(dh * u~, g~)  on the dequantized values

The forward is unchanged; the backward's derivatives read values off by E4M3's rounding (relative
2^-4 at most). `FP8SwiGLUMLP` takes the place of such an MLP module, keeping its children (and so
every parameter name); `convert_to_fp8` swaps it in when the recipe asks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import ops
from .linear import FP8Linear, runs_on_cublas
from .ops import LinearPlan

__all__ = ["FP8SwiGLUMLP", "swiglu_mlp_applies"]


class _SwiGLUFn(torch.autograd.Function):
    """h = silu(g) * u, saving g and u as FP8 tiles of `plan`'s input operand (the down projection's)."""

    @staticmethod
    def forward(ctx, g: Tensor, u: Tensor, plan: LinearPlan) -> Tensor:
        h = F.silu(g) * u
        saved = []
        for t in (g, u):
            data, scale, _, _ = ops.quantize_input(t.detach().reshape(-1, t.shape[-1]), plan, False)
            saved += [data, scale]
        ctx.save_for_backward(*saved)
        ctx.plan, ctx.shape, ctx.dtypes = plan, g.shape, (g.dtype, u.dtype)
        return h

    @staticmethod
    def backward(ctx, dh: Tensor):
        gd, gs, ud, us = ctx.saved_tensors
        k = ctx.shape[-1]
        g = ops.dequantize_operand(gd, gs, ctx.plan.x)[:, :k].to(ctx.dtypes[0]).view(ctx.shape)
        u = ops.dequantize_operand(ud, us, ctx.plan.x)[:, :k].to(ctx.dtypes[1]).view(ctx.shape)
        grad_u = dh * F.silu(g) if ctx.needs_input_grad[1] else None
        grad_g = torch.ops.aten.silu_backward(dh * u, g) if ctx.needs_input_grad[0] else None
        return grad_g, grad_u, None


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


class FP8SwiGLUMLP(nn.Module):
    """`down_proj(silu(gate_proj(x)) * up_proj(x))` with the SwiGLU's inputs saved in FP8 (module docstring).
    Holds the replaced MLP's children under their names, so state dicts and adapters see the same model."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        if not swiglu_mlp_applies(mlp):
            raise ValueError(f"FP8SwiGLUMLP: {type(mlp).__name__} is not a SwiGLU MLP of FP8Linears")
        self.gate_proj, self.up_proj, self.down_proj, self.act_fn = mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn
        self.mlp_class = type(mlp).__name__
        # the down projection's input operand quantizes g and u (fixed here: PEFT may wrap the projections later)
        self.recipe = mlp.down_proj.recipe
        self._plans = {c: LinearPlan.of(self.recipe, c) for c in (False, True)}

    def forward(self, x: Tensor) -> Tensor:
        g, u = self.gate_proj(x), self.up_proj(x)
        if not torch.is_grad_enabled() or not (g.requires_grad or u.requires_grad):
            return self.down_proj(F.silu(g) * u)
        return self.down_proj(_SwiGLUFn.apply(g, u, self._plans[runs_on_cublas(g, self.recipe)]))

    def extra_repr(self) -> str:
        return f"{self.mlp_class}, SwiGLU inputs saved in FP8"
