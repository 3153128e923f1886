"""A GEMM operand at the op boundary: its spec (format, block, contraction padding), a Linear's plan of six
operands, and the operand layout's quantization, padding and dequantization (the reference of quant.py).

At the op boundary an operand is a (data, scale) pair of contiguous tensors described by an `OperandSpec`,
which travels as a string ("e4m3:1x128:512"); a whole `LinearPlan` as one string. Layouts: data [rows, Cp],
zero-padded along the contraction to a multiple of `spec.pad`; scale [Cp/128, rows] for 1x128 tiles (the
transpose of per-row-per-tile scales: the "outer-dim major" layout cuBLAS reads and the Triton kernel
writes), [ceil(rows/br), ceil(Cp/bc)] for other blocks (padding blocks have scale 1), [rows, 1] per row, 0-d
per tensor; a high-precision operand (fmt None) is its BF16 value with scale 1. `scale` is the dequantize
multiplier throughout: x ~ data * scale.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .quant import expand_scale, quantize_2d, resolve_block
from .recipe import TILE, Block, Fp8Format, Fp8Recipe, GemmConfig

__all__ = ["OperandSpec", "LinearPlan", "contraction_pad", "pad_operand", "quantize_operand", "dequantize_operand"]

# cuBLAS blockwise GEMMs need the number of 128-blocks along the contraction to be a multiple of 4
# (K=8960 -> 70 blocks is refused or silently wrong): contractions are padded to 512 with zero data, scale 1.
_BLOCKWISE_PAD = 512


def _eager_cache(fn):
    """`fn` memoized on the eager hot path; while compiling, `fn` itself (the compiler runs it once at trace
    time, and warns on an lru_cache)."""
    cached = functools.lru_cache(maxsize=None)(fn)

    @functools.wraps(fn)
    def call(arg):
        return fn(arg) if torch.compiler.is_compiling() else cached(arg)
    return call


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

    @property
    def blockwise_padded(self) -> bool:
        """Padded for cuBLAS's blockwise kernels (what the Triton quantization kernels write)."""
        return self.pad == _BLOCKWISE_PAD


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
    fuse_rows: bool = False  # compiled, a rows-only activation quantization traced for inductor to fuse (cublas)

    @classmethod
    def of(cls, recipe: Fp8Recipe, cublas: bool) -> "LinearPlan":
        r = recipe
        pads = {name: contraction_pad(getattr(r, name), cublas) for name in ("output", "grad_input", "grad_weight")}
        spec = lambda cfg, gemm: OperandSpec(cfg.fmt, cfg.block, pads[gemm])  # noqa: E731
        return cls(spec(r.output.a, "output"), spec(r.output.b, "output"), spec(r.grad_input.a, "grad_input"),
                   spec(r.grad_input.b, "grad_input"), spec(r.grad_weight.a, "grad_weight"),
                   spec(r.grad_weight.b, "grad_weight"), r.pow2_scale, cublas, r.wgrad_input_from_fp8,
                   r.deep_gemm and cublas, r.fuse_row_quantization and cublas)

    @classmethod
    def per_route(cls, recipe: Fp8Recipe) -> dict[bool, "LinearPlan"]:
        """The recipe's plans for the emulated (False) and the cuBLAS (True) route."""
        return {c: cls.of(recipe, c) for c in (False, True)}

    @property
    def key(self) -> str:
        specs = ",".join(getattr(self, f).key for f in _PLAN_FIELDS)
        flags = (self.pow2, self.cublas, self.x_t_from_fp8, self.deep_gemm, self.fuse_rows)
        return f"{specs};{''.join(str(int(f)) for f in flags)}"

    @staticmethod
    def parse(key: str) -> "LinearPlan":
        return _parse_plan(key)


@_eager_cache
def _parse_plan(key: str) -> LinearPlan:
    specs, flags = key.split(";")
    return LinearPlan(*(OperandSpec.parse(k) for k in specs.split(",")), *(f == "1" for f in flags))


# ------------------------------------------------------------------------------ the operand layout

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


