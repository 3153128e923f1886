"""Host (CPU) time of the FP8 path on a GPU: per call of each piece, and per training step against BF16.

    PYTHONPATH=. python benchmarks/host_overhead.py --model qwen2.5-1.5b --seq 8192 --profile 25

A compiled step is host-bound when the CPU needs longer to enqueue its kernels than the GPU to run them:
"enqueue" below is the time until the CPU has issued a whole step (forward, backward, AdamW; no sync
inside), "step" the time until the GPU has finished it. Per-call times use small operands, so the GPU is
idle and the loop measures only the host: dispatcher, Python, Triton launcher and cuBLAS call overhead.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch
import torch._dynamo


def _per_call_us(fn, n: int = 300) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    return host / n * 1e6


def pieces() -> list[tuple[str, float]]:
    import torch.nn.functional as F

    from fp8train.fp8 import kernels as _triton_quant
    from fp8train.fp8 import ops as o
    from fp8train.fp8.gemm import gemm
    from fp8train.fp8.operands import LinearPlan
    from fp8train.fp8.recipe import Fp8Format, make_recipe

    plan = LinearPlan.of(make_recipe("hybrid"), cublas=True)
    x = torch.randn(256, 1536, device="cuda").bfloat16()
    w = torch.randn(512, 1536, device="cuda")
    dy = torch.randn(256, 512, device="cuda").bfloat16()
    xr, xr_s, xc, xc_s = o.quantize_input(x, plan, True)
    wq, wq_s = o.quantize_weight(w, plan.w, True, False, True)
    fwd = (xr, xr_s, w, None, None, plan.key, torch.bfloat16)
    bwd = (dy, w, None, None, None, None, xc, xc_s, plan.key, True, True, torch.bfloat16)
    ST = F.ScalingType
    return [
        ("torch.empty x4", _per_call_us(lambda: [torch.empty(256, 1536, device="cuda") for _ in range(4)])),
        ("Triton activation kernel (wrapper)", _per_call_us(
            lambda: _triton_quant.quantize_tiles_and_transpose(x, Fp8Format.E4M3, Fp8Format.E4M3, True, 512))),
        ("quantize_input", _per_call_us(lambda: o.quantize_input(x, plan, True))),
        ("quantize_input custom op", _per_call_us(lambda: torch.ops.fp8train.quantize_input(x, plan.key, True, True))),
        ("F.scaled_mm blockwise", _per_call_us(lambda: F.scaled_mm(
            xr, wq.t(), xr_s.t(), ST.BlockWise1x128, wq_s.t(), ST.BlockWise128x128, output_dtype=torch.bfloat16))),
        ("gemm", _per_call_us(lambda: gemm(xr, xr_s, plan.x, wq, wq_s, plan.w, torch.bfloat16, True))),
        ("quantize_weight", _per_call_us(lambda: o.quantize_weight(w, plan.w, True, False, True))),
        ("linear_forward custom op", _per_call_us(lambda: torch.ops.fp8train.linear_forward(*fwd))),
        ("linear_backward custom op", _per_call_us(lambda: torch.ops.fp8train.linear_backward(*bwd))),
        ("bf16 torch.mm (reference)", _per_call_us(lambda: torch.mm(x, w.bfloat16().t()))),
    ]


def step_times(model_name: str, seq: int, recipe: str, layers: int | None, profile_rows: int) -> dict:
    from fp8train import convert_to_fp8
    from fp8train.train.model import ModelConfig, build_model, parallelize_model

    torch._dynamo.reset()
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = build_model(ModelConfig(source=model_name, num_layers=layers, vocab_size=151936))
    convert_to_fp8(model, recipe)
    parallelize_model(model, compile=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    ids = torch.randint(0, 151936, (1, seq), device="cuda")

    def step():
        with torch.autocast("cuda", torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    enqueue, total = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        step()
        enqueue.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        total.append(time.perf_counter() - t0)
    out = {"recipe": recipe, "enqueue_ms": statistics.median(enqueue) * 1e3, "step_ms": statistics.median(total) * 1e3}
    if profile_rows:
        prof = cProfile.Profile()
        prof.enable()
        step()
        torch.cuda.synchronize()
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(profile_rows)
        out["profile"] = s.getvalue()
    torch.cuda.empty_cache()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-1.5b")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--recipes", nargs="+", default=["bf16", "hybrid"])
    p.add_argument("--profile", type=int, default=0, help="print this many cProfile rows (by own time) per recipe")
    args = p.parse_args()
    print("| piece (small operands: host time only) | us per call |\n|---|---|")
    for name, us in pieces():
        print(f"| {name} | {us:.1f} |", flush=True)
    rows = [step_times(args.model, args.seq, r, args.layers, args.profile) for r in args.recipes]
    print(f"\n| {args.model}, {args.seq} tokens, compiled | enqueue ms (host) | step ms | |\n|---|---|---|---|")
    for r in rows:
        bound = "host-bound" if r["enqueue_ms"] > 0.9 * r["step_ms"] else "GPU-bound"
        print(f"| {r['recipe']} | {r['enqueue_ms']:.1f} | {r['step_ms']:.1f} | {bound} |")
    for r in rows:
        if "profile" in r:
            print(f"\ncProfile of one {r['recipe']} step:\n{r['profile']}")


if __name__ == "__main__":
    main()
