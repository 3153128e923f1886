"""`fp8train bench`: the end-to-end training step, BF16 vs FP8 recipes vs torchao float8, on your GPU.

    fp8train bench --models qwen2.5-1.5b qwen2.5-7b:22 --seq 4096 8192 --profile

Every variant runs the trainer's own `Trainer.train_step` (FP32 master weights, fused AdamW, BF16 autocast,
grad clipping) on the same random tokens from the same initial weights; only the Linears differ:
  bf16                 nn.Linear under autocast (the standard mixed-precision baseline)
  hybrid, tensorwise   fp8train.convert_to_fp8 with that recipe
  torchao-tensorwise,  torchao.float8.convert_to_float8_training (LM head left in BF16), when torchao
  torchao-rowwise      is importable
`compiled` applies torch.compile to each decoder layer, for every variant alike (the trainer's
`train.compile`); `cudagraphs` also replays each layer as CUDA graphs (`train.cuda_graphs`). Step time
is the median of the timed steps after the warm-up; peak memory is torch.cuda.max_memory_allocated over
the timed steps (with cudagraphs over all steps: the graphs' pool is allocated while recording). Ratios
are to BF16 at the same model, length and mode, measured in the same process. `--profile` adds the CUDA
kernel time of one step by category (FP8 and BF16 GEMMs told apart by the cuBLAS kernel name, which a
CUDA graph replay keeps).
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import statistics
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass

import torch

__all__ = ["BenchCase", "run_case", "categorize_profile", "markdown_table", "main"]

BF16_PEAK = 989.0  # dense TFLOP/s, H100/H200 SXM datasheet; MFU is against it for every variant
VARIANTS = ("bf16", "hybrid", "tensorwise", "torchao-tensorwise", "torchao-rowwise")
MODES = ("eager", "compiled", "cudagraphs")

_KERNEL_CATEGORIES = [  # (category, regex on the CUDA kernel name), first match wins
    ("quantization", r"_act_kernel|_weight_kernel"),
    ("attention", r"flash|fmha|attention|sdpa|_efficient"),
    ("optimizer", r"adam|multi_tensor|foreach"),
    ("gemm", r"gemm|nvjet|cutlass|xmma|cublas|matmul|sm90_"),
    ("communication", r"nccl"),
    ("norms and elementwise", r"."),
]
# cuBLAS names a kernel by its operand types: FP8 ones are nvjet_sm90_qq*/qr* (q: E4M3, r: E5M2; BF16 is
# t: nvjet_sm90_tst_*) or sm90_xmma_gemm_e4m3*
_FP8_GEMM = r"nvjet_sm\d+_q|e4m3|e5m2"


@dataclass(frozen=True)
class BenchCase:
    """One row of the table."""

    model: str
    """A preset of `fp8train.model.PRESETS`."""
    layers: int | None
    """Decoder layers (None: the preset's)."""
    seq: int
    """Tokens per sequence (batch 1)."""
    variant: str
    """One of VARIANTS."""
    mode: str
    """One of MODES: eager, compiled (torch.compile per decoder layer) or cudagraphs (compiled, and each
    layer's graphs replayed as CUDA graphs)."""
    vocab: int | None = None
    """Embedding rows; None: the preset's (presets sized by a tokenizer get Qwen2.5's 151,936)."""


def categorize_profile(prof) -> dict[str, float]:
    """CUDA kernel time (ms) of a torch.profiler run by category. Only kernel events are summed (a CPU op's
    device time is its kernels' time again). FP8 GEMMs are told by the kernel's name, not by the op that
    launched it: a CUDA graph replay records kernels without their ops."""
    from torch.autograd import DeviceType

    out: dict[str, float] = defaultdict(float, {"fp8 gemm": 0.0, "bf16/fp32 gemm": 0.0})
    for evt in prof.key_averages():
        t = evt.self_device_time_total / 1e3
        if evt.device_type == DeviceType.CPU or t <= 0:
            continue
        name = evt.key.lower()
        cat = next(cat for cat, pat in _KERNEL_CATEGORIES if re.search(pat, name))
        if cat == "gemm":
            cat = "fp8 gemm" if re.search(_FP8_GEMM, name) else "bf16/fp32 gemm"
        out[cat] += t
    out["total"] = sum(out.values())
    return dict(out)


def _convert_torchao(model, recipe: str) -> None:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe),
                               module_filter_fn=lambda mod, fqn: fqn != "lm_head")


