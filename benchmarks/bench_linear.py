"""FP8Linear vs BF16 nn.Linear at the Qwen2.5-1.5B and -7B projection shapes (one GPU, one process).

    PYTHONPATH=. python benchmarks/bench_linear.py [--tokens 8192] [--out results.json]

For each (N x K) it times, with CUDA events (median of repeated runs after warm-up):
  bf16 fwd / fwd+bwd      nn.Linear with BF16 weights
  fp8  fwd / fwd+bwd      FP8Linear, hybrid recipe, ALL quantization included (the weight re-quantized
                          every call: the cache is cleared, as on the first micro-batch of a step)
  raw GEMMs               torch.nn.functional.scaled_mm on pre-quantized operands for output
                          (1x128 . 128x128), grad_input (1x128 . 128x128), grad_weight (1x128 . 1x128),
                          against torch.mm in BF16 on the same shapes
  quant                   the fused activation kernel (both FP8 copies) and the weight kernel
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton.testing

from _harness import projection_shapes  # a sibling module (benchmarks/ is on sys.path)
from fp8train import FP8Linear, cache_fp8_weights
from fp8train.fp8 import kernels as _triton_quant
from fp8train.fp8 import ops
from fp8train.fp8.gemm import gemm
from fp8train.fp8.operands import LinearPlan, quantize_operand
from fp8train.fp8.recipe import make_recipe

SHAPES = {f"{tag} {name}": nk for tag, preset in (("1.5B", "qwen2.5-1.5b"), ("7B", "qwen2.5-7b"))  # (N, K)
          for name, nk in projection_shapes(preset).items()}


def _ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def bench_shape(M: int, N: int, K: int) -> dict:
    torch.manual_seed(0)
    dev = "cuda"
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
    bf16 = torch.nn.Linear(K, N, bias=False, device=dev, dtype=torch.bfloat16)
    fp8 = FP8Linear.from_linear(torch.nn.Linear(K, N, bias=False, device=dev, dtype=torch.bfloat16), "hybrid")
    r = {}
    r["bf16_fwd"] = _ms(lambda: bf16(x))

    def bf16_step():
        bf16(x).backward(g)

    def fp8_fwd():  # outside cache_fp8_weights every call quantizes the weight, as a step's first micro-batch
        return fp8(x)

    def fp8_step():
        fp8(x).backward(g)

    r["bf16_fwdbwd"] = _ms(bf16_step)
    r["fp8_fwd"] = _ms(fp8_fwd)
    r["fp8_fwdbwd"] = _ms(fp8_step)
    with cache_fp8_weights(fp8):  # later micro-batches of a step
        r["fp8_fwdbwd_cached_w"] = _ms(lambda: fp8(x).backward(g))

    plan = LinearPlan.of(make_recipe("hybrid"), cublas=True)
    with torch.no_grad():
        xa, xa_s, xt, xt_s = ops.quantize_input(x.detach(), plan, make_cols=True)
        ga, ga_s, *_ = ops.quantize_input(g, plan, make_cols=False)  # grad_output rows: the input's specs
        gt, gt_s = quantize_operand(g.t(), plan.g_t, True)
        wb = fp8.weight.detach()
        wo, wo_s = ops.quantize_weight(wb, plan.w, True, False, True)
        wgi, wgi_s = ops.quantize_weight(wb, plan.w_t, True, True, True)
        r["gemm_output_fp8"] = _ms(lambda: gemm(xa, xa_s, plan.x, wo, wo_s, plan.w, torch.bfloat16, True))
        r["gemm_grad_input_fp8"] = _ms(lambda: gemm(ga, ga_s, plan.g, wgi, wgi_s, plan.w_t, torch.bfloat16, True))
        r["gemm_grad_weight_fp8"] = _ms(lambda: gemm(gt, gt_s, plan.g_t, xt, xt_s, plan.x_t, torch.float32, True))
        r["gemm_output_bf16"] = _ms(lambda: torch.mm(x.detach(), wb.t()))
        r["gemm_grad_input_bf16"] = _ms(lambda: torch.mm(g, wb))
        r["gemm_grad_weight_bf16"] = _ms(lambda: torch.mm(g.t(), x.detach()))
        fmt = plan.x.fmt
        r["quant_input"] = _ms(lambda: _triton_quant.quantize_tiles_and_transpose(x.detach(), fmt, fmt, True, 512))
        r["quant_grad_output"] = _ms(lambda: _triton_quant.quantize_tiles_and_transpose(g, fmt, fmt, True, 512))
        r["quant_weight"] = _ms(lambda: (_triton_quant.quantize_blocks(wb, fmt, True, 512),
                                         _triton_quant.quantize_blocks(wb, fmt, True, 512, transpose=True)))
    return r


def _profile(M: int, N: int, K: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    fp8 = FP8Linear.from_linear(torch.nn.Linear(K, N, bias=False, device="cuda", dtype=torch.bfloat16), "hybrid")
    for _ in range(3):
        fp8(x).backward(g)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            fp8(x).backward(g)
        torch.cuda.synchronize()
    print(f"\nprofile: 10 x FP8Linear fwd+bwd, M={M} N={N} K={K}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--out", default=None, help="write the raw numbers as JSON here")
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
    ap.add_argument("--profile", default=None, metavar="SHAPE",
                    help="also print a torch.profiler table (CPU and CUDA) of FP8Linear fwd+bwd at this shape")
    args = ap.parse_args(argv)
    M = args.tokens
    results = {}
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  tokens M={M}", flush=True)
    hdr = ("shape", "N x K", "bf16 fwd us", "fp8 fwd us", "fwd x", "bf16 f+b us", "fp8 f+b us", "f+b x",
           "f+b x (w cached)", "out TF/s fp8|bf16", "dgrad TF/s", "wgrad TF/s", "quant us in|go|w")
    print("| " + " | ".join(hdr) + " |")
    print("|" + "---|" * len(hdr))
    for name in args.shapes:
        N, K = SHAPES[name]
        r = bench_shape(M, N, K)
        results[name] = {"N": N, "K": K, "M": M, **r}
        fl = 2 * M * N * K
        tf = lambda ms: fl / (ms * 1e-3) / 1e12
        row = (
            name, f"{N} x {K}",
            f"{r['bf16_fwd'] * 1e3:.0f}", f"{r['fp8_fwd'] * 1e3:.0f}", f"{r['bf16_fwd'] / r['fp8_fwd']:.2f}",
            f"{r['bf16_fwdbwd'] * 1e3:.0f}", f"{r['fp8_fwdbwd'] * 1e3:.0f}", f"{r['bf16_fwdbwd'] / r['fp8_fwdbwd']:.2f}",
            f"{r['bf16_fwdbwd'] / r['fp8_fwdbwd_cached_w']:.2f}",
            f"{tf(r['gemm_output_fp8']):.0f} / {tf(r['gemm_output_bf16']):.0f}",
            f"{tf(r['gemm_grad_input_fp8']):.0f} / {tf(r['gemm_grad_input_bf16']):.0f}",
            f"{tf(r['gemm_grad_weight_fp8']):.0f} / {tf(r['gemm_grad_weight_bf16']):.0f}",
            f"{r['quant_input'] * 1e3:.0f} / {r['quant_grad_output'] * 1e3:.0f} / {r['quant_weight'] * 1e3:.0f}",
        )
        print("| " + " | ".join(row) + " |", flush=True)
    if args.profile:
        _profile(M, *SHAPES[args.profile])
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
