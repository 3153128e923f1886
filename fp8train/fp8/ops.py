"""One FP8 Linear as a function: the activation and weight quantization, and the three GEMMs.

For y = x @ W.T + b with x [M, K] (M tokens) and W [N, K], every GEMM is `a @ b.T` with both operands
row-major and the contraction dimension last (the "operand layout", operands.py):

    GEMM          computes          a                         b                       contraction
    output        y  = x  @ W.T     input         [M, K]      weight    [N, K]        K (features)
    grad_input    dx = dy @ W       grad_output   [M, N]      weight.T  [K, N]        N (features)
    grad_weight   dW = dy.T @ x     grad_output.T [N, M]      input.T   [K, M]        M (tokens)

`reference_fp8_linear` states what the three GEMMs compute; everything below computes exactly that:

    fp8_linear (autograd)     forward:  quantize_input -> linear_forward (quantize W, GEMM `output`)
                              backward: linear_backward (quantize grad_output; W.T, GEMM `grad_input`;
                                        input.T, GEMM `grad_weight`)
    quantize_*                Triton kernels on CUDA (kernels.py), the reference of operands.py elsewhere
                              (and compiled, for a rows-only copy with `fuse_row_quantization`, traced for
                              inductor to fuse into the activation's producer: `_quantize_on_route`);
                              quantize_swiglu(_grads): an MLP's SwiGLU output (and its input gradients)
                              quantized by the kernel that computes them (swiglu.py, `fuse_swiglu`)
    gemm                      the one GEMM (gemm.py): the one route table picks a cuBLAS `scaled_mm` call
                              or the emulation (dequantize + FP32 matmul, every device)
    rows_grad_weight          grad_weight of a high-precision Linear from its input's FP8 rows: a LoRA
                              adapter's, which keeps the copy its frozen FP8 base made (FP8InputLinear)

What the forward saves for backward: the FP8 input.T (1 byte per element; or, with the recipe's
`wgrad_input_from_fp8`, the FP8 input rows it already made; with `input_t_in_backward`, compiled, the input
itself by reference, for the partitioner to recompute, and input.T is made in the backward), never an FP8 copy
of the weight: W.T is quantized again in the backward, or transposed from W's copy where one is kept (the step's
cache, a held or frozen weight), or kept itself beside a frozen W (`freeze_weight(keep_t=True)`). Operands cross
the op boundary as (data, scale) pairs, their specs and the Linear's `LinearPlan` as strings (operands.py).

Eagerly each entry point runs its implementation directly (no dispatcher cost). Under torch.compile on
CUDA the implementation is traced: Triton kernels enter the graph as triton_ops and GEMMs as
`aten._scaled_mm_v2`, so inductor launches them from its own code (host time limits small models).
Elsewhere (CPU, emulated GEMMs) each entry point is an opaque custom op (`torch.ops.fp8train.*`) whose
fake implementation runs the reference on fake tensors, so the compiler cannot rewrite the reference
arithmetic and its view of every output is the real one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .gemm import gemm
from .operands import LinearPlan, OperandSpec, dequantize_operand, pad_operand, quantize_operand
from .quant import dequantize, quantize
from .recipe import BLOCK, Fp8Format, Fp8Recipe, OperandConfig

try:
    from . import kernels as _kernels
except ImportError:  # no triton (CPU-only installs): the reference path is used
    _kernels = None

__all__ = ["reference_fp8_linear", "quantize_input", "quantize_weight", "weight_transposes", "transpose_weight",
           "wgrad_input", "saved_wgrad_input", "linear_forward", "linear_backward", "linear_backward_gemms",
           "rows_grad_weight", "quantize_swiglu", "quantize_swiglu_grads", "swiglu_reference",
           "swiglu_grads_reference"]


def reference_fp8_linear(x: Tensor, w: Tensor, dy: Tensor, recipe: Fp8Recipe) -> tuple[Tensor, Tensor, Tensor]:
    """What one FP8 Linear computes, in FP32 from 2-D x [M, K], w [N, K], dy [M, N]: (y, dx, dW) without bias.
    Each operand is quantized per the recipe from the high-precision tensor (a high-precision operand is its
    BF16 value) and the products accumulate in FP32; FP8Linear's emulated path equals this bit for bit."""
    def q(t: Tensor, cfg: OperandConfig) -> Tensor:
        if cfg.fmt is None:
            return t.bfloat16().float()
        return dequantize(quantize(t, cfg.block, cfg.fmt, recipe.pow2_scale))

    r = recipe
    x_t = q(x, r.output.a).t() if r.wgrad_input_from_fp8 else x.t()
    y = q(x, r.output.a) @ q(w, r.output.b).t()
    dx = q(dy, r.grad_input.a) @ q(w.t(), r.grad_input.b).t()
    dw = q(dy.t(), r.grad_weight.a) @ q(x_t, r.grad_weight.b).t()
    return y, dx, dw


