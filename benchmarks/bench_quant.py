"""Quantization kernels against memory bandwidth: each variant checked bit for bit, then timed.

    PYTHONPATH=. python benchmarks/bench_quant.py [--legacy PATH] [--out results.json]
    ncu ... python benchmarks/bench_quant.py --once --shapes 8192x18944 --only "^w8$"   # one launch each, untimed

The activation kernel reads x [M, K] (BF16) once and writes two FP8 copies plus their scales, so its
floor is (2 + 1 + 1) bytes per element at copy bandwidth; the weight kernel reads FP32 and writes two
FP8 copies (4 + 1 + 1). Variants: the library's kernels at 4/8/16 warps, the rows-only launch (no
backward), the same with exact FP32 scales (`pow2_scale: false`), the SwiGLU producers against what they
replace, with `--strip` a kernel that loops over several 128-feature tiles per program (software-pipelined
loads; tried and dropped), and `--legacy` (a copy of an older `_triton_quant.py`, for A/B in one process).
Candidates for the H200, where the activation kernel streams at ~2.6 TB/s of ~4.3 (docs/benchmarks.md): a
copy of its plain two-copy launch with the programs walking the features first, without masks, or with
streaming cache hints (`_layout_kernel`). (16-warp launches, with a register cap or without, measured
1.45-1.67x slower than 8 warps on the H100 and went, docs/benchmarks.md, seventeenth session; the Gluon
kernels and the weight kernel's per-element division, timed on 2026-12-05, are gone too: section 1.)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys

import torch
import triton
import triton.language as tl

from _harness import median_us, projection_shapes  # a sibling module (benchmarks/ is on sys.path)
from fp8train.fp8 import kernels as tq
from fp8train import make_recipe, quantize
from fp8train.fp8.recipe import Fp8Format

E4M3 = Fp8Format.E4M3
TOKENS = 8192
_1_5B, _7B = projection_shapes("qwen2.5-1.5b"), projection_shapes("qwen2.5-7b")
SWIGLU_SHAPES = [(TOKENS, p["down"][1]) for p in (_1_5B, _7B)]  # [tokens, intermediate]: h, dg, du
ACT_SHAPES = [(TOKENS, _1_5B["q/o"][1]), SWIGLU_SHAPES[0], (TOKENS, _7B["q/o"][1]), SWIGLU_SHAPES[1]]
WEIGHT_SHAPES = [_1_5B["gate/up"], _7B["gate/up"], _7B["down"]]


def _outputs(M: int, K: int, Kp: int, Mp: int, device) -> tuple:
    """The two-copy launch's outputs: rows [M, Kp] and scales [Kp/128, M], cols [K, Mp] and scales [Mp/128, K]."""
    return (torch.empty(M, Kp, dtype=E4M3.dtype, device=device), torch.empty(Kp // 128, M, device=device),
            torch.empty(K, Mp, dtype=E4M3.dtype, device=device), torch.empty(Mp // 128, K, device=device))


@triton.jit
def _strip_kernel(x_ptr, M, K, stride_xm, qr_ptr, sr_ptr, Kp, qc_ptr, sc_ptr, Mp,
                  FMT_MAX: tl.constexpr, DTYPE: tl.constexpr, TILES: tl.constexpr, STAGES: tl.constexpr,
                  BLOCK: tl.constexpr):
    """One program: 128 tokens x TILES feature tiles, the loads of the next tile in flight (BF16, POW2 only)."""
    pid_m = tl.program_id(0)
    offs_m = pid_m * BLOCK + tl.arange(0, BLOCK)
    in_m = offs_m < M
    for t in tl.range(0, TILES, num_stages=STAGES):
        pid_k = tl.program_id(1) * TILES + t
        offs_k = pid_k * BLOCK + tl.arange(0, BLOCK)
        in_k = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=in_m[:, None] & in_k[None, :], other=0.0)
        ax = tq.abs_bits(x, True)
        s_r = tq.scale_from_amax_bits(tq.amax_bits(ax, 1, True), FMT_MAX, True)
        s_c = tq.scale_from_amax_bits(tq.amax_bits(ax, 0, True), FMT_MAX, True)
        q_r = tq.scaled(x, tq.inverse(s_r, True)[:, None]).to(DTYPE)
        tl.store(qr_ptr + offs_m[:, None] * Kp + offs_k[None, :], q_r, mask=in_m[:, None] & (offs_k < Kp)[None, :])
        tl.store(sr_ptr + pid_k * M + offs_m, s_r, mask=in_m & (pid_k * BLOCK < Kp))
        q_c = tq.scaled(x, tq.inverse(s_c, True)[None, :]).to(DTYPE)
        tl.store(qc_ptr + offs_k[:, None] * Mp + offs_m[None, :], tl.trans(q_c),
                 mask=in_k[:, None] & (offs_m < Mp)[None, :])
        tl.store(sc_ptr + pid_m * K + offs_k, s_c, mask=in_k & (pid_m * BLOCK < Mp))


@triton.jit
def _layout_kernel(x_ptr, M, K, stride_xm, qr_ptr, sr_ptr, Kp, qc_ptr, sc_ptr, Mp, FMT_MAX: tl.constexpr,
                   K_FASTEST: tl.constexpr, EVEN: tl.constexpr, STREAM: tl.constexpr, BLOCK: tl.constexpr):
    """The two-copy launch (BF16, POW2) with one of three changes, to time where the H200 loses bandwidth:
    K_FASTEST, consecutive programs walk the features (x read and the rows copy written as contiguous runs,
    the cols copy strided) rather than the tokens; EVEN, no masks (every tile whole and no padding: M, K
    multiples of 128, Kp == K, Mp == M); STREAM, loads and stores marked evict-first / streaming."""
    if K_FASTEST:
        pid_k = tl.program_id(0)
        pid_m = tl.program_id(1)
    else:
        pid_m = tl.program_id(0)
        pid_k = tl.program_id(1)
    offs_m = pid_m * BLOCK + tl.arange(0, BLOCK)
    offs_k = pid_k * BLOCK + tl.arange(0, BLOCK)
    in_m = offs_m < M
    in_k = offs_k < K
    if EVEN:
        x_mask = None
        r_mask = None
        c_mask = None
        sr_mask = None
        sc_mask = None
    else:
        x_mask = in_m[:, None] & in_k[None, :]
        r_mask = in_m[:, None] & (offs_k < Kp)[None, :]
        c_mask = in_k[:, None] & (offs_m < Mp)[None, :]
        sr_mask = in_m & (pid_k * BLOCK < Kp)
        sc_mask = in_k & (pid_m * BLOCK < Mp)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    if EVEN:
        if STREAM:
            x = tl.load(x_ptrs, eviction_policy="evict_first")
        else:
            x = tl.load(x_ptrs)
    elif STREAM:
        x = tl.load(x_ptrs, mask=x_mask, other=0.0, eviction_policy="evict_first")
    else:
        x = tl.load(x_ptrs, mask=x_mask, other=0.0)
    ax = tq.abs_bits(x, True)
    s_r = tq.scale_from_amax_bits(tq.amax_bits(ax, 1, True), FMT_MAX, True)
    s_c = tq.scale_from_amax_bits(tq.amax_bits(ax, 0, True), FMT_MAX, True)
    q_r = tq.scaled(x, tq.inverse(s_r, True)[:, None]).to(qr_ptr.dtype.element_ty)
    if STREAM:
        tl.store(qr_ptr + offs_m[:, None] * Kp + offs_k[None, :], q_r, mask=r_mask, cache_modifier=".cs")
    else:
        tl.store(qr_ptr + offs_m[:, None] * Kp + offs_k[None, :], q_r, mask=r_mask)
    tl.store(sr_ptr + pid_k * M + offs_m, s_r, mask=sr_mask)
    q_t = tl.trans(tq.scaled(x, tq.inverse(s_c, True)[None, :]).to(qc_ptr.dtype.element_ty))
    if STREAM:
        tl.store(qc_ptr + offs_k[:, None] * Mp + offs_m[None, :], q_t, mask=c_mask, cache_modifier=".cs")
    else:
        tl.store(qc_ptr + offs_k[:, None] * Mp + offs_m[None, :], q_t, mask=c_mask)
    tl.store(sc_ptr + pid_m * K + offs_k, s_c, mask=sc_mask)


def layout_quantize(x2d, k_fastest: bool = False, even: bool = False, stream: bool = False, pad: int = 512):
    M, K = x2d.shape
    Kp, Mp = tq.round_up(K, pad), tq.round_up(M, pad)
    qr, sr, qc, sc = _outputs(M, K, Kp, Mp, x2d.device)
    tiles = (Mp // 128, Kp // 128)
    grid = tiles[::-1] if k_fastest else tiles
    even = even and M % 128 == 0 and K % 128 == 0 and (Kp, Mp) == (K, M)
    _layout_kernel[grid](x2d, M, K, x2d.stride(0), qr, sr, Kp, qc, sc, Mp, FMT_MAX=E4M3.max, K_FASTEST=k_fastest,
                         EVEN=even, STREAM=stream, BLOCK=128, num_warps=8)  # the library launch's warps
    return qr, sr.t(), qc, sc.t()


def strip_quantize(x2d, tiles: int, stages: int, num_warps: int = 8, pad: int = 512):
    M, K = x2d.shape
    Kp, Mp = tq.round_up(K, pad), tq.round_up(M, pad)
    qr, sr, qc, sc = _outputs(M, K, Kp, Mp, x2d.device)
    grid = (Mp // 128, Kp // 128 // tiles)  # Kp / 128 is a multiple of 4: tiles in {1, 2, 4}
    _strip_kernel[grid](x2d, M, K, x2d.stride(0), qr, sr, Kp, qc, sc, Mp, FMT_MAX=E4M3.max, DTYPE=tl.float8e4nv,
                        TILES=tiles, STAGES=stages, BLOCK=128, num_warps=num_warps)
    return qr, sr.t(), qc, sc.t()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


def check_act(fn, x, pow2: bool) -> bool:
    M, K = x.shape
    qr, sr, qc, sc = fn(x)
    r, c = quantize(x, (1, 128), E4M3, pow2), quantize(x.t(), (1, 128), E4M3, pow2)
    ok = torch.equal(_bits(qr[:, :K]), _bits(r.data)) and torch.equal(_bits(sr[:, :r.scale.shape[1]]), _bits(r.scale))
    if qc is not None:
        ok &= torch.equal(_bits(qc[:, :M]), _bits(c.data)) and torch.equal(_bits(sc[:, :c.scale.shape[1]]), _bits(c.scale))
    return bool(ok)


def check_weight(fn, w, pow2: bool) -> bool:
    N, K = w.shape
    (q, s), (qt, _) = fn(w)
    ref = quantize(w, (128, 128), E4M3, pow2)
    return bool(torch.equal(_bits(q[:, :K]), _bits(ref.data)) and torch.equal(_bits(qt[:, :N]), _bits(ref.data.t().contiguous()))
                and torch.equal(_bits(s[:, :ref.scale.shape[1]]), _bits(ref.scale)))


def _data(shape, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(shape, generator=g, device="cuda") * torch.logspace(-3, 3, shape[1], device="cuda")[None, :]
    x[7] = 0.0
    return x.to(dtype)


def _wanted(shape, shapes: list[str] | None) -> bool:
    return shapes is None or f"{shape[0]}x{shape[1]}" in shapes


def _differ(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((_bits(a) != _bits(b)).sum())


def swiglu_rows(copy_tbs: float, once: bool = False, shapes: list[str] | None = None,
                only: str | None = None) -> list[dict]:
    """The SwiGLU producers (`fuse_swiglu`) against what they replace, at the MLP's [tokens, intermediate]:
    forward, inductor's fused silu(g) * u (BF16 h written) then the activation kernel (rows + cols); backward,
    inductor's fused derivatives (dg, du written) then the kernel on each. "bit-exact" here: the fused
    kernels' FP8 bytes equal the quantization of torch's eager ops but for at most 1e-5 of them. Bytes moved:
    fused forward reads g, u (4 per element) and writes 2; backward reads dh, g, u (6) and writes 4."""
    from fp8train.fp8 import ops
    from fp8train.fp8.operands import LinearPlan

    plan = LinearPlan.of(make_recipe("hybrid"), True)

    fwd_ref = torch.compile(ops.swiglu_reference)
    bwd_ref = torch.compile(ops.swiglu_grads_reference)
    rows = []
    for M, I in SWIGLU_SHAPES:
        if not _wanted((M, I), shapes):
            continue
        g, u, dh = (_data((M, I), torch.bfloat16, 10 + i) for i in range(3))
        want_h = ops.quantize_input(ops.swiglu_reference(g, u), plan, True)
        dg, du = ops.swiglu_grads_reference(dh, g, u)
        want_g = (*ops.quantize_input(dg, plan, True), *ops.quantize_input(du, plan, True))
        dg = du = None
        variants = {
            "swiglu fwd: inductor h + kernel": (lambda: ops.quantize_input(fwd_ref(g, u), plan, True), None, 6 + 4),
            "swiglu fwd: fused": (lambda: ops.quantize_swiglu(g, u, plan, True), want_h, 6),
            "swiglu bwd: inductor dg, du + kernel x2": (
                lambda: [ops.quantize_input(t, plan, True) for t in bwd_ref(dh, g, u)], None, 10 + 8),
            "swiglu bwd: fused": (lambda: ops.quantize_swiglu_grads(dh, g, u, plan, True), want_g, 14),
        }
        for name, (fn, want, nbytes) in variants.items():
            if only and not re.search(only, name):
                continue
            ok = want is None or sum(_differ(a, b) for a, b in zip(fn(), want)) <= 1e-4 * M * I * 2 * (len(want) // 4)
            us = float("nan") if once else median_us(fn)
            moved = M * I * nbytes
            rows.append({"kind": "swiglu", "shape": [M, I], "variant": name, "bit_exact": bool(ok), "us": us,
                         "tb_s": moved / (us * 1e-6) / 1e12, "floor_us": moved / (copy_tbs * 1e12) * 1e6})
            print(json.dumps(rows[-1]), flush=True)
        g = u = dh = want_h = want_g = None
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--legacy", default=None, help="path of an older _triton_quant.py to compare against")
    ap.add_argument("--out", default=None)
    ap.add_argument("--strip", action="store_true", help="also time the strip variants (tried and dropped)")
    ap.add_argument("--only-swiglu", action="store_true", help="time the SwiGLU producers only")
    ap.add_argument("--shapes", nargs="+", default=None, metavar="MxK",
                    help="only these [M, K] (activations, weights and SwiGLU shapes alike), e.g. 8192x18944")
    ap.add_argument("--only", default=None, metavar="REGEX", help="only the variants whose name this matches")
    ap.add_argument("--once", action="store_true",
                    help="check each variant and run it once, untimed (for `ncu --kernel-name ...`)")
    args = ap.parse_args(argv)
    legacy = None
    if args.legacy:
        spec = importlib.util.spec_from_file_location("legacy_triton_quant", args.legacy)
        legacy = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(legacy)

    big = torch.empty(*SWIGLU_SHAPES[-1], dtype=torch.bfloat16, device="cuda").normal_()  # the largest
    copy_tbs = 2 * big.numel() * 2 / (median_us(lambda: big.clone()) * 1e-6) / 1e12
    big = None  # free it before the kernels run
    print(f"device {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  "
          f"copy bandwidth {copy_tbs:.2f} TB/s (read + write)", flush=True)

    act = {f"w{w}": (lambda x, w=w: tq.quantize_tiles_and_transpose(x, E4M3, E4M3, True, 512, num_warps=w))
           for w in (4, 8, 16)}
    act["w8 rows-only"] = lambda x: tq.quantize_tiles_and_transpose(x, E4M3, E4M3, True, 512, cols=False)
    # exact FP32 scales (`pow2_scale: false`): one correctly rounded reciprocal per block, then a multiply
    act["w8 exact"] = lambda x: tq.quantize_tiles_and_transpose(x, E4M3, E4M3, False, 512)
    act["w8 exact rows-only"] = lambda x: tq.quantize_tiles_and_transpose(x, E4M3, E4M3, False, 512, cols=False)
    for tiles, stages in ((2, 2), (4, 2), (4, 3)) if args.strip else ():  # tried and dropped (docs, section 1)
        act[f"strip t{tiles} s{stages}"] = lambda x, t=tiles, s=stages: strip_quantize(x, t, s)
    for name, kw in (("k-fastest", dict(k_fastest=True)), ("even", dict(even=True)), ("stream", dict(stream=True)),
                     ("even k-fastest stream", dict(even=True, k_fastest=True, stream=True))):
        act[f"w8 {name}"] = lambda x, kw=kw: layout_quantize(x, **kw)
    if legacy is not None:
        act["legacy"] = lambda x: legacy.quantize_tiles_and_transpose(x, E4M3, E4M3, True, 512)
    wgt = {f"w{w}": (lambda w_, w=w: (tq.quantize_blocks(w_, E4M3, True, 512, num_warps=w),
                                      tq.quantize_blocks(w_, E4M3, True, 512, True, num_warps=w))) for w in (4, 8, 16)}
    wgt["w8 exact"] = lambda w_: (tq.quantize_blocks(w_, E4M3, False, 512),
                                  tq.quantize_blocks(w_, E4M3, False, 512, True))
    if legacy is not None:
        def legacy_weight(w_):  # the old kernel returned (W, W.T, scale)
            q, qt, s = legacy.quantize_blocks_and_transpose(w_, E4M3, True, 512)
            return (q, s), (qt, s)

        wgt["legacy"] = legacy_weight

    rows = []
    kinds = (("activation", ACT_SHAPES, act, torch.bfloat16, 4), ("weight", WEIGHT_SHAPES, wgt, torch.float32, 6))
    for kind, shapes, variants, dtype, nbytes in kinds if not args.only_swiglu else ():
        for i, shape in enumerate(shapes):
            if not _wanted(shape, args.shapes):
                continue
            x = _data(shape, dtype, i)
            floor_us = shape[0] * shape[1] * nbytes / (copy_tbs * 1e12) * 1e6
            for name, fn in variants.items():
                if args.only and not re.search(args.only, name):
                    continue
                try:
                    ok = (check_act if kind == "activation" else check_weight)(fn, x, "exact" not in name)
                    us = float("nan") if args.once else median_us(lambda: fn(x))
                except Exception as e:  # a variant that does not compile is reported, not fatal
                    print(f"{kind} {shape} {name}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                moved = shape[0] * shape[1] * (nbytes if "rows-only" not in name else nbytes - 1)
                rows.append({"kind": kind, "shape": list(shape), "variant": name, "bit_exact": ok, "us": us,
                             "tb_s": moved / (us * 1e-6) / 1e12, "floor_us": floor_us})
                print(json.dumps(rows[-1]), flush=True)
            x = None
    rows += swiglu_rows(copy_tbs, args.once, args.shapes, args.only)
    print("\n| kind | M x K | variant | bit-exact | us | TB/s | floor us (copy bw) |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kind']} | {r['shape'][0]} x {r['shape'][1]} | {r['variant']} | {'yes' if r['bit_exact'] else 'NO'} "
              f"| {r['us']:.0f} | {r['tb_s']:.2f} | {r['floor_us']:.0f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"copy_tb_s": copy_tbs, "rows": rows}, f, indent=1)
    return 0 if all(r["bit_exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
