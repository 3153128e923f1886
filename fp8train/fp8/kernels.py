"""Fused Triton quantization kernels for the CUDA path (bit-identical to `fp8train.fp8.quant`'s reference).

`quantize_tiles_and_transpose` reads each 128x128 tile of an activation (input or grad_output) once and
writes both FP8 copies the hybrid recipe needs:
    rows  [M, Kp]  1x128 tiles along the features  (operand a of output / grad_input)
    cols  [K, Mp]  1x128 tiles along the tokens     (operand of grad_weight), quantized from the same
                   high-precision tile, never from the row copy (no double quantization); or, with
                   `col_blocks` (the recipe's `wgrad_blocks`), 128x128 blocks: one scale for the tile.
`quantize_blocks` quantizes a weight in 128x128 blocks, as W (operand b of output) or as W.T (operand b
of grad_input: the same blocks transposed, with the same scales). The activation kernel's producers make
the tile it quantizes from other tensors instead of reading it (`quantize_swiglu`: h = silu(g) * u, the
down projection's input; `quantize_swiglu_grads`: the gate and up projections' grad_outputs), so that
activation is never written in BF16 and read again (fp8train.fp8.swiglu).

Scales are written straight into the layouts cuBLAS wants: 1x128 scales "outer-dim major" ([blocks, rows]
in memory, handed over as the (rows, blocks) transpose view); 128x128 scales row-major [Nb, Kb].
Padded regions (Kp, Mp: contraction lengths rounded up for cuBLAS) hold zeros with scale 1.

Why the kernels are cheap per element (they must stream at memory speed, ~4 TB/s on an H200):
- amax and "holds a NaN" come from one integer max over the bit patterns of |x|: those order like the
  magnitudes, and every NaN pattern lies above +Inf's;
- a power-of-two scale comes from amax's bit patterns too (exponent and a mantissa comparison), not from
  the IEEE division amax / fmt.max that it equals (`scale_from_amax_bits`);
- quantizing multiplies by the block's reciprocal, made once per block on the scales, rather than
  dividing each element (an IEEE division is a multi-instruction sequence on the GPU: too slow per
  element). With power-of-two scales (the default) the reciprocal is the exact 2^-e (exponent
  arithmetic), so x * 2^-e is exactly x / 2^e, and |x * 2^-e| <= fmt.max needs no clamp (the scale is at
  least amax / fmt.max: a quotient that rounds down onto a power of two is not an FP32 amax / 448 or
  / 57344). Exact FP32 scales multiply by the correctly rounded reciprocal RN(1 / s) (one `div_rn` per
  block), as the reference does (`quant.reciprocal`; its clamp changes nothing, see `scaled`):
  x * RN(1 / s) differs from RN(x / s) only where the two straddle an FP8 rounding boundary, which is rare,
  and CPU and GPU stay bit-identical because both make the same IEEE multiply;
- a BF16 tile stays BF16 in registers (amax on its 16-bit patterns) and is widened only for the multiply:
  half the registers, so two programs fit on an SM and one's loads overlap the other's arithmetic.

Pointers stay in the kernels' own bodies: a pointer passed into a `@triton.jit` helper makes torch 2.11's
mutation analysis (which decides what inductor copies before a user kernel) list that input as written,
and inductor then copies every input before every launch (seen on the H200, 2026-12-04).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .quant import FP32_TINY, round_up
from .recipe import Fp8Format

__all__ = ["abs_bits", "amax_bits", "inverse", "ops_layout", "quantize_blocks", "quantize_blocks_op", "quantize_swiglu",
           "quantize_swiglu_grads", "quantize_swiglu_grads_op", "quantize_swiglu_op", "quantize_tiles_and_transpose",
           "quantize_tiles_op", "rows_grad_weight", "rows_grad_weight_op", "scale_from_amax_bits", "scaled"]

_SIDE = 128  # elements along each side of a scaling tile or block
_NUM_WARPS = 8
_INTERPRETER_SMS = 132  # the interpreter's stand-in for the SM count (an H100's, an H200's), so CPU checks slice alike
_FP32_TINY = tl.constexpr(FP32_TINY)
_INF_BITS = tl.constexpr(0x7F800000)


@triton.jit
def abs_bits(x, BF16: tl.constexpr):
    """|x| as integer bit patterns, in x's own width (a BF16 tile stays 16-bit: half the registers)."""
    if BF16:
        bits = (x.to(tl.int16, bitcast=True) & 0x7FFF).to(tl.int16)
    else:
        bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    return bits


