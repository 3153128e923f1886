"""CPU checks of the Triton quantization kernels, run by tests/test_triton_kernels.py in a subprocess.

    python tests/_triton_kernel_checks.py interpret   # with TRITON_INTERPRET=1: the kernels' arithmetic
    python tests/_triton_kernel_checks.py compile     # sm90 machine code: registers and spills
    python tests/_triton_kernel_checks.py exhaustive  # with TRITON_INTERPRET=1: power-of-two scales, every amax

`interpret` runs the kernels in Triton's interpreter and compares, bit for bit, the FP32 values they would
convert to FP8 (the interpreter's own FP8 cast is wrong: it rounds 31.65 to 16; the GPU's cvt.rn.satfinite
is checked on the device by tests/test_gpu.py) and every scale against the reference of fp8train.fp8.quant.
`compile` builds the kernels for SM90 (ptxas ships with Triton) as the JIT would for aligned shapes and
prints the register count and stack size of each launch the library uses, with power-of-two and exact scales. Prints one JSON line.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy
import torch
import triton
import triton.language as tl

from fp8train.fp8 import kernels as tq
from fp8train.fp8.quant import compute_scale, reciprocal
from fp8train.fp8.recipe import Fp8Format


def _pre_conversion(x2d, fmt, pow2):
    """Reference FP32 values x * RN(1 / scale) and scales, 1x128 tiles along the last dim. Unclamped, as the
    kernels store them: the reference's clamp changes nothing after the FP8 conversion because every finite
    value lies within fmt.max * (1 + 2^-22) (`_within_range` checks it on every input here)."""
    R, C = x2d.shape
    nc = -(-C // 128)
    p = torch.nn.functional.pad(x2d.float(), (0, nc * 128 - C)).view(R, nc, 128)
    s = compute_scale(p.abs().amax(-1), fmt, pow2)
    return (p * reciprocal(s, pow2)[..., None]).view(R, -1)[:, :C], s


def _block_pre_conversion(x2d, fmt, pow2, pad):
    """Reference FP32 values and scales of x2d [R, C] in 128x128 blocks, its columns zero-padded to a multiple
    of `pad`: data [R, Cp], scales [ceil(R/128), Cp/128] (padding blocks: zeros, scale 1)."""
    R, C = x2d.shape
    rb, cp = -(-R // 128), pad * -(-C // pad)
    blocks = torch.nn.functional.pad(x2d.float(), (0, cp - C, 0, rb * 128 - R)).view(rb, 128, cp // 128, 128)
    s = compute_scale(blocks.abs().amax(dim=(1, 3)), fmt, pow2)
    return (blocks * reciprocal(s, pow2)[:, None, :, None]).reshape(rb * 128, cp)[:R], s


def _within_range(q, fmt) -> bool:
    """Finite pre-conversion values round to at most +-fmt.max (the clamp is a no-op after conversion)."""
    finite = q[torch.isfinite(q)].abs()
    return bool((finite <= fmt.max * (1 + 2 ** -22)).all())


def _bits(t):
    b = t.contiguous().view(torch.int32).clone()
    b[torch.isnan(t)] = -1
    return b


def _inputs():
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(256, 384, generator=g) * torch.logspace(-30, 30, 384)[None, :]
    wide[3] = 0.0
    wide[5, 7] = 1e4
    nonfinite = torch.randn(256, 256, generator=g)
    nonfinite[0, 0], nonfinite[130, 5], nonfinite[200, 0] = float("nan"), float("inf"), -float("inf")
    edge = torch.ones(128, 128)  # amax / 448 next to powers of two, tiny and huge magnitudes
    for i in range(128):
        edge[i, 0] = 448.0 * 2.0 ** (i % 20 - 10) * (1 + (i // 20) * 2 ** -23)
    return [("wide bf16", wide.to(torch.bfloat16)), ("wide fp32", wide), ("ragged", torch.randn(130, 200, generator=g)),
            ("ragged bf16", torch.randn(257, 129, generator=g).to(torch.bfloat16)), ("nonfinite", nonfinite),
            ("edge", edge), ("edge tiny", edge * 1e-36), ("edge huge", edge * 1e35)]


def interpret() -> dict:
    failures = []
    for name, x in _inputs():
        M, K = x.shape
        for f in ("e4m3", "e5m2"):
            fmt = Fp8Format.parse(f)
            fake = SimpleNamespace(dtype=torch.float32, max=fmt.max)  # FP32 copies: the pre-conversion values
            for pow2 in (True, False):
                rr, rs = _pre_conversion(x, fmt, pow2)
                cr, cs = _pre_conversion(x.t(), fmt, pow2)
                if not (_within_range(rr, fmt) and _within_range(cr, fmt)):
                    failures.append(f"activation {name} {f} pow2={pow2}: a value beyond fmt.max * (1 + 2^-22)")
                for cols in (True, False):
                    qr, sr, qc, sc = tq.quantize_tiles_and_transpose(x, fake, fake, pow2, 512, cols=cols)
                    ok = torch.equal(_bits(qr[:, :K]), _bits(rr)) and torch.equal(_bits(sr[:, :rs.shape[1]]), _bits(rs))
                    ok &= not qr[:, K:].any() and bool((sr[:, rs.shape[1]:] == 1).all())
                    if cols:
                        ok &= torch.equal(_bits(qc[:, :M]), _bits(cr)) and torch.equal(_bits(sc[:, :cs.shape[1]]), _bits(cs))
                        ok &= not qc[:, M:].any() and bool((sc[:, cs.shape[1]:] == 1).all())
                    else:
                        ok &= qc is None and sc is None
                    if not ok:
                        failures.append(f"activation {name} {f} pow2={pow2} cols={cols}")
                if f == "e4m3":  # input.T in 128x128 blocks (`wgrad_blocks`): one scale a tile, rows as before
                    qr, sr, qc, sc = tq.quantize_tiles_and_transpose(x, fake, fake, pow2, 512, col_blocks=True)
                    bq, bs = _block_pre_conversion(x.t(), fmt, pow2, 512)
                    ok = torch.equal(_bits(qr[:, :K]), _bits(rr)) and torch.equal(_bits(sr[:, :rs.shape[1]]), _bits(rs))
                    ok &= torch.equal(_bits(qc), _bits(bq)) and torch.equal(_bits(sc.t()), _bits(bs))
                    ok &= _within_range(bq, fmt)
                    if not ok:
                        failures.append(f"activation {name} pow2={pow2} cols in blocks")
                # input.T alone (`input_t_in_backward`): the same cols copy, no rows
                qr, sr, qc, sc = tq.quantize_tiles_and_transpose(x, fake, fake, pow2, 512, rows=False)
                ok = torch.equal(_bits(qc[:, :M]), _bits(cr)) and torch.equal(_bits(sc[:, :cs.shape[1]]), _bits(cs))
                if not (ok and qr is None and sr is None and not qc[:, M:].any()):
                    failures.append(f"activation {name} {f} pow2={pow2} cols only")
        if x.dtype == torch.float32 and x.shape[0] % 128 == 0:  # weights: FP32 masters, 128x128 blocks
            for pow2 in (True, False):
                fmt = Fp8Format.E4M3
                fake = SimpleNamespace(dtype=torch.float32, max=fmt.max)
                q, s = tq.quantize_blocks(x, fake, pow2, 512)
                qt, st = tq.quantize_blocks(x, fake, pow2, 512, transpose=True)
                nb, kb = M // 128, -(-K // 128)
                blocks = torch.nn.functional.pad(x, (0, kb * 128 - K)).view(nb, 128, kb, 128)
                rs = compute_scale(blocks.abs().amax(dim=(1, 3)), fmt, pow2)
                rq = (blocks * reciprocal(rs, pow2)[:, None, :, None]).reshape(M, kb * 128)[:, :K]
                ok = _within_range(rq, fmt)
                ok &= torch.equal(_bits(q[:, :K]), _bits(rq)) and torch.equal(_bits(qt[:, :M]), _bits(rq.t()))
                ok &= torch.equal(_bits(s[:, :kb]), _bits(rs)) and torch.equal(_bits(st[:, :nb]), _bits(rs.t()))
                ok &= not q[:, K:].any() and not qt[:, M:].any()  # padding: zero data, scale 1
                ok &= bool((s[:, kb:] == 1).all()) and bool((st[:, nb:] == 1).all())
                ok &= q.shape == (M, 512 * -(-K // 512)) and qt.shape == (K, 512 * -(-M // 512))
                if not ok:
                    failures.append(f"weight {name} pow2={pow2}")
    failures += _scale_failures()
    failures += _producer_failures()
    failures += _launch_argument_failures()
    failures += _benchmark_candidate_failures()
    failures += _rows_grad_weight_failures()
    return {"failures": failures}


def _rows_grad_weight_failures() -> list:
    """`rows_grad_weight` (a LoRA adapter's grad_weight from its input's FP8 rows) against an FP64 product of
    the dequantized rows: one or several token slices, ragged tokens and features, N over one program's rows.
    Its products are exact (a BF16 g times a power of two, times an E4M3 value), so only the FP32 sums' order
    differs: relative 1e-6 of the largest entry."""
    failures = []
    gen = torch.Generator().manual_seed(3)
    # 2100 tokens: slices of whole BLOCK_M steps under benchmarks/bench_rows_grad_weight.py's launches, the last
    # one ragged (each launch must sum each token once)
    for m, n, k in ((512, 16, 384), (1000, 8, 200), (2048, 40, 256), (4100, 100, 128), (300, 16, 1000),
                    (2100, 16, 384)):
        x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 30
        kp = -(-k // 128) * 128
        tiles = torch.nn.functional.pad(x, (0, kp - k)).view(m, kp // 128, 128)
        s = compute_scale(tiles.abs().amax(-1), Fp8Format.E4M3, True)
        q = (tiles * reciprocal(s, True)[..., None]).to(torch.float8_e4m3fn)
        g = torch.randn(m, n, generator=gen).to(torch.bfloat16)
        # q as FP32 (the interpreter's FP8 conversion is wrong); the scales in the ops' layout, [Kp/128, M]
        rows = (q.float().view(m, kp), s.t().contiguous())
        out = tq.rows_grad_weight(g, *rows, k)
        ref = g.double().t() @ (q.double() * s.double()[..., None]).view(m, kp)[:, :k]
        err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
        if out.shape != (n, k) or out.dtype != torch.float32 or not err < 1e-6:
            failures.append(f"rows_grad_weight m={m} n={n} k={k}: {tuple(out.shape)} {out.dtype}, error {err:.2e}")
        if m == 2100:
            for cfg in ({"block_m": 128, "waves": 4}, {"block_m": 256, "num_warps": 4, "waves": 4}):
                other = tq.rows_grad_weight(g, *rows, k, **cfg)
                err = ((other - out).abs().max() / out.abs().max()).item()
                if not err < 1e-6:
                    failures.append(f"rows_grad_weight {cfg}: {err:.2e} from the default launch's sums")
    # through the ops as the CUDA path calls it: the rows and scales `quantize_input` hands over for the cuBLAS
    # plan (its reference here, in the same layout), against the ops' reference product
    from fp8train.fp8 import ops
    from fp8train.fp8.operands import LinearPlan
    from fp8train.fp8.recipe import make_recipe

    plan = LinearPlan.of(make_recipe("hybrid"), True)
    x = torch.randn(1000, 600, generator=gen).to(torch.bfloat16)
    g = torch.randn(1000, 16, generator=gen).to(torch.bfloat16)
    q, s = ops._quantize_input_impl(x, plan.key, False, kernels=False)[:2]
    out = tq.rows_grad_weight(g, q.float(), s, 600)
    want = ops._rows_grad_weight_impl(g, q, s, plan.key, 600, kernels=False)
    err = ((out - want).abs().max() / want.abs().max()).item()
    if not err < 1e-6:
        failures.append(f"rows_grad_weight on quantize_input's layout: error {err:.2e}")
    return failures


def _benchmark_candidate_failures() -> list:
    """benchmarks/bench_quant.py's candidates for the H200 (a copy of the library's plain two-copy launch, walked
    and masked otherwise) compute what the library's launch computes: its output, byte for byte, on BF16 inputs
    (whole tiles and ragged; the interpreter's FP8 cast alike in both), so that a device run times variants of
    one function."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _benchmarks import load_benchmark

    bq = load_benchmark("bench_quant")
    failures = []
    for name, x in _inputs():
        if x.dtype != torch.bfloat16:
            continue
        want = tq.quantize_tiles_and_transpose(x, bq.E4M3, bq.E4M3, True, 128)
        variants = {f"layout {kw}": (lambda kw=kw: bq.layout_quantize(x, pad=128, **kw))
                    for kw in ({}, {"k_fastest": True}, {"even": True}, {"stream": True},
                               {"even": True, "k_fastest": True, "stream": True})}
        for vname, fn in variants.items():
            if not all(torch.equal(_bits(a.float()), _bits(b.float())) for a, b in zip(want, fn())):
                failures.append(f"bench_quant {vname} on {name}")
    return failures


@triton.jit
def _scales_kernel(bits_ptr, s_ptr, n, FMT_MAX: tl.constexpr, POW2: tl.constexpr, DIVISION: tl.constexpr,
                   BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    amax_bits = tl.load(bits_ptr + offs, mask=offs < n)
    tl.store(s_ptr + offs, tq.scale_from_amax_bits(amax_bits, FMT_MAX, POW2, DIVISION), mask=offs < n)


def _scale_failures() -> list:
    """The kernels' scale from an amax, against `compute_scale`, for amax = every FP32 exponent (subnormals
    included) with the mantissas around fmt.max's (where a power-of-two scale steps up), their extremes and
    random ones, and 0, Inf, NaN: the power-of-two scale made from the bit patterns and by the division."""
    g = torch.Generator().manual_seed(2)
    failures = []
    for f in ("e4m3", "e5m2"):
        fmt = Fp8Format.parse(f)
        m_fmt = int(torch.tensor(fmt.max, dtype=torch.float32).view(torch.int32)) & 0x7FFFFF
        mantissas = torch.cat([torch.tensor([0, 1, 2, m_fmt - 1, m_fmt, m_fmt + 1, m_fmt + 2, 0x7FFFFE, 0x7FFFFF]),
                               torch.randint(0, 1 << 23, (55,), generator=g)])
        bits = ((torch.arange(255)[:, None] << 23) | mantissas[None, :]).flatten().to(torch.int32)
        bits = torch.cat([bits, torch.tensor([0x7F800000, 0x7FC00000, 0x7F800001], dtype=torch.int32)])
        for pow2, division in ((True, False), (True, True), (False, True)):
            got = torch.empty(bits.numel(), dtype=torch.float32)
            _scales_kernel[(-(-bits.numel() // 1024),)](bits, got, bits.numel(), FMT_MAX=fmt.max, POW2=pow2,
                                                        DIVISION=division, BLOCK=1024)
            want = compute_scale(bits.view(torch.float32), fmt, pow2)
            bad = (_bits(got) != _bits(want)).nonzero().flatten()
            if bad.numel():
                i = int(bad[0])
                failures.append(f"scale {f} pow2={pow2} division={division}: {bad.numel()} amax values differ, "
                                f"first {hex(int(bits[i]))}: {got[i].item()!r} vs {want[i].item()!r}")
    return failures


def exhaustive() -> dict:
    """The power-of-two scale from bit patterns against `compute_scale` for every non-negative FP32 amax (2^31
    patterns, both formats; a few minutes in the interpreter): the count of differences, each format."""
    out = {}
    for f in ("e4m3", "e5m2"):
        fmt = Fp8Format.parse(f)
        differ = 0
        for start in range(0, 1 << 31, 1 << 26):
            bits = torch.arange(start, start + (1 << 26), dtype=torch.int64).to(torch.int32)
            got = torch.empty(bits.numel(), dtype=torch.float32)
            _scales_kernel[(64,)](bits, got, bits.numel(), FMT_MAX=fmt.max, POW2=True, DIVISION=False, BLOCK=1 << 20)
            differ += int((_bits(got) != _bits(compute_scale(bits.view(torch.float32), fmt, True))).sum())
        out[f] = differ
    return out


def _launch_argument_failures() -> list:
    """Every launch hands each tensor to the kernel once, and None for a pointer it does not use: under
    torch.compile inductor copies a tensor passed as two arguments before the launch (measured on the H200:
    0.65 ms per Qwen2.5-7B layer when the input stood in for the producers' unused pointers)."""
    launches, real = [], tq._launcher

    def recording(kernel, traced):
        class _Grid:
            def __getitem__(self, grid):
                def run(*args, **kwargs):
                    launches.append((kernel.__name__, [a for a in (*args, *kwargs.values()) if torch.is_tensor(a)]))
                    return real(kernel, traced)[grid](*args, **kwargs)
                return run
        return _Grid()

    fmt = Fp8Format.E4M3
    x = torch.randn(256, 384).bfloat16()
    tq._launcher = recording
    try:
        for cols in (True, False):
            tq.quantize_tiles_and_transpose(x, fmt, fmt, True, 512, cols=cols)
            tq.quantize_swiglu(x, x * 2, fmt, fmt, True, 512, cols=cols)
            tq.quantize_swiglu_grads(x, x * 2, x * 3, fmt, fmt, True, 512, cols=cols)
        tq.quantize_tiles_and_transpose(x, fmt, fmt, True, 512, rows=False)  # input.T alone (`input_t_in_backward`)
        tq.quantize_swiglu(x, x * 2, fmt, fmt, True, 512, rows=False)  # h.T alone
        for transpose in (False, True):
            tq.quantize_blocks(torch.randn(256, 384), fmt, True, 512, transpose=transpose)
    finally:
        tq._launcher = real
    failures = [f"{name}: a tensor passed twice" for name, ts in launches if len({id(t) for t in ts}) != len(ts)]
    return failures + ([] if len(launches) == 12 else [f"{len(launches)} launches recorded, 12 expected"])


def _truncate_to_bf16(x):
    """FP32 -> BF16 -> FP32 as the interpreter converts: by truncation (the GPU rounds to nearest; that is
    checked against torch's ops by tests/test_gpu.py)."""
    return (x.float().contiguous().view(torch.int32) & ~0xFFFF).view(torch.float32)


def _producer_failures() -> list:
    """The SwiGLU producers (PRODUCER 1: h = silu(g) * u; 2: dg and du), bit for bit against the formulas
    written out here in FP32 torch ops (the sigmoid's exp: numpy's, as the interpreter's), rounded to BF16
    where autograd's BF16 ops round (as the interpreter rounds), then the reference quantization."""
    g0 = torch.Generator().manual_seed(1)
    M, I = 257, 384
    g, u, dh = ((torch.randn(M, I, generator=g0) * torch.logspace(-2, 2, I)).bfloat16() for _ in range(3))
    g[0, :5] = torch.tensor([0.0, -0.0, 80.0, -80.0, 1e-30])
    r = _truncate_to_bf16
    gf, uf, dhf = g.float(), u.float(), dh.float()
    sig = 1 / (1 + torch.from_numpy(numpy.exp(-gf.numpy())))  # tl.sigmoid as the interpreter computes it
    silu = r(gf * sig)
    refs = {"h": r(silu * uf), "dg": r(r(dhf * uf) * sig * (1 + gf * (1 - sig))), "du": r(dhf * silu)}
    fmt = Fp8Format.E4M3
    fake = SimpleNamespace(dtype=torch.float32, max=fmt.max)
    failures = []
    for pow2 in (True, False):
        got = {"h": tq.quantize_swiglu(g, u, fake, fake, pow2, 512)}
        grads = tq.quantize_swiglu_grads(dh, g, u, fake, fake, pow2, 512)
        got["dg"], got["du"] = grads[:4], grads[4:]
        for name, (qr, sr, qc, sc) in got.items():  # the ops' layout: scales [blocks, rows]
            ref = refs[name]
            rr, rs = _pre_conversion(ref, fmt, pow2)
            cr, cs = _pre_conversion(ref.t(), fmt, pow2)
            ok = torch.equal(_bits(qr[:, :I]), _bits(rr)) and torch.equal(_bits(sr.t()[:, :rs.shape[1]]), _bits(rs))
            ok &= torch.equal(_bits(qc[:, :M]), _bits(cr)) and torch.equal(_bits(sc.t()[:, :cs.shape[1]]), _bits(cs))
            ok &= not qr[:, I:].any() and not qc[:, M:].any()
            if not ok:
                failures.append(f"{name} pow2={pow2}")
        # the torch ops that torch.compile traces (triton ops, their own schemas: a clash with ops.py's custom
        # op names once replaced them) compute the same bytes
        e4m3 = torch.float8_e4m3fn
        as_ops = (*tq.quantize_swiglu_op(g, u, e4m3, e4m3, pow2, 512, True, True, False),
                  *tq.quantize_swiglu_grads_op(dh, g, u, e4m3, e4m3, pow2, 512, True, False))
        direct = (*tq.quantize_swiglu(g, u, fmt, fmt, pow2, 512),
                  *tq.quantize_swiglu_grads(dh, g, u, fmt, fmt, pow2, 512))
        same = all(torch.equal(_bits(a.float()), _bits(b.float())) for a, b in zip(as_ops, direct))
        if len(as_ops) != 12 or not same:
            failures.append(f"triton ops pow2={pow2}")
        rows_only = tq.quantize_swiglu(g, u, fake, fake, pow2, 512, cols=False)
        if not (torch.equal(rows_only[0], got["h"][0]) and rows_only[2].numel() == rows_only[3].numel() == 0):
            failures.append(f"h rows only pow2={pow2}")
        cols_only = tq.quantize_swiglu(g, u, fake, fake, pow2, 512, rows=False)
        if not (torch.equal(_bits(cols_only[2]), _bits(got["h"][2])) and torch.equal(cols_only[3], got["h"][3])
                and cols_only[0].numel() == cols_only[1].numel() == 0):
            failures.append(f"h cols only pow2={pow2}")
    return failures


def _resources(kernel) -> dict:
    """Registers and stack bytes per thread."""
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([str(cuobjdump), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    return {k: int(v) for k, v in re.findall(r"(REG|STACK):(\d+)", out)}


def compile_sm90() -> dict:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(16)}  # pointers, sizes, strides: multiples of 16
    act_types = dict(x_ptr="*bf16", M="i32", K="i32", stride_xm="i32", qr_ptr="*fp8e4nv", sr_ptr="*fp32", Kp="i32",
                     qc_ptr="*fp8e4nv", sc_ptr="*fp32", Mp="i32", y_ptr="*bf16", z_ptr="*bf16")
    w_sig = {n: "constexpr" for n in tq._weight_kernel.arg_names}
    w_sig.update(w_ptr="*fp32", N="i32", K="i32", stride_wn="i32", q_ptr="*fp8e4nv", ld_q="i32", s_ptr="*fp32",
                 ld_s="i32")
    out = {}
    for pow2 in (True, False):  # power-of-two scales (the default) and exact ones
        launches = [(name, producer, True, cols) for cols in (True, False) for name, producer in
                    (("activation", 0), ("swiglu h", 1), ("swiglu dg", 2), ("swiglu du", 3))]
        launches += [("activation x.T", 0, False, True), ("swiglu h.T", 1, False, True)]
        # input.T in 128x128 blocks (`wgrad_blocks`), both ways it is made
        launches += [(f"{name} col blocks", producer, rows, True) for name, producer, rows in
                     (("activation", 0, True), ("swiglu h", 1, True), ("activation x.T", 0, False),
                      ("swiglu h.T", 1, False))]
        # FP32 inputs too: under autocast with FP32 weights the norms' outputs (q/k/v's, gate/up's inputs) are FP32
        launches += [(f"activation fp32{t}", 0, rows, cols) for t, rows, cols in
                     (("", True, True), ("", True, False), (".T", False, True))]
        for name, producer, rows, cols in launches:
            bf16 = "fp32" not in name
            consts = dict(ROW_MAX=448.0, COL_MAX=448.0, POW2=pow2, ROWS=rows, COLS=cols, BF16=bf16, BLOCK=128,
                          PRODUCER=producer, COL_BLOCKS="col blocks" in name)
            # the pointers a launch does not use are None, as `_quantize_tiles` passes them
            unused = {"y_ptr": producer == 0, "z_ptr": producer != 2, "qc_ptr": not cols, "sc_ptr": not cols,
                      "qr_ptr": not rows, "sr_ptr": not rows}
            consts.update({n: None for n, none in unused.items() if none})
            act_sig = {n: act_types.get(n, "constexpr") if n not in consts else "constexpr"
                       for n in tq._act_kernel.arg_names}
            act_sig["x_ptr"] = "*bf16" if bf16 else "*fp32"
            k = triton.compile(ASTSource(tq._act_kernel, act_sig, consts, aligned), target=target,
                               options={"num_warps": tq._NUM_WARPS})
            out[f"{name} pow2={pow2} rows={rows} cols={cols}"] = _resources(k)
        for transpose in (False, True):
            consts = dict(FMT_MAX=448.0, POW2=pow2, BF16=False, TRANSPOSE=transpose, BLOCK=128)
            k = triton.compile(ASTSource(tq._weight_kernel, w_sig, consts, aligned), target=target,
                               options={"num_warps": tq._NUM_WARPS})
            out[f"weight pow2={pow2} transpose={transpose}"] = _resources(k)
    g_sig = {n: "constexpr" for n in tq._rows_grad_weight_kernel.arg_names}
    g_sig.update(g_ptr="*bf16", M="i32", N="i32", stride_gm="i32", q_ptr="*fp8e4nv", K="i32", stride_qm="i32",
                 s_ptr="*fp32", stride_sm="i32", stride_sk="i32", out_ptr="*fp32")
    for block_n in (16, 32, 64):  # rows_grad_weight's launches (a LoRA rank up to 16, 32, more)
        consts = dict(M_SLICE=4096, BLOCK_M=64, BLOCK_N=block_n, BLOCK=128, DOT_F32=False)
        k = triton.compile(ASTSource(tq._rows_grad_weight_kernel, g_sig, consts, aligned), target=target,
                           options={"num_warps": 8, "num_stages": 4})
        out[f"rows_grad_weight block_n={block_n}"] = _resources(k)
    return out


def mutation_analysis() -> dict:
    """What torch.compile believes each launch writes: torch's own analysis of the kernels' Triton IR (the one
    that decides which inputs inductor copies before a user kernel), with an SM90 target standing in for the
    GPU. Per launch the library makes: {"writes": [...], "reads": [...]} by argument name."""
    from triton.backends.compiler import GPUTarget
    from torch._higher_order_ops.triton_kernel_wrap import identify_accessed_tensors

    class _Sm90:  # the analysis asks the active driver for its target; there is no GPU here
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    triton.runtime.driver.set_active(_Sm90())

    def accessed(kernel, kw: dict) -> dict:
        rw = identify_accessed_tensors(kernel, kw, {}).read_writes
        return {"writes": sorted(d.name for d in rw.writes), "reads": sorted(d.name for d in rw.reads)}

    M, K = 256, 384
    x, y, z = (torch.randn(M, K).to(torch.bfloat16) for _ in range(3))
    fp8 = torch.float8_e4m3fn
    out = {}
    for producer, others in ((0, ()), (1, (y,)), (2, (y, z)), (3, (y,))):
        for rows, cols, blocks in ((True, True, False), (True, False, False), (False, True, False), (True, True, True),
                                   (False, True, True)):
            y_, z_ = (*others, None, None)[:2]
            kw = dict(x_ptr=x, M=M, K=K, stride_xm=K, qr_ptr=torch.empty(M, K, dtype=fp8) if rows else None,
                      sr_ptr=torch.empty(K // 128, M) if rows else None, Kp=K,
                      qc_ptr=torch.empty(K, M, dtype=fp8) if cols else None,
                      sc_ptr=(torch.empty(K // 128, M // 128) if blocks else torch.empty(M // 128, K)) if cols else None,
                      Mp=M, y_ptr=y_, z_ptr=z_, ROW_MAX=448.0, COL_MAX=448.0, POW2=True, ROWS=rows, COLS=cols,
                      BF16=True, BLOCK=128, PRODUCER=producer, COL_BLOCKS=blocks)
            out[f"activation producer={producer} rows={rows} cols={cols}{' col blocks' if blocks else ''}"] = \
                accessed(tq._act_kernel, kw)
    w = torch.randn(M, K)
    for transpose in (False, True):
        kw = dict(w_ptr=w, N=M, K=K, stride_wn=K, q_ptr=torch.empty(M, K, dtype=fp8), ld_q=K,
                  s_ptr=torch.empty(M // 128, K // 128), ld_s=K // 128, FMT_MAX=448.0, POW2=True, BF16=False,
                  TRANSPOSE=transpose, BLOCK=128)
        out[f"weight transpose={transpose}"] = accessed(tq._weight_kernel, kw)
    kw = dict(g_ptr=x[:, :16].contiguous(), M=M, N=16, stride_gm=16, q_ptr=torch.empty(M, K, dtype=fp8), K=K,
              stride_qm=K, s_ptr=torch.empty(K // 128, M), stride_sm=1, stride_sk=M,
              out_ptr=torch.empty(1, 16, K), M_SLICE=M, BLOCK_M=64, BLOCK_N=16, BLOCK=128, DOT_F32=False)
    out["rows_grad_weight"] = accessed(tq._rows_grad_weight_kernel, kw)
    return out


def op_registrations() -> dict:
    """Each fp8train op (the kernels' triton_ops, the ops' and gemm's custom ops; all imported, as on a GPU):
    {qualified name: [how many define it, whether the dispatcher's schema is the one it was defined with]}. A
    second definition of a name replaces the first silently, and calls of the first then miss arguments."""
    from torch._library.custom_ops import CustomOpDef

    from fp8train.fp8 import gemm, kernels, ops

    out: dict[str, list] = {}
    for module in (kernels, gemm, ops):
        for op in (v for v in vars(module).values() if isinstance(v, CustomOpDef)):
            schema = str(getattr(torch.ops.fp8train, op._qualname.split("::")[1]).default._schema)
            count, same = out.get(op._qualname, (0, True))
            out[op._qualname] = [count + 1, same and schema == op._qualname + op._schema]
    return out


if __name__ == "__main__":
    print(json.dumps({"interpret": interpret, "exhaustive": exhaustive, "compile": compile_sm90,
                      "mutation": mutation_analysis, "ops": op_registrations}[sys.argv[1]]()))
