"""The pieces FP8Linear's three GEMMs are made of, callable eagerly and from inside torch.compile.

    quantize_activation  x [M, K]  -> rows (blocks of x) and cols (blocks of x.T), each FP8 data + scale
    quantize_weight      W [N, K]  -> W and W.T, each FP8 data + scale
    fp8_mm               a, b      -> a @ b.T with FP32 accumulation (cuBLAS `scaled_mm`, or emulated)

plus `linear_forward` (weight quantization + output GEMM) and `linear_backward` (grad_output quantization +
grad_input and grad_weight GEMMs). Eager calls go straight to the Python implementation (no dispatcher cost).
Under torch.compile a decoder layer is one graph with no break at its Linears, two ways:
- on CUDA the implementation is traced: the Triton kernels enter the graph as triton_ops
  (`fp8train::quantize_tiles`, `quantize_blocks`) and the GEMMs as `scaled_mm`, so inductor launches them
  from its generated code, with no Python between them at run time (host time limits small models);
- elsewhere (CPU, emulated GEMMs) each piece is an opaque custom op (`torch.ops.fp8train.*`) with a
  shape-only fake implementation, so the compiler cannot rewrite the reference arithmetic.
The identical quantizations of the input that q/k/v and gate/up share are merged: the opaque ops by
AOTAutograd's CSE, the traced Triton kernels by the joint-graph pass of `compile_options()`
(`_inductor_pass.py`), which CSE cannot do for them.

At the op boundary an operand is a (data, scale) pair of contiguous tensors plus its `OperandConfig` as a
string key ("e4m3:1x128", "e5m2:tensor", "bf16" for a high-precision operand). A 1x128 scale travels as
its transpose [blocks, rows]: that is the "outer-dim major" layout cuBLAS reads, and the layout the Triton
kernel writes, so neither side copies it.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from .quant import Fp8Tensor, _quantize_2d, _resolve_block, expand_scale
from .recipe import Fp8Format, Fp8Recipe, GemmConfig, OperandConfig

try:
    from . import kernels as _kernels
except ImportError:  # no triton (CPU-only installs): the reference path is used
    _kernels = None

# cuBLAS blockwise GEMMs need the number of 128-blocks along the contraction to be a multiple of 4
# (K=8960 -> 70 blocks is refused or silently wrong): pad contractions to 512 with zero data, scale 1.
_CONTRACTION_PAD = 512
_TILE = (1, 128)


# ------------------------------------------------------------------------------- operand configs as keys

def operand_key(cfg: OperandConfig) -> str:
    if cfg.fmt is None:
        return "bf16"
    block = "tensor" if cfg.block is None else f"{cfg.block[0]}x{cfg.block[1]}"
    return f"{cfg.fmt.value}:{block}"


def _eager_cache(fn):
    """`fn` memoized on the eager hot path; while compiling, `fn` itself: the compiler runs it once at trace
    time (and warns on an lru_cache)."""
    cached = functools.lru_cache(maxsize=None)(fn)

    @functools.wraps(fn)
    def call(*args):
        return fn(*args) if torch.compiler.is_compiling() else cached(*args)
    return call


@_eager_cache
def _parse_key(key: str) -> OperandConfig:
    if key == "bf16":
        return OperandConfig(None, None)
    fmt, _, block = key.partition(":")
    return OperandConfig(Fp8Format(fmt), None if block == "tensor" else tuple(int(b) for b in block.split("x")))


def _pack(q: Fp8Tensor | None, like: Tensor) -> tuple[Tensor, Tensor]:
    """(data, scale) for the op boundary; a missing operand is two empty tensors."""
    if q is None:
        return like.new_empty(0, dtype=torch.uint8), like.new_empty(0, dtype=torch.float32)
    scale = q.scale.t() if q.block == _TILE else q.scale
    return q.data.contiguous(), scale.contiguous()


def unpack(data: Tensor, scale: Tensor, key: str) -> Fp8Tensor:
    cfg = _parse_key(key)
    data = data.contiguous()  # as packed; a compiler may hand over another layout
    if cfg.fmt is None:
        return Fp8Tensor(data, scale, None, None)
    block = _resolve_block(cfg.block, tuple(data.shape))
    return Fp8Tensor(data, scale.t() if block == _TILE else scale, block, cfg.fmt)


def pack_pair(a: Fp8Tensor | None, b: Fp8Tensor | None, like: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return (*_pack(a, like), *_pack(b, like))


# ------------------------------------------------------------------------------------ quantization

def _is_tile(cfg: OperandConfig) -> bool:
    return cfg.fmt is not None and cfg.block == _TILE


def _pad_last(data: Tensor, pad: int) -> Tensor:
    """FP8 data zero-padded along the last dim to a multiple of `pad`."""
    extra = -data.shape[1] % pad
    return F.pad(data.view(torch.uint8), (0, extra)).view(data.dtype) if extra else data  # pad(): no fp8 kernel


def _quantize(x2d: Tensor, cfg: OperandConfig, pow2: bool, pad: int) -> Fp8Tensor:
    """Reference quantization of a 2-D operand; pads the contraction (last) dim to `pad` for cuBLAS
    with zero data (scale 1 for added 128-tiles; whole-row and per-tensor scales are unchanged).
    A high-precision operand (fmt None) is its BF16 value with scale 1 (GEMMs with it are emulated)."""
    if cfg.fmt is None:
        data = x2d.to(torch.bfloat16, copy=True).contiguous()  # a copy: an op's output never aliases its input
        return Fp8Tensor(data, torch.ones((), device=x2d.device), None, None)
    C = x2d.shape[1]
    block = _resolve_block(cfg.block, tuple(x2d.shape))
    data, scale = _quantize_2d(x2d, block, cfg.fmt, pow2)
    extra = -C % pad
    if extra:
        data = _pad_last(data, pad)
        if cfg.block is not None and cfg.block[1] == -1:  # a whole-row block spans the padding too
            block = (block[0], C + extra)
        elif block is not None:
            scale = F.pad(scale, (0, -(-(C + extra) // block[1]) - scale.shape[1]), value=1.0)
    return Fp8Tensor(data, scale, block, cfg.fmt)


def _pad_for(cublas: bool, gemm: GemmConfig) -> int:
    """Contraction padding of one GEMM on the cuBLAS path: 512 for the blockwise kernels (whole groups of
    four 128-blocks), 16 (FP8 alignment) otherwise, none when emulated. Both operands get the same."""
    if not cublas:
        return 1
    if gemm.a.fmt is None or gemm.b.fmt is None:
        return 1  # emulated
    blockwise = all(c.block is not None and c.block[1] == 128 for c in (gemm.a, gemm.b))
    return _CONTRACTION_PAD if blockwise else 16


def _tiles(x2d: Tensor, rows_fmt: Fp8Format, cols_fmt: Fp8Format, pow2: bool, pad: int,
           cols: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The Triton activation kernel: rows data, scale [Kp/128, M], cols data, scale [Mp/128, K] (packed;
    no cols: empty). Under torch.compile its triton_op, which inductor sees into and launches itself."""
    if torch.compiler.is_compiling():
        return _kernels.quantize_tiles_op(x2d, rows_fmt.dtype, cols_fmt.dtype, pow2, pad, cols)
    qr, sr, qc, sc = _kernels.quantize_tiles_and_transpose(x2d, rows_fmt, cols_fmt, pow2, pad, cols=cols)
    return (qr, sr.t(), qc, sc.t()) if cols else (qr, sr.t(), *_pack(None, x2d))