@triton.jit
def amax_bits(ax, axis: tl.constexpr, BF16: tl.constexpr):
    """Max of `abs_bits` along `axis`, as FP32 bit patterns (BF16 -> FP32 is a 16-bit shift, exact)."""
    m = tl.max(ax, axis=axis).to(tl.int32)  # (a reduction may widen int16 itself)
    if BF16:
        m = m << 16
    return m


@triton.jit
def scale_from_amax_bits(amax_bits, FMT_MAX: tl.constexpr, POW2: tl.constexpr, DIVISION: tl.constexpr = False):
    """amax as |x| bit patterns -> FP32 dequantize scale, as `quant.compute_scale` (NaN for a NaN block).

    A power-of-two scale comes from the bit patterns alone: with amax = ma * 2^ea and fmt.max = mf * 2^ef
    (mantissas in [1, 2)), RN(amax / fmt.max) lies in (2^(ea-ef-1), 2^(ea-ef)] when ma <= mf and in
    (2^(ea-ef), 2^(ea-ef+1)) when ma > mf (a quotient above 2^k is at least 2^k (1 + 2^-23 / mf), which never
    rounds back onto 2^k), so rounding it up to a power of two gives 2^(ea - ef + (ma > mf)), clamped below to
    FP32's smallest normal as the reference clamps. Equal to the division for every FP32 amax (checked
    exhaustively, docs/benchmarks.md section 1) in a few integer instructions, where an IEEE division is an
    instruction sequence with a slow-path call, made on every thread that holds the scale. `DIVISION` divides
    as the reference does (exact scales always do); see the SwiGLU gradient launch for why one launch keeps it."""
    amax = amax_bits.to(tl.float32, bitcast=True)
    if POW2 and not DIVISION:
        # fmt.max's FP32 bit pattern, a literal per format (no helper call: inductor copies a user kernel's
        # source and its @triton.jit dependencies into its generated code)
        tl.static_assert((FMT_MAX == 448.0) or (FMT_MAX == 57344.0), "an FP8 format's max: E4M3's or E5M2's")
        FMT_BITS: tl.constexpr = 0x43E00000 if FMT_MAX == 448.0 else 0x47600000
        bump = ((amax_bits & 0x7FFFFF) > (FMT_BITS & 0x7FFFFF)).to(tl.int32)  # ma > mf
        e = (amax_bits >> 23) - ((FMT_BITS >> 23) - 127) + bump  # biased exponent of the scale
        s = tl.where(amax_bits == 0, 1.0, (tl.maximum(e, 1) << 23).to(tl.float32, bitcast=True))
    else:
        s = tl.div_rn(amax, FMT_MAX)  # IEEE division, as torch's amax / fmt.max
        s = tl.maximum(tl.where(amax_bits == 0, 1.0, s), _FP32_TINY)
        if POW2:  # keep the exponent, bump it when any mantissa bit is set
            bits = s.to(tl.int32, bitcast=True)
            s = ((bits & 0x7F800000) + tl.where((bits & 0x7FFFFF) != 0, 1 << 23, 0)).to(tl.float32, bitcast=True)
    return tl.where(amax_bits >= _INF_BITS, amax, s)  # Inf stays Inf; NaN is that NaN itself