def run_case(case: BenchCase, *, steps: int = 5, warmup: int = 2, device: str = "cuda", profile: bool = False,
             activation_checkpointing: bool = False) -> dict:
    """Build the model, run `warmup + steps` training steps of one sequence, return the measurements."""
    from .train.config import LoopConfig, TrainConfig
    from .data import CptDataConfig
    from .train.metrics import flops_per_token
    from .train.model import PRESETS, ModelConfig, build_model
    from .train.optim import OptimConfig
    from .train.trainer import Trainer

    import torch._dynamo

    torch._dynamo.reset()  # every case compiles afresh: no recompile limit, no shapes made dynamic by earlier cases
    vocab = case.vocab or (None if PRESETS[case.model]["vocab_size"] else 151936)
    mcfg = ModelConfig(source=case.model, num_layers=case.layers, vocab_size=vocab)
    torch.manual_seed(0)
    with torch.device(device):
        model = build_model(mcfg)
    recipe = case.variant
    if case.variant.startswith("torchao-"):
        _convert_torchao(model, case.variant.split("-", 1)[1])
        recipe = "bf16"
    vocab, seq = model.config.vocab_size, case.seq
    g = torch.Generator().manual_seed(1)
    rows = [{"input_ids": (ids := torch.randint(0, vocab, (seq,), generator=g)), "labels": ids,
             "position_ids": torch.arange(seq)} for _ in range(steps + warmup)]
    cfg = TrainConfig(stage="cpt", data=CptDataConfig(paths=["(synthetic)"], seq_len=seq),
                      run_dir=tempfile.mkdtemp(prefix=f"fp8train-bench-{case.variant}-"), resume="none",
                      device=device, recipe=recipe, model=mcfg,
                      optim=OptimConfig(lr=1e-5, min_lr=1e-6, schedule="constant"),
                      train=LoopConfig(steps=steps + warmup, global_batch=1, micro_batch=1, compile=case.mode != "eager",
                                       cuda_graphs=case.mode == "cudagraphs",
                                       activation_checkpointing=activation_checkpointing))
    trainer = Trainer(cfg, model=model, train_data=rows, val_data=None, progress=False)
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times, losses = [], []
    for i in range(warmup + steps):
        # CUDA graphs allocate their memory pool while recording, in the warm-up: their peak spans it
        if cuda and i == (0 if case.mode == "cudagraphs" else warmup):
            torch.cuda.reset_peak_memory_stats()
        batches = trainer.next_micro_batches()
        sync()
        t0 = time.perf_counter()
        loss, _, _ = trainer.train_step(batches)
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(loss)
    step_s = statistics.median(times[warmup:])
    tflops = flops_per_token(model.config, seq) * seq / step_s / 1e12
    res = {"model": case.model, "layers": model.config.num_hidden_layers, "seq": seq, "variant": case.variant,
           "mode": case.mode, "step_ms": step_s * 1e3, "tokens_per_s": seq / step_s, "tflops": tflops,
           "mfu_bf16_peak": tflops / BF16_PEAK, "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda
           else float("nan"), "loss_first": losses[0], "loss_last": losses[-1],
           "fp8_layers": len(trainer.fp8_report.converted), "first_step_s": times[0],
           "skipped_steps": trainer.skipped_steps}  # non-finite steps skip the optimizer: not a valid timing
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        batches = trainer.next_micro_batches()
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            trainer.train_step(batches)
            sync()
        res["profile_ms"] = categorize_profile(prof)
    del trainer, model, rows
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return res


def _base(results: list[dict], r: dict) -> dict | None:
    return next((b for b in results if b["variant"] == "bf16" and all(b[k] == r[k] for k in
                 ("model", "layers", "seq", "mode"))), None)