def _blocks(w: Tensor, fmt: Fp8Format, pow2: bool, pad: int) -> tuple[Tensor, Tensor, Tensor]:
    """The Triton weight kernel (its triton_op under torch.compile): data, data.T, scale [N/128, Kp/128]."""
    if torch.compiler.is_compiling():
        return _kernels.quantize_blocks_op(w, fmt.dtype, pow2, pad)
    return _kernels.quantize_blocks_and_transpose(w, fmt, pow2, pad)


def _quantize_activation(x2d, rows_cfg: OperandConfig, cols_cfg: OperandConfig, pow2: bool, cublas: bool,
                         pads: tuple[int, int], cols: bool = True):
    """FP8 copies of an activation x [M, K]: rows (blocks of x) and cols (blocks of x.T), each padded
    along its contraction dim for the GEMM it feeds (`pads`). `cols=False`: no grad_weight will need
    the transposed copy (inference, frozen weights); it is not made and comes back as None."""
    rows_pad, cols_pad = pads
    if x2d.stride(1) != 1:  # the kernels read rows with unit stride
        x2d = x2d.contiguous()
    if (cublas and _kernels is not None and _is_tile(rows_cfg) and _is_tile(cols_cfg)
            and rows_pad == cols_pad == _CONTRACTION_PAD):
        qr, sr, qc, sc = _tiles(x2d, rows_cfg.fmt, cols_cfg.fmt, pow2, rows_pad, cols)
        return Fp8Tensor(qr, sr.t(), _TILE, rows_cfg.fmt), Fp8Tensor(qc, sc.t(), _TILE, cols_cfg.fmt) if cols else None
    rows = _quantize(x2d, rows_cfg, pow2, rows_pad)
    if not cols:
        return rows, None
    if rows_cfg == cols_cfg and rows_cfg.block is None and rows_cfg.fmt is not None:  # per-tensor: transpose-exact
        cols_data = _pad_last(rows.data[:, :x2d.shape[1]].t().contiguous(), cols_pad)
        return rows, Fp8Tensor(cols_data, rows.scale.clone(), None, rows.fmt)
    return rows, _quantize(x2d.t(), cols_cfg, pow2, cols_pad)