@triton.jit
def inverse(s, POW2: tl.constexpr):
    """Per-block multiplier for `scaled`, made on the 1-D scales: 2^-e for a power-of-two scale 2^e
    (exponent arithmetic, exact: e stays within [-126, 127]), 0 for Inf, NaN for NaN; for exact scales the
    correctly rounded RN(1 / s), as `quant.reciprocal` (IEEE division: 1/Inf = 0, 1/NaN = NaN)."""
    if POW2:
        bits = s.to(tl.int32, bitcast=True)
        inv = ((254 << 23) - bits).to(tl.float32, bitcast=True)
        inv = tl.where(bits == _INF_BITS, 0.0, inv)
        return tl.where(s != s, s, inv)
    return tl.div_rn(1.0, s)  # one IEEE division per scale (plain `/` is approximate)


@triton.jit
def scaled(x, inv):
    """x * inv (`inverse` of the scale) in FP32: the value the store converts to the output's dtype. Inf
    scale -> inv 0 (finite elements -> 0, Inf/NaN elements -> NaN), NaN -> NaN. No clamp: with a power-of-two
    scale x * 2^-e is exactly x / 2^e, within +-fmt.max; with an exact one s = RN(amax / fmt.max) (at least
    FP32_TINY, so RN(1 / s) is finite) puts |x * RN(1 / s)| within fmt.max * (1 + 2^-22), which the store's
    conversion rounds to +-fmt.max exactly as the reference's clamp-then-cast does."""
    return x.to(tl.float32) * inv


@triton.jit
def _bf16(x):
    """Rounded to BF16 and widened back: where autograd's BF16 ops round."""
    return x.to(tl.bfloat16).to(tl.float32)


