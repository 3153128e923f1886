"""Overlay the loss curves of several runs (FP8 vs BF16, as the InfiR2 paper's Figure 4).

    fp8train plot runs/cpt_fp8 runs/cpt_bf16 -o loss.png
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from .train.metrics import read_jsonl

__all__ = ["load_curves", "plot_runs"]


def _label(run_dir: Path) -> str:
    cfg_path = run_dir / "config.yaml"
    recipe = None
    if cfg_path.is_file():
        recipe = (yaml.safe_load(cfg_path.read_text(encoding="utf-8")) or {}).get("recipe")
    name = run_dir.resolve().name
    return f"{name} ({recipe})" if recipe and recipe not in name else name


def load_curves(run_dir: str | os.PathLike) -> dict:
    """{"label", "train": [(step, loss)], "val": [(step, val_loss)]} from run_dir/metrics.jsonl.

    A step logged twice (a resumed run that replayed it) keeps its last record.
    """
    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist (not an fp8train run directory?)")
    by_step: dict[int, dict] = {}
    for rec in read_jsonl(path):
        by_step.setdefault(rec["step"], {}).update(rec)
    steps = sorted(by_step)
    train = [(s, by_step[s]["loss"]) for s in steps if by_step[s].get("loss") is not None]
    val = [(s, by_step[s]["val_loss"]) for s in steps if by_step[s].get("val_loss") is not None]
    if not train and not val:
        raise ValueError(f"{path} holds no loss values")
    return {"label": _label(run_dir), "train": train, "val": val}


def _ema(values: list[float], alpha: float) -> list[float]:
    out, acc = [], None
    for v in values:
        acc = v if acc is None else alpha * acc + (1 - alpha) * v
        out.append(acc)
    return out


def plot_runs(run_dirs: list[str | os.PathLike], out: str | os.PathLike, *, smooth: float = 0.0,
              title: str | None = None) -> Path:
    """Write a figure with training loss (left) and validation loss (right) of every run overlaid; returns
    the path written: `out`, with `.png` appended unless its suffix is a format matplotlib writes (.svg, .pdf).

    smooth: EMA factor in [0, 1) for the training curves (the raw curve is drawn faintly behind).
    """
    if not run_dirs:
        raise ValueError("give at least one run directory")
    if not 0.0 <= smooth < 1.0:
        raise ValueError(f"smooth must be in [0, 1), got {smooth}")
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    curves = [load_curves(d) for d in run_dirs]
    has_val = any(c["val"] for c in curves)
    fig, axes = plt.subplots(1, 2 if has_val else 1, figsize=(12 if has_val else 7, 4.5), squeeze=False)
    ax_train = axes[0][0]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, c in enumerate(curves):
        color = colors[i % len(colors)]
        if c["train"]:
            steps, losses = zip(*c["train"])
            if smooth:
                ax_train.plot(steps, losses, color=color, alpha=0.25, linewidth=0.8)
                losses = _ema(list(losses), smooth)
            ax_train.plot(steps, losses, color=color, label=c["label"], linewidth=1.4)
        if has_val and c["val"]:
            steps, losses = zip(*c["val"])
            axes[0][1].plot(steps, losses, color=color, marker="o", markersize=4, label=c["label"])
    ax_train.set_title("training loss")
    panels = [ax_train] + ([axes[0][1]] if has_val else [])
    if has_val:
        axes[0][1].set_title("validation loss")
    for ax in panels:
        ax.set_xlabel("step")
        ax.set_ylabel("loss (per token)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    if out.suffix[1:].lower() not in fig.canvas.get_supported_filetypes():
        out = out.with_name(out.name + ".png")  # as matplotlib would write it, but named so
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
