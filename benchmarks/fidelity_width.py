"""How the FP8 gap moves with model width: Qwen2-shaped models pretrained from scratch, FP8 hybrid vs BF16.

Issue 19 item 4. For each shape (`WIDTHxLAYERS`: head size 64, half as many key/value heads, MLP 3x the
width, tied embeddings) and each seed, two runs from the same initialisation on the same batches: BF16 and
FP8 `hybrid`. Every shape sees the same number of tokens per parameter (all parameters, embeddings
included), chosen from the throughput measured here so that all runs fit `--budget-s` (or given with
`--tokens-per-param`). Data: the Python standard library and installed packages' sources and docs (as
fidelity.py reads them), `--seq-len` rows (1,024 tokens) with document masking, `--rows` (32) per step, 1% of the documents held out; AdamW
(0.9, 0.95), weight decay 0.1, warmup-stable-decay, peak LR 1e-3 x 512 / width.

With `--warm-fraction F`, each shape first pretrains in BF16 alone (seed 0) for the first F of its tokens,
and every arm (BF16 and FP8, each seed) continues from that shared checkpoint for the rest, on a continual-
pretraining schedule (peak LR a third of the shape's): the gap is then measured as in continual pretraining of
a trained model, where the paired gap repeats across seeds (docs/fidelity.md: to 0.01% on SmolLM2-135M), rather
than from scratch, where early training amplifies any perturbation and the paired gap moved by up to 2 points
between seeds at 0.1 tokens per parameter.

The gap of a shape and seed is (FP8 - BF16) / BF16 of the final validation loss; beside it, BF16's own
seed-to-seed spread at that shape (what a gap has to exceed to count). `--jobs` runs that many training
runs at once (one process each: small models leave a GPU mostly idle). Writes --out (JSON) and, with
--plot, the gap against width with the seed spread.

    python benchmarks/fidelity_width.py --tokenizer TOKENIZER_DIR --out OUT/width.json --plot OUT/width.png
    python benchmarks/fidelity_width.py --tokenizer TOKENIZER_DIR --warm-fraction 0.7 --out OUT/width.json
    python benchmarks/fidelity_width.py --smoke --out /tmp/width.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

import fidelity as fid  # benchmarks/ is on sys.path: the folder of the script, or tests/_benchmarks.py
from fp8train.cli import keep_freed_memory
from fp8train.data import load_tokenizer
from fp8train.fp8.recipe import make_recipe
from fp8train.train.files import write_text_atomic
from fp8train.train.model import ModelConfig, build_model



@dataclass(frozen=True)
class Shape:
    width: int
    layers: int

    @property
    def model(self) -> dict:
        heads = max(1, self.width // 64)
        return dict(hidden_size=self.width, num_layers=self.layers, num_heads=heads,
                    num_kv_heads=max(1, heads // 2), intermediate_size=3 * self.width)

    @property
    def lr(self) -> float:
        return 1e-3 * 512 / self.width

    @staticmethod
    def parse(text: str) -> "Shape":
        w, _, n = text.partition("x")
        if not (w.isdigit() and n.isdigit()) or int(w) % 128:
            raise ValueError(f"shape {text!r}: expected WIDTHxLAYERS with WIDTH a multiple of 128, e.g. 512x6")
        return Shape(int(w), int(n))


@dataclass(frozen=True)
class Run:
    shape: Shape
    recipe: str
    seed: int
    steps: int
    micro_batch: int
    start: str | None = None
    """The shared BF16 checkpoint an arm continues from (`--warm-fraction`); None: from scratch."""
    warm: bool = False
    """The shared BF16 pretraining of the shape itself (no gap is measured on it)."""

    @property
    def name(self) -> str:
        return f"w{self.shape.width}x{self.shape.layers}_" + ("warm" if self.warm else f"{self.recipe}_s{self.seed}")


def _model(shape: Shape, tokenizer, seed: int):
    torch.manual_seed(seed)
    return build_model(ModelConfig(source="tiny-qwen2", **shape.model), tokenizer)


def param_count(shape: Shape, tokenizer) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in _model(shape, tokenizer, 0).parameters())


def _data(args, tokenizer, tokens: int):
    scale = replace(fid.GPU, seq_len=args.seq_len, val_fraction=0.01)
    files, _ = fid.take_files(fid.corpus_files(0), 0, tokens)
    return fid.cpt_datasets(files, tokens, tokenizer, scale, Path(args.work), 0, "pretraining")


def _train_one(args: argparse.Namespace, run: Run, tokenizer, datasets: tuple) -> dict:
    """One pretraining run; its summary without the curves. `datasets`: `_data`'s (config, train, val)."""
    data, train, val = datasets
    if run.start is None:  # from scratch: a shorter warmup and a longer decay than continual pretraining's
        optim, source = fid.cpt_schedule(run.shape.lr, warmup_ratio=0.05, decay_ratio=0.2), ModelConfig(
            source="tiny-qwen2", **run.shape.model)
        model = _model(run.shape, tokenizer, run.seed)
    else:  # continued from the shape's shared BF16 checkpoint, as continual pretraining
        optim, source = fid.cpt_schedule(run.shape.lr / 3), run.start
        model = build_model(ModelConfig(source=run.start), tokenizer)
    cfg = fid.run_config(Path(args.work), "cpt", run.name, seed=run.seed, device=args.device, data=data, optim=optim,
                         steps=run.steps, batch=args.rows, micro_batch=run.micro_batch, eval_batches=args.eval_batches,
                         model=source, evals=4, recipe=run.recipe)
    t0 = time.perf_counter()
    summary, _ = fid.train_run(cfg, model, tokenizer, train, val)
    summary.pop("train_curve")
    return {"run": {**asdict(run), "name": run.name}, **summary, "wall_s": round(time.perf_counter() - t0, 1)}


