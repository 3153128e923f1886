"""The one GEMM of fp8train: `gemm(a, b)` = a @ b.T with FP32 accumulation, both operands row-major with the
contraction last (the operand layout of operands.py), routed by the one route table: a cuBLAS `scaled_mm`
scaling pair on SM90 (or DeepGEMM's 1x128 x 128x128 kernel with the recipe's `deep_gemm`), else emulated
(dequantize + FP32 matmul: the same function on every device).

Each call states the layout it hands the library: cuBLAS takes mat_b column-major, so b [Rb, C] goes in as
b.t() (strides (1, C)), and the scales in the shapes and strides its scaling type reads. The trap: cuBLAS's
blockwise kernels need the contraction in whole groups of four 128-blocks; operands.py pads it to 512.
"""

from __future__ import annotations

import enum
import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from .operands import OperandSpec, dequantize_operand
from .recipe import BLOCK, ROW, TILE, Fp8Format

__all__ = ["Route", "gemm_route", "gemm", "load_deep_gemm"]


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
    """The `deep_gemm` module with its device state made, or a ValueError naming the recipe key and the install.

    DeepGEMM makes its device state on first use, a cuBLASLt workspace tensor kept for the life of the process.
    Made in a CUDA graph's warm-up (the first GEMM of a layer compiled with CUDA graphs), that tensor lives in the
    graph's memory pool, which cudagraph trees refuse ("tensor(s) in the cudagraph pool not tracked as outputs");
    so it is made here, where the trainer and convert_to_fp8 call this, before any graph."""
    try:
        import deep_gemm
    except ImportError as e:
        raise ValueError(f"config key 'deep_gemm' is true but DeepGEMM does not import ({e}); build it with "
                         "benchmarks/build_deep_gemm.sh (docs/benchmarks.md 0a), or set deep_gemm: false") from None
    if torch.cuda.is_available():
        deep_gemm.get_num_sms()  # (its device state: the workspace, on the current device)
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
