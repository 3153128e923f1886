"""`fp8train demo`: the whole mission, small: FP8 vs BF16 through CPT, SFT, evaluation and an FP8 export.

1. CPT. A small Qwen2-architecture model (random init, tied embeddings) learns Python from the standard
   library sources of the running interpreter, tokenized with the real Qwen2.5 tokenizer, twice: with the
   `hybrid` FP8 recipe (emulated on a CPU) and in BF16, same config, seed and data.
2. SFT. Each CPT model is fine-tuned in its own recipe on a generated chat task it can learn in a minute:
   the capitals of 12 countries asked in four phrasings ("Capital of France?" -> "Answer: Paris";
   assistant-only loss, ChatML template).
3. Evaluation. Both SFT models answer the 12 questions in a fifth phrasing that training never shows
   (`fp8train.eval`, greedy decoding): accuracy (a model that has not learned the task names one city
   for every country: 1 in 12).
4. Export. The FP8 SFT model is exported as an `fp8-block` checkpoint (E4M3, 128x128 block scales).
One table comes out (CPT gap, SFT gap, accuracy of each, the export path) and two overlay plots
(OUT/loss.png for CPT, OUT/sft_loss.png for SFT).

Steps 1-3 of one recipe never read the other's results, so on a CPU with two cores the FP8 arm and the BF16 arm
run side by side in two processes of one torch thread each (`parallel`): each computes bit for bit what it
computes alone (one thread, the same configs, seed and token cache), in about half the wall time.

CPU budget: the 151,936-row tied embedding / LM head (19.4M of the 19.7M parameters) costs far more
than the 2-layer, 128-wide decoder, about 1 ms per token on one core: CPT is 40 steps of 8 x 128 tokens,
SFT 200 steps of 2 x 128 (small batches: from the BF16 CPT model these reached 12/12 on the held-out
phrasing, while 50 steps of 8 x 128, the same tokens, stayed at 1/12). With a GPU the same command trains
a bigger model for longer, one arm after the other.
"""

from __future__ import annotations

import io
import json
import logging
import multiprocessing
import os
import random
import shutil
import sys
import sysconfig
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from .train.config import LoopConfig, TrainConfig
from .data import CptDataConfig, SftDataConfig, build_cpt_datasets, load_tokenizer
from .train.model import ModelConfig
from .train.optim import OptimConfig
from .eval import EvalConfig, run_eval
from .export import export_checkpoint
from .plot import plot_runs
from .threads import cpu_threads
from .train.trainer import Trainer

__all__ = ["DemoConfig", "run_demo", "stdlib_sources", "sft_task", "TASK_INSTRUCTION"]

log = logging.getLogger(__name__)

_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "lib2to3"}