def markdown_table(results: list[dict]) -> str:
    lines = ["| model | layers | seq | mode | variant | step ms | tokens/s | TFLOP/s | MFU (BF16 peak) | peak GiB "
             "| speed x BF16 | memory x BF16 | loss first / last |", "|" + "---|" * 13]
    for r in results:
        b = _base(results, r)
        sp = f"{b['step_ms'] / r['step_ms']:.3f}" if b else "-"
        mem = f"{r['peak_mem_gib'] / b['peak_mem_gib']:.3f}" if b else "-"
        lines.append(f"| {r['model']} | {r['layers']} | {r['seq']} | {r['mode']} | "
                     f"{r['variant']} | {r['step_ms']:.1f} | {r['tokens_per_s']:,.0f} | {r['tflops']:.0f} | "
                     f"{r['mfu_bf16_peak']:.1%} | {r['peak_mem_gib']:.1f} | {sp} | {mem} | "
                     f"{r['loss_first']:.3f} / {r['loss_last']:.3f}"
                     + (f" ({r['skipped_steps']} NON-FINITE steps: invalid)" if r.get("skipped_steps") else "") + " |")
    profiled = [r for r in results if "profile_ms" in r]
    if profiled:
        cats = ["fp8 gemm", "bf16/fp32 gemm", "quantization", "attention", "norms and elementwise", "optimizer",
                "communication", "total"]
        lines += ["", "CUDA kernel time of one step, ms:", "",
                  "| model | seq | mode | variant | " + " | ".join(cats) + " |", "|" + "---|" * (len(cats) + 4)]
        for r in profiled:
            p = r["profile_ms"]
            lines.append(f"| {r['model']}/{r['layers']} | {r['seq']} | {r['mode']} | "
                         f"{r['variant']} | " + " | ".join(f"{p.get(c, 0.0):.1f}" for c in cats) + " |")
    return "\n".join(lines)


def _model_spec(spec: str) -> tuple[str, int | None]:
    name, _, layers = spec.partition(":")
    return name, int(layers) if layers else None


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="fp8train bench", description=__doc__,
                                          formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["qwen2.5-1.5b"], metavar="PRESET[:LAYERS]",
                   help="model presets, optionally with a layer count (qwen2.5-7b:16)")
    p.add_argument("--seq", type=int, nargs="+", default=[8192])
    p.add_argument("--vocab", type=int, default=None, help="embedding rows (default: the preset's)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--modes", nargs="+", default=["compiled"], choices=MODES,
                   help="compiled: torch.compile per layer; cudagraphs: also CUDA graphs (no per-kernel launch cost)")
    p.add_argument("--steps", type=int, default=5, help="timed steps (median)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    p.add_argument("--ac", action="store_true", help="activation checkpointing (every variant)")
    p.add_argument("--profile", action="store_true", help="kernel time by category of one more step")
    p.add_argument("--device", default="cuda", help="cuda; cpu only to smoke-test the harness")
    p.add_argument("--out", default=None, help="append each result as a JSON line to this file")
    return p


def main(args: argparse.Namespace | list[str] | None = None) -> int:
    if not isinstance(args, argparse.Namespace):
        args = build_parser().parse_args(args)
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"device {gpu}  torch {torch.__version__}", flush=True)
    results = []
    for spec in args.models:
        name, layers = _model_spec(spec)
        for seq in args.seq:
            for mode in args.modes:
                for variant in args.variants:
                    case = BenchCase(name, layers, seq, variant, mode, args.vocab)
                    try:
                        r = run_case(case, steps=args.steps, warmup=args.warmup, device=args.device,
                                     profile=args.profile, activation_checkpointing=args.ac)
                    except Exception as e:  # a peer that fails to import or run (OOM) is reported, not fatal
                        print(f"{case}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                        gc.collect()
                        if args.device == "cuda":
                            torch.cuda.empty_cache()
                        continue
                    results.append(r)
                    print(json.dumps(r), flush=True)
                    if args.out:
                        with open(args.out, "a") as f:
                            f.write(json.dumps(r) + "\n")
    print("\n" + markdown_table(results), flush=True)
    return 0 if results else 1
