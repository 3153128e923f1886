"""Observability: model FLOPs, MFU, the progress bar, metrics.jsonl, FP8 health logs, and the experiment
trackers of `train.report_to` (TensorBoard, Weights & Biases, MLflow).

run_dir/metrics.jsonl has one JSON object per logged step (and per evaluation):
    step, loss, lr, grad_norm, tokens_per_s, tflops, mfu, peak_mem_gib, skipped_steps[, val_loss]
run_dir/fp8_health.jsonl has one object per health check: {"step", "layers": {fqn: {role: stats}}}.
A resumed run first drops the entries past its checkpoint, so each file reads as one uninterrupted run.
The trackers get the same scalars (`train/<key>`, `val/loss`) and the health aggregated by projection
(`fp8_health/<proj>/<role>/<stat>`); W&B and MLflow read their own settings (WANDB_MODE, WANDB_PROJECT,
MLFLOW_TRACKING_URI, ...), and a resumed run starts a new tracker run of the same name.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import resource
import time
from pathlib import Path

import torch

__all__ = ["device_clock", "flops_per_token", "peak_tflops", "MetricsLogger", "Throughput", "read_jsonl",
           "health_summary", "health_scalars", "peak_memory_gib", "REPORT_TO", "resolve_report_to"]

# Dense datasheet peaks in TFLOP/s per GPU: (BF16, FP8). None = no FP8 tensor cores.
_PEAK_TFLOPS = {"H100": (989.0, 1979.0), "H200": (989.0, 1979.0), "H800": (989.0, 1979.0),
                "H20": (148.0, 296.0), "A100": (312.0, None), "L40S": (362.0, 733.0)}


def flops_per_token(config, seq_len: int, weight_grads: bool = True) -> float:
    """Training FLOPs per token (forward + backward = 3x forward) of an HF decoder config.

    6 x (the parameters that do matmuls: every decoder weight plus the LM head; the input embedding
    is a lookup and does not count, even when tied to the head) + the attention matmuls: QK^T and
    AV cost 2 x 2 x seq x heads x head_dim per token and layer in the forward pass, halved because
    causal attention (flash / SDPA) skips the masked upper triangle; x3 for training.
    `weight_grads=False` (LoRA's frozen base): 4 x the parameters, no grad_weight GEMMs (the adapters'
    own FLOPs, ~rank / hidden of the base's, are left out).
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
    return (6.0 if weight_grads else 4.0) * matmul_params + attention


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


def health_scalars(stats: dict, prefix: str = "fp8_health") -> dict[str, float]:
    """`track_fp8_health` statistics as flat scalars, aggregated by projection kind (`summarize_fp8_health`):
    {"fp8_health/q_proj/input/underflow": ..., ...}. PEFT's LoRA layers hold the FP8Linear as `base_layer`."""
    from ..fp8.health import summarize_fp8_health

    by_projection = {fqn.removesuffix(".base_layer"): roles for fqn, roles in stats.items()}
    return {f"{prefix}/{kind}/{role}/{key}": float(value)
            for kind, roles in summarize_fp8_health(by_projection).items()
            for role, values in roles.items() for key, value in values.items()}


REPORT_TO = ("tensorboard", "wandb", "mlflow")
_PACKAGE = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


def _installed(name: str) -> bool:
    return importlib.util.find_spec(_PACKAGE[name]) is not None


def resolve_report_to(value: "list[str] | str | None") -> list[str]:
    """`train.report_to` as transformers spells it: a list of `tensorboard`, `wandb`, `mlflow`; `all` (those
    installed) or `none`; null = TensorBoard when it is installed. A named tracker must be installed."""
    if value is None:
        return ["tensorboard"] if _installed("tensorboard") else []
    names = [value] if isinstance(value, str) else list(value)
    if names in ([], ["none"]):
        return []
    if names == ["all"]:
        return [n for n in REPORT_TO if _installed(n)]
    for name in names:
        if name not in REPORT_TO:
            raise ValueError(f"config key 'train.report_to': unknown tracker {name!r}; expected some of "
                             f"{list(REPORT_TO)}, 'all' or 'none'")
        if not _installed(name):
            raise ValueError(f"config key 'train.report_to' names {name}, which is not installed: "
                             f"pip install {_PACKAGE[name]}  (or pip install 'fp8train[loggers]')")
    return list(dict.fromkeys(names))


class _TensorBoard:
    def __init__(self, run_dir: Path, start_step: int, config: dict):
        from torch.utils.tensorboard import SummaryWriter

        self._w = SummaryWriter(str(run_dir / "tensorboard"), purge_step=start_step + 1)

    def log(self, scalars: dict[str, float], step: int) -> None:
        for key, value in scalars.items():
            self._w.add_scalar(key, value, step)

    def close(self) -> None:
        self._w.close()


class _WandB:
    def __init__(self, run_dir: Path, start_step: int, config: dict):
        import wandb

        self._run = wandb.init(name=run_dir.name, dir=str(run_dir), config=config, reinit="create_new")

    def log(self, scalars: dict[str, float], step: int) -> None:
        self._run.log(scalars, step=step)

    def close(self) -> None:
        self._run.finish()


class _MLflow:
    def __init__(self, run_dir: Path, start_step: int, config: dict):
        import mlflow

        self._mlflow = mlflow
        self._run = mlflow.start_run(run_name=run_dir.name)
        mlflow.log_params(_flatten(config))

    def log(self, scalars: dict[str, float], step: int) -> None:
        self._mlflow.log_metrics(scalars, step=step, run_id=self._run.info.run_id)

    def close(self) -> None:
        self._mlflow.end_run()


_TRACKERS = {"tensorboard": _TensorBoard, "wandb": _WandB, "mlflow": _MLflow}
_START_HINT = {
    "tensorboard": "check that run_dir is writable",
    "wandb": "log in (`wandb login`, or WANDB_API_KEY), or set WANDB_MODE=offline",
    "mlflow": "set MLFLOW_TRACKING_URI to a tracking server, or to a local folder (file:/path) with "
              "MLFLOW_ALLOW_FILE_STORE=true (MLflow 3)",
}


def _flatten(tree: dict, prefix: str = "") -> dict[str, str]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = str(value)
    return out


class MetricsLogger:
    """Writes metrics.jsonl and fp8_health.jsonl, mirrors the scalars to the trackers of `report_to`
    (`resolve_report_to`; `config`, the resolved run config, goes to W&B and MLflow), and drives a tqdm bar.
    Only rank 0 makes one (`enabled=False` elsewhere)."""

    def __init__(self, run_dir: str | os.PathLike, *, total_steps: int, start_step: int = 0,
                 report_to: "list[str] | str | None" = None, config: dict | None = None, progress: bool = True,
                 enabled: bool = True):
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self._trackers: list = []
        self._bar = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for name in resolve_report_to(report_to):  # first: a tracker that cannot start leaves the metrics as they are
            self._trackers.append(self._start(name, start_step, config or {}))
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.health_path = self.run_dir / "fp8_health.jsonl"
        for path in (self.metrics_path, self.health_path):
            _truncate_jsonl(path, start_step)
        if progress:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc=self.run_dir.name, unit="step",
                             dynamic_ncols=True)

    def _start(self, name: str, start_step: int, config: dict):
        try:
            return _TRACKERS[name](self.run_dir, start_step, config)
        except Exception as e:  # (W&B without a login, MLflow without a store it can write: the tracker's own line)
            self.close()
            message = " ".join(str(e).split())[:300] or type(e).__name__
            raise ValueError(f"config key 'train.report_to': {name} could not start a run ({type(e).__name__}: "
                             f"{message}); {_START_HINT[name]}") from None

    def _append(self, path: Path, record: dict) -> None:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def _track(self, scalars: dict, step: int) -> None:
        scalars = {k: float(v) for k, v in scalars.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        for tracker in self._trackers:
            tracker.log(scalars, step)

    def log(self, record: dict) -> None:
        """Append one record (it must have `step`); None and non-finite values stay out of the trackers."""
        if not self.enabled:
            return
        self._append(self.metrics_path, record)
        self._track({(f"train/{k}" if k != "val_loss" else "val/loss"): v for k, v in record.items() if k != "step"},
                    record["step"])

    def log_health(self, step: int, stats: dict) -> str:
        line = health_summary(stats)
        if self.enabled:
            self._append(self.health_path, {"step": step, "layers": stats})
            self._track(health_scalars(stats), step)
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
        for tracker in self._trackers:
            tracker.close()
        self._trackers = []


def device_clock(device: torch.device) -> "float | torch.cuda.Event":
    """Now, in the order of the device's work: on CUDA a timed event recorded on the current stream (it completes
    once everything queued before it is done), elsewhere the host's clock (a CPU runs work as it is issued)."""
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def _seconds_between(start: "float | torch.cuda.Event", end: "float | torch.cuda.Event") -> float:
    if isinstance(end, torch.cuda.Event):
        end.synchronize()  # (the next step is queued by then: the device does not wait for the host)
        return start.elapsed_time(end) / 1e3
    return end - start


class Throughput:
    """Tokens/s, TFLOP/s and MFU of the training steps added since the last `report`, timed on the device's clock
    (`device_clock`) from the end of the step before them (or a `reset`) to the end of the last one: steps that
    overlap the host's work are timed as the device runs them, without a wait that would stop the overlap.

    tokens_per_s counts the tokens of all ranks; tflops and mfu are per device.
    """

    def __init__(self, device: torch.device, peak: float | None, world_size: int = 1):
        self.device, self.peak, self.world_size = device, peak, world_size
        self.flops_per_token: float | None = None
        self.reset()

    def reset(self) -> None:
        """Start a new window now (after evaluation or checkpointing, which are not training time)."""
        self._tokens, self._start, self._end = 0, device_clock(self.device), None

    def add(self, tokens: int, ended: "float | torch.cuda.Event") -> None:
        """A step of `tokens`, whose work was done at `ended` (its `device_clock` after its last work)."""
        self._tokens += tokens
        self._end = ended

    def report(self) -> dict:
        dt = max(_seconds_between(self._start, self._end), 1e-9) if self._end is not None else 1e-9
        tps = self._tokens / dt
        tflops = tps * (self.flops_per_token or 0.0) / self.world_size / 1e12
        if self._end is not None:
            self._tokens, self._start, self._end = 0, self._end, None
        return {"tokens_per_s": tps, "tflops": tflops, "mfu": tflops / self.peak if self.peak else None}
