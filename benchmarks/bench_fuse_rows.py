"""An activation's 1x128 FP8 rows made inside the inductor kernel that produces it (`fuse_row_quantization`)
against the tile kernel reading it back.

    PYTHONPATH=. python benchmarks/bench_fuse_rows.py [--model qwen2.5-7b] [--out results.jsonl]

The producer is the LoRA MLP's SwiGLU, h = silu(g) * u at [8192 tokens, intermediate], whose BF16 h the down
projection's adapter reads too (so h is written either way). Three compiled versions, each checked against the
first's FP8 bytes and scales:
  kernel      inductor's kernel writes h, then `kernels.quantize_tiles` reads h back (fuse_row_quantization off)
  fused       the quantization traced into the same graph: one inductor kernel writes h and its rows, the rows
              from h rounded to BF16 (`ops._as_written`), so they equal the tile kernel's
  fused, FP32 the same without the rounding (the rows of the producer's FP32 value: a few values one E4M3 step
              apart); what the rounding costs
Times are the median of triton's do_bench, us.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from _harness import append_jsonl, median_us, projection_shapes  # a sibling module (benchmarks/ is on sys.path)
from fp8train.fp8 import ops
from fp8train.fp8.operands import LinearPlan, quantize_operand
from fp8train.fp8.recipe import parse_recipe

TOKENS = 8192


def _versions(plan_fused: LinearPlan, plan_kernel: LinearPlan) -> dict:
    silu = torch.nn.functional.silu

    def rows_by(plan: LinearPlan):  # h and its rows as the ops quantize them under `plan`
        def fn(g, u):
            h = silu(g) * u
            return h, *ops.quantize_input(h, plan, False)[:2]
        return fn

    def fused_fp32(g, u):
        h = silu(g) * u
        return h, *quantize_operand(h, plan_fused.x, plan_fused.pow2)

    return {"kernel": rows_by(plan_kernel), "fused": rows_by(plan_fused), "fused, FP32": fused_fp32}


def run(intermediate: int) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    g, u = (torch.randn(TOKENS, intermediate, generator=gen, device="cuda").bfloat16() for _ in range(2))
    plans = [LinearPlan.of(parse_recipe(r), True) for r in ("hybrid+fuse_rows", "hybrid")]
    rows, ref = [], None
    for name, fn in _versions(*plans).items():
        torch._dynamo.reset()
        compiled = torch.compile(fn)
        h, q, s = compiled(g, u)
        if ref is None:
            ref = (h, q, s)
        same = torch.equal(q.view(torch.uint8), ref[1].view(torch.uint8)) and torch.equal(s, ref[2])
        apart = (q.view(torch.int8).int() - ref[1].view(torch.int8).int()).abs().ne(0).float().mean().item()
        if not torch.equal(h, ref[0]):
            raise SystemExit(f"bench_fuse_rows: {name} wrote another h than the kernel version")
        us = median_us(lambda: compiled(g, u))
        rows.append({"shape": f"{TOKENS}x{intermediate}", "version": name, "us": us, "same FP8": same,
                     "share of values apart": apart})
    for r in rows:
        r["x kernel"] = rows[0]["us"] / r["us"]
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-7b", help="a preset whose intermediate width to use")
    ap.add_argument("--out", default=None, help="append the rows as JSON lines")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_fuse_rows: needs a CUDA GPU (inductor's Triton kernels, the tile kernel)")
    rows = run(projection_shapes(args.model)["down"][1])
    print(f"| shape | version | us | x kernel | same FP8 | values apart |  ({torch.cuda.get_device_name()})")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['version']} | {r['us']:.1f} | {r['x kernel']:.2f} | {r['same FP8']} | "
              f"{r['share of values apart']:.5f} |")
        append_jsonl(args.out and Path(args.out), {**r, "gpu": torch.cuda.get_device_name(), "model": args.model})
    if not rows[1]["same FP8"]:
        raise SystemExit("bench_fuse_rows: the fused rows differ from the tile kernel's")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