def _empty(like: Tensor) -> tuple[Tensor, Tensor]:
    return like.new_empty(0, dtype=torch.uint8), like.new_empty(0, dtype=torch.float32)


def _tile_kernel_applies(rows: OperandSpec, cols: OperandSpec, cublas: bool) -> bool:
    # (Under torch.compile the Triton kernel beat inductor fusing the traced reference quantization into the
    # producing norm / SwiGLU kernels by 5% or more at 7B, though the latter saves its FP8 copies' memory:
    # docs/benchmarks.md section 0, item 1.)
    return (cublas and _kernels is not None and rows.is_tile and (cols.is_tile or _col_blocks(cols))
            and rows.blockwise_padded and cols.blockwise_padded)


def _rows_traced(p: LinearPlan, make_rows: bool, make_cols: bool) -> bool:
    """Compiling with the recipe's `fuse_row_quantization` (cuBLAS plans only): a rows-only copy is the reference's
    torch ops, which inductor fuses into the kernel producing the activation, instead of the tile kernel reading
    it again."""
    return p.fuse_rows and make_rows and not make_cols and torch.compiler.is_compiling()


def _as_written(x: Tensor) -> Tensor:
    """x as its dtype stores it. Fused into x's producer, inductor would quantize the producer's FP32 value (it
    skips a fused BF16 op's rounding); a bitcast makes it round first, so the FP8 copy is the one the tile kernel
    makes from x in memory. (The `& -1` keeps inductor's joint-graph pass from folding the two views away.)"""
    if x.dtype not in (torch.bfloat16, torch.float16):
        return x
    return (x.view(torch.int16) & -1).view(x.dtype)


def _col_blocks(cols: OperandSpec) -> bool:
    """input.T in 128x128 blocks (the recipe's `wgrad_blocks`): the tile kernels' one scale a tile."""
    return cols.fmt is not None and cols.block == BLOCK


