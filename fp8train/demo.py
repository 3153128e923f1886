"""`fp8train demo`: a small real FP8-vs-BF16 continual-pretraining job that runs anywhere.

A small Qwen2-architecture model (random init, tied embeddings) learns Python from the standard
library sources of the running interpreter, tokenized with the real Qwen2.5 tokenizer. The same
config, seed and data run twice: with the `hybrid` FP8 recipe (emulated on a CPU) and in BF16. Both
final train/val losses, their relative gap and an overlay plot (OUT/loss.png) come out.

CPU budget: the 151,936-row tied embedding / LM head (19.4M of the 19.7M parameters) costs far more
than the 2-layer, 128-wide decoder, about 1 ms per token on one core, so each run is 40 steps of
8 x 128 tokens. Measured on a shared, busy 2-core VM: about 2 minutes for the whole command (45-65 s
per run, the rest start-up, tokenizer and data). With a GPU the same command trains a bigger model for longer.
"""

from __future__ import annotations

import logging
import shutil
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .train.config import LoopConfig, TrainConfig
from .data import CptDataConfig, build_cpt_datasets, load_tokenizer
from .train.model import ModelConfig
from .train.optim import OptimConfig
from .plot import plot_runs
from .threads import cpu_threads
from .train.trainer import Trainer

__all__ = ["DemoConfig", "run_demo", "stdlib_sources"]

log = logging.getLogger(__name__)

_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "lib2to3"}


@dataclass
class DemoConfig:
    """Options of `fp8train demo`."""

    out_dir: str = "runs/demo"
    """Where the two runs, the token cache and loss.png go (the two run directories are recreated)."""
    device: str = "auto"
    """`auto` (CUDA when available), `cpu` or `cuda`; the sizes below depend on it."""
    steps: int | None = None
    """Override the number of optimizer steps (CPU: 40, GPU: 300)."""
    seed: int = 0
    """Model init and data order, shared by both runs."""
    cpu_threads: int | None = 1
    """torch threads on a CPU, restored afterwards; None or 0 keeps torch's default (`fp8train.threads`
    says why one: on a shared 2-core VM the demo took 1m58s with one thread against 4m36s with two)."""


# (model overrides, seq_len, global_batch, micro_batch, steps, peak lr, source bytes, token budget)
_SIZES = {
    "cpu": dict(model=dict(num_layers=2, hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2),
                seq_len=128, global_batch=8, micro_batch=4, steps=40, lr=3e-3, source_bytes=1_500_000,
                max_tokens=300_000),
    "cuda": dict(model=dict(num_layers=8, hidden_size=512, intermediate_size=1536, num_heads=8, num_kv_heads=2),
                 seq_len=1024, global_batch=32, micro_batch=8, steps=300, lr=2e-3, source_bytes=40_000_000,
                 max_tokens=8_000_000),
}