@dataclass
class DemoConfig:
    """Options of `fp8train demo`."""

    out_dir: str = "runs/demo"
    """Where the runs, evaluations, export, token cache and plots go (a second demo into the same folder recreates
    its runs, evaluations and export; the token cache is reused)."""
    device: str = "auto"
    """`auto` (CUDA when available), `cpu` or `cuda`; the sizes below depend on it."""
    steps: int | None = None
    """Override the number of optimizer steps of CPT and of SFT (CPU: 40 and 200, GPU: 300 and 300)."""
    seed: int = 0
    """Model init and data order, shared by both runs."""
    cpu_threads: int | None = 1
    """torch threads on a CPU (of each arm's process, side by side), restored afterwards; None or 0 keeps torch's
    default (`fp8train.threads` says why one: on a shared 2-core VM the demo took 1m58s with one thread against
    4m36s with two)."""
    parallel: bool = True
    """On a CPU with a core for each arm's threads, run the FP8 and the BF16 arm (CPT, SFT, evaluation) side by
    side, in two processes: each computes exactly what it computes alone, in half the wall time on two idle
    cores. False (`--sequential`): one after the other, as on a GPU always."""
    tokenizer: str | None = None
    """`load_tokenizer`'s source; None: the real Qwen2.5 tokenizer."""

    def __post_init__(self):
        if self.steps is not None and self.steps < 2:  # (checked before minutes of work, not after)
            raise ValueError(f"demo: --steps must be at least 2 (a warmup and a decay step), got {self.steps}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"demo: --device must be auto, cpu or cuda, got {self.device!r}")


# CPT: (model overrides, seq_len, global_batch, micro_batch, steps, peak lr, source bytes, token budget);
# sft: the SFT run on the generated task (steps, rows of seq_len tokens, batch, peak lr, chats generated).
_SIZES = {
    "cpu": dict(model=dict(num_layers=2, hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2),
                seq_len=128, global_batch=8, micro_batch=4, steps=40, lr=3e-3, source_bytes=1_500_000,
                max_tokens=300_000,
                sft=dict(steps=200, seq_len=128, global_batch=2, micro_batch=2, lr=3e-3, samples=3000)),
    "cuda": dict(model=dict(num_layers=8, hidden_size=512, intermediate_size=1536, num_heads=8, num_kv_heads=2),
                 seq_len=1024, global_batch=32, micro_batch=8, steps=300, lr=2e-3, source_bytes=40_000_000,
                 max_tokens=8_000_000,
                 sft=dict(steps=300, seq_len=128, global_batch=4, micro_batch=4, lr=1e-3, samples=6000)),
}
TASK_INSTRUCTION = "Reply with the city."
_CAPITALS = (("France", "Paris"), ("Italy", "Rome"), ("Japan", "Tokyo"), ("Egypt", "Cairo"), ("Spain", "Madrid"),
             ("Germany", "Berlin"), ("Russia", "Moscow"), ("China", "Beijing"), ("Kenya", "Nairobi"), ("Peru", "Lima"),
             ("Cuba", "Havana"), ("Greece", "Athens"))
_TRAIN_PHRASINGS = ("What is the capital of {}?", "Capital of {}?", "Which city is the capital of {}?",
                    "Tell me the capital of {}.")
_EVAL_PHRASING = "Name the capital of {}."


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
    steps = size["steps"] if demo.steps is None else demo.steps
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


def sft_task(n: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(n training chats, the 12 evaluation problems) of the capitals task: {"question", "answer", "response"}.
    Training asks in four phrasings, the evaluation in a fifth; the response is "Answer: <city>"."""
    rng = random.Random(seed)

    def item(country: str, city: str, phrasing: str) -> dict:
        return {"question": phrasing.format(country), "answer": city, "response": f"Answer: {city}"}

    train = [item(*rng.choice(_CAPITALS), rng.choice(_TRAIN_PHRASINGS)) for _ in range(n)]
    return train, [item(country, city, _EVAL_PHRASING) for country, city in _CAPITALS]


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _sft_config(demo: DemoConfig, device: str, recipe: str, data: Path, out: Path) -> TrainConfig:
    """The SFT run of `recipe`; its model, the CPT checkpoint, is set by `_run_arm` once CPT has run."""
    size = _SIZES[device]["sft"]
    steps = size["steps"] if demo.steps is None else demo.steps
    return TrainConfig(
        stage="sft", run_dir=str(out / f"sft_{_run_name(recipe)}"), resume="none", seed=demo.seed, device=device,
        recipe=recipe, model=ModelConfig(source=""),
        data=SftDataConfig(paths=[str(data)], seq_len=size["seq_len"], val_fraction=0.05),
        optim=OptimConfig(lr=size["lr"], min_lr=size["lr"] / 10, weight_decay=0.0, grad_clip=1.0, schedule="cosine",
                          warmup_ratio=0.05),
        train=LoopConfig(steps=steps, global_batch=size["global_batch"], micro_batch=size["micro_batch"],
                         eval_every=max(1, steps // 4), eval_batches=8, save_every=0, keep_last=1, log_every=1,
                         health_every=max(1, steps // 2)),
    )


def run_demo(demo: DemoConfig | None = None) -> dict:
    """Run CPT, SFT, evaluation (both recipes) and the FP8 export; return {recipe: {"loss", "val_loss",
    "first_loss", "seconds", "sft_loss", "sft_val_loss", "accuracy"[, "export"]}} (CPT keys unprefixed).
    Side by side (`DemoConfig.parallel`) the arms run in processes started with `spawn`, which import the
    calling script again: a script that calls this needs the `if __name__ == "__main__":` guard."""
    demo = demo or DemoConfig()
    device = demo.device if demo.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    with cpu_threads(demo.cpu_threads if device == "cpu" else None):
        return _run(demo, device)


@dataclass(frozen=True)
class _Arm:
    """One recipe's half of the demo, everything it reads named here (a process of its own can run it)."""

    recipe: str
    cpt: TrainConfig
    sft: TrainConfig  # its model (the CPT checkpoint) is filled in once CPT has run
    eval: EvalConfig  # its model (the SFT export) likewise
    tokenizer: str | None


def _arm_threads(demo: DemoConfig) -> int:
    """torch threads of each arm's process (`cpu_threads`; 0 or None: torch's default)."""
    return demo.cpu_threads or torch.get_num_threads()


def _side_by_side(demo: DemoConfig, device: str) -> bool:
    """Whether the two arms run at once, in two processes: on a CPU with a core for each arm's threads."""
    if not demo.parallel or device != "cpu":
        return False
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cores >= 2 * _arm_threads(demo)


def _run(demo: DemoConfig, device: str) -> dict:
    t_start = time.perf_counter()
    out = Path(demo.out_dir)
    files = stdlib_sources(_SIZES[device]["source_bytes"])
    print(f"demo on {device}: {len(files)} standard-library files from {files[0].parent}, "
          f"{demo.tokenizer or 'Qwen2.5'} tokenizer")
    tokenizer = load_tokenizer(demo.tokenizer)
    probe = _demo_config(demo, device, "bf16", files, out)
    train_data, val_data = build_cpt_datasets(probe.data, tokenizer, demo.seed)  # (and the token cache the arms read)
    print(f"data: {len(train_data)} training and {len(val_data) if val_data else 0} validation sequences "
          f"of {probe.data.seq_len} tokens")

    size = _SIZES[device]["sft"]  # the SFT task, generated, and its held-out evaluation
    train, held_out = sft_task(size["samples"], seed=demo.seed + 1)
    # the user turn as `fp8train eval` writes it: the question, a blank line, the instruction
    train_file = _write_jsonl(out / "task" / "train.jsonl", [
        {"prompt": f"{p['question']}\n\n{TASK_INSTRUCTION}", "response": p["response"]} for p in train])
    eval_file = _write_jsonl(out / "task" / "eval.jsonl", [{"question": p["question"], "answer": p["answer"]}
                                                           for p in held_out])
    print(f"SFT task: {len(train)} generated chats ('{train[0]['question']}' -> '{train[0]['response']}'), "
          f"evaluated on {len(held_out)} questions phrased as '{held_out[0]['question']}'")

    arms = [_Arm(recipe, _demo_config(demo, device, recipe, files, out),
                 _sft_config(demo, device, recipe, train_file, out),
                 EvalConfig(model="", data=str(eval_file), instruction=TASK_INSTRUCTION, greedy=True, max_new_tokens=8,
                            batch_size=len(held_out), out=str(out / f"eval_{_run_name(recipe)}")), demo.tokenizer)
            for recipe in ("hybrid", "bf16")]
    if _side_by_side(demo, device):
        threads = _arm_threads(demo)
        print(f"CPT, SFT and evaluation of FP8 (hybrid) and BF16 run side by side, in two processes of {threads} "
              f"thread(s) each (each computes what it computes alone; --sequential runs them one after the other)")
        done = _run_side_by_side(arms, threads)
    else:
        done = [_run_arm(arm, None, None, tokenizer, (train_data, val_data)) for arm in arms]
    results = {arm.recipe: r for arm, r in zip(arms, done)}
    runs = {recipe: r.pop("runs") for recipe, r in results.items()}

    png = plot_runs([runs["hybrid"]["cpt"], runs["bf16"]["cpt"]], out / "loss.png",
                    title=f"fp8train demo: FP8 (hybrid) vs BF16, CPT on the Python stdlib ({device})")
    sft_png = plot_runs([runs["hybrid"]["sft"], runs["bf16"]["sft"]], out / "sft_loss.png",
                        title=f"fp8train demo: FP8 (hybrid) vs BF16, SFT on '{TASK_INSTRUCTION}' ({device})")
    export = out / "fp8_block"  # 4. the FP8 model as an fp8-block checkpoint for serving
    shutil.rmtree(export, ignore_errors=True)
    results["hybrid"]["export"] = export_checkpoint(Path(runs["hybrid"]["sft"]) / "final", export, format="fp8-block")

    f8, b16 = results["hybrid"], results["bf16"]
    n = len(held_out)
    print(f"\n{'':<26}{'FP8 (hybrid)':>14}{'BF16':>10}{'FP8 - BF16':>12}")
    for label, key in (("CPT train loss (last 5)", "loss"), ("CPT val loss", "val_loss"),
                       ("SFT train loss (last 5)", "sft_loss"), ("SFT val loss", "sft_val_loss")):
        if f8.get(key) is not None and b16.get(key) is not None:
            print(f"{label:<26}{f8[key]:>14.4f}{b16[key]:>10.4f}{f8[key] - b16[key]:>+12.4f}")
    right = [round(r["accuracy"] * n) for r in (f8, b16)]
    print(f"{'task accuracy (held out)':<26}{f'{right[0]}/{n}':>14}{f'{right[1]}/{n}':>10}{right[0] - right[1]:>+12d}")
    line = f"relative gap FP8 vs BF16: CPT train {(f8['loss'] - b16['loss']) / b16['loss']:+.2%}"
    if f8["val_loss"] is not None and b16["val_loss"] is not None:
        line += f", val {(f8['val_loss'] - b16['val_loss']) / b16['val_loss']:+.2%}"
    print(line + f"; SFT train loss {f8['sft_loss'] - b16['sft_loss']:+.4f} nats")
    print(f"fp8-block export of the FP8 model: {f8['export']}")
    print(f"plots: {png}, {sft_png}   runs: {out}   total {time.perf_counter() - t_start:.0f} s")
    return results


_LABELS = {"hybrid": "fp8", "bf16": "bf16"}


def _run_side_by_side(arms: list[_Arm], threads: int) -> list[dict]:
    """`_run_arm` of each arm in a process of its own (spawned: the parent has run the tokenizer's threads). The
    first arm to fail, or whose process dies (the OOM killer, a signal), raises here at once, and the others are
    stopped rather than waited for."""
    ctx = multiprocessing.get_context("spawn")
    running, finished = [], False
    try:
        for arm in arms:
            receive, send = ctx.Pipe(duplex=False)
            process = ctx.Process(target=_arm_process, args=(arm, threads, f"[{_LABELS[arm.recipe]}] ", send),
                                  name=f"fp8train-demo-{_LABELS[arm.recipe]}", daemon=True)
            process.start()
            send.close()  # (the child's end: a child that dies closes the pipe, and `poll` sees it)
            running.append((arm, process, receive))
        results = {}
        while len(results) < len(running):
            for arm, process, receive in running:
                if arm.recipe in results or not receive.poll(0.2):
                    continue
                try:
                    ok, value = receive.recv()
                except EOFError:  # the process ended without a word
                    process.join(5)
                    code = process.exitcode
                    how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
                    raise RuntimeError(f"the demo's {_LABELS[arm.recipe]} arm's process ended without a result "
                                       f"({how}; out of memory?)") from None
                if not ok:
                    raise value
                results[arm.recipe] = value
        finished = True
        return [results[arm.recipe] for arm in arms]
    finally:
        for _, process, _ in running:
            if finished:  # an arm that has sent its result exits by itself (its own clean-up, its locks released)
                process.join(60)
            if process.is_alive():
                process.terminate()
            process.join()


def _arm_process(arm: _Arm, threads: int, prefix: str, send: "multiprocessing.connection.Connection") -> None:
    """An arm's process: `_run_arm`, then (True, its result) or (False, the exception) to the parent."""
    try:
        message = (True, _run_arm(arm, threads, prefix))
    except BaseException as e:  # (KeyboardInterrupt too: the parent decides)
        message = (False, e)
    try:
        send.send(message)
    except Exception:  # an exception that does not pickle: its type and message
        send.send((False, RuntimeError(f"{type(message[1]).__name__}: {message[1]}")))


def _run_arm(arm: _Arm, threads: int | None, prefix: str | None, tokenizer: "PreTrainedTokenizerBase | None" = None,
             cpt_data: tuple | None = None) -> dict:
    """1. CPT, 2. SFT from its checkpoint, 3. the evaluation of the SFT model, for one recipe. In a process of
    its own (`prefix` given): glibc keeps freed memory, `threads` torch threads, each output line prefixed, no
    progress bars, and the tokenizer and the CPT rows made again (the same rows: the token cache the parent
    wrote, the same seed); in the demo's own process, the parent's `tokenizer` and `cpt_data` (train, val)."""
    if prefix is not None:
        from .cli import keep_freed_memory

        # as the `fp8train` command does: without it each step page-faults its buffers in again (the demo took
        # 10 min 11 s on a 2-core AVX2 CPU, 635 s of it system time; 4 min 55 s and 32 s with it)
        keep_freed_memory()
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # (two processes' bars on one terminal: labelled lines only)
        sys.stdout, sys.stderr = _Prefixed(sys.stdout, prefix), _Prefixed(sys.stderr, prefix)
    with cpu_threads(threads):
        tokenizer = tokenizer or load_tokenizer(arm.tokenizer)
        train_data, val_data = cpt_data or build_cpt_datasets(arm.cpt.data, tokenizer, arm.cpt.seed)
        for folder in (arm.cpt.run_dir, arm.sft.run_dir, arm.eval.out):
            shutil.rmtree(folder, ignore_errors=True)  # the demo owns its runs and evaluations (`fp8train eval`
            # refuses to overwrite earlier results)
        t0 = time.perf_counter()
        res = Trainer(arm.cpt, tokenizer=tokenizer, train_data=train_data, val_data=val_data,
                      progress=prefix is None).fit()
        tail = [res.losses[s] for s in sorted(res.losses)[-5:]]
        result = {"loss": sum(tail) / len(tail), "val_loss": res.val_loss, "seconds": time.perf_counter() - t0,
                  "first_loss": res.losses[min(res.losses)]}
        cpt_model = res.run_dir / "checkpoints" / f"step_{res.step:08d}" / "model"  # FP32, as trained
        cpt_run = res.run_dir

        t0 = time.perf_counter()
        sft = replace(arm.sft, model=replace(arm.sft.model, source=str(cpt_model)))
        res = Trainer(sft, tokenizer=tokenizer, progress=prefix is None).fit()
        tail = [res.losses[s] for s in sorted(res.losses)[-5:]]
        metrics = run_eval(replace(arm.eval, model=str(res.final_dir)))
        result.update(sft_loss=sum(tail) / len(tail), sft_val_loss=res.val_loss, accuracy=metrics["pass@1"],
                      sft_seconds=time.perf_counter() - t0)
    return result | {"runs": {"cpt": str(cpt_run), "sft": str(res.run_dir)}}


class _Prefixed(io.TextIOBase):
    """A text stream that starts each line with `prefix` (the arms' lines interleave on one terminal)."""

    def __init__(self, stream, prefix: str):
        self._stream, self._prefix, self._line_start = stream, prefix, True

    def write(self, text: str) -> int:
        pieces = []
        for piece in text.splitlines(keepends=True):
            visible = piece.strip("\r\n")
            pieces.append(self._prefix + piece if self._line_start and visible else piece)
            self._line_start = piece.endswith(("\n", "\r")) or (self._line_start and not visible)
        self._stream.write("".join(pieces))
        self._stream.flush()
        return len(text)

    def flush(self) -> None:
        self._stream.flush()
