"""LoRA on a frozen base: BF16 LoRA vs FP8 hybrid LoRA (fp8train's own path), on one GPU.

    PYTHONPATH=. python benchmarks/lora_gpu.py --out $OUT/lora.jsonl                 # H200: Qwen2.5-7B, 28 layers
    PYTHONPATH=. python benchmarks/lora_gpu.py --device cpu --tiny                   # the CPU check

The issue-20 setup: a Qwen2.5-7B-shaped model (all 28 layers, random init) whose base weights are BF16 and
frozen, PEFT LoRA r=16 (alpha 32) on all seven projections (FP32 adapters, fused AdamW over them only),
each decoder layer compiled (`parallelize_model(compile=True)`, fp8train's inductor pass; `--cuda-graphs`: and
replayed as CUDA graphs, as `train.cuda_graphs` does), one sequence of
8192 tokens per step, `cache_fp8_weights` around each step, BF16 autocast. `hybrid` converts the base
projections to FP8Linear first (`convert_to_fp8`), then LoRA wraps them (`apply_lora`), and keeps the
frozen base in FP8 for the run, its BF16 weights in host memory (`freeze_fp8_weights(offload=True)`), as
`model.lora` does in fp8train's trainer. For the A/B: `hybrid+on-gpu` freezes without offloading,
`hybrid+every-step` quantizes the base weights in every forward and backward (the path before freezing);
a recipe modifier of `fp8train.parse_recipe` applies too (`+deep_gemm`: the base's output and grad_input GEMMs on
DeepGEMM's kernel). Printed per recipe: ms/step and tokens/s (median over the steps after
`--warmup`), peak GPU memory (whole run, model included), the loss of the first and last step, and what
dynamo compiled: frames compiled, and recompilations with their first reasons (the target: none per step).
`--profile` adds the CUDA kernel time of one more step by `fp8train bench`'s categories (`--top-kernels N`:
and its N slowest kernels; `--trace DIR`: its Chrome trace).

This script is the path of a user who brings a PEFT model (its own loop, HF's full-logits loss, each step
timed between two synchronizations). `fp8train bench --lora 16` measures fp8train's own trainer with
`model.lora`, as `fp8train train` runs it (chunked loss, overlapped steps).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

from fp8train import cache_fp8_weights, convert_to_fp8, freeze_fp8_weights, parse_recipe
from fp8train.bench import (categorize_profile, kernel_launches, profile_table, top_kernel_times, top_kernels_table,
                            write_trace)
from fp8train.fp8.recipe import MODIFIERS
from fp8train.train.lora import LoraConfig, apply_lora
from fp8train.train.model import PRESETS, parallelize_model
from fp8train.train.optim import OptimConfig, build_optimizer
from _harness import append_jsonl, device_for, fill_defaults  # a sibling: benchmarks/ is on sys.path


def model_config(tiny: bool):
    from transformers import Qwen2Config

    p = dict(PRESETS["qwen2.5-7b"])
    if tiny:
        p.update(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512)
    p.pop("model_type")
    theta = p.pop("rope_theta")
    return Qwen2Config(**p, use_cache=False, rope_parameters={"rope_type": "default", "rope_theta": theta})


class _Recompiles(logging.Handler):
    """Counts dynamo's "Recompiling function ..." messages (the `recompiles` log artifact)."""

    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def run_one(recipe: str, a: argparse.Namespace, device: torch.device) -> dict:
    from transformers import AutoModelForCausalLM

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(model_config(a.tiny), dtype=torch.bfloat16,
                                                 attn_implementation="sdpa")
    model.train()
    base, *mods = recipe.split("+")
    modes = [m for m in mods if m in ("on-gpu", "every-step")]
    knobs = [m for m in mods if m not in modes]  # fp8train.parse_recipe's modifiers
    if len(modes) > 1 or any(m not in MODIFIERS for m in knobs) or (base == "bf16" and mods):
        raise SystemExit(f"lora_gpu: unknown variant {recipe!r} (RECIPE, RECIPE+on-gpu, RECIPE+every-step, "
                         f"each optionally with {['+' + m for m in MODIFIERS]})")
    mode = modes[0] if modes else ""
    if base != "bf16":
        convert_to_fp8(model, parse_recipe("+".join([base, *knobs])))
    model = apply_lora(model, LoraConfig(rank=a.rank, alpha=2 * a.rank))  # adapters FP32, the base frozen
    parallelize_model(model, activation_checkpointing=a.activation_checkpointing, compile=not a.no_compile,
                      cuda_graphs=a.cuda_graphs)
    optimizer = build_optimizer(model, OptimConfig(lr=1e-4, weight_decay=0.0))  # optim.impl auto: Triton on CUDA
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    batches = [torch.randint(0, vocab, (a.batch, a.seq), generator=g).to(device) for _ in range(2)]

    frozen = contextlib.ExitStack()
    if mode != "every-step":
        frozen.enter_context(freeze_fp8_weights(model, offload=mode != "on-gpu"))
    handler = _Recompiles()
    recompile_log = logging.getLogger("torch._dynamo.guards.__recompiles")
    torch._logging.set_logs(recompiles=True)
    recompile_log.addHandler(handler)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def train_step(ids: torch.Tensor) -> float:
        if a.cuda_graphs:  # a new step: the graphs may reuse the last one's outputs (the loss is read already)
            torch.compiler.cudagraph_mark_step_begin()
        with cache_fp8_weights(model):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    seconds, losses, warm, profile_ms, launches, top, trace = [], [], 0, None, None, None, None
    try:
        for step in range(a.warmup + a.steps):
            _sync(device)
            t0 = time.perf_counter()
            losses.append(train_step(batches[step % 2]))
            _sync(device)
            seconds.append(time.perf_counter() - t0)
            if step == a.warmup - 1:
                warm = len(handler.messages)
        if a.profile:  # one more step, untimed: kernel time by category (fp8train bench's categories)
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                train_step(batches[0])
                _sync(device)
            profile_ms, launches = categorize_profile(prof), kernel_launches(prof)
            top = top_kernel_times(prof, a.top_kernels) if a.top_kernels else None
            trace = write_trace(prof, str(a.trace), f"lora-{recipe}") if a.trace else None
    finally:
        frozen.close()
        recompile_log.removeHandler(handler)
        torch._logging.set_logs()
    step_s = statistics.median(seconds[a.warmup:])
    frames = dict(torch._dynamo.utils.counters["frames"])
    out = {"recipe": recipe, "rank": a.rank, "layers": model.config.num_hidden_layers, "seq": a.seq,
           "batch": a.batch, "trainable_params": trainable, "ms_per_step": 1e3 * step_s,
           "tokens_per_s": a.batch * a.seq / step_s,
           "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
           "loss_first": losses[0], "loss_last": losses[-1], "compiled": not a.no_compile, "cuda_graphs": a.cuda_graphs,
           "frames_compiled": frames.get("ok", 0), "recompiles": len(handler.messages),
           "recompiles_after_warmup": len(handler.messages) - warm,
           "recompile_reasons": [m.splitlines()[-1].strip()[:200] for m in handler.messages[:8]]}
    if profile_ms is not None:
        out["profile_ms"], out["kernel_launches"] = profile_ms, launches
    if top is not None:
        out["top_kernels_ms"] = top
    if trace is not None:
        out["trace"] = trace
    del model, optimizer, batches
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="a 2-layer 128-wide model, 64 tokens: the CPU check")
    p.add_argument("--recipes", nargs="+", default=["bf16", "hybrid"])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 8192; --tiny 64)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 10; --tiny 2)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation)")
    p.add_argument("--no-compile", action="store_true", help="eager layers (the CPU test's default is compiled)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="replay each compiled layer as CUDA graphs (train.cuda_graphs): no per-kernel launch cost")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--profile", action="store_true", help="kernel time by category of one more step")
    p.add_argument("--top-kernels", type=int, default=0, metavar="N", help="with --profile: the N slowest kernels too")
    p.add_argument("--trace", type=Path, default=None, metavar="DIR",
                   help="with --profile: that step's Chrome trace per recipe (.json.gz) in DIR")
    p.add_argument("--out", type=Path, default=None, help="append one JSON line per recipe here")
    a = fill_defaults(p.parse_args(argv), dict(seq=(64, 8192), steps=(2, 10)))
    if a.cuda_graphs and (a.no_compile or a.device != "cuda"):
        p.error("--cuda-graphs replays the compiled layers on CUDA: not with --no-compile or --device cpu")
    return a


