"""Fused Triton quantization kernels for the CUDA path (bit-identical to `fp8train.quant`'s reference).

`quantize_tiles_and_transpose` reads each 128x128 tile of an activation (input or grad_output) once and
writes both FP8 copies the hybrid recipe needs:
    rows  [M, Kp]  1x128 tiles along the features  (operand a of output / grad_input)
    cols  [K, Mp]  1x128 tiles along the tokens     (operand of grad_weight), quantized from the same
                   high-precision tile, never from the row copy (no double quantization).
`quantize_blocks_and_transpose` does the same for a weight with 128x128 blocks, where the transposed
copy (for grad_input) shares the block scales exactly.

Scales are written straight into the layouts cuBLAS wants: 1x128 scales "outer-dim major" ([blocks, rows]
in memory, handed over as the (rows, blocks) transpose view); 128x128 scales row-major [Nb, Kb].
Padded regions (Kp, Mp: contraction lengths rounded up for cuBLAS) hold zeros with scale 1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_TILE = 128
_FP32_TINY = tl.constexpr(1.1754943508222875e-38)
_FP32_MAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def _scale_from_amax(amax, has_nan, FMT_MAX: tl.constexpr, POW2: tl.constexpr):
    s = tl.div_rn(amax, FMT_MAX)
    s = tl.where(amax == 0.0, 1.0, s)
    s = tl.maximum(s, _FP32_TINY)
    if POW2:
        bits = s.to(tl.int32, bitcast=True)
        exp = bits & 0x7F800000
        up = exp + tl.where((bits & 0x007FFFFF) != 0, 1 << 23, 0)
        s = tl.where(s <= _FP32_MAX, up.to(tl.float32, bitcast=True), s)  # finite only
    zero = s - s
    return tl.where(has_nan, zero / zero, s)  # NaN built in-kernel: a NaN global never equals itself


@triton.jit
def _quant(x, s, FMT_MAX: tl.constexpr, OUT_DTYPE: tl.constexpr):
    q = tl.div_rn(x, s)  # IEEE-rounded, as torch's x / scale (plain `/` is approximate)
    clipped = tl.minimum(tl.maximum(q, -FMT_MAX), FMT_MAX)
    return tl.where(q != q, q, clipped).to(OUT_DTYPE)  # NaN stays NaN, as torch.clamp keeps it


@triton.jit
def _act_kernel(
    x_ptr, M, K, stride_xm,
    qr_ptr, sr_ptr, Kp,        # rows copy [M, Kp], scales [Kp/128, M]
    qc_ptr, sc_ptr, Mp,        # cols copy [K, Mp], scales [Mp/128, K]
    ROW_MAX: tl.constexpr, ROW_DTYPE: tl.constexpr,
    COL_MAX: tl.constexpr, COL_DTYPE: tl.constexpr,
    POW2: tl.constexpr, BLOCK: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = pid_m * BLOCK + tl.arange(0, BLOCK)
    offs_k = pid_k * BLOCK + tl.arange(0, BLOCK)
    in_m = offs_m < M
    in_k = offs_k < K
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                mask=in_m[:, None] & in_k[None, :], other=0.0).to(tl.float32)
    ax = tl.abs(x)
    isnan = (x != x).to(tl.int32)

    # rows copy: one scale per (token, 128 features)
    s_r = _scale_from_amax(tl.max(ax, axis=1), tl.max(isnan, axis=1) > 0, ROW_MAX, POW2)
    q_r = _quant(x, s_r[:, None], ROW_MAX, ROW_DTYPE)
    tl.store(qr_ptr + offs_m[:, None] * Kp + offs_k[None, :], q_r,
             mask=in_m[:, None] & (offs_k < Kp)[None, :])
    tl.store(sr_ptr + pid_k * M + offs_m, s_r, mask=in_m & (pid_k * BLOCK < Kp))

    # cols copy: one scale per (feature, 128 tokens), stored transposed [K, Mp]
    s_c = _scale_from_amax(tl.max(ax, axis=0), tl.max(isnan, axis=0) > 0, COL_MAX, POW2)
    q_c = _quant(x, s_c[None, :], COL_MAX, COL_DTYPE)
    # transpose in registers/shared memory first, so each thread stores bytes contiguous along tokens
    tl.store(qc_ptr + offs_k[:, None] * Mp + offs_m[None, :], tl.trans(q_c),
             mask=in_k[:, None] & (offs_m < Mp)[None, :])
    tl.store(sc_ptr + pid_m * K + offs_k, s_c, mask=in_k & (pid_m * BLOCK < Mp))


@triton.jit
def _weight_kernel(
    w_ptr, N, K, stride_wn,
    q_ptr, Kp,                 # [N, Kp]
    qt_ptr, Np,                # [K, Np]
    s_ptr, KB,                 # [ceil(N/128), Kp/128]
    FMT_MAX: tl.constexpr, DTYPE: tl.constexpr, POW2: tl.constexpr, BLOCK: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK + tl.arange(0, BLOCK)
    offs_k = pid_k * BLOCK + tl.arange(0, BLOCK)
    in_n = offs_n < N
    in_k = offs_k < K
    w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :],
                mask=in_n[:, None] & in_k[None, :], other=0.0).to(tl.float32)
    amax = tl.max(tl.max(tl.abs(w), axis=1), axis=0)
    has_nan = tl.max(tl.max((w != w).to(tl.int32), axis=1), axis=0) > 0
    s = _scale_from_amax(amax, has_nan, FMT_MAX, POW2)
    q = _quant(w, s, FMT_MAX, DTYPE)
    tl.store(q_ptr + offs_n[:, None] * Kp + offs_k[None, :], q, mask=in_n[:, None] & (offs_k < Kp)[None, :])
    tl.store(qt_ptr + offs_k[:, None] * Np + offs_n[None, :], tl.trans(q), mask=in_k[:, None] & (offs_n < Np)[None, :])
    if pid_n * BLOCK < N:
        tl.store(s_ptr + pid_n * KB + pid_k, s)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def quantize_tiles_and_transpose(x2d, row_fmt, col_fmt, pow2: bool, pad: int):
    """x2d [M, K] -> (rows data [M, Kp], rows scale view (M, Kp/128) with strides (1, M),
    cols data [K, Mp], cols scale view (K, Mp/128) with strides (1, K)); Kp, Mp = round_up(., pad)."""
    M, K = x2d.shape
    Kp, Mp = _round_up(K, pad), _round_up(M, pad)
    dev = x2d.device
    qr = torch.empty(M, Kp, dtype=row_fmt.dtype, device=dev)
    sr = torch.empty(Kp // _TILE, M, dtype=torch.float32, device=dev)
    qc = torch.empty(K, Mp, dtype=col_fmt.dtype, device=dev)
    sc = torch.empty(Mp // _TILE, K, dtype=torch.float32, device=dev)
    grid = (max(Mp, M) // _TILE + (max(Mp, M) % _TILE > 0), max(Kp, K) // _TILE + (max(Kp, K) % _TILE > 0))
    _act_kernel[grid](
        x2d, M, K, x2d.stride(0), qr, sr, Kp, qc, sc, Mp,
        ROW_MAX=row_fmt.max, ROW_DTYPE=_tl_dtype(row_fmt.dtype), COL_MAX=col_fmt.max, COL_DTYPE=_tl_dtype(col_fmt.dtype),
        POW2=pow2, BLOCK=_TILE, num_warps=8,
    )
    return qr, sr.t(), qc, sc.t()


def quantize_blocks_and_transpose(w, fmt, pow2: bool, pad: int):
    """w [N, K] -> (data [N, Kp], data.T [K, Np], scale [ceil(N/128), Kp/128] row-major)."""
    N, K = w.shape
    Kp, Np = _round_up(K, pad), _round_up(N, pad)
    dev = w.device
    q = torch.empty(N, Kp, dtype=fmt.dtype, device=dev)
    qt = torch.empty(K, Np, dtype=fmt.dtype, device=dev)
    NB, KB = -(-max(N, Np) // _TILE), Kp // _TILE
    s = torch.empty(-(-N // _TILE), KB, dtype=torch.float32, device=dev)
    _weight_kernel[(NB, max(KB, -(-K // _TILE)))](
        w, N, K, w.stride(0), q, Kp, qt, Np, s, KB,
        FMT_MAX=fmt.max, DTYPE=_tl_dtype(fmt.dtype), POW2=pow2, BLOCK=_TILE, num_warps=8,
    )
    return q, qt, s


def _tl_dtype(dtype: torch.dtype):
    return tl.float8e4nv if dtype == torch.float8_e4m3fn else tl.float8e5