def _worker(job: tuple) -> dict:
    """A worker process's run (--jobs > 1): its own tokenizer and datasets (read from the token cache)."""
    args, run = job
    torch.set_num_threads(2)
    tokenizer = load_tokenizer(args.tokenizer)
    return _train_one(args, run, tokenizer, _data(args, tokenizer, args.corpus_tokens))


def rate(shape: Shape, recipe: str, tokenizer, args, device) -> float:
    """Forward + backward tokens/s of one micro-batch (fidelity.py's measurement at this shape)."""
    scale = replace(fid.GPU, seq_len=args.seq_len, micro_batch=args.micro_batch)
    recipe_obj = make_recipe("hybrid") if recipe == "hybrid" else recipe
    return fid.tokens_per_s(_model(shape, tokenizer, 0), recipe_obj, scale, device)


def plan(args, shapes: list[Shape], tokenizer, device) -> tuple[dict, float, dict]:
    """Tokens per parameter that fits all runs in the time left (or the one given), the steps per shape."""
    params = {s: param_count(s, tokenizer) for s in shapes}
    if args.tokens_per_param:
        r, rates = args.tokens_per_param, {}
    else:
        rates = {(s, rc): rate(s, rc, tokenizer, args, device) for s in shapes for rc in ("bf16", "hybrid")}
        f = args.warm_fraction  # the warm share runs once per shape, in BF16; the rest per seed and recipe

        def seconds(s: Shape) -> float:  # per token per parameter
            arms = sum(1 / rates[(s, rc)] for rc in ("bf16", "hybrid")) * len(args.seeds)
            return params[s] / fid.LOOP_EFFICIENCY * (f / rates[(s, "bf16")] + (1 - f) * arms)

        seconds_per_token_per_param = sum(seconds(s) for s in shapes)
        r = args.train_s * args.jobs_speedup / seconds_per_token_per_param
    steps = {s: max(args.min_steps, int(r * params[s] / (args.rows * args.seq_len))) for s in shapes}
    return steps, r, {"params": {f"{s.width}x{s.layers}": n for s, n in params.items()},
                      "tokens_per_s": {f"{s.width}x{s.layers} {rc}": round(v) for (s, rc), v in rates.items()}}