@triton.jit
def _swiglu(g, u):
    """h = silu(g) * u rounded as the BF16 forward rounds: bf16(bf16(g * sigmoid(g)) * u). SiLU as inductor
    computes it (Triton's sigmoid: the GPU's fast exp and division), not bit for bit torch's eager kernel:
    the FP8 bytes differ from those of eager's h in at most 1e-4 of the values (tests/test_gpu.py)."""
    g = g.to(tl.float32)
    return (_bf16(g * tl.sigmoid(g)) * u.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def _swiglu_grad_gate(dsilu, g):
    """dg = silu_backward(dsilu, g) in torch's order, dsilu * sig * (1 + g * (1 - sig)); dsilu = bf16(dh * u)."""
    g = g.to(tl.float32)
    sig = tl.sigmoid(g)
    return (dsilu.to(tl.float32) * sig * (1.0 + g * (1.0 - sig))).to(tl.bfloat16)


@triton.jit
def _swiglu_grad_up(dh, g):
    """du = bf16(dh * bf16(silu(g)))."""
    g = g.to(tl.float32)
    return (dh.to(tl.float32) * _bf16(g * tl.sigmoid(g))).to(tl.bfloat16)


@triton.jit
def _act_kernel(
    x_ptr, M, K, stride_xm,
    qr_ptr, sr_ptr, Kp,        # rows copy [M, Kp], scales [Kp/128, M]
    qc_ptr, sc_ptr, Mp,        # cols copy [K, Mp], scales [Mp/128, K] (COL_BLOCKS: [ceil(K/128), Mp/128])
    y_ptr, z_ptr,              # the producer's other inputs (x's shape and strides)
    ROW_MAX: tl.constexpr, COL_MAX: tl.constexpr,  # the copies' dtypes are their pointers'
    POW2: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr, BF16: tl.constexpr, BLOCK: tl.constexpr,
    PRODUCER: tl.constexpr, COL_BLOCKS: tl.constexpr,
):
    """Quantizes a tile of x itself (PRODUCER 0), of h = silu(g) * u (1: the down projection's input, made
    here from the gate and up outputs, never written in BF16), of the SwiGLU's input gradient dg (2: from dh,
    g, u) or du (3: from dh, g), into the rows copy (ROWS), the cols copy (COLS) or both; COL_BLOCKS: the cols
    copy has one scale for the whole 128x128 tile (a block of x.T, as a weight's) instead of one per feature.
    (dg and du in one launch, reading dh and g once, measured slower: the two tiles need twice the registers.)"""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = pid_m * BLOCK + tl.arange(0, BLOCK)
    offs_k = pid_k * BLOCK + tl.arange(0, BLOCK)
    in_m = offs_m < M
    in_k = offs_k < K
    offs = offs_m[:, None] * stride_xm + offs_k[None, :]
    mask = in_m[:, None] & in_k[None, :]
    # loads stay in this body (see the module docstring on pointers); BF16 stays BF16 until the multiply
    if PRODUCER == 3:  # du: g first (see below)
        g_tile = tl.load(y_ptr + offs, mask=mask, other=0.0)
    else:
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if PRODUCER == 1:  # x is g, y is u
        x = _swiglu(x, tl.load(y_ptr + offs, mask=mask, other=0.0))
    if PRODUCER == 2:  # x is dh, y is g, z is u: dh * u first, so that dh and u die before g's tile is read
        x = (x.to(tl.float32) * tl.load(z_ptr + offs, mask=mask, other=0.0).to(tl.float32)).to(tl.bfloat16)
        x = _swiglu_grad_gate(x, tl.load(y_ptr + offs, mask=mask, other=0.0))
    if PRODUCER == 3:  # x is dh, y is g, read first so that it dies first (119 registers, not 152)
        x = _swiglu_grad_up(tl.load(x_ptr + offs, mask=mask, other=0.0), g_tile)
    if not BF16:
        x = x.to(tl.float32)
    # both amaxes first, so that the |x| bit patterns die before the quantized copies are made
    ax = abs_bits(x, BF16)
    if ROWS:
        amax_r = amax_bits(ax, 1, BF16)  # one per (token, 128 features)
    if COLS:
        if COL_BLOCKS:  # one for the tile (128 tokens, 128 features): the max of the rows' (no column reduction)
            if ROWS:
                amax_c = tl.max(amax_r, axis=0)
            else:
                amax_c = tl.max(amax_bits(ax, 1, BF16), axis=0)
        else:
            amax_c = amax_bits(ax, 0, BF16)  # one per (feature, 128 tokens)
    if ROWS:
        s_r = scale_from_amax_bits(amax_r, ROW_MAX, POW2)
        q_r = scaled(x, inverse(s_r, POW2)[:, None])
        tl.store(qr_ptr + offs_m[:, None] * Kp + offs_k[None, :], q_r.to(qr_ptr.dtype.element_ty),
                 mask=in_m[:, None] & (offs_k < Kp)[None, :])
        tl.store(sr_ptr + pid_k * M + offs_m, s_r, mask=in_m & (pid_k * BLOCK < Kp))

    if COLS:  # the cols copy is stored transposed, [K, Mp]
        # dg's cols scales divide, as the reference does (the same numbers): with the division's slow-path call
        # in the code ptxas keeps that launch within 128 registers, without it takes 151 (one program per SM)
        s_c = scale_from_amax_bits(amax_c, COL_MAX, POW2, PRODUCER == 2)
        if COL_BLOCKS:  # one scale, stored at the block's place in the row-major [ceil(K/128), Mp/128]
            q_c = scaled(x, inverse(s_c, POW2))
            if (pid_m * BLOCK < Mp) & (pid_k * BLOCK < K):
                tl.store(sc_ptr + pid_k * (Mp // BLOCK) + pid_m, s_c)
        else:
            q_c = scaled(x, inverse(s_c, POW2)[None, :])
            tl.store(sc_ptr + pid_m * K + offs_k, s_c, mask=in_k & (pid_m * BLOCK < Mp))
        tl.store(qc_ptr + offs_k[:, None] * Mp + offs_m[None, :], tl.trans(q_c.to(qc_ptr.dtype.element_ty)),
                 mask=in_k[:, None] & (offs_m < Mp)[None, :])


@triton.jit
def _weight_kernel(
    w_ptr, N, K, stride_wn,
    q_ptr, ld_q,               # W [N, Kp] (ld_q = Kp), or W.T [K, Np] (ld_q = Np) with TRANSPOSE
    s_ptr, ld_s,               # scales, row-major: [ceil(N/128), Kp/128], or [ceil(K/128), Np/128]
    FMT_MAX: tl.constexpr, POW2: tl.constexpr, BF16: tl.constexpr, TRANSPOSE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK + tl.arange(0, BLOCK)
    offs_k = pid_k * BLOCK + tl.arange(0, BLOCK)
    in_n = offs_n < N
    in_k = offs_k < K
    w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :],
                mask=in_n[:, None] & in_k[None, :], other=0.0)
    if not BF16:
        w = w.to(tl.float32)
    s = scale_from_amax_bits(tl.max(amax_bits(abs_bits(w, BF16), 1, BF16), axis=0), FMT_MAX, POW2)
    q = scaled(w, inverse(s, POW2))  # the block's reciprocal, as the activation kernel and the reference
    q = q.to(q_ptr.dtype.element_ty)
    if TRANSPOSE:  # block (n, k) of W is block (k, n) of W.T: same data transposed, same scale
        tl.store(q_ptr + offs_k[:, None] * ld_q + offs_n[None, :], tl.trans(q),
                 mask=in_k[:, None] & (offs_n < ld_q)[None, :])
        if pid_k * BLOCK < K:
            tl.store(s_ptr + pid_k * ld_s + pid_n, s)
    else:
        tl.store(q_ptr + offs_n[:, None] * ld_q + offs_k[None, :], q, mask=in_n[:, None] & (offs_k < ld_q)[None, :])
        if pid_n * BLOCK < N:
            tl.store(s_ptr + pid_n * ld_s + pid_k, s)


@triton.jit
def _rows_grad_weight_kernel(
    g_ptr, M, N, stride_gm,                   # g [M, N] BF16: the output gradient
    q_ptr, K, stride_qm,                      # x's FP8 rows [M, Kp] (1x128 tiles)
    s_ptr, stride_sm, stride_sk,              # their scales by token and tile (the ops' [Kp/128, M]: 1, M)
    out_ptr,                                  # FP32 partial sums [slices, N, K]: one per slice of M_SLICE tokens
    M_SLICE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK: tl.constexpr,
    DOT_F32: tl.constexpr,  # Triton's interpreter multiplies BF16 dot operands' bit patterns: FP32 there
):
    """dW [N, K] = g.T @ x over one slice of the tokens, x dequantized from its FP8 rows: a program owns 128
    columns of x (one scale per token) and BLOCK_N rows of dW. The scale folds into g, whose BF16 product with
    a power of two is exact, so each term is g * s * q as the reference makes it; BF16 tensor-core products,
    FP32 sums."""
    pid_k = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_k = pid_k * BLOCK + tl.arange(0, BLOCK)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    in_k = offs_k < K
    in_n = offs_n < N
    acc = tl.zeros((BLOCK_N, BLOCK), dtype=tl.float32)
    for m in range(0, M_SLICE, BLOCK_M):
        offs_m = pid_s * M_SLICE + m + tl.arange(0, BLOCK_M)
        in_m = offs_m < M
        g = tl.load(g_ptr + offs_m[:, None] * stride_gm + offs_n[None, :], mask=in_m[:, None] & in_n[None, :],
                    other=0.0)
        s = tl.load(s_ptr + offs_m * stride_sm + pid_k * stride_sk, mask=in_m, other=0.0)
        q = tl.load(q_ptr + offs_m[:, None] * stride_qm + offs_k[None, :], mask=in_m[:, None] & in_k[None, :],
                    other=0.0)
        gs = (g.to(tl.float32) * s[:, None]).to(tl.bfloat16)
        if DOT_F32:  # the same products: both operands hold BF16 values
            acc = tl.dot(tl.trans(gs.to(tl.float32)), q.to(tl.float32), acc)
        else:
            acc = tl.dot(tl.trans(gs), q.to(tl.bfloat16), acc)
    tl.store(out_ptr + pid_s * N * K + offs_n[:, None] * K + offs_k[None, :], acc, mask=in_n[:, None] & in_k[None, :])


def _launcher(kernel, traced: bool):
    # under torch.compile the launch is recorded for inductor (which then starts the kernel from its own
    # generated code); eagerly it is Triton's own launch
    return torch.library.wrap_triton(kernel) if traced else kernel


def ops_layout(out, like: torch.Tensor) -> tuple:
    """(rows data, scale view, cols data, scale view), each copy None where not made, in the ops' layout: the
    scales as their contiguous [blocks, rows] buffers, a missing copy as empty tensors."""
    def copy(q, s):
        if q is None:
            return like.new_empty(0, dtype=torch.uint8), like.new_empty(0, dtype=torch.float32)
        return q, s.t()

    return (*copy(*out[:2]), *copy(*out[2:]))


def _quantize_tiles(x2d, others, producer: int, row_fmt, col_fmt, pow2: bool, pad: int, cols: bool,
                    num_warps: int | None, traced: bool, rows: bool = True, col_blocks: bool = False) -> tuple:
    """One launch of `_act_kernel` over x2d [M, K] (and `others`, the producer's other inputs, of its shape):
    (rows data, rows scale view, cols data, cols scale view), None for a copy not made; with `col_blocks` the
    cols scales are 128x128 blocks' (the view of the row-major [ceil(K/128), Mp/128] buffer)."""
    if not (rows or cols):
        raise ValueError("_quantize_tiles: neither copy asked for")
    M, K = x2d.shape
    Kp, Mp = round_up(K, pad), round_up(M, pad)
    dev = x2d.device
    qr = torch.empty(M, Kp, dtype=row_fmt.dtype, device=dev) if rows else None
    sr = torch.empty(Kp // _SIDE, M, dtype=torch.float32, device=dev) if rows else None
    if cols:
        qc = torch.empty(K, Mp, dtype=col_fmt.dtype, device=dev)
        sc_shape = (-(-K // _SIDE), Mp // _SIDE) if col_blocks else (Mp // _SIDE, K)
        sc = torch.empty(sc_shape, dtype=torch.float32, device=dev)
        m_tiles = -(-max(Mp, M) // _SIDE)
    else:
        qc, sc, m_tiles = None, None, -(-M // _SIDE)
    grid = (m_tiles, -(-max(Kp, K) // _SIDE))
    # None for a pointer the launch does not use (compiled out), never a tensor passed twice: under
    # torch.compile inductor then copies it before the launch (0.65 ms per Qwen2.5-7B layer at 8192 tokens
    # on the H200 when x2d stood in for y and z; docs/benchmarks.md)
    y, z = (*others, None, None)[:2]
    _launcher(_act_kernel, traced)[grid](
        x2d, M, K, x2d.stride(0), qr, sr, Kp, qc, sc, Mp, y, z, ROW_MAX=row_fmt.max, COL_MAX=col_fmt.max,
        POW2=pow2, BF16=x2d.dtype == torch.bfloat16, PRODUCER=producer, ROWS=rows, COLS=cols, BLOCK=_SIDE,
        COL_BLOCKS=col_blocks, num_warps=num_warps or _NUM_WARPS,
    )
    return (qr, sr.t() if rows else None, qc, sc.t() if cols else None)


def quantize_tiles_and_transpose(x2d, row_fmt, col_fmt, pow2: bool, pad: int, cols: bool = True,
                                 num_warps: int | None = None, _traced: bool = False, rows: bool = True,
                                 col_blocks: bool = False):
    """x2d [M, K] -> (rows data [M, Kp], rows scale view (M, Kp/128) with strides (1, M),
    cols data [K, Mp], cols scale view (K, Mp/128) with strides (1, K)); Kp, Mp = round_up(., pad).
    `cols=False` skips the transposed copy (no backward will need it), `rows=False` the row copy (a backward
    making input.T alone); a copy not made is None. `col_blocks`: cols quantized in 128x128 blocks, its scale
    the view (Mp/128, ceil(K/128)) of the row-major [ceil(K/128), Mp/128] scales (grad_weight's input.T
    as a weight-like operand: the recipe's `wgrad_blocks`).
    A format is anything with `.dtype` (of the copy) and `.max` (an FP32 dtype gives the values before
    the FP8 conversion: the CPU interpreter checks use it)."""
    return _quantize_tiles(x2d, (), 0, row_fmt, col_fmt, pow2, pad, cols, num_warps, _traced, rows, col_blocks)


def quantize_swiglu(g, u, row_fmt, col_fmt, pow2: bool, pad: int, cols: bool = True, num_warps: int | None = None,
                    _traced: bool = False, rows: bool = True, col_blocks: bool = False):
    """The tiles of h = silu(g) * u from BF16 g, u [M, I], without h ever being written: (rows data, rows
    scale [Ip/128, M], cols data, cols scale [Mp/128, I]), the scales as buffers in the ops' layout (not the
    views `quantize_tiles_and_transpose` returns); a copy not made (`rows`, `cols` False): empty tensors;
    `col_blocks` as there."""
    return ops_layout(_quantize_tiles(g, (u,), 1, row_fmt, col_fmt, pow2, pad, cols, num_warps, _traced, rows,
                                      col_blocks), g)


def quantize_swiglu_grads(dh, g, u, row_fmt, col_fmt, pow2: bool, pad: int, cols: bool = True,
                          num_warps: int | None = None, _traced: bool = False, col_blocks: bool = False):
    """The tiles of the SwiGLU's input gradients from BF16 dh, g, u [M, I]: dg's four tensors, then du's (as
    `quantize_swiglu` returns them), in two launches."""
    dg = _quantize_tiles(dh, (g, u), 2, row_fmt, col_fmt, pow2, pad, cols, num_warps, _traced, True, col_blocks)
    du = _quantize_tiles(dh, (g,), 3, row_fmt, col_fmt, pow2, pad, cols, num_warps, _traced, True, col_blocks)
    return (*ops_layout(dg, dh), *ops_layout(du, dh))


def quantize_blocks(w, fmt, pow2: bool, pad: int, transpose: bool = False, num_warps: int = _NUM_WARPS,
                    _traced: bool = False):
    """w [N, K] -> W (data [N, Kp], scale [ceil(N/128), Kp/128]) or, with `transpose`, W.T (data [K, Np],
    scale [ceil(K/128), Np/128]); Kp, Np = round_up(., pad); scales row-major. The transposed copy is the
    quantization of w.T itself: a 128x128 block's scale does not depend on which way it is read."""
    N, K = w.shape
    rows, cols = (K, N) if transpose else (N, K)  # of the operand
    cols_p = round_up(cols, pad)
    q = torch.empty(rows, cols_p, dtype=fmt.dtype, device=w.device)
    s = torch.empty(-(-rows // _SIDE), -(-cols_p // _SIDE), dtype=torch.float32, device=w.device)
    row_blocks, col_blocks = s.shape
    grid = (col_blocks, row_blocks) if transpose else (row_blocks, col_blocks)  # over (blocks of N, blocks of K)
    ld_q, ld_s = cols_p, col_blocks
    _launcher(_weight_kernel, _traced)[grid](w, N, K, w.stride(0), q, ld_q, s, ld_s, FMT_MAX=fmt.max, POW2=pow2,
                                             BF16=w.dtype == torch.bfloat16, TRANSPOSE=transpose, BLOCK=_SIDE,
                                             num_warps=num_warps)
    return q, s


def rows_grad_weight(g, q, s, k: int, _traced: bool = False, *, block_m: int = 64, num_warps: int = 8,
                     num_stages: int = 4, waves: int = 2):
    """dW [N, K] (FP32) = g.T @ x from BF16 g [M, N] and x's FP8 rows: data q [M, Kp] E4M3 with power-of-two
    scales s [Kp/128, M] (the 1x128 tiles in the ops' layout, `ops_layout`); K = k real columns. Tokens are
    split into slices, so that narrow x still fills the GPU (`waves` programs per SM), and the slices' sums
    added in FP32. The launch keywords are benchmarks/bench_rows_grad_weight.py's sweep."""
    M, N = g.shape
    if tuple(s.shape) != (q.shape[1] // _SIDE, M) or q.shape[0] != M:
        raise ValueError(f"rows_grad_weight: rows {tuple(q.shape)} and scales {tuple(s.shape)} for {M} tokens: the "
                         "scales must be the ops' [Kp/128, M] buffer")
    block_n = 64 if N > 32 else 32 if N > 16 else 16
    k_blocks, n_blocks = -(-k // _SIDE), -(-N // block_n)
    sms = (torch.cuda.get_device_properties(g.device).multi_processor_count if g.device.type == "cuda"
           else _INTERPRETER_SMS)
    slices = max(1, min(-(-waves * sms // (k_blocks * n_blocks)), M // 512))  # >= 512 tokens a slice
    m_slice = round_up(-(-M // slices), max(128, block_m))  # whole BLOCK_M steps: no slice reads the next's
    slices = -(-M // m_slice)
    # [slices * N, k], not [slices, N, k]: one slice returns the buffer itself, since inductor's scheduler fails
    # (KeyError) on a triton_op returning a view of the buffer its kernel wrote
    out = torch.empty(slices * N, k, dtype=torch.float32, device=g.device)
    _launcher(_rows_grad_weight_kernel, _traced)[(k_blocks, n_blocks, slices)](
        g, M, N, g.stride(0), q, k, q.stride(0), s, s.stride(1), s.stride(0), out,
        M_SLICE=m_slice, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK=_SIDE,
        DOT_F32=not isinstance(_rows_grad_weight_kernel, triton.runtime.JITFunction), num_warps=num_warps,
        num_stages=num_stages)
    return out if slices == 1 else out.view(slices, N, k).sum(0)


# ------------------------------------------------------------------------ the same, as torch ops
# torch.compile traces into a triton_op: inductor sees the kernel launch itself (no Python op call per
# launch at run time). Scales come back as contiguous [blocks, rows] buffers; no cols copy: empty tensors.

_FORMATS = {f.dtype: f for f in Fp8Format}


@torch.library.triton_op("fp8train::quantize_tiles", mutates_args=())
def quantize_tiles_op(x2d: torch.Tensor, row_dtype: torch.dtype, col_dtype: torch.dtype, pow2: bool, pad: int,
                      rows: bool, cols: bool, col_blocks: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                         torch.Tensor]:
    return ops_layout(quantize_tiles_and_transpose(x2d, _FORMATS[row_dtype], _FORMATS[col_dtype], pow2, pad, cols,
                                                   _traced=True, rows=rows, col_blocks=col_blocks), x2d)


@torch.library.triton_op("fp8train::quantize_swiglu_tiles", mutates_args=())
def quantize_swiglu_op(g: torch.Tensor, u: torch.Tensor, row_dtype: torch.dtype, col_dtype: torch.dtype, pow2: bool,
                       pad: int, rows: bool, cols: bool, col_blocks: bool) -> tuple[torch.Tensor, torch.Tensor,
                                                                                   torch.Tensor, torch.Tensor]:
    return quantize_swiglu(g, u, _FORMATS[row_dtype], _FORMATS[col_dtype], pow2, pad, cols, _traced=True, rows=rows,
                           col_blocks=col_blocks)


@torch.library.triton_op("fp8train::quantize_swiglu_grad_tiles", mutates_args=())
def quantize_swiglu_grads_op(dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor, row_dtype: torch.dtype,
                             col_dtype: torch.dtype, pow2: bool, pad: int, cols: bool, col_blocks: bool) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return quantize_swiglu_grads(dh, g, u, _FORMATS[row_dtype], _FORMATS[col_dtype], pow2, pad, cols, _traced=True,
                                 col_blocks=col_blocks)


@torch.library.triton_op("fp8train::quantize_blocks", mutates_args=())
def quantize_blocks_op(w: torch.Tensor, dtype: torch.dtype, pow2: bool, pad: int,
                       transpose: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_blocks(w, _FORMATS[dtype], pow2, pad, transpose, _traced=True)


@torch.library.triton_op("fp8train::rows_grad_weight_kernel", mutates_args=())  # ops.py has rows_grad_weight
def rows_grad_weight_op(g: torch.Tensor, q: torch.Tensor, s: torch.Tensor, k: int) -> torch.Tensor:
    return rows_grad_weight(g, q, s, k, _traced=True)
