"""FP8 health: how much of each operand underflows to zero or saturates, and the range of its scales.

    with track_fp8_health(model) as stats:       # {layer fqn: {role: {underflow, saturation, scale_min, scale_max}}}
        model(**batch).loss.backward()
    summarize_fp8_health(stats)                  # the same, aggregated by projection kind
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Iterator

import torch
from torch import nn

from .linear import FP8Linear
from .quant import Fp8Tensor

__all__ = ["track_fp8_health", "summarize_fp8_health"]


def operand_health(x2d: torch.Tensor, q: Fp8Tensor) -> dict:
    """Fraction of non-zero values flushed to zero, fraction at the top of the FP8 range, scale range."""
    rows, cols = x2d.shape
    if q.fmt is None:  # not quantized
        return {"underflow": 0.0, "saturation": 0.0, "scale_min": 1.0, "scale_max": 1.0}
    data = q.data[:rows, :cols].float()
    nonzero = x2d != 0
    n = max(int(nonzero.sum()), 1)
    scale = q.scale if q.block is None else q.scale[: -(-rows // q.block[0]), : -(-cols // q.block[1])]
    finite = scale[torch.isfinite(scale)]  # the blocks of x only: padding blocks (scale 1) left out
    return {
        "underflow": float(((data == 0) & nonzero).sum()) / n,
        "saturation": float((data.abs() >= q.fmt.max).sum()) / max(data.numel(), 1),
        "scale_min": float(finite.min()) if finite.numel() else float("nan"),
        "scale_max": float(finite.max()) if finite.numel() else float("nan"),
    }



@contextlib.contextmanager
def track_fp8_health(model: nn.Module) -> Iterator[dict]:
    """A forward + backward inside this context fills the yielded dict:
    {layer fqn: {"input" | "weight" | "grad_output": {"underflow", "saturation", "scale_min", "scale_max"}}}
    underflow = fraction of non-zero values that became 0 in FP8; saturation = fraction at +-fmt.max."""
    stats: dict = {}
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, FP8Linear) and m.recipe.enabled]
    for name, m in layers:
        m._health = stats.setdefault(name, {})
    try:
        yield stats
    finally:
        for _, m in layers:
            m._health = None


def summarize_fp8_health(stats: dict) -> dict:
    """Aggregate per-layer health by layer type (q_proj, ..., down_proj) and role: the mean underflow and
    saturation fractions and the overall scale range."""
    acc: dict = defaultdict(lambda: {"underflow": [], "saturation": [], "scale_min": [], "scale_max": []})
    for fqn, roles in stats.items():
        kind = fqn.rsplit(".", 1)[-1]
        for role, s in roles.items():
            for k in acc[(kind, role)]:
                acc[(kind, role)][k].append(s[k])
    out: dict = {}
    for (kind, role), v in sorted(acc.items()):
        out.setdefault(kind, {})[role] = {
            "underflow": sum(v["underflow"]) / len(v["underflow"]),
            "saturation": sum(v["saturation"]) / len(v["saturation"]),
            "scale_min": min(v["scale_min"]),
            "scale_max": max(v["scale_max"]),
        }
    return out
