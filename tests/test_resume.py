"""Exact resume: an interrupted run, resumed from its last checkpoint, reproduces the uninterrupted
run's per-step losses bit for bit on the CPU, also after `kill -9` of the CLI process (between saves,
inside a save, and just before a save's rename). Resume refuses to continue a run with a config that
changes its trajectory, and a refused command changes no file of the run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fp8train.cli import main
from fp8train.train.checkpoint import find_latest_checkpoint
from fp8train.train.config import ConfigError, config_to_dict, load_config
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

    def after_step(done, *args):
        original(done, *args)
        if done.step == stop_step:
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


# Runs `fp8train train ARGS...` and kills itself (SIGKILL) at a point: after step N, inside the save that
# writes a file (after torch.save wrote it), or inside a save with everything written, manifest
# included, just before the rename into place.
_KILLER = r"""
import os, signal, sys
point, arg = sys.argv[1], sys.argv[2]
def die():
    os.kill(os.getpid(), signal.SIGKILL)
if point == "after_step":
    from fp8train.train.trainer import Trainer
    original = Trainer._after_step
    def after_step(self, done, *a):
        original(self, done, *a)
        if done.step == int(arg):
            die()
    Trainer._after_step = after_step
elif point == "writing":
    import torch
    real_save = torch.save
    def save(obj, f, *a, **k):
        real_save(obj, f, *a, **k)
        if str(f).endswith(arg):
            die()
    torch.save = save
elif point == "renaming":
    real_replace = os.replace
    def replace(src, dst, **k):
        if os.path.basename(str(dst)) == arg:
            die()
        real_replace(src, dst, **k)
    os.replace = replace
