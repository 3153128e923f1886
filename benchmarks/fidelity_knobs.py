"""FP8 fidelity knobs and the noise floor: full CPT -> SFT -> accuracy runs of several arms from one base.

Issue 19 items 2, 3 and 5. Every arm starts from the same SmolLM2-135M base, reads the same CPT and SFT
batches (the data split is fixed by --seed) and differs only in what its spec names:

    bf16                          BF16 (the reference of the gaps of every arm on its seed)
    bf16@1                        BF16 with training seed 1 (data order): the noise floor, and the
                                  reference of the arms on seed 1
    hybrid                        the paper's recipe: 1x128 activations, 128x128 weights, power-of-two scales
    hybrid+exact                  ... with exact FP32 scales (amax / 448) instead of powers of two
    hybrid+keep=0,1,-2,-1         ... with those decoder layers left in BF16 (the `bf16_layers` key)
    hybrid+exact+keep=0,-1@1      combinations, and any arm with another training seed
    hybrid+swiglu_fp8, ...        any recipe modifier of `fp8train.parse_recipe` (`fp8train bench`'s spelling)
                                  that is a training config key (all but wgrad_from_fp8)

Per arm: CPT (`--cpt-steps` of 32 x 2,048 tokens, warmup-stable-decay), SFT of that result on GSM8K
(`--sft-steps` of 16 x 2,048), greedy exact-match accuracy on the `--holdout` problems, and the FP8 health
of every check (underflow / saturation per layer type and operand over time). Each stage's validation loss is
measured twice: by the model as trained (an FP8 arm's forward in FP8) and from its BF16 `hf` export (what a user
serving that export gets: the same weights, every GEMM in BF16), so the gap splits into what FP8 training did
to the weights and what the FP8 forward adds. The step counts are fixed, not
sized from the clock, so that arms run in different invocations (or device calls) are comparable; an arm
that would not fit the `--budget-s` left is skipped and recorded. `--merge` joins the results of several
invocations (or a runs file that keeps them, `--runs`) into one table: each arm's gaps to the BF16 arm of
its training seed, at the end and at every validation, BF16's own seed-to-seed spread beside them, and the
paired accuracy test against BF16.

    python benchmarks/fidelity_knobs.py --base-gguf SmolLM2-135M-Instruct.Q4_1.gguf --gsm8k train.jsonl \
        --arms bf16 hybrid bf16@1 hybrid+exact --out OUT/a.json
    python benchmarks/fidelity_knobs.py --merge OUT/a.json OUT/b.json --out docs/fidelity_knobs.json \
        --runs docs/fidelity_knobs_runs.json --plot docs/fidelity_knobs.png
    python benchmarks/fidelity_knobs.py --smoke --gsm8k ../shared/data/gsm8k/train.jsonl --out /tmp/k.json
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import traceback
from dataclasses import dataclass, fields
from pathlib import Path

import torch

import fidelity as fid  # benchmarks/ is on sys.path: the folder of the script, or tests/_benchmarks.py
from fp8train.cli import keep_freed_memory
from fp8train.data import build_sft_datasets, load_tokenizer
from fp8train.fp8.recipe import MODIFIERS
from fp8train.train.config import TrainConfig
from fp8train.train.files import write_text_atomic
from fp8train.train.model import ModelConfig, build_model
from fp8train.train.optim import OptimConfig

REFERENCE = "bf16"


@dataclass(frozen=True)
class Arm:
    """One training arm: the spec's parts (see the module docstring)."""

    spec: str
    recipe: str
    knobs: tuple[tuple[str, bool], ...]
    """(config key, value) of the spec's recipe modifiers, in its order (`exact`: ("pow2_scale", False))."""
    bf16_layers: tuple[int, ...]
    seed: int

    @property
    def pow2_scale(self) -> bool:
        return dict(self.knobs).get("pow2_scale", True)

    @property
    def slug(self) -> str:
        return self.spec.replace("+", "_").replace("=", "").replace(",", "_").replace("@", "_s")

    def describe(self) -> dict:
        """The arm as the results record it: recipe, pow2_scale, any other knob, bf16_layers, seed."""
        return {"recipe": self.recipe, "pow2_scale": self.pow2_scale, **dict(self.knobs),
                "bf16_layers": list(self.bf16_layers), "seed": self.seed}


_CONFIG_KEYS = {f.name for f in fields(TrainConfig)}


