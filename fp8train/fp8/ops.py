"""One FP8 Linear as a function: operand specs, the GEMM route table, quantization, the three GEMMs.

For y = x @ W.T + b with x [M, K] (M tokens) and W [N, K], every GEMM is `a @ b.T` with both operands
row-major and the contraction dimension last (the "operand layout"):

    GEMM          computes          a                         b                       contraction
    output        y  = x  @ W.T     input         [M, K]      weight    [N, K]        K (features)
    grad_input    dx = dy @ W       grad_output   [M, N]      weight.T  [K, N]        N (features)
    grad_weight   dW = dy.T @ x     grad_output.T [N, M]      input.T   [K, M]        M (tokens)

`reference_fp8_linear` states what the three GEMMs compute; everything below computes exactly that:

    fp8_linear (autograd)     forward:  quantize_input -> linear_forward (quantize W, GEMM `output`)
                              backward: linear_backward (quantize grad_output; W.T, GEMM `grad_input`;
                                        input.T, GEMM `grad_weight`)
    quantize_*                Triton kernels on CUDA (kernels.py), the reference of quant.py elsewhere;
                              quantize_swiglu(_grads): an MLP's SwiGLU output (and its input gradients)
                              quantized by the kernel that computes them (swiglu.py, `fuse_swiglu`)
    gemm                      the one GEMM: `gemm_route` (the one route table) picks a cuBLAS `scaled_mm`
                              call or the emulation (dequantize + FP32 matmul, every device)

What the forward saves for backward: the FP8 input.T (1 byte per element; or, with the recipe's
`wgrad_input_from_fp8`, the FP8 input rows it already made), never the BF16 input and never an FP8 copy of
the weight: W.T is quantized again (or transposed from the step's cached W) in the backward.

At the op boundary an operand is a (data, scale) pair of contiguous tensors described by an `OperandSpec`
(format, block, contraction padding), which travels as a string ("e4m3:1x128:512"); a whole `LinearPlan` as
one string. Layouts: data [rows, Cp], zero-padded along the contraction to a multiple of `spec.pad`; scale
[Cp/128, rows] for 1x128 tiles (the transpose of per-row-per-tile scales: the "outer-dim major" layout
cuBLAS reads and the Triton kernel writes), [ceil(rows/br), ceil(Cp/bc)] for other blocks (padding blocks
have scale 1), [rows, 1] per row, 0-d per tensor; a high-precision operand (fmt None) is its BF16 value.

Eagerly each entry point runs its implementation directly (no dispatcher cost). Under torch.compile on
CUDA the implementation is traced: Triton kernels enter the graph as triton_ops and GEMMs as
`aten._scaled_mm_v2`, so inductor launches them from its own code (host time limits small models).
Elsewhere (CPU, emulated GEMMs) each entry point is an opaque custom op (`torch.ops.fp8train.*`) whose
fake implementation runs the reference on fake tensors, so the compiler cannot rewrite the reference
arithmetic and its view of every output is the real one.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .quant import dequantize, expand_scale, quantize, quantize_2d, resolve_block
from .recipe import BLOCK, ROW, TILE, Block, Fp8Format, Fp8Recipe, GemmConfig, OperandConfig

try:
    from . import kernels as _kernels
except ImportError:  # no triton (CPU-only installs): the reference path is used
    _kernels = None

__all__ = ["OperandSpec", "LinearPlan", "Route", "gemm_route", "contraction_pad", "gemm", "quantize_operand",
           "dequantize_operand", "pad_operand", "quantize_input", "quantize_weight", "weight_transposes", "transpose_weight",
           "wgrad_input",
           "linear_forward", "linear_backward", "linear_backward_gemms", "quantize_swiglu", "quantize_swiglu_grads",
           "swiglu_reference", "swiglu_grads_reference", "reference_fp8_linear", "load_deep_gemm"]

# cuBLAS blockwise GEMMs need the number of 128-blocks along the contraction to be a multiple of 4
# (K=8960 -> 70 blocks is refused or silently wrong): contractions are padded to 512 with zero data, scale 1.
_BLOCKWISE_PAD = 512


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


def _eager_cache(fn):
    """`fn` memoized on the eager hot path; while compiling, `fn` itself (the compiler runs it once at trace
    time, and warns on an lru_cache)."""
    cached = functools.lru_cache(maxsize=None)(fn)

    @functools.wraps(fn)
    def call(arg):
        return fn(arg) if torch.compiler.is_compiling() else cached(arg)
    return call


# --------------------------------------------------------------------------------- operand specs, plans

@dataclass(frozen=True)
class OperandSpec:
    """One GEMM operand: its format (None: high precision, BF16), its block in operand layout, and the
    multiple its contraction (last) dim is zero-padded to for the GEMM it feeds (1: none)."""

    fmt: Fp8Format | None
    block: Block
    pad: int = 1

    @property
    def key(self) -> str:
        if self.fmt is None:
            return "bf16"
        block = "tensor" if self.block is None else f"{self.block[0]}x{self.block[1]}"
        return f"{self.fmt.value}:{block}:{self.pad}"

    @staticmethod
    def parse(key: str) -> "OperandSpec":
        return _parse_spec(key)

    @property
    def is_tile(self) -> bool:
        return self.fmt is not None and self.block == TILE


@_eager_cache
def _parse_spec(key: str) -> OperandSpec:
    if key == "bf16":
        return OperandSpec(None, None)
    fmt, block, pad = key.split(":")
    return OperandSpec(Fp8Format(fmt), None if block == "tensor" else tuple(int(b) for b in block.split("x")),
                       int(pad))


def contraction_pad(gemm: GemmConfig, cublas: bool) -> int:
    """Contraction padding of one GEMM: 512 for cuBLAS's blockwise kernels (whole groups of four 128-blocks),
    16 (FP8 alignment) for its other FP8 kernels, none when emulated. Both operands get the same."""
    if not cublas or gemm.a.fmt is None or gemm.b.fmt is None:
        return 1
    blockwise = all(c.block is not None and c.block[1] == 128 for c in (gemm.a, gemm.b))
    return _BLOCKWISE_PAD if blockwise else 16


_PLAN_FIELDS = ("x", "w", "g", "w_t", "g_t", "x_t")


@dataclass(frozen=True)
class LinearPlan:
    """What a recipe and the device fix about one Linear's three GEMMs: the six operand specs, scale
    rounding, whether the GEMMs may run on cuBLAS, and where grad_weight's input operand comes from."""

    x: OperandSpec    # input rows: a of output
    w: OperandSpec    # weight: b of output
    g: OperandSpec    # grad_output rows: a of grad_input
    w_t: OperandSpec  # weight.T: b of grad_input
    g_t: OperandSpec  # grad_output.T: a of grad_weight
    x_t: OperandSpec  # input.T: b of grad_weight
    pow2: bool
    cublas: bool
    x_t_from_fp8: bool
    deep_gemm: bool = False  # tile x block GEMMs (output, grad_input) on DeepGEMM's SM90 kernel (with cublas)

    @classmethod
    def of(cls, recipe: Fp8Recipe, cublas: bool) -> "LinearPlan":
        r = recipe
        pads = {name: contraction_pad(getattr(r, name), cublas) for name in ("output", "grad_input", "grad_weight")}
        spec = lambda cfg, gemm: OperandSpec(cfg.fmt, cfg.block, pads[gemm])  # noqa: E731
        return cls(spec(r.output.a, "output"), spec(r.output.b, "output"), spec(r.grad_input.a, "grad_input"),
                   spec(r.grad_input.b, "grad_input"), spec(r.grad_weight.a, "grad_weight"),
                   spec(r.grad_weight.b, "grad_weight"), r.pow2_scale, cublas, r.wgrad_input_from_fp8,
                   r.deep_gemm and cublas)

    @property
    def key(self) -> str:
        specs = ",".join(getattr(self, f).key for f in _PLAN_FIELDS)
        return f"{specs};{int(self.pow2)}{int(self.cublas)}{int(self.x_t_from_fp8)}{int(self.deep_gemm)}"

    @staticmethod
    def parse(key: str) -> "LinearPlan":
        return _parse_plan(key)


