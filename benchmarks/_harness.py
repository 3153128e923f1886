"""What the GPU benchmark scripts share: their tiny/full defaults, the device they run on, a kernel's median
time, one JSON line per result. A sibling module: the scripts import it from their own folder (tests/_benchmarks.py puts it on sys.path)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def fill_defaults(args: argparse.Namespace, defaults: dict[str, tuple]) -> argparse.Namespace:
    """Options left None get their (tiny, full) default by `args.tiny`."""
    for key, (tiny, full) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, tiny if args.tiny else full)
    return args


def device_for(name: str, script: str) -> torch.device:
    """The device asked for; a one-line exit without CUDA; one CPU thread (a tiny model gains nothing from
    more, and spin-waiting threads crawl on a busy CPU)."""
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"{script}: no CUDA device (use --device cpu --tiny for the CPU check)")
    if device.type == "cpu":
        torch.set_num_threads(1)
    return device


def median_us(fn) -> float:
    """fn's median time on the GPU in microseconds (triton's do_bench: 25 ms warm-up, 100 ms of runs)."""
    import triton  # (the CPU tests import this module without triton)

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def append_jsonl(path: Path | None, record: dict) -> None:
    if path is not None:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


def projection_shapes(preset: str) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of a decoder layer's projections in a model preset (fp8train's PRESETS):
    q/o, k/v, gate/up, down."""
    from fp8train.train.model import PRESETS

    c = PRESETS[preset]
    h, i = c["hidden_size"], c["intermediate_size"]
    kv = h // c["num_attention_heads"] * c["num_key_value_heads"]
    return {"q/o": (h, h), "k/v": (kv, h), "gate/up": (i, h), "down": (h, i)}
