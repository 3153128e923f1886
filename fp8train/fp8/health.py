"""FP8 health: how much of each operand underflows to zero or saturates, and the range of its scales.

    with track_fp8_health(model) as stats:       # filled when the context closes:
        model(**batch).loss.backward()           # {layer fqn: {role: {underflow, saturation, scale_min, scale_max}}}
    summarize_fp8_health(stats)                  # the same, aggregated by projection kind

underflow = fraction of the non-zero values that became 0 in FP8; saturation = fraction at +-fmt.max;
scale_min / scale_max over the finite scales of the operand's own blocks (padding left out). Roles:
input (operand a of output), weight (b of output), grad_output (a of grad_input). The statistics are
computed as tensors inside the layer's forward and backward (`operand_health_stats`), so tracking
changes nothing the layer computes and a compiled layer stays one graph.
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from typing import Iterator

import torch
from torch import Tensor, nn

from .quant import quantize

__all__ = ["track_fp8_health", "summarize_fp8_health", "operand_health_stats", "health_dict"]

_ROLES = ("input", "weight", "grad_output")


def operand_health_stats(x2d: Tensor, spec, pow2: bool) -> Tensor:
    """[underflowed, non-zero, saturated, elements, scale min, scale max] (FP32) of x quantized per `spec`
    (an operands.OperandSpec; its padding is ignored). A high-precision operand neither underflows nor saturates."""
    n = float(x2d.numel())
    if spec.fmt is None:
        return torch.tensor([0.0, n, 0.0, n, 1.0, 1.0], device=x2d.device)
    q = quantize(x2d, spec.block, spec.fmt, pow2)
    data, nonzero = q.data.float(), x2d != 0
    finite = torch.isfinite(q.scale)
    inf = torch.full_like(q.scale, math.inf)
    counts = torch.stack([((data == 0) & nonzero).sum(), nonzero.sum(), (data.abs() >= spec.fmt.max).sum()]).float()
    scale_range = torch.stack([torch.where(finite, q.scale, inf).amin(), torch.where(finite, q.scale, -inf).amax()])
    scale_range = torch.where(finite.any(), scale_range, torch.full_like(scale_range, math.nan))
    return torch.cat([counts, counts.new_tensor([n]), scale_range.float()])


def health_dict(stats: Tensor) -> dict:
    """The [3, 6] statistics of one layer (rows: input, weight, grad_output) as fractions and scales."""
    out = {}
    for role, (under, nonzero, sat, n, smin, smax) in zip(_ROLES, stats.tolist()):
        out[role] = {"underflow": under / max(nonzero, 1.0), "saturation": sat / max(n, 1.0),
                     "scale_min": smin, "scale_max": smax}
    return out


@contextlib.contextmanager
def track_fp8_health(model: nn.Module) -> Iterator[dict]:
    """A forward + backward inside this context fills the yielded dict when it closes:
    {layer fqn: {"input" | "weight" | "grad_output": {"underflow", "saturation", "scale_min", "scale_max"}}}."""
    from .linear import FP8Linear

    stats: dict = {}
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, FP8Linear) and m.recipe.enabled]
    for _, m in layers:
        m.track_health(True)
    try:
        yield stats
        for name, m in layers:
            h = m.health()
            if h is not None:
                stats[name] = h
    finally:
        for _, m in layers:
            m.track_health(False)


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