def gaps(runs: list[dict]) -> dict:
    """Per shape: the FP8 gap of each seed, their mean and range, and BF16's seed-to-seed spread."""
    by = {}
    for r in runs:
        key = f"{r['run']['shape']['width']}x{r['run']['shape']['layers']}"
        by.setdefault(key, {}).setdefault(r["run"]["seed"], {})[r["run"]["recipe"]] = r["final_val_loss"]
    out = {}
    for key, seeds in by.items():
        g = [fid.rel_gap(v["hybrid"], v["bf16"]) for v in seeds.values() if "hybrid" in v and "bf16" in v]
        bf = [v["bf16"] for v in seeds.values() if "bf16" in v]
        out[key] = {"width": int(key.split("x")[0]), "gaps": g, "gap_mean": float(np.mean(g)) if g else None,
                    "gap_min": min(g, default=None), "gap_max": max(g, default=None),
                    "bf16_val_losses": bf,
                    "bf16_seed_spread": (max(bf) - min(bf)) / min(bf) if len(bf) > 1 else None}
    return dict(sorted(out.items(), key=lambda kv: kv[1]["width"]))


def plot(summary: dict, png: Path, title: str, target: float = 0.25) -> None:
    """Left: the gap of each seed against width inside BF16's seed-to-seed spread. Right: the same gaps on
    their own scale, beside the CPT target (`target`, %): the paired gap can be far inside the spread."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [v for v in summary.values() if v["gap_mean"] is not None]
    w = [v["width"] for v in rows]
    mean = [100 * v["gap_mean"] for v in rows]
    spread = [100 * (v["bf16_seed_spread"] or 0) for v in rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, zoom in zip(axes, (False, True)):
        if not zoom:
            ax.fill_between(w, [-s for s in spread], spread, color="0.85", label="BF16 seed-to-seed spread")
        for v in rows:
            ax.scatter([v["width"]] * len(v["gaps"]), [100 * g for g in v["gaps"]], color="C0", s=14, zorder=3)
        ax.plot(w, mean, marker="o", color="C0", label="FP8 hybrid - BF16 of the same seed (mean; dots: seeds)")
        if zoom:
            ax.axhline(target, color="C3", ls="--", lw=1, label=f"CPT target {target}%")
            ax.set_ylim(min(-0.05, min(mean) - 0.05), max(target, max(mean)) * 1.25)
        ax.axhline(0, color="0.4", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(w, [str(x) for x in w])
        ax.set_xlabel("model width (hidden size)")
        ax.set_ylabel("final validation loss gap (%)")
        ax.set_title("the paired gap alone" if zoom else "against BF16's seed spread", fontsize=9)
        ax.legend(fontsize=7, loc="upper left")
    fig.suptitle("\n".join(textwrap.wrap(title, 110)), fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--plot", default=None, help="PNG of the gap against width")
    p.add_argument("--work", default="/tmp/fp8train_width")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (or 'qwen2.5', the default)")
    p.add_argument("--shapes", nargs="+", type=Shape.parse, default=[Shape(256, 4), Shape(512, 6), Shape(1024, 8)])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    p.add_argument("--tokens-per-param", type=float, default=None, help="fixed; default: what fits the budget")
    p.add_argument("--budget-s", type=float, default=480.0, help="wall clock for everything")
    p.add_argument("--jobs", type=int, default=1, help="training runs at once (processes)")
    p.add_argument("--jobs-speedup", type=float, default=1.0, help="assumed throughput gain of --jobs, for the plan")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per packed row")
    p.add_argument("--rows", type=int, default=32, help="rows per optimizer step")
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--warm-fraction", type=float, default=0.0,
                   help="share of each shape's tokens pretrained once in BF16, then continued by every arm "
                        "(0: from scratch)")
    p.add_argument("--min-steps", type=int, default=20)
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--smoke", action="store_true", help="CPU shapes and a few steps: a check of the code")
    args = p.parse_args(argv)
    if not 0.0 <= args.warm_fraction < 1.0:
        p.error(f"--warm-fraction {args.warm_fraction}: a share of the tokens in [0, 1)")
    args.device = fid.pick_device(args.device).type
    if args.smoke:
        args.shapes, args.min_steps, args.seq_len, args.rows, args.micro_batch, args.eval_batches = (
            [Shape(128, 1), Shape(256, 2)], 2, 128, 4, 2, 2)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.monotonic()
    device = torch.device(args.device)
    if device.type == "cpu":
        keep_freed_memory()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(args.tokenizer)
    args.train_s = args.budget_s - 60.0  # set-up, data and the last writes
    steps, r, info = plan(args, args.shapes, tokenizer, device)
    args.train_s -= time.monotonic() - t0
    if args.smoke:
        steps = {s: min(n, 3) for s, n in steps.items()}
    args.corpus_tokens = int(max(steps.values()) * args.rows * args.seq_len * 1.02 / 0.99) + 1
    datasets = _data(args, tokenizer, args.corpus_tokens)  # tokenized once, here; the workers read the cache
    shapes = sorted(args.shapes, key=lambda s: -s.width)  # the longest first: the pool ends together
    warm = {s: max(args.min_steps, round(args.warm_fraction * steps[s])) for s in shapes} if args.warm_fraction else {}
    warm_runs = [Run(s, "bf16", 0, warm[s], args.micro_batch, warm=True) for s in shapes if warm.get(s)]
    start = {w.shape: str(Path(args.work) / "runs" / w.name / "final") for w in warm_runs}
    runs = [Run(s, rc, seed, max(args.min_steps, steps[s] - warm.get(s, 0)), args.micro_batch, start.get(s))
            for s in shapes for seed in args.seeds for rc in ("bf16", "hybrid")]
    print(f"[width] tokens/param {r:.3f}; steps {dict((f'{s.width}x{s.layers}', n) for s, n in steps.items())}"
          + (f", the first {args.warm_fraction:.0%} shared in BF16" if warm_runs else "") + f"; {info}", flush=True)
    res = {"config": {k: (str(v) if k == "shapes" else v) for k, v in vars(args).items()},
           "tokens_per_param": r, "plan": info, "warm": [], "runs": [], "gaps": {},
           "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    pool = mp.get_context("spawn").Pool(args.jobs, maxtasksperchild=1) if args.jobs > 1 else None
    for phase, batch in (("warm", warm_runs), ("runs", runs)):  # the arms start once their checkpoints exist
        done = (pool.imap_unordered(_worker, [(args, run) for run in batch]) if pool
                else (_train_one(args, run, tokenizer, datasets) for run in batch))
        for result in done:  # written as each run ends: a timeout keeps what finished
            res[phase].append(result)
            res["gaps"], res["wall_s"] = gaps(res["runs"]), round(time.monotonic() - t0, 1)
            write_text_atomic(out, json.dumps(res, indent=1, default=str))
            print(f"[width] {result['run']['name']}: val loss {result['final_val_loss']:.4f} in {result['wall_s']} s, "
                  f"{result['tokens_per_s'] or 0:,.0f} tokens/s", flush=True)
    if pool:
        pool.close()
        pool.join()
    for key, g in res["gaps"].items():
        print(f"[width] {key}: gaps {[f'{100 * x:+.2f}%' for x in g['gaps']]}, BF16 seed spread "
              f"{fid.fmt_value(g['bf16_seed_spread'], True)}", flush=True)
    if args.plot:
        how = (f"continued from a shared BF16 checkpoint ({args.warm_fraction:.0%} of the tokens)" if warm_runs
               else "from scratch")
        plot(res["gaps"], Path(args.plot), f"FP8 hybrid vs BF16 {how}, {r:.2f} tokens per parameter; "
                                                f"{res['device_name']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