@_eager_cache
def _parse_plan(key: str) -> LinearPlan:
    specs, flags = key.split(";")
    return LinearPlan(*(OperandSpec.parse(k) for k in specs.split(",")), *(f == "1" for f in flags))


# ------------------------------------------------------------------------------------- quantization

def _pad_last(data: Tensor, pad: int) -> Tensor:
    """Data zero-padded along the last dim to a multiple of `pad` (F.pad has no FP8 kernel: pad the bytes)."""
    extra = -data.shape[1] % pad
    if not extra:
        return data
    if data.element_size() == 1:
        return F.pad(data.view(torch.uint8), (0, extra)).view(data.dtype)
    return F.pad(data, (0, extra))


def pad_operand(data: Tensor, scale: Tensor, spec: OperandSpec) -> tuple[Tensor, Tensor]:
    """An operand's data [R, C] and scale (op layout, blocks of the C columns) padded for its GEMM: zero data
    up to a multiple of `spec.pad` and scale 1 for the added blocks (whole-row and per-tensor scales cover
    the padding as they are). The one padding rule: the quantizers, the weight cache and FSDP's FP8 weights."""
    C = data.shape[1]
    data = _pad_last(data, spec.pad)
    if data.shape[1] == C or spec.fmt is None or spec.block is None or spec.block[1] == -1:
        return data, scale
    blocks = -(-data.shape[1] // spec.block[1])
    if spec.block == TILE:  # [blocks, rows]
        return data, F.pad(scale, (0, 0, 0, blocks - scale.shape[0]), value=1.0)
    return data, F.pad(scale, (0, blocks - scale.shape[1]), value=1.0)


def quantize_operand(x2d: Tensor, spec: OperandSpec, pow2: bool) -> tuple[Tensor, Tensor]:
    """The reference quantization of a 2-D operand, padded for its GEMM, as (data, scale) in the op layout.
    A high-precision operand is a BF16 copy (an op's output never aliases its input) with scale 1."""
    if spec.fmt is None:
        return x2d.to(torch.bfloat16, copy=True).contiguous(), torch.ones((), device=x2d.device)
    data, scale = quantize_2d(x2d, resolve_block(spec.block, tuple(x2d.shape)), spec.fmt, pow2)
    if spec.block == TILE:
        scale = scale.t().contiguous()
    return pad_operand(data, scale, spec)


def dequantize_operand(data: Tensor, scale: Tensor, spec: OperandSpec) -> Tensor:
    """FP32 values of an operand in the op layout (padding included)."""
    if spec.fmt is None:
        return data.float()
    if spec.block == TILE:
        scale = scale.t()
    block = resolve_block(spec.block, tuple(data.shape))
    return data.float() * expand_scale(scale, block, tuple(data.shape))


def _empty(like: Tensor) -> tuple[Tensor, Tensor]:
    return like.new_empty(0, dtype=torch.uint8), like.new_empty(0, dtype=torch.float32)


def _tile_kernel_applies(rows: OperandSpec, cols: OperandSpec, cublas: bool) -> bool:
    # (Under torch.compile the Triton kernel beat inductor fusing the traced reference quantization into the
    # producing norm / SwiGLU kernels by 5% or more at 7B, though the latter saves its FP8 copies' memory:
    # docs/benchmarks.md section 0, item 1.)
    return (cublas and _kernels is not None and rows.is_tile and cols.is_tile
            and rows.pad == cols.pad == _BLOCKWISE_PAD)


def _quantize_activation(x2d: Tensor, rows: OperandSpec, cols: OperandSpec, pow2: bool, make_cols: bool,
                         cublas: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """FP8 copies of an activation x [M, K]: rows (blocks of x, for output / grad_input) and, if
    `make_cols`, cols (blocks of x.T, for grad_weight), both quantized from x itself; no cols: empty."""
    if x2d.stride(1) != 1:  # the kernel reads rows with unit stride
        x2d = x2d.contiguous()
    if _tile_kernel_applies(rows, cols, cublas):
        if torch.compiler.is_compiling():  # its triton_op: inductor sees into it and launches it itself
            return _kernels.quantize_tiles_op(x2d, rows.fmt.dtype, cols.fmt.dtype, pow2, rows.pad, make_cols)
        return _kernels.ops_layout(_kernels.quantize_tiles_and_transpose(x2d, rows.fmt, cols.fmt, pow2, rows.pad,
                                                                         make_cols), x2d)
    rd, rs = quantize_operand(x2d, rows, pow2)
    if not make_cols:
        return rd, rs, *_empty(x2d)
    if (rows.fmt, rows.block) == (cols.fmt, cols.block) and rows.block is None and rows.fmt is not None:
        # one scale for the tensor: the transposed copy is the row copy transposed, exactly
        return rd, rs, _pad_last(rd[:, : x2d.shape[1]].t().contiguous(), cols.pad), rs.clone()
    return rd, rs, *quantize_operand(x2d.t(), cols, pow2)


def quantize_weight(w: Tensor, spec: OperandSpec, pow2: bool, transpose: bool, cublas: bool) -> tuple[Tensor, Tensor]:
    """W [N, K] as the operand `spec` describes: W for output, or W.T (`transpose`) for grad_input."""
    if w.stride(1) != 1:
        w = w.contiguous()
    if cublas and _kernels is not None and spec.fmt is not None and spec.block == BLOCK and spec.pad == _BLOCKWISE_PAD:
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
        return _pad_last(data_t, spec_t.pad), scale.clone()
    return pad_operand(data_t, scale[:, : -(-k // 128)].t().contiguous(), spec_t)


# ------------------------------------------------------------------------------------------- the GEMM

class Route(enum.Enum):
    """How one GEMM runs: a cuBLAS `scaled_mm` scaling pair, or emulated (dequantize + FP32 matmul)."""

    EMULATED = "emulated"
    TENSOR = "tensor"          # one scale per operand (any E4M3/E5M2 mix but E5M2 x E5M2)
    ROW = "row"                # one scale per row of each operand (E4M3)
    TILE_BLOCK = "tile_block"  # 1x128 tiles x 128x128 blocks (E4M3)
    TILE_TILE = "tile_tile"    # 1x128 tiles x 1x128 tiles (E4M3)


# The scaling pairs cuBLAS has kernels for; any other pair (custom recipes) is emulated.
_ROUTES = {(None, None): Route.TENSOR, (ROW, ROW): Route.ROW, (TILE, BLOCK): Route.TILE_BLOCK,
           (TILE, TILE): Route.TILE_TILE}


def gemm_route(a: OperandSpec, b: OperandSpec) -> Route:
    """The route an operand pair takes where cuBLAS FP8 GEMMs exist (SM90)."""
    route = _ROUTES.get((a.block, b.block), Route.EMULATED) if a.fmt and b.fmt else Route.EMULATED
    if route is Route.TENSOR:
        return Route.EMULATED if a.fmt is b.fmt is Fp8Format.E5M2 else route
    return route if a.fmt is b.fmt is Fp8Format.E4M3 else Route.EMULATED


def gemm(a: Tensor, a_scale: Tensor, a_spec: OperandSpec, b: Tensor, b_scale: Tensor, b_spec: OperandSpec,
         out_dtype: torch.dtype, cublas: bool, deep_gemm: bool = False) -> Tensor:
    """a [Ra, C] @ b [Rb, C].T with FP32 accumulation, in out_dtype (the one GEMM of fp8train). `deep_gemm`:
    a tile x block pair with BF16 output runs on DeepGEMM's SM90 kernel instead of cuBLAS's (the same
    products, measured bit-identical; faster at the 7B shapes, docs/benchmarks.md)."""
    route = gemm_route(a_spec, b_spec) if cublas else Route.EMULATED
    if route is Route.EMULATED or a.shape[0] % 16 or b.shape[0] % 16:
        # the same function on any device: an FP32 product even under an ambient autocast (a backward run
        # inside one, or the forward with exact FP32 scales, whose dequantized values BF16 would round)
        with torch.autocast(a.device.type, enabled=False):
            return (dequantize_operand(a, a_scale, a_spec) @ dequantize_operand(b, b_scale, b_spec).t()).to(out_dtype)
    ST = F.ScalingType
    a, b = a.contiguous(), b.contiguous()
    # mat_a a [Ra, C] row-major; mat_b b.t() [C, Rb] column-major (strides (1, C))
    if route is Route.TILE_BLOCK and deep_gemm and out_dtype is torch.bfloat16 and b.shape[0] % 128 == 0:
        # DeepGEMM's NT kernel: a [Ra, C] and b [Rb, C] K-major; scale_a as (Ra, C/128) strides (1, Ra) (its
        # MN-major, TMA-aligned LHS layout: Ra % 16 == 0 here); scale_b [Rb/128, C/128] row-major as it is
        return _deep_gemm_op(a, a_scale.contiguous().t(), b, b_scale.contiguous())
    if route is Route.TILE_BLOCK:
        # scale_a [C/128, Ra].t(): (Ra, C/128) strides (1, Ra); scale_b [Rb/128, C/128].t(): strides (1, C/128)
        return _scaled_mm(a, b.t(), a_scale.contiguous().t(), ST.BlockWise1x128, b_scale.contiguous().t(),
                          ST.BlockWise128x128, out_dtype)
    if route is Route.TILE_TILE:
        # scale_a (Ra, C/128) strides (1, Ra); scale_b [C/128, Rb].t(): (Rb, C/128) strides (1, Rb)
        return _scaled_mm(a, b.t(), a_scale.contiguous().t(), ST.BlockWise1x128, b_scale.contiguous().t(),
                          ST.BlockWise1x128, out_dtype)
    if route is Route.TENSOR:
        return _scaled_mm(a, b.t(), a_scale.reshape(1), ST.TensorWise, b_scale.reshape(1), ST.TensorWise, out_dtype)
    # row-wise: scale_a (Ra, 1), scale_b (1, Rb); the CUTLASS kernel writes BF16 only
    out = _scaled_mm(a, b.t(), a_scale.reshape(-1, 1), ST.RowWise, b_scale.reshape(1, -1), ST.RowWise, torch.bfloat16)
    return out.to(out_dtype)


def _scaled_mm(a: Tensor, b: Tensor, scale_a: Tensor, recipe_a, scale_b: Tensor, recipe_b, out_dtype) -> Tensor:
    """`F.scaled_mm`; while compiling, the aten op it calls, directly: Dynamo (torch 2.11) does not trace
    `torch._scaled_mm_v2`, and each GEMM would break the graph."""
    if not torch.compiler.is_compiling():
        return F.scaled_mm(a, b, scale_a, recipe_a, scale_b, recipe_b, output_dtype=out_dtype)
    block = F.ScalingType.BlockWise128x128.value  # ints: Dynamo cannot compare the pybind enums
    if (recipe_b.value == block and b.shape[1] % 128) or (recipe_a.value == block and a.shape[0] % 128):
        # torch 2.11's shape check of the aten op floors a partial 128-block that cuBLAS takes (a dim such
        # as 64): such GEMMs stay an opaque op (no real model has one; test models do)
        return _scaled_mm_op(a, b, scale_a, recipe_a.value, scale_b, recipe_b.value, out_dtype)
    return torch.ops.aten._scaled_mm_v2.default(a, b, [scale_a], [recipe_a.value], [], [scale_b], [recipe_b.value],
                                                [], None, out_dtype)


@torch.library.custom_op("fp8train::scaled_mm", mutates_args=())
def _scaled_mm_op(a: Tensor, b: Tensor, scale_a: Tensor, recipe_a: int, scale_b: Tensor, recipe_b: int,
                  out_dtype: torch.dtype) -> Tensor:
    ST = F.ScalingType
    return F.scaled_mm(a, b, scale_a, ST(recipe_a), scale_b, ST(recipe_b), output_dtype=out_dtype)


@_scaled_mm_op.register_fake
def _(a, b, scale_a, recipe_a, scale_b, recipe_b, out_dtype):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


@functools.cache
def load_deep_gemm():
    """The `deep_gemm` module, or a ValueError naming the recipe key and the install."""
    try:
        import deep_gemm
    except ImportError as e:
        raise ValueError(f"config key 'deep_gemm' is true but DeepGEMM does not import ({e}); build it from "
                         "github.com/deepseek-ai/DeepGEMM as docs/benchmarks.md says, or set deep_gemm: false") from None
    return deep_gemm


@torch.library.custom_op("fp8train::deep_gemm", mutates_args=())
def _deep_gemm_op(a: Tensor, scale_a: Tensor, b: Tensor, scale_b: Tensor) -> Tensor:
    """D [Ra, Rb] = (a * scale_a) @ (b * scale_b).T in BF16 on DeepGEMM (1x128 tiles x 128x128 blocks)."""
    out = a.new_empty((a.shape[0], b.shape[0]), dtype=torch.bfloat16)
    load_deep_gemm().fp8_gemm_nt((a, scale_a), (b, scale_b), out)
    return out


@_deep_gemm_op.register_fake
def _(a, scale_a, b, scale_b):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=torch.bfloat16)


# ------------------------------------------------------------ forward and backward of one FP8 Linear

def _quantize_input_impl(x: Tensor, plan: str, make_cols: bool, kernels: bool = True) -> tuple[Tensor, ...]:
    """Input rows (operand a of output) and, with `make_cols`, input.T (operand b of grad_weight)."""
    p = LinearPlan.parse(plan)
    return _quantize_activation(x, p.x, p.x_t, p.pow2, make_cols, p.cublas and kernels)


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


def _backward_impl(dy: Tensor, weight: Tensor, w: Tensor | None, w_scale: Tensor | None, x_saved: Tensor | None,
                   x_saved_scale: Tensor | None, plan: str, want_dx: bool, want_dw: bool,
                   dx_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """grad_output quantized (rows; cols when dW is wanted), then grad_input and grad_weight (FP32)."""
    p = LinearPlan.parse(plan)
    g, g_scale, g_t, g_t_scale = _quantize_activation(dy, p.g, p.g_t, p.pow2, want_dw, p.cublas)
    return _backward_gemms_impl(g, g_scale, g_t, g_t_scale, weight, w, w_scale, x_saved, x_saved_scale, plan, want_dx,
                                want_dw, dx_dtype)


def _backward_gemms_impl(g: Tensor, g_scale: Tensor, g_t: Tensor, g_t_scale: Tensor, weight: Tensor, w: Tensor | None,
                         w_scale: Tensor | None, x_saved: Tensor | None, x_saved_scale: Tensor | None, plan: str,
                         want_dx: bool, want_dw: bool, dx_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """grad_input and grad_weight from grad_output's operands (rows g; cols g_t, when dW is wanted).
    `x_saved` is input.T's operand, or the input rows with the plan's `x_t_from_fp8`; `w` is W's operand
    when the forward was given one (W.T is then its transpose where that is exact)."""
    p = LinearPlan.parse(plan)
    dx = dw = g.new_empty(0, dtype=torch.float32)
    if want_dx:
        w_t = transpose_weight(w, w_scale, p, weight.shape[1]) if w is not None else None
        w_t = w_t or quantize_weight(weight, p.w_t, p.pow2, True, p.cublas)
        # grad_input: dx [M, K] = dy [M, Np] @ W.T [K, Np].T
        dx = gemm(g, g_scale, p.g, *w_t, p.w_t, dx_dtype, p.cublas, p.deep_gemm)
    if want_dw:
        if p.x_t_from_fp8:  # dequantize the saved rows, transpose, re-quantize (DeepSeek-V3)
            rows = dequantize_operand(x_saved, x_saved_scale, p.x)[:, : weight.shape[1]]
            x_saved, x_saved_scale = quantize_operand(rows.t(), p.x_t, p.pow2)
        # grad_weight: dW [N, K] = dy.T [N, Mp] @ x.T [K, Mp].T
        dw = gemm(g_t, g_t_scale, p.g_t, x_saved, x_saved_scale, p.x_t, torch.float32, p.cublas)
    return dx, dw


def swiglu_reference(g: Tensor, u: Tensor) -> Tensor:
    """h = silu(g) * u, as a Llama/Qwen2 MLP computes it (in g's and u's dtype)."""
    return F.silu(g) * u


def swiglu_grads_reference(dh: Tensor, g: Tensor, u: Tensor) -> tuple[Tensor, Tensor]:
    """(dg, du) of h = silu(g) * u, as autograd computes them: silu_backward(dh * u, g) and dh * silu(g)."""
    return torch.ops.aten.silu_backward(dh * u, g), dh * F.silu(g)


def _swiglu_kernel_applies(p: LinearPlan, rows: OperandSpec, cols: OperandSpec, *tensors: Tensor) -> bool:
    return _tile_kernel_applies(rows, cols, p.cublas) and all(t.dtype == torch.bfloat16 for t in tensors)


def _quantize_swiglu_impl(g: Tensor, u: Tensor, plan: str, make_cols: bool,
                          kernels: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """h = silu(g) * u quantized as the plan's input (rows, and input.T with `make_cols`): on CUDA in one
    kernel that never writes h; elsewhere `swiglu_reference`, then the input's quantization."""
    p = LinearPlan.parse(plan)
    g, u = g.contiguous(), u.contiguous()
    if kernels and _swiglu_kernel_applies(p, p.x, p.x_t, g, u):
        if torch.compiler.is_compiling():
            return _kernels.quantize_swiglu_op(g, u, p.x.fmt.dtype, p.x_t.fmt.dtype, p.pow2, p.x.pad, make_cols)
        return _kernels.quantize_swiglu(g, u, p.x.fmt, p.x_t.fmt, p.pow2, p.x.pad, make_cols)
    return _quantize_activation(swiglu_reference(g, u), p.x, p.x_t, p.pow2, make_cols, p.cublas and kernels)


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
                                                     make_cols)
        return _kernels.quantize_swiglu_grads(dh, g, u, p.g.fmt, p.g_t.fmt, p.pow2, p.g.pad, make_cols)
    dg, du = swiglu_grads_reference(dh, g, u)
    return (*_quantize_activation(dg, p.g, p.g_t, p.pow2, make_cols, p.cublas and kernels),
            *_quantize_activation(du, p.g, p.g_t, p.pow2, make_cols, p.cublas and kernels))


# The custom ops: what torch.compile sees of the three entry points on CPU and with emulated GEMMs. Their
# fake implementations run the reference path on fake tensors: shapes, dtypes, strides are the real ones.

@torch.library.custom_op("fp8train::quantize_input", mutates_args=())
def _quantize_input_op(x: Tensor, plan: str, make_cols: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _quantize_input_impl(x, plan, make_cols)


@_quantize_input_op.register_fake
def _(x, plan, make_cols):
    return _quantize_input_impl(x, plan, make_cols, kernels=False)


@torch.library.custom_op("fp8train::linear_forward", mutates_args=())
def _forward_op(x_rows: Tensor, x_rows_scale: Tensor, weight: Tensor, w: Tensor | None, w_scale: Tensor | None,
                plan: str, out_dtype: torch.dtype) -> Tensor:
    return _forward_impl(x_rows, x_rows_scale, weight, w, w_scale, plan, out_dtype)


@_forward_op.register_fake
def _(x_rows, x_rows_scale, weight, w, w_scale, plan, out_dtype):
    return x_rows.new_empty((x_rows.shape[0], weight.shape[0]), dtype=out_dtype)


@torch.library.custom_op("fp8train::linear_backward", mutates_args=())
def _backward_op(dy: Tensor, weight: Tensor, w: Tensor | None, w_scale: Tensor | None, x_saved: Tensor | None,
                 x_saved_scale: Tensor | None, plan: str, want_dx: bool, want_dw: bool,
                 dx_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    return _backward_impl(dy, weight, w, w_scale, x_saved, x_saved_scale, plan, want_dx, want_dw, dx_dtype)


@_backward_op.register_fake
def _backward_fake(dy, weight, w, w_scale, x_saved, x_saved_scale, plan, want_dx, want_dw, dx_dtype):
    dx = dy.new_empty((dy.shape[0], weight.shape[1]) if want_dx else (0,), dtype=dx_dtype if want_dx else torch.float32)
    dw = dy.new_empty(tuple(weight.shape) if want_dw else (0,), dtype=torch.float32)
    return dx, dw


@torch.library.custom_op("fp8train::linear_backward_gemms", mutates_args=())
def _backward_gemms_op(g: Tensor, g_scale: Tensor, g_t: Tensor, g_t_scale: Tensor, weight: Tensor, w: Tensor | None,
                       w_scale: Tensor | None, x_saved: Tensor | None, x_saved_scale: Tensor | None, plan: str,
                       want_dx: bool, want_dw: bool, dx_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    return _backward_gemms_impl(g, g_scale, g_t, g_t_scale, weight, w, w_scale, x_saved, x_saved_scale, plan, want_dx,
                                want_dw, dx_dtype)


@_backward_gemms_op.register_fake
def _(g, g_scale, g_t, g_t_scale, weight, w, w_scale, x_saved, x_saved_scale, plan, want_dx, want_dw, dx_dtype):
    return _backward_fake(g, weight, w, w_scale, x_saved, x_saved_scale, plan, want_dx, want_dw, dx_dtype)


@torch.library.custom_op("fp8train::quantize_swiglu", mutates_args=())
def _quantize_swiglu_op(g: Tensor, u: Tensor, plan: str, make_cols: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _quantize_swiglu_impl(g, u, plan, make_cols)


@_quantize_swiglu_op.register_fake
def _(g, u, plan, make_cols):
    return _quantize_swiglu_impl(g, u, plan, make_cols, kernels=False)


@torch.library.custom_op("fp8train::quantize_swiglu_grads", mutates_args=())
def _quantize_swiglu_grads_op(dh: Tensor, g: Tensor, u: Tensor, plan: str, make_cols: bool) -> tuple[
        Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _quantize_swiglu_grads_impl(dh, g, u, plan, make_cols)


@_quantize_swiglu_grads_op.register_fake
def _(dh, g, u, plan, make_cols):
    return _quantize_swiglu_grads_impl(dh, g, u, plan, make_cols, kernels=False)


def _opaque(plan: LinearPlan) -> bool:
    """Compiling without cuBLAS: the opaque op, whose reference arithmetic the compiler must not rewrite.
    Eagerly, and compiling on CUDA (traced into the graph), the implementation itself."""
    return torch.compiler.is_compiling() and not plan.cublas


def quantize_input(x: Tensor, plan: LinearPlan, make_cols: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The input's FP8 operands: rows data, scale and (with `make_cols`) input.T data, scale; else empty."""
    return (_quantize_input_op if _opaque(plan) else _quantize_input_impl)(x, plan.key, make_cols)


def linear_forward(x_rows: Tensor, x_rows_scale: Tensor, weight: Tensor, w: Tensor | None, w_scale: Tensor | None,
                   plan: LinearPlan, out_dtype: torch.dtype) -> Tensor:
    """The output GEMM from the input rows; W quantized from `weight` unless given as (w, w_scale)."""
    return (_forward_op if _opaque(plan) else _forward_impl)(x_rows, x_rows_scale, weight, w, w_scale, plan.key,
                                                             out_dtype)


def linear_backward(dy: Tensor, weight: Tensor, w: Tensor | None, w_scale: Tensor | None, x_saved: Tensor | None,
                    x_saved_scale: Tensor | None, plan: LinearPlan, want_dx: bool, want_dw: bool,
                    dx_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """grad_input (in dx_dtype; empty unless wanted) and grad_weight (FP32; empty unless wanted)."""
    return (_backward_op if _opaque(plan) else _backward_impl)(dy, weight, w, w_scale, x_saved, x_saved_scale,
                                                               plan.key, want_dx, want_dw, dx_dtype)


def linear_backward_gemms(g: Tensor, g_scale: Tensor, g_t: Tensor, g_t_scale: Tensor, weight: Tensor,
                          w: Tensor | None, w_scale: Tensor | None, x_saved: Tensor | None,
                          x_saved_scale: Tensor | None, plan: LinearPlan, want_dx: bool, want_dw: bool,
                          dx_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """`linear_backward` from grad_output's operands made by its producer (`quantize_swiglu_grads`)."""
    return (_backward_gemms_op if _opaque(plan) else _backward_gemms_impl)(
        g, g_scale, g_t, g_t_scale, weight, w, w_scale, x_saved, x_saved_scale, plan.key, want_dx, want_dw, dx_dtype)


def quantize_swiglu(g: Tensor, u: Tensor, plan: LinearPlan, make_cols: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The operands of h = silu(g) * u as the input of a Linear with `plan` (`quantize_input` of
    `swiglu_reference(g, u)`, without h written on CUDA)."""
    return (_quantize_swiglu_op if _opaque(plan) else _quantize_swiglu_impl)(g, u, plan.key, make_cols)


def quantize_swiglu_grads(dh: Tensor, g: Tensor, u: Tensor, plan: LinearPlan, make_cols: bool) -> tuple[Tensor, ...]:
    """The grad_output operands of the gate and up Linears (`plan`) from the SwiGLU's output gradient dh:
    dg's rows, scale, cols, scale, then du's (of `swiglu_grads_reference`; dg and du not written on CUDA)."""
    return (_quantize_swiglu_grads_op if _opaque(plan) else _quantize_swiglu_grads_impl)(dh, g, u, plan.key, make_cols)
