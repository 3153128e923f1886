"""End-to-end training step: BF16 vs fp8train recipes vs torchao float8, one GPU, one process.

    PYTHONPATH=. python benchmarks/e2e.py --model qwen2.5-1.5b --layers 28 --seq 8192 [--compile] [--profile]

Every variant runs the trainer's own `Trainer.train_step` (FP32 master weights, AdamW, BF16 autocast,
grad clipping) on the same random tokens; only the Linears differ:
  bf16                 nn.Linear under autocast (the standard mixed-precision baseline)
  hybrid, tensorwise   fp8train.convert_to_fp8 with that recipe
  torchao-tensorwise,  torchao.float8.convert_to_float8_training (LM head left in BF16), if torchao
  torchao-rowwise      is importable
Step time is the median of the steps after `--warmup`; peak memory is torch.cuda.max_memory_allocated
over the timed steps. `--profile` adds a per-category CUDA time breakdown of one step per variant.
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import statistics
import sys
import tempfile
import time
from collections import defaultdict

import torch

from fp8train.config import LoopConfig, TrainConfig
from fp8train.data import CptDataConfig
from fp8train.metrics import flops_per_token
from fp8train.model import ModelConfig, build_model
from fp8train.optim import OptimConfig
from fp8train.trainer import Trainer

BF16_PEAK, FP8_PEAK = 989.0, 1979.0  # dense TFLOP/s, H100/H200 SXM datasheet

_CATEGORIES = [  # (category, regex on the CUDA kernel name), first match wins
    ("quantization (fp8train)", r"_act_kernel|_weight_kernel"),
    ("fp8 gemm", r"f8|fp8|e4m3|e5m2|scaled_mm|f8f8"),
    ("attention", r"flash|fmha|attention|sdpa|_efficient"),
    ("optimizer", r"adam|multi_tensor|foreach"),
    ("bf16/fp32 gemm", r"gemm|nvjet|cutlass|sm90_xmma|cublas|matmul"),
    ("communication", r"nccl"),
    ("norms and elementwise", r"."),
]


def _categorize(prof) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for evt in prof.key_averages():
        t = getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0)
        if t <= 0 or evt.key.startswith("ProfilerStep"):
            continue
        name = evt.key.lower()
        for cat, pat in _CATEGORIES:
            if re.search(pat, name):
                out[cat] += t / 1e3  # ms
                break
    return dict(out)


def _convert_torchao(model, recipe: str) -> None:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe),
                               module_filter_fn=lambda mod, fqn: fqn != "lm_head")


def run_variant(variant: str, args, seq: int) -> dict:
    torch.manual_seed(0)
    with torch.device(args.device):
        model = build_model(ModelConfig(source=args.model, num_layers=args.layers, vocab_size=args.vocab))
    recipe = variant
    if variant.startswith("torchao-"):
        _convert_torchao(model, variant.split("-", 1)[1])
        recipe = "bf16"
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    rows = [{"input_ids": (ids := torch.randint(0, vocab, (seq,), generator=g)), "labels": ids,
             "position_ids": torch.arange(seq)} for _ in range(args.steps + args.warmup)]
    cfg = TrainConfig(stage="cpt", data=CptDataConfig(paths=["(synthetic)"], seq_len=seq), run_dir=tempfile.mkdtemp(prefix=f"e2e-{variant}-"), resume="none", device=args.device,
                      recipe=recipe, model=ModelConfig(source=args.model, num_layers=args.layers, vocab_size=args.vocab),
                      optim=OptimConfig(lr=1e-5, min_lr=1e-6, schedule="constant"),
                      train=LoopConfig(steps=args.steps + args.warmup, global_batch=1, micro_batch=1,
                                       compile=args.compile, activation_checkpointing=args.ac))
    trainer = Trainer(cfg, model=model, train_data=rows, val_data=None, progress=False)
    times, losses = [], []
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for i in range(args.warmup + args.steps):
        if i == args.warmup and cuda:
            torch.cuda.reset_peak_memory_stats()
        batches = trainer._micro_batches(next(trainer._batches))
        sync()
        t0 = time.perf_counter()
        loss, _, _ = trainer.train_step(batches)
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(loss)
    step_s = statistics.median(times[args.warmup:])
    res = {"variant": variant, "seq": seq, "step_ms": step_s * 1e3, "tokens_per_s": seq / step_s,
           "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan"), "loss_first": losses[0], "loss_last": losses[-1],
           "fp8_layers": len(getattr(trainer, "fp8_report", None).converted) if recipe != "bf16" else 0}
    fpt = flops_per_token(model.config, seq)
    res["tflops"] = fpt * seq / step_s / 1e12
    res["mfu_bf16_peak"] = res["tflops"] / BF16_PEAK
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            trainer.train_step(batches)
            sync()
        res["profile_ms"] = _categorize(prof)
    del trainer, model, rows
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-1.5b")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the preset's)")
    ap.add_argument("--vocab", type=int, default=None, help="embedding rows (default: the preset's)")
    ap.add_argument("--seq", type=int, nargs="+", default=[8192])
    ap.add_argument("--variants", nargs="+", default=["bf16", "hybrid", "tensorwise", "torchao-tensorwise", "torchao-rowwise"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--compile", action="store_true", help="torch.compile each decoder layer (all variants)")
    ap.add_argument("--ac", action="store_true", help="activation checkpointing (all variants)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--device", default="cuda", help="cuda; cpu only for a smoke test of the script")
    ap.add_argument("--out", default=None, help="append the results as JSON lines here")
    args = ap.parse_args(argv)
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"device {gpu}  torch {torch.__version__}  model {args.model} layers {args.layers} "
          f"compile={args.compile} ac={args.ac}", flush=True)
    results = []
    for seq in args.seq:
        for v in args.variants:
            try:
                r = run_variant(v, args, seq)
            except Exception as e:  # a peer that fails to import or run is reported, not fatal
                print(f"{v} seq {seq}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                gc.collect()
                if args.device == "cuda":
                    torch.cuda.empty_cache()
                continue
            results.append(r)
            print(json.dumps(r), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps({**r, "model": args.model, "layers": args.layers, "compile": args.compile}) + "\n")
    print("\n| seq | variant | step ms | tokens/s | TFLOP/s | MFU (bf16 peak) | peak GiB | speed x bf16 | memory x bf16 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        base = next((b for b in results if b["seq"] == r["seq"] and b["variant"] == "bf16"), None)
        sp = f"{base['step_ms'] / r['step_ms']:.3f}" if base else "-"
        mem = f"{r['peak_mem_gib'] / base['peak_mem_gib']:.3f}" if base else "-"
        print(f"| {r['seq']} | {r['variant']} | {r['step_ms']:.1f} | {r['tokens_per_s']:.0f} | {r['tflops']:.0f} | "
              f"{r['mfu_bf16_peak']:.1%} | {r['peak_mem_gib']:.1f} | {sp} | {mem} |")
    if args.profile:
        cats = sorted({c for r in results for c in r.get("profile_ms", {})})
        print("\n| variant | " + " | ".join(cats) + " |")
        print("|---|" + "---|" * len(cats))
        for r in results:
            p = r.get("profile_ms", {})
            print(f"| {r['variant']} (seq {r['seq']}) | " + " | ".join(f"{p.get(c, 0):.1f}" for c in cats) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