def main(argv=None) -> list[dict]:
    a = parse_args(argv)
    device = device_for(a.device, "lora_gpu")
    results = []
    print(f"{'recipe':<18} {'ms/step':>9} {'tokens/s':>10} {'peak GiB':>9} {'loss 1':>8} {'loss last':>9} "
          f"{'frames':>7} {'recompiles':>10}", flush=True)
    for recipe in a.recipes:
        r = run_one(recipe, a, device)
        results.append(r)
        mem = f"{r['peak_mem_gib']:.1f}" if r["peak_mem_gib"] is not None else "n/a"
        print(f"{recipe:<18} {r['ms_per_step']:>9.1f} {r['tokens_per_s']:>10,.0f} {mem:>9} {r['loss_first']:>8.4f} "
              f"{r['loss_last']:>9.4f} {r['frames_compiled']:>7} {r['recompiles']:>10}", flush=True)
        for reason in r["recompile_reasons"]:
            print(f"    recompiled: {reason}")
        append_jsonl(a.out, r)
    profiled = [r for r in results if "profile_ms" in r]
    if profiled:
        rows = [([r["recipe"]], r["profile_ms"], r["kernel_launches"], r["ms_per_step"]) for r in profiled]
        print("\n".join(profile_table(["recipe"], rows)))
        for r in (r for r in profiled if r.get("top_kernels_ms")):
            print("\n".join(top_kernels_table(r["recipe"], r["top_kernels_ms"])))
    by = {r["recipe"]: r for r in results}
    if "bf16" in by:
        for recipe, r in by.items():
            if recipe != "bf16":
                mem = (f", peak memory {r['peak_mem_gib'] / by['bf16']['peak_mem_gib']:.2f}x"
                       if r["peak_mem_gib"] else "")
                print(f"{recipe} LoRA vs bf16 LoRA: {r['tokens_per_s'] / by['bf16']['tokens_per_s']:.3f}x tokens/s{mem}")
    return results


if __name__ == "__main__":
    main()
    sys.exit(0)
