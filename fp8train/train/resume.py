"""Which checkpoint a run continues from, and the check that it is the same run.

`resume` (config key): `auto` continues from the newest complete checkpoint in run_dir/checkpoints,
`none` starts a new run (and refuses a run_dir that already holds one), a path continues from that
checkpoint, and `force` is `auto` that accepts a changed config.

Before anything is built or written, the resolved config is compared with the run's saved one
(run_dir/config.yaml, else the config.yaml inside the checkpoint). A difference in anything that
shapes the trajectory - model, tokenizer, stage, recipe and its knobs, data, optimizer and schedule,
global batch, seed - refuses with one line listing each key with its old and new value; `resume: force`
accepts them, as does a checkpoint path into a run_dir that holds no run yet (a branch: the checkpoint's own
config.yaml is compared, and its changes apply). Free to change, and recorded in the log: how and where the
run executes (device, micro-batch, compile, activation checkpointing, the distributed section, the token cache),
how often it logs, evaluates and saves, and a longer run (`train.steps` / `train.epochs` raised).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .checkpoint import Checkpoint, find_latest_checkpoint, verify_checkpoint
from .config import ConfigError, TrainConfig, config_to_dict

__all__ = ["ResumePlan", "config_changes", "plan_resume"]

# Keys (or whole sections) that do not change what is computed, only how, where and how often it is observed.
_FREE = ("run_dir", "resume", "device", "cpu_threads", "distributed", "data.cache_dir", "train.micro_batch",
         "train.eval_every", "train.eval_batches", "train.save_every", "train.keep_last", "train.log_every",
         "train.health_every", "train.activation_checkpointing", "train.compile", "train.cuda_graphs",
         "train.max_nonfinite_steps", "train.loss_impl", "train.loss_chunk_tokens", "model.lora.offload_base",
         "model.lora.keep_weight_t", "deep_gemm", "fuse_swiglu", "input_t_in_backward", "hold_fp8_weights",
         "optim.impl")


@dataclass
class ResumePlan:
    checkpoint: Checkpoint | None = None
    """The verified checkpoint to continue from; None starts at step 0."""
    notes: list[str] = field(default_factory=list)
    """Lines for the log: accepted config changes, a run started over."""
    forced: bool = False
    """`resume: force`, or a branch from another run's checkpoint, accepted changes that shape the trajectory:
    the new optimizer and schedule settings apply."""


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict) or not d:
        return {prefix: d}
    out = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _longer(old: dict, new: dict) -> bool:
    """Whether the new `train.steps` / `train.epochs` only lengthen the run."""
    def number(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    (s0, e0), (s1, e1) = ((c.get("train.steps"), c.get("train.epochs")) for c in (old, new))
    if s0 is not None or s1 is not None:
        return number(s0) and number(s1) and s1 >= s0
    return number(e0) and number(e1) and e1 >= e0


def config_changes(saved: dict, new: dict) -> tuple[list[str], list[str]]:
    """(changes that alter the trajectory, changes that do not), each as `key: old -> new`."""
    old, cur = _flatten(saved), _flatten(yaml.safe_load(yaml.safe_dump(new)))  # compare as YAML reads them
    missing = object()
    keys = sorted(k for k in old.keys() | cur.keys() if old.get(k, missing) != cur.get(k, missing))
    trajectory, free = [], []
    for k in keys:
        line = f"{k} {old.get(k, '(absent)')!r} -> {cur.get(k, '(absent)')!r}"
        if k not in old or k not in cur:  # a key added to (or dropped from) fp8train since the run was saved
            free.append(line)
        elif k in ("train.steps", "train.epochs"):
            (free if _longer(old, cur) else trajectory).append(line)
        elif any(k == f or k.startswith(f + ".") for f in _FREE):
            free.append(line)
        else:
            trajectory.append(line)
    return trajectory, free


def _read_yaml(path: Path) -> dict:
    try:
        saved = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"{path} (a saved run config) is unreadable: {' '.join(str(e).split())}") from None
    if not isinstance(saved, dict):
        raise ConfigError(f"{path} (a saved run config) is not a mapping")
    return saved


def plan_resume(cfg: TrainConfig) -> ResumePlan:
    """Decide what `cfg` continues; refuse (one line, nothing written) what would continue the wrong run.

    Every rank calls it (verifying a checkpoint is collective)."""
    run_dir = Path(cfg.run_dir)
    mode = cfg.resume.lower()
    latest = find_latest_checkpoint(run_dir / "checkpoints")
    run_config = run_dir / "config.yaml"
    logged = (run_dir / "metrics.jsonl").is_file()
    if mode == "none":
        if latest is not None or run_config.is_file() or logged:
            raise FileExistsError(f"{run_dir} already holds a run and config key 'resume' is 'none'; use resume=auto "
                                  "to continue it, or a new run_dir")
        return ResumePlan()
    explicit = mode not in ("auto", "force")
    try:
        ckpt = verify_checkpoint(Path(cfg.resume) if explicit else latest) if explicit or latest else None
    except FileNotFoundError as e:  # (a typo in the path: the key names it; a corrupt checkpoint says so itself)
        raise ConfigError(f"config key 'resume': {e} (or use auto, force or none)", "resume") from None
    # A checkpoint path into a run_dir without a run of its own branches: the new config's changes are the
    # point, so they apply (as with force) and are logged, where they would otherwise be refused.
    branch = explicit and not run_config.is_file()
    if run_config.is_file():
        saved, where = _read_yaml(run_config), run_config
    elif ckpt is not None and "config.yaml" in ckpt.files:  # verified with the checkpoint
        where = ckpt.path / "config.yaml"
        saved = _read_yaml(where)
    elif logged and mode != "force":
        raise ConfigError(f"{run_dir} holds metrics.jsonl but no config.yaml or checkpoint to tell which run it was; "
                          "use a new run_dir, or resume=force to start it over (its metrics are replaced)")
    else:
        return ResumePlan(ckpt)
    trajectory, free = config_changes(saved, config_to_dict(cfg))
    if trajectory and mode != "force" and not branch:
        raise ConfigError(f"{run_dir} holds a run whose config ({where}) differs in what shapes its trajectory: "
                          f"{'; '.join(trajectory)}. Use a new run_dir for a new run, or resume=force to continue "
                          "this one with the new values")
    notes = [f"config changed since {where}: {'; '.join(free)}"] if free else []
    if trajectory:
        notes.append(f"branching from {ckpt.path} with a changed trajectory: {'; '.join(trajectory)}" if branch else
                     f"resume=force: continuing with a changed trajectory: {'; '.join(trajectory)}")
    if ckpt is None and logged:
        notes.append(f"{run_dir} has no checkpoint yet: the run starts over from step 0 (metrics.jsonl is rewritten)")
    return ResumePlan(ckpt, notes, forced=bool(trajectory))