def _quantize_weight_cfg(w: Tensor, cfg: OperandConfig, cfg_t: OperandConfig, pow2: bool, pads: tuple[int, int],
                         cublas: bool) -> tuple[Fp8Tensor, Fp8Tensor]:
    """FP8 copies of the weight: W [N, K] for `output` and W.T [K, N] for `grad_input`."""
    pad, pad_t = pads
    if w.stride(1) != 1:
        w = w.contiguous()
    if (cublas and _kernels is not None and cfg.fmt is not None and cfg.block == (128, 128) and cfg_t == cfg
            and pad == pad_t == _CONTRACTION_PAD):
        q, qt, s = _blocks(w, cfg.fmt, pow2, pad)
        kb = -(-w.shape[1] // 128)
        st = F.pad(s.t()[:kb], (0, qt.shape[1] // 128 - s.shape[0]), value=1.0)
        return Fp8Tensor(q, s, (128, 128), cfg.fmt), Fp8Tensor(qt, st.contiguous(), (128, 128), cfg.fmt)
    # 128x128 blocks and per-tensor scales are transpose-exact: quantizing w.t() gives the same numbers
    return _quantize(w, cfg, pow2, pad), _quantize(w.t(), cfg_t, pow2, pad_t)


def _quantize_weight(w: Tensor, recipe: Fp8Recipe, cublas: bool) -> tuple[Fp8Tensor, Fp8Tensor]:
    pads = (_pad_for(cublas, recipe.output), _pad_for(cublas, recipe.grad_input))
    return _quantize_weight_cfg(w, recipe.output.b, recipe.grad_input.b, recipe.pow2_scale, pads, cublas)


# -------------------------------------------------------------------------------------------- GEMM

def _dequantize_2d(q: Fp8Tensor) -> Tensor:
    return q.data.float() * expand_scale(q.scale, q.block, tuple(q.data.shape))


def _outer_major(scale: Tensor) -> Tensor:
    """1x128 scales as (rows, blocks) with strides (1, rows): the layout cuBLAS reads."""
    return scale if scale.stride(0) == 1 else scale.t().contiguous().t()


def _kind(q: Fp8Tensor) -> str:
    if q.block is None:
        return "tensor"
    if q.block == _TILE:
        return "tile"
    if q.block == (128, 128):
        return "block"
    return "row" if q.block[0] == 1 and q.block[1] >= q.data.shape[1] else "other"


def _cublas_pair(a: Fp8Tensor, b: Fp8Tensor) -> bool:
    """Scaling pairs cuBLAS runs: per-tensor x per-tensor (not E5M2 x E5M2), row x row, and the E4M3
    blockwise pairs 1x128 x 128x128 and 1x128 x 1x128. Anything else (custom recipes) is emulated."""
    if a.fmt is None or b.fmt is None:  # a high-precision operand
        return False
    pair = (_kind(a), _kind(b))
    e4m3 = a.data.dtype == b.data.dtype == torch.float8_e4m3fn
    if pair == ("tensor", "tensor"):
        return not (a.data.dtype == b.data.dtype == torch.float8_e5m2)
    return (pair == ("row", "row") and e4m3) or (pair in {("tile", "block"), ("tile", "tile")} and e4m3)


def _scaled_mm(a: Tensor, b: Tensor, scale_a: Tensor, recipe_a, scale_b: Tensor, recipe_b, out_dtype) -> Tensor:
    """`F.scaled_mm`; while compiling, the aten op it calls, directly: Dynamo (torch 2.11) does not trace
    `torch._scaled_mm_v2`, and each GEMM would break the graph."""
    if not torch.compiler.is_compiling():
        return F.scaled_mm(a, b, scale_a, recipe_a, scale_b, recipe_b, output_dtype=out_dtype)
    block = F.ScalingType.BlockWise128x128.value  # ints: Dynamo cannot compare the pybind enums
    if (recipe_b.value == block and b.shape[1] % 128) or (recipe_a.value == block and a.shape[0] % 128):
        # torch 2.11's shape check of the aten op floors a partial 128-block that cuBLAS takes (a dim
        # such as 64): such GEMMs stay an opaque op (no real model has one; test models do)
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


def _fp8_mm(a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype, cublas: bool) -> Tensor:
    """a @ b.T with a [Ra, C] and b [Rb, C] in FP8, FP32 accumulation, output in out_dtype."""
    if not cublas or a.data.shape[0] % 16 or b.data.shape[0] % 16 or not _cublas_pair(a, b):
        # emulated, the same function: an FP32 product even under an ambient autocast (a backward run
        # inside one, or the forward with exact FP32 scales, whose dequantized values BF16 would round)
        with torch.autocast(a.data.device.type, enabled=False):
            return (_dequantize_2d(a) @ _dequantize_2d(b).t()).to(out_dtype)
    ST = F.ScalingType
    # mat_a [Ra, C] row-major; mat_b = b.data.t(): [C, Rb] column-major (strides (1, C)).
    if a.block is None and b.block is None:
        return _scaled_mm(a.data, b.data.t(), a.scale.reshape(1), ST.TensorWise, b.scale.reshape(1),
                          ST.TensorWise, out_dtype)
    if a.block != _TILE:  # row-wise: one scale per row of each operand (CUTLASS kernel: BF16 output)
        out = _scaled_mm(a.data, b.data.t(), a.scale.reshape(-1, 1), ST.RowWise, b.scale.reshape(1, -1),
                         ST.RowWise, torch.bfloat16)
        return out.to(out_dtype)
    if b.block == (128, 128):
        # scale_a (Ra, C/128) strides (1, Ra); scale_b (C/128, Rb/128) strides (1, C/128)
        return _scaled_mm(a.data, b.data.t(), _outer_major(a.scale), ST.BlockWise1x128,
                          b.scale.contiguous().t(), ST.BlockWise128x128, out_dtype)
    # both 1x128: scale_a (Ra, C/128) strides (1, Ra); scale_b (Rb, C/128) strides (1, Rb)
    return _scaled_mm(a.data, b.data.t(), _outer_major(a.scale), ST.BlockWise1x128,
                      _outer_major(b.scale), ST.BlockWise1x128, out_dtype)


# ------------------------------------------------------- the entry points on (data, scale) tensors
# Each runs once per Linear per step on the hot path, compiled or not: the common cuBLAS cases go
# straight to the Triton kernel or `scaled_mm` with no Fp8Tensor bookkeeping (host time is what limits
# small models), everything else takes the general path above.

def _block_kind(block) -> str:
    if block is None:
        return "tensor"
    return {(1, 128): "tile", (128, 128): "block", (1, -1): "row"}.get(tuple(block), "other")


@_eager_cache
def _route(a_key: str, b_key: str) -> str | None:
    """The cuBLAS call an operand pair takes (what `_cublas_pair` allows), or None: emulated."""
    a, b = _parse_key(a_key), _parse_key(b_key)
    if a.fmt is None or b.fmt is None:
        return None
    pair = (_block_kind(a.block), _block_kind(b.block))
    if pair == ("tensor", "tensor"):
        return None if a.fmt is b.fmt is Fp8Format.E5M2 else "tensor"
    if not a.fmt is b.fmt is Fp8Format.E4M3:
        return None
    return {("row", "row"): "row", ("tile", "block"): "tile_block", ("tile", "tile"): "tile_tile"}.get(pair)


def _activation_impl(x: Tensor, rows: str, cols: str, pow2: bool, rows_pad: int, cols_pad: int, make_cols: bool,
                     cublas: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    rc, cc = _parse_key(rows), _parse_key(cols)
    if not (cublas and _kernels is not None and _is_tile(rc) and _is_tile(cc)
            and rows_pad == cols_pad == _CONTRACTION_PAD):
        r, c = _quantize_activation(x, rc, cc, pow2, cublas, (rows_pad, cols_pad), make_cols)
        return pack_pair(r, c, x)
    return _tiles(x if x.stride(1) == 1 else x.contiguous(), rc.fmt, cc.fmt, pow2, rows_pad, make_cols)


def _weight_impl(w: Tensor, key: str, key_t: str, pow2: bool, pad: int, pad_t: int,
                 cublas: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    q, qt = _quantize_weight_cfg(w, _parse_key(key), _parse_key(key_t), pow2, (pad, pad_t), cublas)
    return pack_pair(q, qt, w)


def _mm_impl(a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor, a_key: str, b_key: str,
             out_dtype: torch.dtype, cublas: bool) -> Tensor:
    route = _route(a_key, b_key) if cublas else None
    if route is None or a.shape[0] % 16 or b.shape[0] % 16:
        return _fp8_mm(unpack(a, a_scale, a_key), unpack(b, b_scale, b_key), out_dtype, cublas)
    ST = F.ScalingType
    a, b = a.contiguous(), b.contiguous()
    # mat_a a [Ra, C] row-major; mat_b b.t() [C, Rb] column-major (strides (1, C))
    if route == "tile_block":
        # scale_a [C/128, Ra].t(): (Ra, C/128) strides (1, Ra); scale_b [Rb/128, C/128].t(): strides (1, C/128)
        return _scaled_mm(a, b.t(), a_scale.contiguous().t(), ST.BlockWise1x128, b_scale.contiguous().t(),
                          ST.BlockWise128x128, out_dtype)
    if route == "tile_tile":
        # scale_a (Ra, C/128) strides (1, Ra); scale_b (Rb, C/128) strides (1, Rb)
        return _scaled_mm(a, b.t(), a_scale.contiguous().t(), ST.BlockWise1x128, b_scale.contiguous().t(),
                          ST.BlockWise1x128, out_dtype)
    if route == "tensor":
        return _scaled_mm(a, b.t(), a_scale.reshape(1), ST.TensorWise, b_scale.reshape(1), ST.TensorWise,
                          out_dtype)
    # row-wise: one scale per row of each operand (CUTLASS kernel: BF16 output)
    out = _scaled_mm(a, b.t(), a_scale.reshape(-1, 1), ST.RowWise, b_scale.reshape(1, -1), ST.RowWise,
                     torch.bfloat16)
    return out.to(out_dtype)


def _forward_impl(xr: Tensor, xr_s: Tensor, w: Tensor, x_key: str, w_key: str, wt_key: str, pow2: bool, pad: int,
                  pad_t: int, out_dtype: torch.dtype, cublas: bool) -> tuple[Tensor, Tensor, Tensor]:
    """`output` GEMM with the weight quantized here: y, and W.T's operand (data, scale) for grad_input."""
    wq, wq_s, wt, wt_s = _weight_impl(w, w_key, wt_key, pow2, pad, pad_t, cublas)
    return _mm_impl(xr, xr_s, wq, wq_s, x_key, w_key, out_dtype, cublas), wt, wt_s


def _backward_impl(dy: Tensor, wt: Tensor, wt_s: Tensor, xc: Tensor, xc_s: Tensor, g_key: str, gt_key: str,
                   wt_key: str, xt_key: str, pow2: bool, pad_gi: int, pad_gw: int, want_dx: bool, want_dw: bool,
                   x_dtype: torch.dtype, cublas: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """grad_output quantized (rows, and cols when dW is wanted), then grad_input and grad_weight (FP32):
    dx, dw (empty when not wanted) and grad_output's rows operand (data, scale)."""
    g, g_s, gt, gt_s = _activation_impl(dy, g_key, gt_key, pow2, pad_gi, pad_gw, want_dw, cublas)
    # grad_input: dx [M, K] = dy [M, Np] @ W.T [K, Np].T
    dx = _mm_impl(g, g_s, wt, wt_s, g_key, wt_key, x_dtype, cublas) if want_dx else dy.new_empty(0, dtype=x_dtype)
    # grad_weight: dW [N, K] = dy.T [N, Mp] @ x.T [K, Mp].T
    dw = (_mm_impl(gt, gt_s, xc, xc_s, gt_key, xt_key, torch.float32, cublas) if want_dw
          else dy.new_empty(0, dtype=torch.float32))
    return dx, dw, g, g_s


# ------------------------------------------------------------------------------ the custom ops
# Fake implementations run the reference path on fake tensors (cublas=False): the same shapes, dtypes and
# (packed, contiguous) strides as the real outputs by construction.

@torch.library.custom_op("fp8train::quantize_activation", mutates_args=())
def _activation_op(x: Tensor, rows: str, cols: str, pow2: bool, rows_pad: int, cols_pad: int, make_cols: bool,
                   cublas: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _activation_impl(x, rows, cols, pow2, rows_pad, cols_pad, make_cols, cublas)


@_activation_op.register_fake
def _(x, rows, cols, pow2, rows_pad, cols_pad, make_cols, cublas):
    return _activation_impl(x, rows, cols, pow2, rows_pad, cols_pad, make_cols, False)


@torch.library.custom_op("fp8train::quantize_weight", mutates_args=())
def _weight_op(w: Tensor, key: str, key_t: str, pow2: bool, pad: int, pad_t: int,
               cublas: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _weight_impl(w, key, key_t, pow2, pad, pad_t, cublas)


@_weight_op.register_fake
def _(w, key, key_t, pow2, pad, pad_t, cublas):
    return _weight_impl(w, key, key_t, pow2, pad, pad_t, False)


@torch.library.custom_op("fp8train::fp8_mm", mutates_args=())
def _mm_op(a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor, a_key: str, b_key: str, out_dtype: torch.dtype,
           cublas: bool) -> Tensor:
    return _mm_impl(a, a_scale, b, b_scale, a_key, b_key, out_dtype, cublas)


@_mm_op.register_fake
def _(a, a_scale, b, b_scale, a_key, b_key, out_dtype, cublas):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


@torch.library.custom_op("fp8train::linear_forward", mutates_args=())
def _forward_op(xr: Tensor, xr_s: Tensor, w: Tensor, x_key: str, w_key: str, wt_key: str, pow2: bool, pad: int,
                pad_t: int, out_dtype: torch.dtype, cublas: bool) -> tuple[Tensor, Tensor, Tensor]:
    return _forward_impl(xr, xr_s, w, x_key, w_key, wt_key, pow2, pad, pad_t, out_dtype, cublas)


@_forward_op.register_fake
def _(xr, xr_s, w, x_key, w_key, wt_key, pow2, pad, pad_t, out_dtype, cublas):
    _, _, wt, wt_s = _weight_impl(w, w_key, wt_key, pow2, pad, pad_t, False)
    return xr.new_empty((xr.shape[0], w.shape[0]), dtype=out_dtype), wt, wt_s


@torch.library.custom_op("fp8train::linear_backward", mutates_args=())
def _backward_op(dy: Tensor, wt: Tensor, wt_s: Tensor, xc: Tensor, xc_s: Tensor, g_key: str, gt_key: str,
                 wt_key: str, xt_key: str, pow2: bool, pad_gi: int, pad_gw: int, want_dx: bool, want_dw: bool,
                 x_dtype: torch.dtype, cublas: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _backward_impl(dy, wt, wt_s, xc, xc_s, g_key, gt_key, wt_key, xt_key, pow2, pad_gi, pad_gw, want_dx,
                          want_dw, x_dtype, cublas)


@_backward_op.register_fake
def _(dy, wt, wt_s, xc, xc_s, g_key, gt_key, wt_key, xt_key, pow2, pad_gi, pad_gw, want_dx, want_dw, x_dtype, cublas):
    g, g_s, _, _ = _activation_impl(dy, g_key, gt_key, pow2, pad_gi, pad_gw, False, False)
    dx = dy.new_empty((dy.shape[0], wt.shape[0]) if want_dx else (0,), dtype=x_dtype)
    dw = dy.new_empty((dy.shape[1], xc.shape[0]) if want_dw else (0,), dtype=torch.float32)
    return dx, dw, g, g_s


# ------------------------------------------------------------------------------- what FP8Linear calls
# Eagerly: the impl, no dispatcher. Compiling on CUDA (cublas, the last argument): the impl too, traced, so
# its Triton kernels (triton_ops) and cuBLAS GEMMs are nodes of the graph and inductor launches them from its
# own code, with no Python op call per Linear at run time. Compiling anywhere else: the opaque op, whose
# reference arithmetic the compiler must not rewrite (eager and compiled agree bit for bit).

def _pick(op, impl, cublas: bool):
    return op if torch.compiler.is_compiling() and not cublas else impl


def quantize_activation(*args) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(x, rows_key, cols_key, pow2, rows_pad, cols_pad, make_cols, cublas) -> rows data, scale, cols data, scale."""
    return _pick(_activation_op, _activation_impl, args[-1])(*args)


def quantize_weight(*args) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(w, key, key_t, pow2, pad, pad_t, cublas) -> W data, scale, W.T data, scale."""
    return _pick(_weight_op, _weight_impl, args[-1])(*args)


def fp8_mm(*args) -> Tensor:
    """(a, a_scale, b, b_scale, a_key, b_key, out_dtype, cublas) -> a @ b.T."""
    return _pick(_mm_op, _mm_impl, args[-1])(*args)


def linear_forward(*args) -> tuple[Tensor, Tensor, Tensor]:
    """(x rows data, scale, w, x_key, w_key, wt_key, pow2, pad, pad_t, out_dtype, cublas) -> y, W.T data, scale."""
    return _pick(_forward_op, _forward_impl, args[-1])(*args)


def linear_backward(*args) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dy, W.T data, scale, x.T data, scale, keys g, g_t, w_t, x_t, pow2, pad_gi, pad_gw, want_dx, want_dw,
    x_dtype, cublas) -> dx, dW (FP32), grad_output rows data, scale."""
    return _pick(_backward_op, _backward_impl, args[-1])(*args)
