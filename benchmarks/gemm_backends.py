"""The three blockwise FP8 GEMMs on cuBLAS (`scaled_mm`) against DeepGEMM's SM90 kernels (one GPU, one process).

    PYTHONPATH=. python benchmarks/gemm_backends.py [--tokens 8192] [--models 7b 1.5b] [--out gemms.jsonl]

Operands are made by fp8train's own quantization kernels for the hybrid recipe, exactly as training makes
them (layouts, padding, power-of-two scales), from random BF16 tensors with a few large channels. For each
projection shape of a model and each GEMM:
  output       y  [M, N] = x [M, K] @ W [N, K].T             1x128 tiles . 128x128 blocks, BF16 out
  grad_input   dx [M, K] = dy [M, N] @ W.T [K, N].T          1x128 tiles . 128x128 blocks, BF16 out
  grad_weight  dW [N, K] = dy.T [N, M] @ x.T [K, M].T        1x128 tiles . 1x128 tiles (along tokens), FP32 out
it times both backends with CUDA events (median after warm-up), checks each against the FP32 product of the
dequantized operands (SQNR in dB) and whether the two agree bit for bit. output and grad_input go through
`gemm(..., deep_gemm=True)`, the route training takes with the recipe's `deep_gemm`; DeepGEMM's
grad_weight kernel, which training does not use, accumulates into an FP32 C (D = C + A B): timed with
C = D = a zeroed buffer, the zeroing timed apart.

`--merged` asks what one GEMM per group of projections that read the same input would save (a measurement
before any such change to the library): q, k and v as one [Nq + 2 Nkv, K] projection, gate and up as one
[2 I, K], against their separate GEMMs on the route training takes, the separate grad_inputs' BF16 sums
included (two for q/k/v, one for gate/up).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from _harness import projection_shapes  # a sibling module (benchmarks/ is on sys.path)
from fp8train.fp8 import ops
from fp8train.fp8.gemm import gemm
from fp8train.fp8.operands import LinearPlan, dequantize_operand
from fp8train.fp8.recipe import make_recipe

SHAPES = {"1.5b": projection_shapes("qwen2.5-1.5b"), "7b": projection_shapes("qwen2.5-7b")}  # (N, K) per projection


_PER_LAYER = {"q/o": 2, "k/v": 2, "gate/up": 2, "down": 1}  # projections of each shape in a decoder layer


def _ms(fn) -> float:
    import triton.testing  # GPU machines only: the table below is also read on the CPU

    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def _sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    err = (out.double() - ref.double()).pow(2).sum()
    return float(10 * torch.log10(ref.double().pow(2).sum() / err.clamp_min(1e-300)))


def _operands(M: int, N: int, K: int, plan: LinearPlan) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, K, device="cuda", generator=g).mul_(0.5)
    x[:, :: max(1, K // 8)] *= 40.0  # a few massive channels, as real residual streams have
    w = torch.randn(N, K, device="cuda", generator=g).mul_(K ** -0.5)
    dy = torch.randn(M, N, device="cuda", generator=g).mul_(1e-3)
    x, w, dy = x.bfloat16(), w.bfloat16(), dy.bfloat16()
    xa, xa_s, xt, xt_s = ops.quantize_input(x, plan, make_cols=True)
    ga, ga_s, gt, gt_s = ops.quantize_input(dy, plan, make_cols=True)  # grad_output: the same kernel and specs
    wo, wo_s = ops.quantize_weight(w, plan.w, plan.pow2, False, True)
    wt, wt_s = ops.quantize_weight(w, plan.w_t, plan.pow2, True, True)
    return {"output": (xa, xa_s, plan.x, wo, wo_s, plan.w, torch.bfloat16),
            "grad_input": (ga, ga_s, plan.g, wt, wt_s, plan.w_t, torch.bfloat16),
            "grad_weight": (gt, gt_s, plan.g_t, xt, xt_s, plan.x_t, torch.float32)}


def _deep_gemm_tile_tile(dg, a, a_s, b, b_s, out: torch.Tensor) -> torch.Tensor:
    """grad_weight on DeepGEMM's 1x128 . 1x128 kernel, which fp8train does not route (cuBLAS is faster there):
    D = C + A @ B.T with C = D (`out`, zeroed by the caller); 1x128 scales stored [C/128, rows], handed over as
    their (rows, C/128) transpose view (strides (1, rows)), the MN-major layout the SM90 kernels read."""
    dg.fp8_gemm_nt((a, a_s.t()), (b, b_s.t()), out, c=out, recipe=(1, 1, 128))
    return out


def bench(dg, model: str, M: int) -> list[dict]:
    plan = LinearPlan.of(make_recipe("hybrid"), cublas=True)
    rows = []
    for name, (N, K) in SHAPES[model].items():
        for kind, (a, a_s, a_spec, b, b_s, b_spec, out_dtype) in _operands(M, N, K, plan).items():
            with torch.no_grad():
                ref = dequantize_operand(a, a_s, a_spec) @ dequantize_operand(b, b_s, b_spec).t()
            cublas = lambda: gemm(a, a_s, a_spec, b, b_s, b_spec, out_dtype, True)  # noqa: E731
            flops = 2 * ref.shape[0] * ref.shape[1] * a.shape[1]  # the padded contraction, as both run it
            r = {"model": model, "shape": name, "gemm": kind, "M": ref.shape[0], "N": ref.shape[1], "K": a.shape[1],
                 "cublas_ms": _ms(cublas), "cublas_sqnr": _sqnr(ref, cublas())}
            if dg is not None:
                if kind == "grad_weight":
                    out = torch.zeros(ref.shape, device="cuda", dtype=out_dtype)
                    deep = lambda: _deep_gemm_tile_tile(dg, a, a_s, b, b_s, out.zero_())  # noqa: E731
                    r["zero_ms"] = _ms(lambda: out.zero_())
                else:  # the route training takes with the recipe's deep_gemm
                    deep = lambda: gemm(a, a_s, a_spec, b, b_s, b_spec, out_dtype,  # noqa: E731
                                        True, deep_gemm=True)
                res = deep().clone()
                r["deepgemm_sqnr"] = _sqnr(ref, res)
                r["deepgemm_bit_identical"] = bool(torch.equal(res, cublas()))
                r["deepgemm_ms"] = _ms(deep)
            for key in ("cublas", "deepgemm"):
                if f"{key}_ms" in r:
                    r[f"{key}_tflops"] = flops / r[f"{key}_ms"] / 1e9
            rows.append(r)
            print(json.dumps(r), flush=True)
    return rows


def bench_merged(model: str, M: int, deep_gemm: bool) -> list[dict]:
    """Each group's three GEMMs, separate (as many launches as projections, + grad_input sums) and merged."""
    plan = LinearPlan.of(make_recipe("hybrid", deep_gemm=deep_gemm), cublas=True)
    shapes = SHAPES[model]
    (nq, k), (nkv, _), (ni, _) = shapes["q/o"], shapes["k/v"], shapes["gate/up"]
    groups = {"q/k/v": ([nq, nkv, nkv], nq + 2 * nkv), "gate/up": ([ni, ni], 2 * ni)}

    def time_ms(operands: tuple) -> float:  # one GEMM on the route training takes
        return _ms(lambda: gemm(*operands, True, deep_gemm=deep_gemm))

    dx = torch.randn(M, k, device="cuda").bfloat16()
    add_ms = _ms(lambda: dx + dx)  # one BF16 sum of two grad_inputs [M, K]
    rows = []
    for group, (parts, merged) in groups.items():
        separate = [_operands(M, n, k, plan) for n in parts]
        whole = _operands(M, merged, k, plan)
        for kind in ("output", "grad_input", "grad_weight"):
            sep = sum(time_ms(part[kind]) for part in separate)
            sep += add_ms * (len(parts) - 1) if kind == "grad_input" else 0.0
            one = time_ms(whole[kind])
            r = {"model": model, "group": group, "gemm": kind, "deep_gemm": deep_gemm, "separate_ms": sep,
                 "merged_ms": one, "saved_ms": sep - one}
            rows.append(r)
            print(json.dumps(r), flush=True)
    return rows