def parse_arm(spec: str, seed: int) -> Arm:
    """`recipe[+modifier][+keep=i,j,..][@seed]` -> Arm; ValueError naming the spec and the part it cannot read.
    The modifiers are `fp8train.parse_recipe`'s that are config keys."""
    body, _, seed_s = spec.partition("@")
    recipe, *mods = body.split("+")
    if recipe not in ("bf16", "hybrid", "tensorwise", "rowwise"):
        raise ValueError(f"arm {spec!r}: unknown recipe {recipe!r} (bf16, hybrid, tensorwise, rowwise)")
    knobs, keep = [], ()
    usable = [m for m, (key, _) in MODIFIERS.items() if key in _CONFIG_KEYS]
    for mod in mods:
        if mod in usable and recipe != "bf16":
            knobs.append(MODIFIERS[mod])
        elif mod.startswith("keep=") and recipe != "bf16":
            try:
                keep = tuple(int(i) for i in mod[5:].split(","))
            except ValueError:
                raise ValueError(f"arm {spec!r}: {mod!r} is not keep=<layer indices, comma-separated>") from None
        else:
            raise ValueError(f"arm {spec!r}: unknown modifier {mod!r} ({', '.join(usable)}, keep=i,j,..; none for bf16)")
    if seed_s and not seed_s.isdigit():
        raise ValueError(f"arm {spec!r}: the seed after '@' must be a non-negative integer")
    return Arm(spec, recipe, tuple(knobs), keep, int(seed_s) if seed_s else seed)


# ------------------------------------------------------------------------------------------- runs