from fp8train.cli import main
sys.exit(main(sys.argv[3:]))
"""


def test_kill_9_between_and_inside_saves_then_resume_is_bit_exact(tmp_path, byte_tokenizer, corpus):
    extra = {"recipe": "hybrid", "train.steps": 10, "train.save_every": 2, "train.eval_every": 5}
    reference = Trainer(tiny_config(tmp_path / "ref", byte_tokenizer, corpus, **extra), progress=False).fit()

    run_dir = tmp_path / "cli" / "run"
    ckpts = run_dir / "checkpoints"
    args = ["train", "--no-progress", str(TINY_CONFIG), *tiny_overrides(tmp_path / "cli", byte_tokenizer, corpus, **extra)]
    # the same thread count as this process: the same BF16 sums
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parent.parent)}

    def run(*point):
        cmd = [sys.executable, "-c", _KILLER, *(point or ("none", "-")), *args]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)

    for point, latest in ((("after_step", "3"), "step_00000002"),  # between saves
                          (("writing", ".tmp_step_00000006/optimizer.pt"), "step_00000004"),  # a torn save
                          (("renaming", "step_00000008"), "step_00000006")):  # complete but not in place
        done = run(*point)
        assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
        assert find_latest_checkpoint(ckpts).name == latest, point
        assert not (run_dir / "final").exists()
    assert any(p.name.startswith(".tmp_step_00000008") for p in ckpts.iterdir())  # what the last kill left

    done = run()
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in done.stdout and "step_00000006" in done.stdout
    records = _records(run_dir)
    assert sorted(records) == list(range(1, 11))
    assert {s: r["loss"] for s, r in records.items()} == reference.losses  # bit for bit
    assert records[10]["val_loss"] == reference.val_loss
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000008", "step_00000010"]  # no leftovers
    assert (run_dir / "final" / "config.json").is_file()


def _snapshot(run_dir: Path) -> dict:
    """Every file of the run: its bytes and modification time."""
    return {p.relative_to(run_dir).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(run_dir.rglob("*")) if p.is_file()}


_SHORT = {"recipe": "bf16", "train.steps": 2, "train.save_every": 0, "optim.warmup_steps": 1, "optim.decay_steps": 1,
          "train.eval_every": 0, "train.health_every": 0}


def test_resume_refuses_a_changed_trajectory_and_writes_nothing(tmp_path, byte_tokenizer, corpus, capsys):
    """issue 17: `resume: auto` with a changed lr / recipe / data / seed refuses in one line naming each key,
    old and new value, and how to proceed; the run's files are untouched. Longer runs and other cadences
    continue, and the change is logged; `resume: force` continues with the new values."""
    run_dir = tmp_path / "run"
    Trainer(tiny_config(tmp_path, byte_tokenizer, corpus, **_SHORT), progress=False).fit()
    before = _snapshot(run_dir)
    for change, shown in (({"optim.lr": 1e-3}, "optim.lr 0.003 -> 0.001"), ({"recipe": "hybrid"}, "recipe 'bf16' -> 'hybrid'"),
                          ({"data.seq_len": 32}, "data.seq_len 64 -> 32"), ({"seed": 1}, "seed 0 -> 1"),
                          ({"swiglu_inputs_fp8": "true"}, "swiglu_inputs_fp8 False -> True"),
                          # (a shorter run whose schedule still fits it: 1 + 1 warmup/decay steps would not)
                          ({"train.steps": 1, "optim.decay_steps": 0, "optim.warmup_steps": 0, "optim.decay_ratio": 0.0,
                            "optim.warmup_ratio": 0.0}, "train.steps 2 -> 1")):
        with pytest.raises(ConfigError) as error:
            Trainer(tiny_config(tmp_path, byte_tokenizer, corpus, **{**_SHORT, **change}), progress=False)
        message = str(error.value)
        assert "\n" not in message and shown in message and "new run_dir" in message and "resume=force" in message
    capsys.readouterr()
    overrides = tiny_overrides(tmp_path, byte_tokenizer, corpus, **{**_SHORT, "optim.lr": 1e-3, "recipe": "hybrid"})
    assert main(["train", "--no-progress", str(TINY_CONFIG), *overrides]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "optim.lr 0.003 -> 0.001; recipe 'bf16' -> 'hybrid'" in err, err
    assert _snapshot(run_dir) == before  # config.yaml, metrics.jsonl, checkpoints, final/: untouched

    longer = Trainer(tiny_config(tmp_path, byte_tokenizer, corpus, **{**_SHORT, "train.steps": 3, "train.log_every": 2,
                                                                       "model.lora.offload_base": "false",
                                                                       "deep_gemm": "true", "fuse_swiglu": "true",
                                                                       "optim.impl": "fused"}),
                     progress=False)
    assert longer.step == 2
    # the step is the config's (torch's fused), not the foreach flags the checkpoint's param_groups carry
    assert all(g["fused"] and not g["foreach"] for g in longer.optimizer.param_groups)
    assert "config changed since" in capsys.readouterr().out  # recorded in the log
    assert sorted(longer.fit().losses) == [3]
    assert load_config(run_dir / "config.yaml").train.steps == 3

    forced = Trainer(tiny_config(tmp_path, byte_tokenizer, corpus, resume="force",
                                 **{**_SHORT, "train.steps": 3, "optim.lr": 1e-3}), progress=False)
    assert forced.step == 3 and forced.optimizer.param_groups[0]["initial_lr"] == 1e-3
    assert "resume=force: continuing with a changed trajectory: optim.lr 0.003 -> 0.001" in capsys.readouterr().out
    assert load_config(run_dir / "config.yaml").optim.lr == 1e-3


def test_a_checkpoint_path_into_a_new_run_dir_branches_with_the_new_config(tmp_path, byte_tokenizer, corpus, capsys):
    """`resume: <checkpoint>` into a run_dir without a run of its own: the checkpoint's config.yaml is compared,
    and a changed lr applies from the checkpoint's step on and is logged (it was once ignored without a word:
    the optimizer kept the checkpoint's lr while the branch's config.yaml recorded the new one)."""
    Trainer(tiny_config(tmp_path, byte_tokenizer, corpus, **_SHORT), progress=False).fit()
    ckpt = find_latest_checkpoint(tmp_path / "run" / "checkpoints")
    capsys.readouterr()
    same = Trainer(tiny_config(tmp_path, byte_tokenizer, corpus, resume=ckpt, run_dir=tmp_path / "same",
                               **{**_SHORT, "train.steps": 3}), progress=False)
    assert same.step == 2 and same.optimizer.param_groups[0]["initial_lr"] == 3e-3
    assert "branching" not in capsys.readouterr().out
    branch = Trainer(tiny_config(tmp_path, byte_tokenizer, corpus, resume=ckpt, run_dir=tmp_path / "branch",
                                 **{**_SHORT, "train.steps": 3, "optim.lr": 1e-3}), progress=False)
    assert branch.step == 2 and branch.optimizer.param_groups[0]["initial_lr"] == 1e-3
    assert f"branching from {ckpt} with a changed trajectory: optim.lr 0.003 -> 0.001" in capsys.readouterr().out
    assert sorted(branch.fit().losses) == [3]
    assert load_config(tmp_path / "branch" / "config.yaml").optim.lr == 1e-3
    # once the branch has a run of its own, it is compared with that, as `auto` is
    with pytest.raises(ConfigError, match="optim.lr 0.001 -> 0.003"):
        Trainer(tiny_config(tmp_path, byte_tokenizer, corpus, resume=ckpt, run_dir=tmp_path / "branch",
                            **{**_SHORT, "train.steps": 3}), progress=False)


def test_run_dir_with_metrics_but_no_checkpoint(tmp_path, byte_tokenizer, corpus, capsys):
    """A run that died before its first checkpoint: the same config starts it over (the same steps again);
    another config, or metrics without a config, refuse without touching metrics.jsonl."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    with pytest.raises(ConfigError, match=r"metrics.jsonl but no config.yaml or checkpoint.*resume=force"):
        Trainer(tiny_config(tmp_path, byte_tokenizer, corpus, **_SHORT), progress=False)
    cfg = tiny_config(tmp_path, byte_tokenizer, corpus, **_SHORT)
    import yaml

    (run_dir / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    before = _snapshot(run_dir)
    with pytest.raises(ConfigError, match=r"optim.lr 0.003 -> 0.001"):
        Trainer(tiny_config(tmp_path, byte_tokenizer, corpus, **{**_SHORT, "optim.lr": 1e-3}), progress=False)
    assert _snapshot(run_dir) == before
    again = Trainer(cfg, progress=False)
    assert again.step == 0 and "starts over from step 0" in capsys.readouterr().out
    assert sorted(again.fit().losses) == [1, 2]


def test_resume_none_refuses_a_run_dir_with_checkpoints(tmp_path, byte_tokenizer, corpus):
    extra = {"recipe": "bf16", "train.steps": 2, "train.save_every": 0, "optim.warmup_steps": 1,
             "optim.decay_steps": 1}
    Trainer(tiny_config(tmp_path, byte_tokenizer, corpus, **extra), progress=False).fit()
    with pytest.raises(FileExistsError, match="resume=auto"):
        Trainer(tiny_config(tmp_path, byte_tokenizer, corpus, resume="none", **extra), progress=False)
    (tmp_path / "run" / "checkpoints").rename(tmp_path / "elsewhere")  # a run without checkpoints is a run too
    with pytest.raises(FileExistsError, match="already holds a run"):
        Trainer(tiny_config(tmp_path, byte_tokenizer, corpus, resume="none", **extra), progress=False)
    (tmp_path / "elsewhere").rename(tmp_path / "run" / "checkpoints")
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