def _quantize_activation(x2d: Tensor, rows: OperandSpec, cols: OperandSpec, pow2: bool, make_cols: bool,
                         cublas: bool, make_rows: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """FP8 copies of an activation x [M, K]: rows (blocks of x, for output / grad_input) unless not `make_rows`
    and, if `make_cols`, cols (blocks of x.T, for grad_weight), both quantized from x itself; a copy not made:
    empty tensors."""
    if x2d.stride(1) != 1:  # the kernel reads rows with unit stride
        x2d = x2d.contiguous()
    if _tile_kernel_applies(rows, cols, cublas):
        if torch.compiler.is_compiling():  # its triton_op: inductor sees into it and launches it itself
            return _kernels.quantize_tiles_op(x2d, rows.fmt.dtype, cols.fmt.dtype, pow2, rows.pad, make_rows,
                                              make_cols, _col_blocks(cols))
        return _kernels.ops_layout(_kernels.quantize_tiles_and_transpose(
            x2d, rows.fmt, cols.fmt, pow2, rows.pad, make_cols, rows=make_rows, col_blocks=_col_blocks(cols)), x2d)
    rd, rs = quantize_operand(x2d, rows, pow2)
    if not make_cols:
        return rd, rs, *_empty(x2d)
    if (rows.fmt, rows.block) == (cols.fmt, cols.block) and rows.block is None and rows.fmt is not None:
        # one scale for the tensor: the transposed copy is the row copy transposed, exactly
        cd, cs = pad_operand(rd[:, : x2d.shape[1]].t().contiguous(), rs.clone(), cols)
    else:
        cd, cs = quantize_operand(x2d.t(), cols, pow2)
    return (rd, rs, cd, cs) if make_rows else (*_empty(x2d), cd, cs)


def _quantize_on_route(p: LinearPlan, x2d: Tensor, rows: OperandSpec, cols: OperandSpec, make_cols: bool,
                       kernels: bool, make_rows: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`_quantize_activation` on plan p's route: the tile kernel where it applies on cuBLAS (not with `kernels`
    False: the fake implementations), the reference elsewhere, and for a rows-only copy under the recipe's
    `fuse_row_quantization`, compiled, the reference traced on x as stored (`_rows_traced`, `_as_written`)."""
    if kernels and _rows_traced(p, make_rows, make_cols):
        return _quantize_activation(_as_written(x2d), rows, cols, p.pow2, make_cols, False, make_rows)
    return _quantize_activation(x2d, rows, cols, p.pow2, make_cols, p.cublas and kernels, make_rows)


def quantize_weight(w: Tensor, spec: OperandSpec, pow2: bool, transpose: bool, cublas: bool) -> tuple[Tensor, Tensor]:
    """W [N, K] as the operand `spec` describes: W for output, or W.T (`transpose`) for grad_input."""
    if w.stride(1) != 1:
        w = w.contiguous()
    if cublas and _kernels is not None and spec.fmt is not None and spec.block == BLOCK and spec.blockwise_padded:
        if torch.compiler.is_compiling():
            return _kernels.quantize_blocks_op(w, spec.fmt.dtype, pow2, spec.pad, transpose)
        return _kernels.quantize_blocks(w, spec.fmt, pow2, spec.pad, transpose)
    return quantize_operand(w.t() if transpose else w, spec, pow2)


def weight_transposes(plan: LinearPlan) -> bool:
    """Whether W.T's operand is W's transposed exactly: 128x128 blocks and one scale per tensor read the same
    both ways (row-wise scales and mixed formats do not)."""
    w, w_t = plan.w, plan.w_t
    return w.fmt is not None and (w.fmt, w.block) == (w_t.fmt, w_t.block) and w.block in (BLOCK, None)


def transpose_weight(data: Tensor, scale: Tensor, plan: LinearPlan, k: int) -> tuple[Tensor, Tensor] | None:
    """W.T's operand from W's (data [N, Kp], K = k real columns) where that is exact (`weight_transposes`);
    None otherwise (W.T must be quantized from the weight)."""
    if not weight_transposes(plan):
        return None
    spec, spec_t = plan.w, plan.w_t
    data_t = data.view(torch.uint8)[:, :k].t().contiguous().view(data.dtype)
    if spec.block is None:
        return pad_operand(data_t, scale.clone(), spec_t)
    return pad_operand(data_t, scale[:, : -(-k // 128)].t().contiguous(), spec_t)


# ------------------------------------------------------------ forward and backward of one FP8 Linear

def _quantize_input_impl(x: Tensor, plan: str, make_cols: bool, make_rows: bool = True,
                         kernels: bool = True) -> tuple[Tensor, ...]:
    """Input rows (operand a of output; unless not `make_rows`) and, with `make_cols`, input.T (operand b of
    grad_weight)."""
    p = LinearPlan.parse(plan)
    return _quantize_on_route(p, x, p.x, p.x_t, make_cols, kernels, make_rows)


def _forward_impl(x_rows: Tensor, x_rows_scale: Tensor, weight: Tensor, w: Tensor | None, w_scale: Tensor | None,
                  plan: str, out_dtype: torch.dtype) -> Tensor:
    """output: y [M, N] = x [M, Kp] @ W [N, Kp].T, W quantized here unless given (the step's cache, FSDP)."""
    p = LinearPlan.parse(plan)
    if w is None:
        w, w_scale = quantize_weight(weight, p.w, p.pow2, False, p.cublas)
    return gemm(x_rows, x_rows_scale, p.x, w, w_scale, p.w, out_dtype, p.cublas, p.deep_gemm)


def wgrad_input(plan: LinearPlan, rows: Tensor, rows_scale: Tensor, cols: Tensor,
                cols_scale: Tensor) -> tuple[Tensor, Tensor]:
    """What a forward saves for grad_weight's input operand: input.T's (cols), or with the plan's
    `x_t_from_fp8` the input rows (input.T is re-quantized from them in the backward)."""
    return (rows, rows_scale) if plan.x_t_from_fp8 else (cols, cols_scale)


def saved_wgrad_input(plan: LinearPlan, saved: Tensor, saved_scale: Tensor | None) -> tuple[Tensor, Tensor]:
    """What the backward hands grad_weight from what the forward saved: `wgrad_input`'s pair as it is, or, for
    an input saved by reference (no scale: `input_t_in_backward`), input.T's operand made now from it."""
    if saved_scale is None:
        return quantize_input(saved, plan, True, make_rows=False)[2:]
    return saved, saved_scale


def _backward_impl(dy: Tensor, weight: Tensor, w: Tensor | None, w_scale: Tensor | None, w_t: Tensor | None,
                   w_t_scale: Tensor | None, x_saved: Tensor | None, x_saved_scale: Tensor | None, plan: str,
                   want_dx: bool, want_dw: bool, dx_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """grad_output quantized (rows; cols when dW is wanted), then grad_input and grad_weight (FP32)."""
    p = LinearPlan.parse(plan)
    g, g_scale, g_t, g_t_scale = _quantize_on_route(p, dy, p.g, p.g_t, want_dw, True)
    return _backward_gemms_impl(g, g_scale, g_t, g_t_scale, weight, w, w_scale, w_t, w_t_scale, x_saved,
                                x_saved_scale, plan, want_dx, want_dw, dx_dtype)


def _backward_gemms_impl(g: Tensor, g_scale: Tensor, g_t: Tensor, g_t_scale: Tensor, weight: Tensor, w: Tensor | None,
                         w_scale: Tensor | None, w_t: Tensor | None, w_t_scale: Tensor | None, x_saved: Tensor | None,
                         x_saved_scale: Tensor | None, plan: str, want_dx: bool, want_dw: bool,
                         dx_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """grad_input and grad_weight from grad_output's operands (rows g; cols g_t, when dW is wanted).
    `x_saved` is input.T's operand, or the input rows with the plan's `x_t_from_fp8`. W.T's operand is `w_t`
    where one is kept (a frozen weight's, `keep_t`), else the transpose of `w`, W's operand, where the forward
    was given one and that is exact, else quantized from the weight."""
    p = LinearPlan.parse(plan)
    dx = dw = g.new_empty(0, dtype=torch.float32)
    if want_dx:
        if w_t is None:
            w_t, w_t_scale = ((transpose_weight(w, w_scale, p, weight.shape[1]) if w is not None else None)
                              or quantize_weight(weight, p.w_t, p.pow2, True, p.cublas))
        # grad_input: dx [M, K] = dy [M, Np] @ W.T [K, Np].T
        dx = gemm(g, g_scale, p.g, w_t, w_t_scale, p.w_t, dx_dtype, p.cublas, p.deep_gemm)
    if want_dw:
        if p.x_t_from_fp8:  # dequantize the saved rows, transpose, re-quantize (DeepSeek-V3)
            rows = dequantize_operand(x_saved, x_saved_scale, p.x)[:, : weight.shape[1]]
            x_saved, x_saved_scale = quantize_operand(rows.t(), p.x_t, p.pow2)
        # grad_weight: dW [N, K] = dy.T [N, Mp] @ x.T [K, Mp].T
        dw = gemm(g_t, g_t_scale, p.g_t, x_saved, x_saved_scale, p.x_t, torch.float32, p.cublas)
    return dx, dw


def _rows_grad_weight_impl(g: Tensor, x_rows: Tensor, x_rows_scale: Tensor, plan: str, k: int,
                           kernels: bool = True) -> Tensor:
    """grad_weight [N, K] (FP32) of a high-precision Linear that kept its input only as the FP8 rows
    `quantize_input` made (a LoRA adapter beside its frozen FP8 base): g.T @ x, x dequantized. On CUDA with
    1x128 E4M3 tiles, power-of-two scales and a BF16 g, one kernel reads the FP8 rows (exact products, FP32
    sums); otherwise the dequantized rows in an FP32 matmul."""
    p = LinearPlan.parse(plan)
    if (kernels and p.cublas and _kernels is not None and p.x.is_tile and p.x.fmt is Fp8Format.E4M3 and p.pow2
            and g.dtype == torch.bfloat16):
        if torch.compiler.is_compiling():
            return _kernels.rows_grad_weight_op(g.contiguous(), x_rows, x_rows_scale, k)
        return _kernels.rows_grad_weight(g.contiguous(), x_rows, x_rows_scale, k)
    return g.float().t() @ dequantize_operand(x_rows, x_rows_scale, p.x)[:, :k]


def swiglu_reference(g: Tensor, u: Tensor) -> Tensor:
    """h = silu(g) * u, as a Llama/Qwen2 MLP computes it (in g's and u's dtype)."""
    return F.silu(g) * u


def swiglu_grads_reference(dh: Tensor, g: Tensor, u: Tensor) -> tuple[Tensor, Tensor]:
    """(dg, du) of h = silu(g) * u, as autograd computes them: silu_backward(dh * u, g) and dh * silu(g)."""
    return torch.ops.aten.silu_backward(dh * u, g), dh * F.silu(g)


def _swiglu_kernel_applies(p: LinearPlan, rows: OperandSpec, cols: OperandSpec, *tensors: Tensor) -> bool:
    return _tile_kernel_applies(rows, cols, p.cublas) and all(t.dtype == torch.bfloat16 for t in tensors)


def _quantize_swiglu_impl(g: Tensor, u: Tensor, plan: str, make_cols: bool, make_rows: bool = True,
                          kernels: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """h = silu(g) * u quantized as the plan's input (rows unless not `make_rows`, input.T with `make_cols`): on
    CUDA in one kernel that never writes h; elsewhere `swiglu_reference`, then the input's quantization."""
    p = LinearPlan.parse(plan)
    g, u = g.contiguous(), u.contiguous()
    if kernels and _swiglu_kernel_applies(p, p.x, p.x_t, g, u):
        if torch.compiler.is_compiling():
            return _kernels.quantize_swiglu_op(g, u, p.x.fmt.dtype, p.x_t.fmt.dtype, p.pow2, p.x.pad, make_rows,
                                               make_cols, _col_blocks(p.x_t))
        return _kernels.quantize_swiglu(g, u, p.x.fmt, p.x_t.fmt, p.pow2, p.x.pad, make_cols, rows=make_rows,
                                        col_blocks=_col_blocks(p.x_t))
    return _quantize_on_route(p, swiglu_reference(g, u), p.x, p.x_t, make_cols, kernels, make_rows)


def _quantize_swiglu_grads_impl(dh: Tensor, g: Tensor, u: Tensor, plan: str, make_cols: bool,
                                kernels: bool = True) -> tuple[Tensor, ...]:
    """dg's and du's grad_output operands (rows; cols with `make_cols`), 8 tensors: on CUDA by the kernel's
    producers (one launch each; dg and du never written); elsewhere `swiglu_grads_reference`, then
    grad_output's quantization."""
    p = LinearPlan.parse(plan)
    dh, g, u = dh.contiguous(), g.contiguous(), u.contiguous()
    if kernels and _swiglu_kernel_applies(p, p.g, p.g_t, dh, g, u):
        if torch.compiler.is_compiling():
            return _kernels.quantize_swiglu_grads_op(dh, g, u, p.g.fmt.dtype, p.g_t.fmt.dtype, p.pow2, p.g.pad,
                                                     make_cols, _col_blocks(p.g_t))
        return _kernels.quantize_swiglu_grads(dh, g, u, p.g.fmt, p.g_t.fmt, p.pow2, p.g.pad, make_cols,
                                              col_blocks=_col_blocks(p.g_t))
    dg, du = swiglu_grads_reference(dh, g, u)
    return (*_quantize_on_route(p, dg, p.g, p.g_t, make_cols, kernels),
            *_quantize_on_route(p, du, p.g, p.g_t, make_cols, kernels))


# The custom ops: what torch.compile sees of the three entry points on CPU and with emulated GEMMs. Their
# fake implementations run the reference path on fake tensors: shapes, dtypes, strides are the real ones.

@torch.library.custom_op("fp8train::quantize_input", mutates_args=())
def _quantize_input_op(x: Tensor, plan: str, make_cols: bool, make_rows: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _quantize_input_impl(x, plan, make_cols, make_rows)


@_quantize_input_op.register_fake
def _(x, plan, make_cols, make_rows):
    return _quantize_input_impl(x, plan, make_cols, make_rows, kernels=False)


@torch.library.custom_op("fp8train::linear_forward", mutates_args=())
def _forward_op(x_rows: Tensor, x_rows_scale: Tensor, weight: Tensor, w: Tensor | None, w_scale: Tensor | None,
                plan: str, out_dtype: torch.dtype) -> Tensor:
    return _forward_impl(x_rows, x_rows_scale, weight, w, w_scale, plan, out_dtype)


@_forward_op.register_fake
def _(x_rows, x_rows_scale, weight, w, w_scale, plan, out_dtype):
    return x_rows.new_empty((x_rows.shape[0], weight.shape[0]), dtype=out_dtype)


@torch.library.custom_op("fp8train::linear_backward", mutates_args=())
def _backward_op(dy: Tensor, weight: Tensor, w: Tensor | None, w_scale: Tensor | None, w_t: Tensor | None,
                 w_t_scale: Tensor | None, x_saved: Tensor | None, x_saved_scale: Tensor | None, plan: str,
                 want_dx: bool, want_dw: bool, dx_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    return _backward_impl(dy, weight, w, w_scale, w_t, w_t_scale, x_saved, x_saved_scale, plan, want_dx, want_dw,
                          dx_dtype)


@_backward_op.register_fake
def _backward_fake(dy, weight, w, w_scale, w_t, w_t_scale, x_saved, x_saved_scale, plan, want_dx, want_dw, dx_dtype):
    dx = dy.new_empty((dy.shape[0], weight.shape[1]) if want_dx else (0,), dtype=dx_dtype if want_dx else torch.float32)
    dw = dy.new_empty(tuple(weight.shape) if want_dw else (0,), dtype=torch.float32)
    return dx, dw


@torch.library.custom_op("fp8train::linear_backward_gemms", mutates_args=())
def _backward_gemms_op(g: Tensor, g_scale: Tensor, g_t: Tensor, g_t_scale: Tensor, weight: Tensor, w: Tensor | None,
                       w_scale: Tensor | None, w_t: Tensor | None, w_t_scale: Tensor | None, x_saved: Tensor | None,
                       x_saved_scale: Tensor | None, plan: str, want_dx: bool, want_dw: bool,
                       dx_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    return _backward_gemms_impl(g, g_scale, g_t, g_t_scale, weight, w, w_scale, w_t, w_t_scale, x_saved, x_saved_scale,
                                plan, want_dx, want_dw, dx_dtype)


@_backward_gemms_op.register_fake
def _(g, g_scale, g_t, g_t_scale, weight, w, w_scale, w_t, w_t_scale, x_saved, x_saved_scale, plan, want_dx, want_dw,
      dx_dtype):
    return _backward_fake(g, weight, w, w_scale, w_t, w_t_scale, x_saved, x_saved_scale, plan, want_dx, want_dw,
                          dx_dtype)


@torch.library.custom_op("fp8train::quantize_swiglu", mutates_args=())
def _quantize_swiglu_op(g: Tensor, u: Tensor, plan: str, make_cols: bool,
                        make_rows: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _quantize_swiglu_impl(g, u, plan, make_cols, make_rows)


@_quantize_swiglu_op.register_fake
def _(g, u, plan, make_cols, make_rows):
    return _quantize_swiglu_impl(g, u, plan, make_cols, make_rows, kernels=False)


@torch.library.custom_op("fp8train::quantize_swiglu_grads", mutates_args=())
def _quantize_swiglu_grads_op(dh: Tensor, g: Tensor, u: Tensor, plan: str, make_cols: bool) -> tuple[
        Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _quantize_swiglu_grads_impl(dh, g, u, plan, make_cols)


@_quantize_swiglu_grads_op.register_fake
def _(dh, g, u, plan, make_cols):
    return _quantize_swiglu_grads_impl(dh, g, u, plan, make_cols, kernels=False)


@torch.library.custom_op("fp8train::rows_grad_weight", mutates_args=())
def _rows_grad_weight_op(g: Tensor, x_rows: Tensor, x_rows_scale: Tensor, plan: str, k: int) -> Tensor:
    return _rows_grad_weight_impl(g, x_rows, x_rows_scale, plan, k)


@_rows_grad_weight_op.register_fake
def _(g, x_rows, x_rows_scale, plan, k):
    return g.new_empty((g.shape[1], k), dtype=torch.float32)


def _opaque(plan: LinearPlan) -> bool:
    """Compiling without cuBLAS: the opaque op, whose reference arithmetic the compiler must not rewrite.
    Eagerly, and compiling on CUDA (traced into the graph), the implementation itself."""
    return torch.compiler.is_compiling() and not plan.cublas


def quantize_input(x: Tensor, plan: LinearPlan, make_cols: bool,
                   make_rows: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The input's FP8 operands: rows data, scale (unless not `make_rows`: a backward making input.T alone) and
    (with `make_cols`) input.T data, scale; a copy not made: empty tensors."""
    return (_quantize_input_op if _opaque(plan) else _quantize_input_impl)(x, plan.key, make_cols, make_rows)


def linear_forward(x_rows: Tensor, x_rows_scale: Tensor, weight: Tensor, w: Tensor | None, w_scale: Tensor | None,
                   plan: LinearPlan, out_dtype: torch.dtype) -> Tensor:
    """The output GEMM from the input rows; W quantized from `weight` unless given as (w, w_scale)."""
    return (_forward_op if _opaque(plan) else _forward_impl)(x_rows, x_rows_scale, weight, w, w_scale, plan.key,
                                                             out_dtype)


def linear_backward(dy: Tensor, weight: Tensor, w: Tensor | None, w_scale: Tensor | None, w_t: Tensor | None,
                    w_t_scale: Tensor | None, x_saved: Tensor | None, x_saved_scale: Tensor | None, plan: LinearPlan,
                    want_dx: bool, want_dw: bool, dx_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """grad_input (in dx_dtype; empty unless wanted) and grad_weight (FP32; empty unless wanted). W.T's operand:
    `w_t` where kept, else made from `w` (W's operand) or the weight (`_backward_gemms_impl`)."""
    return (_backward_op if _opaque(plan) else _backward_impl)(dy, weight, w, w_scale, w_t, w_t_scale, x_saved,
                                                               x_saved_scale, plan.key, want_dx, want_dw, dx_dtype)


def linear_backward_gemms(g: Tensor, g_scale: Tensor, g_t: Tensor, g_t_scale: Tensor, weight: Tensor,
                          w: Tensor | None, w_scale: Tensor | None, w_t: Tensor | None, w_t_scale: Tensor | None,
                          x_saved: Tensor | None, x_saved_scale: Tensor | None, plan: LinearPlan, want_dx: bool,
                          want_dw: bool, dx_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """`linear_backward` from grad_output's operands made by its producer (`quantize_swiglu_grads`)."""
    return (_backward_gemms_op if _opaque(plan) else _backward_gemms_impl)(
        g, g_scale, g_t, g_t_scale, weight, w, w_scale, w_t, w_t_scale, x_saved, x_saved_scale, plan.key, want_dx,
        want_dw, dx_dtype)


def quantize_swiglu(g: Tensor, u: Tensor, plan: LinearPlan, make_cols: bool,
                    make_rows: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The operands of h = silu(g) * u as the input of a Linear with `plan` (`quantize_input` of
    `swiglu_reference(g, u)`, without h written on CUDA); `make_rows=False`: input.T's alone (rows empty), as
    the backward re-makes it for grad_weight."""
    return (_quantize_swiglu_op if _opaque(plan) else _quantize_swiglu_impl)(g, u, plan.key, make_cols, make_rows)


def quantize_swiglu_grads(dh: Tensor, g: Tensor, u: Tensor, plan: LinearPlan, make_cols: bool) -> tuple[Tensor, ...]:
    """The grad_output operands of the gate and up Linears (`plan`) from the SwiGLU's output gradient dh:
    dg's rows, scale, cols, scale, then du's (of `swiglu_grads_reference`; dg and du not written on CUDA)."""
    return (_quantize_swiglu_grads_op if _opaque(plan) else _quantize_swiglu_grads_impl)(dh, g, u, plan.key, make_cols)


def rows_grad_weight(g: Tensor, x_rows: Tensor, x_rows_scale: Tensor, plan: LinearPlan, k: int) -> Tensor:
    """grad_weight (FP32 [N, K]) from grad_output g [M, N] and the input's FP8 rows (`quantize_input`'s, K real
    columns): `_rows_grad_weight_impl`."""
    return (_rows_grad_weight_op if _opaque(plan) else _rows_grad_weight_impl)(g, x_rows, x_rows_scale, plan.key, k)
