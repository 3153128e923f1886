"""A LoRA adapter A's grad_weight from its input's FP8 rows (`model.lora.inputs_fp8`) against BF16's GEMM.

    PYTHONPATH=. python benchmarks/bench_rows_grad_weight.py [--rank 16] [--out results.jsonl]

dA [r, K] = g.T @ x over the tokens: BF16 LoRA's autograd runs it as one cuBLAS GEMM on the BF16 input (2 bytes
an element read); `inputs_fp8` keeps only the frozen base's FP8 rows of x (1 byte an element, a scale per 128),
and `kernels.rows_grad_weight` reads those. With r = 16 the product is thin, so both are bound by reading x:
the kernel's floor is half the GEMM's. Each launch configuration (`block_m`, `num_warps`, `num_stages`,
`waves`) is checked against the default's output (the same products, summed in another order) and the
default against an FP64 product (both within a few units of sqrt(tokens) x 2^-24, `_TOL`), then timed (median
of triton's do_bench) at Qwen2.5-7B's adapter widths.
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import torch

from _harness import append_jsonl, median_us, projection_shapes  # a sibling module (benchmarks/ is on sys.path)
from fp8train import make_recipe
from fp8train.fp8 import kernels as tq
from fp8train.fp8 import ops
from fp8train.fp8.operands import LinearPlan, dequantize_operand

TOKENS = 8192
DEFAULT = {"block_m": 64, "num_warps": 8, "num_stages": 4, "waves": 2}
SWEEP = [dict(zip(DEFAULT, v)) for v in itertools.product((64, 128, 256), (4, 8), (3, 4), (2, 4, 8))]  # 36


# FP32 sums of TOKENS products: relative to the largest sum, a few units of sqrt(TOKENS) * 2^-24 (2.2e-6 measured
# at K=18944 on an H100), whichever order the launch sums in
_TOL = 4 * TOKENS ** 0.5 * 2.0 ** -24


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def run(rank: int, widths: list[int]) -> list[dict]:
    plan = LinearPlan.of(make_recipe("hybrid"), True)
    rows = []
    for k in widths:
        gen = torch.Generator(device="cuda").manual_seed(k)
        x = (torch.randn(TOKENS, k, generator=gen, device="cuda") *
             torch.logspace(-2, 2, k, device="cuda")[None, :]).bfloat16()
        g = torch.randn(TOKENS, rank, generator=gen, device="cuda").bfloat16()
        q, s = ops.quantize_input(x, plan, False)[:2]
        want = g.double().t() @ dequantize_operand(q, s, plan.x).double()[:, :k]
        base = tq.rows_grad_weight(g, q, s, k)
        if _rel(base, want) > _TOL:
            raise SystemExit(f"rows_grad_weight at K={k}: error {_rel(base, want):.1e} against FP64")
        read = x.numel() + s.numel() * 4 + g.numel() * 2  # bytes the kernel must read
        bf16_us = median_us(lambda: g.t() @ x)
        rows.append({"K": k, "rank": rank, "variant": "BF16 GEMM g.T @ x (cuBLAS)", "us": bf16_us,
                     "GB/s": (2 * x.numel() + g.numel() * 2) / bf16_us / 1e3, "x BF16": 1.0})
        for cfg in SWEEP:
            out = tq.rows_grad_weight(g, q, s, k, **cfg)
            if _rel(out, base) > _TOL:
                raise SystemExit(f"rows_grad_weight {cfg} at K={k}: {_rel(out, base):.1e} from the default's")
            us = median_us(lambda: tq.rows_grad_weight(g, q, s, k, **cfg))
            name = " ".join(f"{a}={b}" for a, b in cfg.items()) + (" (default)" if cfg == DEFAULT else "")
            rows.append({"K": k, "rank": rank, "variant": name, "us": us, "GB/s": read / us / 1e3,
                         "x BF16": bf16_us / us})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--model", default="qwen2.5-7b", help="a preset whose hidden and intermediate widths to use")
    ap.add_argument("--out", default=None, help="append the rows as JSON lines")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_rows_grad_weight: needs a CUDA GPU (the Triton kernel)")
    shapes = projection_shapes(args.model)
    rows = run(args.rank, [shapes["q/o"][1], shapes["down"][1]])
    print(f"| K | variant | us | GB/s | x BF16 GEMM |  ({torch.cuda.get_device_name()}, {TOKENS} tokens, r={args.rank})")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['K']} | {r['variant']} | {r['us']:.1f} | {r['GB/s']:.0f} | {r['x BF16']:.2f} |")
        append_jsonl(args.out and Path(args.out), {**r, "gpu": torch.cuda.get_device_name(), "model": args.model})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
