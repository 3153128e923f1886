"""Observability: model FLOPs, MFU, the progress bar, metrics.jsonl, TensorBoard and FP8 health logs.

run_dir/metrics.jsonl has one JSON object per logged step (and per evaluation):
    step, loss, lr, grad_norm, tokens_per_s, tflops, mfu, peak_mem_gib, skipped_steps[, val_loss]
run_dir/fp8_health.jsonl has one object per health check: {"step", "layers": {fqn: {role: stats}}}.
A resumed run first drops the entries past its checkpoint, so each file reads as one uninterrupted run.
"""

from __future__ import annotations

import json
import math
import os
import resource
import time
from pathlib import Path

import torch

__all__ = ["flops_per_token", "peak_tflops", "MetricsLogger", "Throughput", "read_jsonl", "health_summary",
           "peak_memory_gib"]

# Dense datasheet peaks in TFLOP/s per GPU: (BF16, FP8). None = no FP8 tensor cores.
_PEAK_TFLOPS = {"H100": (989.0, 1979.0), "H200": (989.0, 1979.0), "H800": (989.0, 1979.0),
                "H20": (148.0, 296.0), "A100": (312.0, None), "L40S": (362.0, 733.0)}


def flops_per_token(config, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward = 3x forward) of an HF decoder config.

    6 x (the parameters that do matmuls: every decoder weight plus the LM head; the input embedding
    is a lookup and does not count, even when tied to the head) + the attention matmuls: QK^T and
    AV cost 2 x 2 x seq x heads x head_dim per token and layer in the forward pass, halved because
    causal attention (flash / SDPA) skips the masked upper triangle; x3 for training.
    """
    h, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    ffn = config.intermediate_size
    attn_proj = h * heads * head_dim * 2 + h * kv_heads * head_dim * 2  # q, o and k, v
    mlp = 3 * h * ffn  # gate, up, down
    matmul_params = layers * (attn_proj + mlp) + vocab * h  # + LM head
    attention = 3 * 2 * 2 * layers * heads * head_dim * seq_len / 2
    return 6.0 * matmul_params + attention


def peak_tflops(device: torch.device, fp8: bool) -> float | None:
    """Dense peak of the GPU in TFLOP/s for FP8 (when the recipe converts layers) or BF16; None on CPU
    or an unknown GPU."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, (bf16, f8) in _PEAK_TFLOPS.items():
        if key in name:
            return (f8 or bf16) if fp8 else bf16
    return None


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated device memory on CUDA; the process's peak resident set size on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def read_jsonl(path: str | os.PathLike, *, allow_torn_tail: bool = False) -> list[dict]:
    """The records of a JSONL file; an unreadable line is an error naming file:line, except, with
    `allow_torn_tail`, a last line without its newline (a process killed mid-write)."""
    out = []
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    for i, line in enumerate(lines, 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                if allow_torn_tail and i == len(lines) and not line.endswith("\n"):
                    break
                raise ValueError(f"{path}:{i}: not valid JSON ({e.msg})") from None
    return out


def _truncate_jsonl(path: Path, step: int) -> None:
    """Keep the records with step <= `step` (a resume replays the steps after its checkpoint)."""
    if not path.exists():
        return
    kept = [r for r in read_jsonl(path, allow_torn_tail=True) if r.get("step", 0) <= step]
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
    os.replace(tmp, path)


def health_summary(stats: dict) -> str:
    """One line: worst underflow and saturation over the layers per role, and the scale range."""
    if not stats:
        return "fp8 health: no FP8 layers"
    parts = []
    for role in ("input", "weight", "grad_output"):
        rows = [(name, roles[role]) for name, roles in stats.items() if role in roles]
        if not rows:
            continue
        under = max(rows, key=lambda r: r[1]["underflow"])
        sat = max(rows, key=lambda r: r[1]["saturation"])
        lo = min(s["scale_min"] for _, s in rows)
        hi = max(s["scale_max"] for _, s in rows)
        parts.append(f"{role}: underflow<= {under[1]['underflow']:.2e}, saturation<= {sat[1]['saturation']:.2e}, "
                     f"scales [{lo:.1e}, {hi:.1e}]")
    return f"fp8 health ({len(stats)} layers) " + "; ".join(parts)


class MetricsLogger:
    """Writes metrics.jsonl and fp8_health.jsonl, mirrors scalars to TensorBoard when it is installed,
    and drives a tqdm bar. Only rank 0 makes one (`enabled=False` elsewhere)."""

    def __init__(self, run_dir: str | os.PathLike, *, total_steps: int, start_step: int = 0,
                 tensorboard: bool = True, progress: bool = True, enabled: bool = True):
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self._tb = None
        self._bar = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.health_path = self.run_dir / "fp8_health.jsonl"
        for path in (self.metrics_path, self.health_path):
            _truncate_jsonl(path, start_step)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # optional extra `tb`
                SummaryWriter = None
            if SummaryWriter is not None:
                self._tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=start_step + 1)
        if progress:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc=self.run_dir.name, unit="step",
                             dynamic_ncols=True)

    def _append(self, path: Path, record: dict) -> None:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def log(self, record: dict) -> None:
        """Append one record (it must have `step`); None and non-finite values stay out of TensorBoard."""
        if not self.enabled:
            return
        self._append(self.metrics_path, record)
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(f"train/{key}" if key != "val_loss" else "val/loss", value, record["step"])

    def log_health(self, step: int, stats: dict) -> str:
        line = health_summary(stats)
        if self.enabled:
            self._append(self.health_path, {"step": step, "layers": stats})
            self.write(f"step {step}: {line}")
        return line

    def progress(self, step: int, loss: float, lr: float, tokens_per_s: float | None) -> None:
        if self._bar is not None:
            post = {"loss": f"{loss:.4f}", "lr": f"{lr:.2e}"}
            if tokens_per_s:
                post["tok/s"] = f"{tokens_per_s:,.0f}"
            self._bar.set_postfix(post, refresh=False)  # first, so that the update draws this step's loss
            self._bar.update(step - self._bar.n)

    def write(self, message: str) -> None:
        """Print a line without breaking the bar."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(message)
        else:
            print(message, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


class Throughput:
    """Tokens/s, TFLOP/s and MFU over the training steps since the last `report` (device-synchronized).

    tokens_per_s counts the tokens of all ranks; tflops and mfu are per device.
    """

    def __init__(self, device: torch.device, peak: float | None, world_size: int = 1):
        self.device, self.peak, self.world_size = device, peak, world_size
        self.flops_per_token: float | None = None
        self.reset()

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def reset(self) -> None:
        """Start a new window (after evaluation or checkpointing, which are not training time)."""
        self._tokens = 0
        self._t0 = self._now()

    def add(self, tokens: int) -> None:
        self._tokens += tokens

    def report(self) -> dict:
        dt = max(self._now() - self._t0, 1e-9)
        tps = self._tokens / dt
        tflops = tps * (self.flops_per_token or 0.0) / self.world_size / 1e12
        self.reset()
        return {"tokens_per_s": tps, "tflops": tflops, "mfu": tflops / self.peak if self.peak else None}
