"""Block-scaled FP8 quantization: the plain PyTorch reference every other path is checked against.

Convention, used everywhere in fp8train: `scale` is the dequantize multiplier,

    x ~ data.float() * scale        (per block),        scale = amax(block) / fmt.max

computed just in time from the tensor itself, rounded up to a power of two by default (so dividing by
it is exact in binary). Quantizing multiplies each element by the block's correctly rounded FP32
reciprocal RN(1 / scale), made once per block, not one division per element (the GPU kernels do the same:
there a division is a slow instruction sequence). For a power-of-two scale that is exactly x / scale, and
the scale and its reciprocal come from bit patterns, no division at all (so a compiler fusing this code
cannot change them); for an exact scale, one IEEE division per block, and the product differs from
RN(x / scale) only where the two straddle an FP8 rounding boundary (rare): CPU and GPU agree bit for bit
since both make the same IEEE multiply.

An all-zero block gets scale 1. A block that holds NaN or +-Inf gets a non-finite scale and dequantizes
to NaN everywhere: non-finite values are never clipped into finite ones, so a diverging run shows NaN
rather than silently wrong numbers.

Blocks are (rows, cols) over the input viewed as 2-D rows: an N-D tensor is flattened to
[prod(shape[:-1]), shape[-1]], a 1-D tensor is one row. A block dimension of -1 spans the whole
dimension, `block=None` means one scale for the tensor. The last block in each dimension may be
ragged (the shape need not be a multiple of the block).

Public: `quantize`, `dequantize`, `Fp8Tensor`. For the rest of fp8train.fp8 (kernels.py is checked against
these bit for bit): `compute_scale`, `quantize_2d` (a 2-D tensor and a resolved block, no checks),
`reciprocal`, `resolve_block`, `expand_scale`, `round_up`, `FP32_TINY`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

from .recipe import Block, Fp8Format

__all__ = ["Fp8Tensor", "quantize", "dequantize"]

FP32_TINY = torch.finfo(torch.float32).tiny


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
_ALLOWED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass
class Fp8Tensor:
    """An FP8 tensor with one FP32 scale per block: x ~ data * scale."""

    data: torch.Tensor   # float8, same shape as the source
    scale: torch.Tensor  # float32, [ceil(rows / br), ceil(cols / bc)]; 0-D for per-tensor
    block: Block
    fmt: Fp8Format

    def dequantize(self) -> torch.Tensor:
        return dequantize(self)


def _rows(x: torch.Tensor) -> torch.Tensor:
    if x.dim() == 0:
        raise ValueError("quantize: expected a tensor with at least 1 dimension, got a scalar")
    return x.reshape(1, -1) if x.dim() == 1 else x.reshape(-1, x.shape[-1])


def resolve_block(block: Block, shape: tuple[int, int]) -> tuple[int, int] | None:
    if block is None:
        return None
    if len(block) != 2:
        raise ValueError(f"quantize: block must be (rows, cols) or None, got {block!r}")
    br, bc = (shape[i] if b == -1 else b for i, b in enumerate(block))
    if not (isinstance(br, (int, torch.SymInt)) and isinstance(bc, (int, torch.SymInt))) or br < 1 or bc < 1:
        raise ValueError(f"quantize: block sizes must be positive integers or -1, got {block!r}")
    return max(br, 1), max(bc, 1)


def compute_scale(amax: torch.Tensor, fmt: Fp8Format, pow2_scale: bool) -> torch.Tensor:
    """FP32 dequantize scale from a block amax: amax / fmt.max, 1 where amax == 0, at least FP32's smallest
    normal, optionally rounded up to the next power of two (`_pow2_scale`). NaN and Inf pass through."""
    amax = amax.float()
    if pow2_scale:
        return _pow2_scale(amax, fmt)
    # divide by a tensor, not a Python scalar: CUDA turns scalar division into a reciprocal multiply,
    # which can differ from the CPU's IEEE division in the last bit
    s = amax / torch.full_like(amax, fmt.max)
    return torch.where(amax == 0, torch.ones_like(s), s).clamp_min(FP32_TINY)


# each format's max as an FP32 bit pattern (made once here: a traced function reads a constant)
_MAX_BITS = {f: struct.unpack("<i", struct.pack("<f", f.max))[0] for f in Fp8Format}


def _pow2_scale(amax: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """RN(amax / fmt.max) rounded up to a power of two, from bit patterns: with amax = ma * 2^ea and
    fmt.max = mf * 2^ef (mantissas in [1, 2)) the quotient lies in (2^(ea-ef-1), 2^(ea-ef)] when ma <= mf and in
    (2^(ea-ef), 2^(ea-ef+1)) when ma > mf, so the scale is 2^(ea - ef + (ma > mf)), at least 2^-126; 1 for
    amax 0. Integer arithmetic only, so a compiler cannot change it (inductor's Triton code divides
    approximately), and the kernels' `scale_from_amax_bits` computes the same; equal to the IEEE division
    rounded up for every FP32 amax (tests/test_quant.py)."""
    f = _MAX_BITS[fmt]
    bits = amax.view(torch.int32)
    bump = ((bits & 0x7FFFFF) > (f & 0x7FFFFF)).to(torch.int32)
    e = ((bits >> 23) - ((f >> 23) - 127) + bump).clamp_min(1)  # the scale's biased exponent
    s = torch.where(amax == 0, 1.0, (e << 23).view(torch.float32))
    return torch.where(torch.isfinite(amax), s, amax)


def _check_input(x: torch.Tensor, where: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{where}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _ALLOWED_DTYPES:
        raise ValueError(f"{where}: expected a floating-point tensor (fp32/bf16/fp16/fp64), got {x.dtype}")


def quantize(
    x: torch.Tensor,
    block: Block = (1, 128),
    fmt: Fp8Format | str = "e4m3",
    pow2_scale: bool = True,
) -> Fp8Tensor:
    """Quantize `x` to FP8 with one scale per `block` (reference implementation, any device).

    Returns an `Fp8Tensor` whose `.data` has x's shape and whose `.scale` has one FP32 value per block.
    """
    _check_input(x, "quantize")
    fmt = Fp8Format.parse(fmt)
    x2 = _rows(x)
    data, scale = quantize_2d(x2, resolve_block(block, tuple(x2.shape)), fmt, pow2_scale)
    return Fp8Tensor(data.reshape(x.shape), scale, block, fmt)


def reciprocal(scale: torch.Tensor, pow2_scale: bool) -> torch.Tensor:
    """The quantize multiplier of each block, RN(1 / scale): for a power-of-two scale 2^e the exact 2^-e by
    exponent arithmetic (no division for a compiler to approximate); 0 for an Inf scale (finite values -> 0,
    Inf -> NaN, as x / Inf), NaN for NaN."""
    if pow2_scale:
        inv = ((254 << 23) - scale.view(torch.int32)).view(torch.float32)
        return torch.where(torch.isinf(scale), 0.0, torch.where(torch.isnan(scale), scale, inv))
    # a tensor divided by a tensor, IEEE on CPU and CUDA alike (a Python-scalar numerator would let CUDA use
    # an approximate reciprocal)
    return torch.ones_like(scale) / scale


def quantize_2d(x: torch.Tensor, block, fmt: Fp8Format, pow2_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float()
    if block is None:
        scale = compute_scale(xf.abs().amax(), fmt, pow2_scale)
        return (xf * reciprocal(scale, pow2_scale)).clamp(-fmt.max, fmt.max).to(fmt.dtype).contiguous(), scale
    R, C = xf.shape
    br, bc = block
    nr, nc = -(-R // br), -(-C // bc)
    padded = torch.nn.functional.pad(xf, (0, nc * bc - C, 0, nr * br - R))  # zeros leave amax alone
    blocks = padded.view(nr, br, nc, bc)
    amax = blocks.abs().amax(dim=(1, 3))
    if R == 0 or C == 0:
        amax = torch.zeros(nr, nc, device=x.device)
    scale = compute_scale(amax, fmt, pow2_scale)
    q = (blocks * reciprocal(scale, pow2_scale)[:, None, :, None]).clamp(-fmt.max, fmt.max).to(fmt.dtype)
    q = q.view(nr * br, nc * bc)
    return (q if q.shape == (R, C) else q[:R, :C]).contiguous(), scale  # row-major whatever x's layout


def expand_scale(scale: torch.Tensor, block, shape: tuple[int, int]) -> torch.Tensor:
    """Per-element view of per-block scales for a 2-D tensor of `shape` (block already resolved)."""
    if block is None:
        return scale.expand(shape)
    br, bc = block
    return scale.repeat_interleave(br, 0).repeat_interleave(bc, 1)[: shape[0], : shape[1]]


def dequantize(q: Fp8Tensor) -> torch.Tensor:
    """FP32 values of `q`: data * scale, block by block."""
    d2 = _rows(q.data).float()
    block = resolve_block(q.block, tuple(d2.shape))
    return (d2 * expand_scale(q.scale, block, tuple(d2.shape))).reshape(q.data.shape)