def merged_table(rows: list[dict]) -> str:
    out = ["| model | group | GEMM | deep_gemm | separate ms (+ sums) | merged ms | saved ms |",
           "|---|---|---|---|---|---|---|"]
    out += [f"| {r['model']} | {r['group']} | {r['gemm']} | {r['deep_gemm']} | {r['separate_ms']:.3f} | "
            f"{r['merged_ms']:.3f} | {r['saved_ms']:.3f} |" for r in rows]
    return "\n".join(out)


def table(rows: list[dict]) -> str:
    out = ["| model | shape | GEMM | M x N x K | cuBLAS ms | TFLOP/s | DeepGEMM ms | TFLOP/s | speed-up "
           "| SQNR dB cuBLAS / DeepGEMM | bit-identical |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        dg = r.get("deepgemm_ms")
        deep = (f"{dg:.3f} | {r['deepgemm_tflops']:.0f} | {r['cublas_ms'] / dg:.3f}" if dg else "- | - | -")
        out.append(f"| {r['model']} | {r['shape']} | {r['gemm']} | {r['M']} x {r['N']} x {r['K']} | "
                   f"{r['cublas_ms']:.3f} | {r['cublas_tflops']:.0f} | {deep} | {r['cublas_sqnr']:.1f} / "
                   f"{r.get('deepgemm_sqnr', math.nan):.1f} | {r.get('deepgemm_bit_identical', '-')} |")
    for model in dict.fromkeys(r["model"] for r in rows):
        sel = [r for r in rows if r["model"] == model and "deepgemm_ms" in r]
        if sel:  # one decoder layer: each shape as many times as the layer has it
            layer = lambda pick: sum(_PER_LAYER[r["shape"]] * pick(r) for r in sel)  # noqa: E731
            cublas = layer(lambda r: r["cublas_ms"])
            routed = layer(lambda r: r["cublas_ms"] if r["gemm"] == "grad_weight" else r["deepgemm_ms"])
            out.append(f"\n{model}, one decoder layer's 21 GEMMs: cuBLAS {cublas:.2f} ms; with `deep_gemm` (output "
                       f"and grad_input on DeepGEMM) {routed:.2f} ms ({cublas / routed:.3f}x); all on DeepGEMM "
                       f"{layer(lambda r: r['deepgemm_ms']):.2f} ms")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--models", nargs="+", default=["7b", "1.5b"], choices=sorted(SHAPES))
    p.add_argument("--out", type=Path)
    p.add_argument("--merged", action="store_true", help="also time q/k/v and gate/up as one GEMM each")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gemm_backends.py: no CUDA device", file=sys.stderr)
        return 2
    try:
        import deep_gemm as dg
    except ImportError as e:
        print(f"gemm_backends.py: deep_gemm not importable ({e}); timing cuBLAS only", file=sys.stderr)
        dg = None
    rows = [r for model in args.models for r in bench(dg, model, args.tokens)]
    print(table(rows))
    if args.merged:
        merged = [r for model in args.models for deep in ((False, True) if dg else (False,))
                  for r in bench_merged(model, args.tokens, deep)]
        print(merged_table(merged))
        rows += merged
    if args.out:
        args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