def stdlib_sources(max_bytes: int, min_file_bytes: int = 2048) -> list[Path]:
    """The interpreter's standard-library .py files in sorted order, up to `max_bytes` in all (tests,
    site-packages, caches and stubs under `min_file_bytes` left out, so that every held-out document
    fills at least one sequence)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(f"the standard library folder {root} (sysconfig 'stdlib') does not exist")
    files, total = [], 0
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if any(part in _SKIP_DIRS for part in rel[:-1]) or not path.is_file():
            continue
        size = path.stat().st_size
        if size < min_file_bytes or total + size > max_bytes:
            continue
        files.append(path)
        total += size
    if not files:
        raise FileNotFoundError(f"no .py files under {root}")
    return files


def _run_name(recipe: str) -> str:
    return "bf16" if recipe == "bf16" else f"fp8_{recipe}"


def _demo_config(demo: DemoConfig, device: str, recipe: str, files: list[Path], out: Path) -> TrainConfig:
    size = _SIZES[device]
    steps = demo.steps or size["steps"]
    return TrainConfig(
        stage="cpt", run_dir=str(out / _run_name(recipe)), resume="none", seed=demo.seed, device=device, recipe=recipe,
        model=ModelConfig(source="tiny-qwen2", tie_embeddings=True, **size["model"]),
        data=CptDataConfig(paths=[str(f) for f in files], seq_len=size["seq_len"], val_fraction=0.05,
                           cache_dir=str(out / "token_cache"), max_tokens=size["max_tokens"]),
        optim=OptimConfig(lr=size["lr"], min_lr=size["lr"] / 10, weight_decay=0.1, grad_clip=1.0, schedule="wsd",
                          warmup_steps=max(1, steps // 10), decay_steps=max(1, steps // 4)),
        train=LoopConfig(steps=steps, global_batch=size["global_batch"], micro_batch=size["micro_batch"],
                         eval_every=max(1, steps // 4), eval_batches=8, save_every=0, keep_last=1, log_every=1,
                         health_every=max(1, steps // 2)),
    )


def run_demo(demo: DemoConfig | None = None) -> dict:
    """Run the FP8 and BF16 jobs and the plot; return {recipe: {"loss", "val_loss", "seconds"}}."""
    demo = demo or DemoConfig()
    device = demo.device if demo.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    with cpu_threads(demo.cpu_threads if device == "cpu" else None):
        return _run(demo, device)


def _run(demo: DemoConfig, device: str) -> dict:
    t_start = time.perf_counter()
    out = Path(demo.out_dir)
    files = stdlib_sources(_SIZES[device]["source_bytes"])
    print(f"demo on {device}: {len(files)} standard-library files from {files[0].parent}, Qwen2.5 tokenizer")

    tokenizer = load_tokenizer(None)
    probe = _demo_config(demo, device, "bf16", files, out)
    train_data, val_data = build_cpt_datasets(probe.data, tokenizer, demo.seed)
    print(f"data: {len(train_data)} training and {len(val_data) if val_data else 0} validation sequences "
          f"of {probe.data.seq_len} tokens")

    results = {}
    for recipe in ("hybrid", "bf16"):
        cfg = _demo_config(demo, device, recipe, files, out)
        shutil.rmtree(cfg.run_dir, ignore_errors=True)  # the demo owns these two directories
        t0 = time.perf_counter()
        res = Trainer(cfg, tokenizer=tokenizer, train_data=train_data, val_data=val_data).fit()
        tail = [res.losses[s] for s in sorted(res.losses)[-5:]]
        results[recipe] = {"loss": sum(tail) / len(tail), "val_loss": res.val_loss,
                           "seconds": time.perf_counter() - t0, "first_loss": res.losses[min(res.losses)]}
    png = plot_runs([out / _run_name("hybrid"), out / "bf16"], out / "loss.png",
                    title=f"fp8train demo: FP8 (hybrid) vs BF16, CPT on the Python stdlib ({device})")

    f8, b16 = results["hybrid"], results["bf16"]
    print("\nrecipe        first loss   final train loss (mean of last 5)   final val loss   time")
    for name, r in (("fp8 hybrid", f8), ("bf16", b16)):
        val = f"{r['val_loss']:.4f}" if r["val_loss"] is not None else "n/a"
        print(f"{name:<12}  {r['first_loss']:>10.4f}   {r['loss']:>33.4f}   {val:>14}   {r['seconds']:.0f} s")
    gap_train = (f8["loss"] - b16["loss"]) / b16["loss"]
    line = f"relative gap FP8 vs BF16: train {gap_train:+.2%}"
    if f8["val_loss"] is not None and b16["val_loss"] is not None:
        line += f", val {(f8['val_loss'] - b16['val_loss']) / b16['val_loss']:+.2%}"
    print(line)
    print(f"plot: {png}   runs: {out / _run_name('hybrid')}, {out / 'bf16'}   total {time.perf_counter() - t_start:.0f} s")
    return results