class _Runner:
    """The shared base and data of one invocation, and the pipeline every arm goes through."""

    def __init__(self, args: argparse.Namespace):
        self.args, self.clock = args, fid.Clock(args.budget_s)
        self.scale = fid.SMOKE if args.smoke else fid.GPU
        self.device = fid.pick_device(args.device)
        self.work = Path(args.work)
        if args.base_gguf:
            self.base, self.tokenizer = fid.load_gguf(Path(args.base_gguf), 2 if args.smoke else None)
        else:  # the smoke run without the GGUF: the tiny fallback base, untrained
            self.tokenizer = load_tokenizer(None)
            torch.manual_seed(args.seed)
            self.base = build_model(ModelConfig(source="tiny-qwen2"), self.tokenizer)
        self.base_dir = fid.save_base(self.base, self.tokenizer, self.work)
        s, tps = self.scale, self.scale.cpt_batch * self.scale.seq_len
        need = max(s.min_corpus_tokens, int(args.cpt_steps * tps * 1.02 / (1 - s.val_fraction)))
        files, _ = fid.take_files(fid.corpus_files(args.seed), 0, need)
        self.cpt_data, self.cpt_train, self.cpt_val = fid.cpt_datasets(files, need, self.tokenizer, s, self.work,
                                                                    args.seed, "CPT")
        self.sft_data = fid.gsm8k_sft_data(args.gsm8k, s, args.holdout, args.smoke)
        self.sft_train, self.sft_val, _ = build_sft_datasets(self.sft_data, self.tokenizer, args.seed)
        self.prompts, self.golds = fid.holdout_prompts(self.sft_data, self.tokenizer, s.eval_limit)
        self.data = {"cpt_train_rows": len(self.cpt_train), "cpt_val_rows": len(self.cpt_val),
                     "sft_train_rows": len(self.sft_train), "holdout": len(self.golds),
                     "cpt_tokens_per_step": tps, "sft_tokens_per_step": s.sft_batch * s.seq_len}

    def config(self, arm: Arm, stage: str, data, optim: OptimConfig, steps: int, batch: int, source: Path):
        s = self.scale
        steps = min(steps, s.max_steps) if s.max_steps else steps  # the smoke run's clamp
        return fid.run_config(self.work, stage, f"{stage}_{arm.slug}", seed=arm.seed, device=self.device.type,
                              data=data, optim=optim, steps=steps, batch=batch, micro_batch=s.micro_batch,
                              eval_batches=s.eval_batches, model=source,
                              health_every=max(1, steps // 8) if arm.recipe != "bf16" else 0, recipe=arm.recipe,
                              bf16_layers=list(arm.bf16_layers), **dict(arm.knobs))

    def run(self, arm: Arm) -> dict:
        """CPT -> SFT -> greedy accuracy of one arm: each stage's summary (curves included) and FP8 health trend."""
        s, a, runs = self.scale, self.args, self.work / "runs"
        out: dict = {"arm": arm.describe()}
        cfg = self.config(arm, "cpt", self.cpt_data, fid.cpt_schedule(s.cpt_lr), a.cpt_steps, s.cpt_batch, self.base_dir)
        out["cpt"], model = fid.train_run(cfg, copy.deepcopy(self.base), self.tokenizer, self.cpt_train, self.cpt_val,
                                          export_eval=True)
        # the config names the CPT run's BF16 export: the FP32 model handed over in memory is not on disk
        cfg = self.config(arm, "sft", self.sft_data, fid.sft_schedule(s.sft_lr), a.sft_steps, s.sft_batch,
                          runs / f"cpt_{arm.slug}" / "final")
        out["sft"], _ = fid.train_run(cfg, model, self.tokenizer, self.sft_train, self.sft_val, export_eval=True)
        del model
        t0 = time.perf_counter()
        outs = fid.generate_greedy(runs / f"sft_{arm.slug}" / "final", self.tokenizer, self.prompts,
                                   s.max_new_tokens, s.eval_batch, self.device)
        ev = fid.score(outs, self.golds)
        ev["per_problem"] = "".join("1" if c else "0" for c in ev["per_problem"])  # 500 bytes, for McNemar
        out["eval"] = {**ev, "wall_s": round(time.perf_counter() - t0, 1)}
        for stage in ("cpt", "sft"):  # the trend, check by check, holds what the run's means summarize
            out[stage]["fp8_health_trend"] = out[stage].pop("fp8_health", {}).get("trend", [])
        return out


def _write(path: Path, res: dict) -> None:
    write_text_atomic(path, json.dumps(res, indent=1, default=str))


def run_arms(args: argparse.Namespace) -> dict:
    arms = [parse_arm(spec, args.seed) for spec in args.arms]  # every spec checked before anything runs
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.device == "cpu" or not torch.cuda.is_available():
        keep_freed_memory()  # as the `fp8train` command does: without it a CPU step is several times slower
    runner = _Runner(args)
    res = {"config": {k: v for k, v in vars(args).items() if k != "merge"}, "data": runner.data,
           "setup_s": round(runner.clock.elapsed(), 1), "arms": {}, "skipped": {}, "errors": {}}
    per_arm = args.arm_s  # the expected time of one arm until one has been measured
    for arm in arms:
        if runner.clock.left() < per_arm:
            res["skipped"][arm.spec] = f"{runner.clock.left():.0f} s left, an arm takes about {per_arm:.0f} s"
            continue
        t0 = time.monotonic()
        fid.log_line(runner.clock, f"arm {arm.spec}: {args.cpt_steps} CPT + {args.sft_steps} SFT steps")
        try:
            res["arms"][arm.spec] = {**runner.run(arm), "wall_s": round(time.monotonic() - t0, 1)}
        except Exception:  # the other arms stand without it
            res["errors"][arm.spec] = traceback.format_exc()
            print(res["errors"][arm.spec], file=sys.stderr, flush=True)
        per_arm = time.monotonic() - t0
        _write(out, res)
    res["wall_s"] = round(runner.clock.elapsed(), 1)
    _write(out, res)
    fid.plot_curves(runner.work, [f"cpt_{a.slug}" for a in arms if a.spec in res["arms"]], out.with_suffix(".cpt.png"),
              "CPT from SmolLM2-135M: FP8 knobs vs BF16")
    return res


# ------------------------------------------------------------------------------------------ merge


def load_calls(paths: list[Path]) -> dict[str, dict]:
    """Invocation name -> its results: a results JSON (named by its file), or every call of a runs file
    (`--runs`, which is how the raw runs are kept in docs/)."""
    calls = {}
    for p in paths:
        res = json.loads(p.read_text(encoding="utf-8"))
        calls.update(res["calls"] if "calls" in res else {p.name: res})
    return calls


def _reference(spec: str, arms: dict, seed: int) -> str:
    """The BF16 arm an arm's gaps are measured against: BF16 of the same training seed where it ran, else
    `bf16`; a BF16 arm's own gap is to `bf16` (the noise floor)."""
    arm = parse_arm(spec, seed)
    same_seed = REFERENCE if arm.seed == seed else f"{REFERENCE}@{arm.seed}"
    return same_seed if arm.recipe != "bf16" and same_seed in arms else REFERENCE


def _curve_gaps(curve: list, ref_curve: list) -> list:
    """[[step, relative gap], ...] at the validation steps both curves have."""
    ref = dict(ref_curve)
    return [[s, fid.rel_gap(v, ref[s])] for s, v in curve if s in ref]


def merge(calls: dict[str, dict]) -> dict:
    """The arms of several invocations (same steps and data, checked), each with its gaps to the BF16 arm of its
    training seed (`_reference`), final and at every validation, and BF16's seed-to-seed spread."""
    arms, cfg0 = {}, None
    for name, res in calls.items():
        cfg = {k: res["config"][k] for k in ("cpt_steps", "sft_steps", "seed", "holdout", "smoke")}
        if cfg0 is not None and cfg != cfg0:
            raise ValueError(f"{name}: run with {cfg}, the first with {cfg0}: the arms are not comparable")
        cfg0 = cfg
        arms.update(res["arms"])
    if REFERENCE not in arms:
        raise ValueError(f"no {REFERENCE!r} arm among {sorted(arms)}: nothing to measure the gaps against")
    table = {}
    for spec, r in arms.items():
        ref_spec = _reference(spec, arms, cfg0["seed"])
        ref = arms[ref_spec]
        row = {"reference": ref_spec}
        for st in ("cpt", "sft"):
            row[f"{st}_val_loss"] = r[st]["final_val_loss"]
            row[f"{st}_gap"] = fid.rel_gap(r[st]["final_val_loss"], ref[st]["final_val_loss"])
            row[f"{st}_val_gaps"] = _curve_gaps(r[st].get("val_curve", []), ref[st].get("val_curve", []))
            row[f"{st}_export_val_loss"] = r[st].get("export_val_loss")  # runs before 2026-12-06 lack it
            row[f"{st}_export_gap"] = fid.rel_gap(r[st].get("export_val_loss"), ref[st].get("export_val_loss"))
        row["accuracy"] = r["eval"]["accuracy"]
        row["accuracy_diff_points"] = 100 * (r["eval"]["accuracy"] - ref["eval"]["accuracy"])
        row["paired"] = fid.paired([c == "1" for c in ref["eval"]["per_problem"]],
                                   [c == "1" for c in r["eval"]["per_problem"]])
        row["cpt_tokens_per_s"] = r["cpt"]["tokens_per_s"]
        table[spec] = row
    seeds = {spec: row for spec, row in table.items() if spec.startswith(REFERENCE + "@")}
    return {"config": cfg0, "table": table,
            "noise_floor": {st: max((abs(row[f"{st}_gap"]) for row in seeds.values()), default=None)
                            for st in ("cpt", "sft")},
            "accuracy_noise_points": max((abs(row["accuracy_diff_points"]) for row in seeds.values()), default=None)}


def runs_file(calls: dict[str, dict], merged_name: str) -> dict:
    """The raw runs as docs/ keeps them: every invocation's results without the train curves (the
    validation curves, health trends and per-problem results stay)."""
    calls = copy.deepcopy(calls)
    for res in calls.values():
        for r in res["arms"].values():
            for st in ("cpt", "sft"):
                r[st].pop("train_curve", None)
    return {"note": f"raw arms of {len(calls)} invocations (train curves dropped); merged table: {merged_name}",
            "calls": calls}


def _points(x: float | None) -> str:
    return "n/a (no bf16@ seed)" if x is None else f"{x:.1f} points"


def markdown(m: dict) -> str:
    """The merged table, BF16's spread under it, then each arm's CPT gap at every validation."""
    nf, table = m["noise_floor"], m["table"]
    lines = ["| arm | against | CPT val loss | CPT gap | SFT val loss | SFT gap | accuracy | vs BF16 (only BF16 / only "
             "arm, p) |", "|---|---|---|---|---|---|---|---|"]
    for spec, r in table.items():
        p = r["paired"]
        lines.append(f"| {spec} | {r['reference']} | {r['cpt_val_loss']:.4f} | {fid.fmt_value(r['cpt_gap'], True)} | "
                     f"{r['sft_val_loss']:.4f} | {fid.fmt_value(r['sft_gap'], True)} | "
                     f"{100 * r['accuracy']:.1f}% ({r['accuracy_diff_points']:+.1f}) "
                     f"| {p['only_bf16']} / {p['only_fp8']}, p = {p['mcnemar_p']:.2f} |")
    lines += ["", f"BF16 seed-to-seed spread (noise floor): CPT {fid.fmt_value(nf['cpt'], True)}, SFT "
              f"{fid.fmt_value(nf['sft'], True)}, accuracy {_points(m['accuracy_noise_points'])}."]
    served = {spec: r for spec, r in table.items() if r.get("cpt_export_gap") is not None}
    if served:
        lines += ["", "The same arms served from their BF16 `hf` export (each stage's final model in BF16, no FP8 "
                  "GEMM; the gaps above are of the model as trained, FP8 forward included):", "",
                  "| arm | against | CPT export val loss | CPT gap, export | as trained | SFT export val loss | "
                  "SFT gap, export | as trained |", "|---|---|---|---|---|---|---|---|"]
        for spec, r in served.items():
            lines.append(f"| {spec} | {r['reference']} | {fid.fmt_value(r['cpt_export_val_loss'])} | "
                         f"{fid.fmt_value(r['cpt_export_gap'], True)} | {fid.fmt_value(r['cpt_gap'], True)} | "
                         f"{fid.fmt_value(r['sft_export_val_loss'])} | {fid.fmt_value(r['sft_export_gap'], True)} | "
                         f"{fid.fmt_value(r['sft_gap'], True)} |")
    along = {spec: r["cpt_val_gaps"] for spec, r in table.items() if spec != REFERENCE and r["cpt_val_gaps"]}
    if along:
        steps = sorted({s for gaps in along.values() for s, _ in gaps})
        lines += ["", "CPT gap at each validation step:", "",
                  "| arm | " + " | ".join(str(s) for s in steps) + " |", "|---|" + "---|" * len(steps)]
        for spec, gaps in along.items():
            at = dict(gaps)
            lines.append(f"| {spec} | " + " | ".join(fid.fmt_value(at.get(s), True) for s in steps) + " |")
    return "\n".join(lines) + "\n"


def plot(m: dict, png: Path) -> None:
    """CPT and SFT validation-loss gaps of every arm to its BF16 reference, the BF16 seeds' spread shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    specs = [s for s in m["table"] if s != REFERENCE]
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.45 * len(specs) + 1.6), sharey=True)
    for ax, stage in zip(axes, ("cpt", "sft")):
        gaps = [100 * m["table"][s][f"{stage}_gap"] for s in specs]
        colors = ["0.6" if s.startswith(REFERENCE) else "tab:blue" for s in specs]
        ax.barh(range(len(specs)), gaps, color=colors)
        if m["noise_floor"][stage] is not None:
            ax.axvspan(-100 * m["noise_floor"][stage], 100 * m["noise_floor"][stage], color="0.9", zorder=0,
                       label="BF16 seed-to-seed")
        ax.axvline(0, color="0.3", lw=0.8)
        ax.set_xlabel(f"{stage.upper()} validation loss gap to BF16 of the same seed (%)")
        ax.legend(fontsize=8, loc="lower right")
    axes[0].set_yticks(range(len(specs)), specs, fontsize=8)
    axes[0].invert_yaxis()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="results JSON (the CPT plot lands beside it)")
    p.add_argument("--merge", nargs="+", default=None, help="results JSONs to join (no training)")
    p.add_argument("--plot", default=None, help="with --merge: PNG of every arm's gaps")
    p.add_argument("--runs", default=None, help="with --merge: also write the inputs' raw runs to this JSON")
    p.add_argument("--arms", nargs="+", default=["bf16", "hybrid", "bf16@1", "hybrid+exact"])
    p.add_argument("--work", default="/tmp/fp8train_knobs", help="runs, token caches and models")
    p.add_argument("--base-gguf", default=None, help="SmolLM2-135M-Instruct GGUF; absent: the tiny untrained base")
    p.add_argument("--gsm8k", default=None, help="GSM8K train.jsonl")
    p.add_argument("--cpt-steps", type=int, default=96)
    p.add_argument("--sft-steps", type=int, default=92)
    p.add_argument("--holdout", type=int, default=500)
    p.add_argument("--seed", type=int, default=0, help="the data split and the default training seed")
    p.add_argument("--budget-s", type=float, default=540.0)
    p.add_argument("--arm-s", type=float, default=120.0, help="expected seconds per arm until one is measured")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--smoke", action="store_true", help="CPU shapes (2 layers of the base, a few steps)")
    args = p.parse_args(argv)
    if args.merge is None and args.gsm8k is None:
        p.error("--gsm8k is required to train")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.merge:
        calls = load_calls([Path(p) for p in args.merge])
        m = merge(calls)
        _write(Path(args.out), m)
        if args.runs:
            _write(Path(args.runs), runs_file(calls, Path(args.out).name))
        if args.plot:
            plot(m, Path(args.plot))
        print(markdown(m), end="")
        return 0
    res = run_arms(args)
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
