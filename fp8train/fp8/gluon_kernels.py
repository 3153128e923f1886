"""The quantization launches that write a transposed FP8 copy, in Gluon (Triton's dialect with explicit
layouts): candidates to replace `kernels._act_kernel`'s launches that write both copies and
`kernels._weight_kernel`'s W.T launch, once the H200 has checked and timed them.

The two-copy launch of `_act_kernel` stores its cols copy [K, Mp] transposed. Plain Triton lays the tile out
with each thread holding a row segment (features contiguous), so the transposed store goes through shared
memory one FP8 byte at a time: 64 byte loads, 40 stores and 8 barriers per thread in its SM90 code, and 2.3
TB/s against 3.7 for the rows-only launch (docs/benchmarks.md section 1). Here the layout is chosen:

    each thread holds 128 / warps consecutive tokens x 4 consecutive features of the 128 x 128 tile
    (lanes along the features, warps along the tokens)

so the rows copy is stored as 4-byte words along the features, the cols copy as 16-byte (8 warps) words
along the tokens from the same registers (the two layouts below differ only in register order:
`convert_layout(..., assert_trivial=True)` proves it moves no data), the per-token amax is one warp
reduction, and only the per-feature amax crosses warps (through shared memory). Same arithmetic as
`_act_kernel` (its helpers, the producers included), so the same bytes. The W.T kernel reads a weight
block the same way and stores its transpose from the same registers.

Gluon has no CPU interpreter: on the CPU the kernels' own source without its layouts runs in Triton's
interpreter against the Triton kernels (tests/_triton_kernel_checks.py) and the layouts are checked where
they compile for SM90; on the H200 tests/test_gpu.py compares the compiled kernels with the Triton ones bit
for bit. `kernels.quantize_tiles_and_transpose`, `quantize_swiglu(_grads)` and `quantize_blocks` launch them
with `gluon=True` (under torch.compile through opaque ops: inductor cannot launch a Gluon kernel itself): the
recipe knob `gluon_kernels` (`hybrid+gluon`), off until the H200 has checked and timed them.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from . import kernels as tq

__all__ = ["launch_config"]


@gluon.jit
def _act2_kernel(
    x_ptr, M, K, stride_xm,
    qr_ptr, sr_ptr, Kp,        # rows copy [M, Kp], scales [Kp/128, M]
    qc_ptr, sc_ptr, Mp,        # cols copy [K, Mp], scales [Mp/128, K]
    y_ptr, z_ptr,              # the producer's other inputs (x's shape and strides)
    ROW_MAX: gl.constexpr, COL_MAX: gl.constexpr, POW2: gl.constexpr, BF16: gl.constexpr, PRODUCER: gl.constexpr,
):
    """`_act_kernel` with COLS (PRODUCER as there: 0 x, 1 h, 2 dg, 3 du), in the layout of the docstring."""
    BLOCK: gl.constexpr = 128
    WARPS: gl.constexpr = gl.num_warps()
    rows: gl.constexpr = gl.BlockedLayout([BLOCK // WARPS, 4], [1, 32], [WARPS, 1], [1, 0])  # features fastest
    cols: gl.constexpr = gl.BlockedLayout([BLOCK // WARPS, 4], [1, 32], [WARPS, 1], [0, 1])  # tokens fastest
    pid_m = gl.program_id(0)
    pid_k = gl.program_id(1)
    offs_m = pid_m * BLOCK + gl.arange(0, BLOCK, layout=gl.SliceLayout(1, rows))
    offs_k = pid_k * BLOCK + gl.arange(0, BLOCK, layout=gl.SliceLayout(0, rows))
    in_m = offs_m < M
    in_k = offs_k < K
    offs = offs_m[:, None] * stride_xm + offs_k[None, :]
    mask = in_m[:, None] & in_k[None, :]
    if PRODUCER == 3:  # du: g first, as `_act_kernel` reads it
        g_tile = gl.load(y_ptr + offs, mask=mask, other=0.0)
    else:
        x = gl.load(x_ptr + offs, mask=mask, other=0.0)
    if PRODUCER == 1:  # x is g, y is u
        x = tq._swiglu(x, gl.load(y_ptr + offs, mask=mask, other=0.0))
    if PRODUCER == 2:  # x is dh, y is g, z is u
        x = (x.to(gl.float32) * gl.load(z_ptr + offs, mask=mask, other=0.0).to(gl.float32)).to(gl.bfloat16)
        x = tq._swiglu_grad_gate(x, gl.load(y_ptr + offs, mask=mask, other=0.0))
    if PRODUCER == 3:  # x is dh, y is g
        x = tq._swiglu_grad_up(gl.load(x_ptr + offs, mask=mask, other=0.0), g_tile)
    if not BF16:
        x = x.to(gl.float32)

    ax = tq._abs_bits(x, BF16)
    amax_r = tq._amax_bits(ax, 1, BF16)  # per token: within a warp
    amax_c = tq._amax_bits(ax, 0, BF16)  # per feature: across the warps
    s_r = tq._scale_from_amax_bits(amax_r, ROW_MAX, POW2)
    q_r = tq._quant(x, tq._inverse(s_r, POW2)[:, None]).to(qr_ptr.dtype.element_ty)
    # [M, Kp]: 4 consecutive features per thread, a warp writes 128 bytes of one token
    gl.store(qr_ptr + offs_m[:, None] * Kp + offs_k[None, :], q_r, mask=in_m[:, None] & (offs_k < Kp)[None, :])
    gl.store(sr_ptr + pid_k * M + offs_m, s_r, mask=in_m & (pid_k * BLOCK < Kp))

    s_c = tq._scale_from_amax_bits(amax_c, COL_MAX, POW2)
    q_c = gl.convert_layout(tq._quant(x, tq._inverse(s_c, POW2)[None, :]).to(qc_ptr.dtype.element_ty), cols,
                            assert_trivial=True)
    offs_mc = pid_m * BLOCK + gl.arange(0, BLOCK, layout=gl.SliceLayout(1, cols))
    offs_kc = pid_k * BLOCK + gl.arange(0, BLOCK, layout=gl.SliceLayout(0, cols))
    # [K, Mp], stored from the same registers: 128 / warps consecutive tokens of a feature per thread
    gl.store(qc_ptr + offs_kc[None, :] * Mp + offs_mc[:, None], q_c,
             mask=(offs_kc < K)[None, :] & (offs_mc < Mp)[:, None])
    gl.store(sc_ptr + pid_m * K + offs_k, s_c, mask=in_k & (pid_m * BLOCK < Mp))


@gluon.jit
def _weight_t_kernel(
    w_ptr, N, K, stride_wn,
    q_ptr, ld_q,               # W.T [K, Np] (ld_q = Np)
    s_ptr, ld_s,               # scales, row-major [ceil(K/128), Np/128]
    FMT_MAX: gl.constexpr, POW2: gl.constexpr, BF16: gl.constexpr,
):
    """`kernels._weight_kernel` with TRANSPOSE (W.T, grad_input's operand b), in the layout of
    `_act2_kernel`: block (n, k) of W read along k, stored as block (k, n) of W.T from the same registers,
    16-byte words along n. The block's one scale: a warp reduction, then across the warps."""
    BLOCK: gl.constexpr = 128
    WARPS: gl.constexpr = gl.num_warps()
    rows: gl.constexpr = gl.BlockedLayout([BLOCK // WARPS, 4], [1, 32], [WARPS, 1], [1, 0])  # k fastest
    cols: gl.constexpr = gl.BlockedLayout([BLOCK // WARPS, 4], [1, 32], [WARPS, 1], [0, 1])  # n fastest
    pid_n = gl.program_id(0)  # the grid runs over (blocks of Np, blocks of K), as for the Triton kernel
    pid_k = gl.program_id(1)
    offs_n = pid_n * BLOCK + gl.arange(0, BLOCK, layout=gl.SliceLayout(1, rows))
    offs_k = pid_k * BLOCK + gl.arange(0, BLOCK, layout=gl.SliceLayout(0, rows))
    w = gl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :],
                mask=(offs_n < N)[:, None] & (offs_k < K)[None, :], other=0.0)
    if not BF16:
        w = w.to(gl.float32)
    s = tq._scale_from_amax_bits(gl.max(tq._amax_bits(tq._abs_bits(w, BF16), 1, BF16), axis=0), FMT_MAX, POW2)
    q = gl.convert_layout(tq._quant(w, tq._inverse(s, POW2)).to(q_ptr.dtype.element_ty), cols, assert_trivial=True)
    offs_nc = pid_n * BLOCK + gl.arange(0, BLOCK, layout=gl.SliceLayout(1, cols))
    offs_kc = pid_k * BLOCK + gl.arange(0, BLOCK, layout=gl.SliceLayout(0, cols))
    gl.store(q_ptr + offs_kc[None, :] * ld_q + offs_nc[:, None], q,
             mask=(offs_kc < K)[None, :] & (offs_nc < ld_q)[:, None])
    if pid_k * BLOCK < K:
        gl.store(s_ptr + pid_k * ld_s + pid_n, s)


def launch_config(producer: int, pow2: bool) -> dict:
    """Warps and register cap of a two-copy launch, from the SM90 code (tests/_triton_kernel_checks.py builds
    the same): 8 warps hold 113-127 registers (two programs per SM) but for dg, whose tile takes 148 there
    (79 at 16 warps), and for exact scales' h and du, 132 uncapped (128 capped by `maxnreg`, no spills; a
    launch option: these kernels are launched eagerly, an opaque op under torch.compile)."""
    if producer == 2:
        return {"num_warps": 16}
    return {"num_warps": 8} if pow2 else {"num_warps": 8, "maxnreg": 128}
