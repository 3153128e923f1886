"""Exact resume: an interrupted run, resumed from its last checkpoint, reproduces the uninterrupted
run's per-step losses bit for bit on the CPU, also after `kill -9` of the CLI process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fp8train.train.checkpoint import find_latest_checkpoint
from fp8train.train.config import load_config
from fp8train.train.trainer import Trainer
from test_trainer import TINY_CONFIG, byte_tokenizer, corpus, one_thread, tiny_config, tiny_overrides  # noqa: F401

_EXACT_KEYS = ("loss", "lr", "grad_norm", "val_loss", "tokens", "skipped_steps")


def _records(run_dir: Path) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out.setdefault(rec["step"], {}).update({k: rec[k] for k in _EXACT_KEYS if k in rec})
    return out


def _logged_steps(run_dir: Path) -> int:
    """Complete metrics lines so far (the writer may be mid-line)."""
    path = run_dir / "metrics.jsonl"
    return path.read_text().count("\n") if path.exists() else 0


def _interrupt_at(trainer: Trainer, stop_step: int) -> None:
    original = trainer._after_step

    def after_step(step, *args):
        original(step, *args)
        if step == stop_step:
            raise KeyboardInterrupt

    trainer._after_step = after_step


@pytest.mark.parametrize("recipe", ["hybrid", "bf16"])
def test_resume_after_interruption_is_bit_exact(tmp_path, byte_tokenizer, corpus, recipe):
    extra = {"recipe": recipe, "train.steps": 9, "train.save_every": 3}
    full = Trainer(tiny_config(tmp_path / "full", byte_tokenizer, corpus, **extra), progress=False).fit()

    cfg = tiny_config(tmp_path / "cut", byte_tokenizer, corpus, **extra)
    first = Trainer(cfg, progress=False)
    _interrupt_at(first, 5)  # after the step-3 checkpoint, before the step-6 one
    with pytest.raises(KeyboardInterrupt):
        first.fit()
    assert find_latest_checkpoint(Path(cfg.run_dir) / "checkpoints").name == "step_00000003"
    resumed = Trainer(cfg, progress=False)
    assert resumed.step == 3
    result = resumed.fit()

    assert sorted(result.losses) == list(range(4, 10))
    assert {s: result.losses[s] for s in result.losses} == {s: full.losses[s] for s in range(4, 10)}  # exact
    assert result.val_loss == full.val_loss
    assert _records(tmp_path / "cut" / "run") == _records(tmp_path / "full" / "run")  # replayed steps 4-5 once


def test_kill_9_of_cli_mid_run_then_resume_is_bit_exact(tmp_path, byte_tokenizer, corpus):
    extra = {"recipe": "hybrid", "train.steps": 12, "train.save_every": 3, "train.eval_every": 6}
    reference = Trainer(tiny_config(tmp_path / "ref", byte_tokenizer, corpus, **extra), progress=False).fit()

    run_dir = tmp_path / "cli" / "run"
    cmd = [sys.executable, "-m", "fp8train", "train", "--no-progress", str(TINY_CONFIG),
           *tiny_overrides(tmp_path / "cli", byte_tokenizer, corpus, **extra)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the same thread count as this process: same BF16 sums
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if _logged_steps(run_dir) >= 7:
                break
            time.sleep(0.02)
        assert proc.poll() is None, f"the run ended before it could be killed: {proc.stderr.read().decode()[-2000:]}"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (run_dir / "final").exists()
    killed_at = max(_records(run_dir))
    assert 7 <= killed_at < 12

    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in done.stderr + done.stdout
    records = _records(run_dir)
    assert sorted(records) == list(range(1, 13))
    assert {s: r["loss"] for s, r in records.items()} == reference.losses  # bit for bit
    assert records[12]["val_loss"] == reference.val_loss
    assert (run_dir / "final" / "config.json").is_file()


def test_resume_none_refuses_a_run_dir_with_checkpoints(tmp_path, byte_tokenizer, corpus):
    extra = {"recipe": "bf16", "train.steps": 2, "train.save_every": 0, "optim.warmup_steps": 1,
             "optim.decay_steps": 1}
    Trainer(tiny_config(tmp_path, byte_tokenizer, corpus, **extra), progress=False).fit()
    with pytest.raises(FileExistsError, match="resume=auto"):
        Trainer(tiny_config(tmp_path, byte_tokenizer, corpus, resume="none", **extra), progress=False)
    # A finished run resumes to its end: nothing is trained again, the export is rewritten.
    again = Trainer(tiny_config(tmp_path, byte_tokenizer, corpus, **extra), progress=False)
    assert again.step == 2
    result = again.fit()
    assert result.losses == {} and result.val_loss is not None and result.final_dir.is_dir()


def test_resume_with_a_different_global_batch_is_refused(tmp_path, byte_tokenizer, corpus):
    extra = {"recipe": "bf16", "train.steps": 2, "train.save_every": 0, "optim.warmup_steps": 1,
             "optim.decay_steps": 1}
    Trainer(tiny_config(tmp_path, byte_tokenizer, corpus, **extra), progress=False).fit()
    cfg = load_config(TINY_CONFIG, tiny_overrides(tmp_path, byte_tokenizer, corpus, **extra,
                                                  **{"train.global_batch": 4}))
    with pytest.raises(ValueError, match="global_batch"):
        Trainer(cfg, progress=False)


def test_resumed_metrics_drop_steps_past_the_checkpoint_and_a_torn_line(tmp_path):
    from fp8train.train.metrics import MetricsLogger, read_jsonl

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 3.0}\n{"step": 2, "loss": 2.5}\n{"step": 3, "loss": 2.0}\n{"step": 4, "lo')
    logger = MetricsLogger(tmp_path, total_steps=5, start_step=2, report_to="none", progress=False)
    logger.log({"step": 3, "loss": 1.5})
    logger.close()
    assert read_jsonl(path) == [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.5}, {"step": 3, "loss": 1.5}]
    path.write_text('{"step": 1}\nnot json\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not valid JSON"):
        MetricsLogger(tmp_path, total_steps=5, start_step=1, report_to="none", progress=False)
