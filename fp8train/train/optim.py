"""AdamW with Megatron-style weight-decay groups, the paper's learning-rate schedules, gradient clipping.

Schedules are defined on the 1-based iteration ``i = step + 1`` that Megatron counts, where ``step``
is the 0-based index of the optimizer step about to run (what `LambdaLR` passes). So with ``W``
warmup steps the first step already trains at ``peak / W`` (no step is wasted at lr 0), step ``W - 1``
is the first at peak, and the last step (``i = total_steps``) lands exactly on ``min_lr``. For the
paper's CPT (40,000 steps, 5,000 warmup, cosine over the last 5,000) the checkpoint after iteration
35,000 is still at peak and the decay phase restarts from it, as in the paper.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from .adamw import TritonAdamW, triton_adamw_available

__all__ = ["OptimConfig", "build_optimizer", "build_scheduler", "clip_grad_norm", "gradient_norm", "lr_lambda",
           "optimizer_step", "optimizer_step_on_device", "restore_step_impl", "skips_on_device"]

Schedule = Literal["wsd", "cosine", "constant"]
_SCHEDULES = ("wsd", "cosine", "constant")
Impl = Literal["auto", "triton", "fused", "foreach"]
_IMPLS = ("auto", "triton", "fused", "foreach")


@dataclass
class OptimConfig:
    """AdamW and learning-rate schedule settings (the `optim` section of a training config)."""

    lr: float = 1e-4
    """Peak learning rate (reached at the end of warmup)."""
    min_lr: float = 1e-5
    """Final learning rate of the `wsd` and `cosine` decays; unused by `constant`."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW (beta1, beta2); the paper uses (0.9, 0.95) for CPT and SFT."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay of matrices and embeddings; biases, norms and 1-D params get none."""
    grad_clip: float = 1.0
    """Clip the global gradient L2 norm to this; 0 disables clipping (the norm is still measured)."""
    schedule: Schedule = "wsd"
    """`wsd` (warmup, stable, cosine decay; CPT), `cosine` (warmup then cosine; SFT) or `constant`."""
    warmup_steps: int = 0
    """Linear warmup length in optimizer steps; 0 means use `warmup_ratio`."""
    warmup_ratio: float = 0.0
    """Warmup as a fraction of the total steps (rounded up), used when `warmup_steps` is 0."""
    decay_steps: int = 0
    """`wsd` only: length of the final cosine decay in steps; 0 means use `decay_ratio`."""
    decay_ratio: float = 0.1
    """`wsd` only: decay length as a fraction of the total steps (rounded up), when `decay_steps` is 0."""
    impl: Impl = "auto"
    """The AdamW step: `triton` (fp8train's, one launch per parameter group, CUDA; fp8train.train.adamw),
    `fused` (torch's fused kernel), `foreach` (torch's multi-tensor ops, any device); `auto` is `triton`
    when every parameter is on CUDA and Triton is installed, `foreach` otherwise. All keep torch's AdamW
    state, so the key is free to change on resume."""

    def __post_init__(self) -> None:
        self.lr = _number("lr", self.lr, gt=0.0)
        self.min_lr = _number("min_lr", self.min_lr, ge=0.0)
        if self.min_lr > self.lr:
            raise ValueError(f"optim.min_lr ({self.min_lr}) must be <= optim.lr ({self.lr})")
        if not isinstance(self.betas, (tuple, list)) or len(self.betas) != 2:
            raise ValueError(f"optim.betas must be a pair [beta1, beta2], got {self.betas!r}")
        self.betas = tuple(_number(f"betas[{i}]", b, ge=0.0, lt=1.0) for i, b in enumerate(self.betas))
        self.eps = _number("eps", self.eps, gt=0.0)
        self.weight_decay = _number("weight_decay", self.weight_decay, ge=0.0)
        self.grad_clip = _number("grad_clip", self.grad_clip, ge=0.0)
        if self.schedule not in _SCHEDULES:
            raise ValueError(f"optim.schedule must be one of {list(_SCHEDULES)}, got {self.schedule!r}")
        self.warmup_steps = _integer("warmup_steps", self.warmup_steps)
        self.warmup_ratio = _number("warmup_ratio", self.warmup_ratio, ge=0.0, lt=1.0)
        self.decay_steps = _integer("decay_steps", self.decay_steps)
        self.decay_ratio = _number("decay_ratio", self.decay_ratio, ge=0.0, le=1.0)
        if self.impl not in _IMPLS:
            raise ValueError(f"optim.impl must be one of {list(_IMPLS)}, got {self.impl!r}")


def _number(name: str, value: object, *, gt=None, ge=None, lt=None, le=None) -> float:
    # bool is an int subclass, and YAML 1.1 reads `1e-4` (no dot) as a string: both are user errors.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"optim.{name} must be a number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"optim.{name} must be finite, got {value}")
    for bad, op, bound in ((gt is not None and value <= gt, ">", gt), (ge is not None and value < ge, ">=", ge),
                           (lt is not None and value >= lt, "<", lt), (le is not None and value > le, "<=", le)):
        if bad:
            raise ValueError(f"optim.{name} must be {op} {bound}, got {value}")
    return value


def _integer(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"optim.{name} must be an integer, got {value!r} ({type(value).__name__})")
    if value < 0:
        raise ValueError(f"optim.{name} must be >= 0, got {value}")
    return value


def _steps_from_ratio(ratio: float, total_steps: int) -> int:
    # Round before ceil so that e.g. 0.05 * 20 = 1.0000000000000002 does not become 2.
    return math.ceil(round(ratio * total_steps, 9))


def _warmup_steps(cfg: OptimConfig, total_steps: int) -> int:
    return cfg.warmup_steps or _steps_from_ratio(cfg.warmup_ratio, total_steps)


def lr_lambda(cfg: OptimConfig, total_steps: int) -> Callable[[int], float]:
    """The schedule as a multiplier of `cfg.lr`, a function of the 0-based optimizer step.

    Steps past `total_steps` stay at the final value.
    """
    if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
        raise ValueError(f"total_steps must be a positive integer, got {total_steps!r}")
    warmup = _warmup_steps(cfg, total_steps)
    source = "optim.warmup_steps" if cfg.warmup_steps else "optim.warmup_ratio"
    if warmup > total_steps:
        raise ValueError(f"{source} gives {warmup} warmup steps, more than the {total_steps} total steps")
    min_ratio = cfg.min_lr / cfg.lr

    def cosine(progress: float) -> float:
        # progress 0 -> 1.0 (peak), 0.5 -> exactly (1 + min_ratio) / 2, 1 -> exactly min_ratio
        progress = min(progress, 1.0)
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    if cfg.schedule == "wsd":
        decay = cfg.decay_steps or _steps_from_ratio(cfg.decay_ratio, total_steps)
        if warmup + decay > total_steps:
            what = "optim.decay_steps" if cfg.decay_steps else "optim.decay_ratio"
            raise ValueError(f"{source} ({warmup} steps) plus {what} ({decay} steps) exceed the {total_steps} "
                             "total steps")
        decay_start = total_steps - decay  # last iteration at peak

        def wsd(step: int) -> float:
            i = step + 1
            if i <= warmup:
                return i / warmup
            if i <= decay_start:
                return 1.0
            return cosine((i - decay_start) / decay)

        return wsd

    if cfg.schedule == "cosine":
        decay = total_steps - warmup

        def warmup_cosine(step: int) -> float:
            i = step + 1
            if i <= warmup:
                return i / warmup
            return cosine((i - warmup) / decay) if decay else min_ratio

        return warmup_cosine

    def constant(step: int) -> float:
        i = step + 1
        return i / warmup if i <= warmup else 1.0

    return constant


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig,
                    total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """`LambdaLR` over `lr_lambda`; call `scheduler.step()` once after each `optimizer.step()`."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, total_steps))


def _param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    # Megatron's rule: biases and 1-D parameters (norm weights) get no weight decay. named_parameters()
    # visits registration order and yields a tied parameter once, so the groups are deterministic.
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if param.dtype != torch.float32:
            raise ValueError(f"parameter {name!r} is {param.dtype}; fp8train keeps FP32 master weights "
                             "(load the model in float32 and compute in BF16 under autocast)")
        (no_decay if param.ndim < 2 or name.endswith(".bias") else decay).append(param)
    if not decay and not no_decay:
        raise ValueError("the model has no trainable parameters")
    return [
        {"params": decay, "weight_decay": weight_decay, "name": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
    ]


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW over the FP32 parameters of `model`: group 0 decays, group 1 (biases, norms) does not; its step
    as `cfg.impl` says."""
    groups = _param_groups(model, cfg.weight_decay)
    impl = cfg.impl
    if impl == "auto":
        cuda = all(p.is_cuda for g in groups for p in g["params"])
        impl = "triton" if cuda and triton_adamw_available() else "foreach"
    hyper = dict(lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    if impl == "triton":
        try:
            return TritonAdamW(groups, **hyper)
        except (ValueError, RuntimeError) as e:
            raise ValueError(f"optim.impl: triton: {e}") from None
    return torch.optim.AdamW(groups, **hyper, fused=impl == "fused" or None, foreach=impl == "foreach" or None)


_IMPL_KEYS = ("fused", "foreach", "capturable", "differentiable")


def restore_step_impl(optimizer: torch.optim.Optimizer, configured: list[dict]) -> None:
    """After `load_state_dict`: the step this optimizer was built with, from `configured` (its param_groups as
    built). A checkpoint's param_groups carry the `fused` / `foreach` flags of the run that saved it, which
    torch restores with the hyperparameters; `optim.impl` is free to change on resume, so they go back. The
    `step` counters move to where the step keeps them (torch's fused: the parameter's device; else the CPU)."""
    for group, built in zip(optimizer.param_groups, configured):
        group.update({k: built[k] for k in _IMPL_KEYS if k in built})
        on_device = group.get("fused") or group.get("capturable")
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].to(device=p.device if on_device else "cpu", dtype=torch.float32)


def _params(model_or_params: nn.Module | Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return list(model_or_params.parameters()) if isinstance(model_or_params, nn.Module) else list(model_or_params)


def _total_norm(params: list[torch.Tensor]) -> torch.Tensor:
    """The global gradient L2 norm as a device tensor (no host sync); FSDP2 DTensors reduced across ranks."""
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0, error_if_nonfinite=False)
    if hasattr(total, "full_tensor"):  # DTensor with Partial placement: all-reduce once, as torchtitan does
        total = total.full_tensor()
    return total


def clip_grad_norm(model_or_params: nn.Module | Iterable[torch.Tensor], max_norm: float | None) -> float:
    """Clip gradients to a global L2 norm of `max_norm` and return the norm before clipping.

    `max_norm` None or 0 only measures. A non-finite norm is returned as is with the gradients left
    untouched (torch would turn them all into NaN), so the caller can count and skip the step.
    Works for FSDP2 DTensor parameters: the norm is reduced across ranks before clipping.
    """
    params = _params(model_or_params)
    total = _total_norm(params)
    norm = float(total.item())
    if max_norm and math.isfinite(norm):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return norm


def gradient_norm(optimizer: torch.optim.Optimizer,
                  model_or_params: nn.Module | Iterable[torch.Tensor]) -> torch.Tensor:
    """The global gradient L2 norm as a device tensor, enqueued without a host sync (FSDP2 DTensors reduced
    across ranks): `TritonAdamW`'s own (one launch per group; the step's tables made here) where it steps
    exactly the parameters that have gradients, else torch's `get_total_norm`. Enqueued before the caller's
    first host read of the step (the trainer's loss), its host work overlaps the backward still running on the
    GPU, and that one read waits for the norm too; hand it to `optimizer_step` as `norm`."""
    params = _params(model_or_params)
    if isinstance(optimizer, TritonAdamW):
        stepped = {id(p) for g in optimizer.param_groups for p in g["params"] if p.grad is not None}
        if stepped == {id(p) for p in params if p.grad is not None}:
            return optimizer.grad_norm()
    return _total_norm(params)


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer's step divides the gradients by `optimizer.grad_scale` and skips itself where
    `optimizer.found_inf` is not 0, both device tensors (GradScaler's hooks: torch's fused AdamW, `TritonAdamW`),
    so that clipping and the skip of a non-finite step need no host sync."""
    fused = bool(optimizer.param_groups) and all(g.get("fused") for g in optimizer.param_groups)
    return fused or isinstance(optimizer, TritonAdamW)


def optimizer_step(optimizer: torch.optim.Optimizer, model_or_params: nn.Module | Iterable[torch.Tensor],
                   max_norm: float | None, *, skip: bool = False, norm: torch.Tensor | None = None) -> float:
    """Clip the gradients to a global L2 norm of `max_norm` and step; return the norm before clipping (`norm`:
    the device tensor `gradient_norm` enqueued for these gradients, else made here).

    No step, and the gradients left as they are, when `skip` or the norm is not finite (the caller counts
    it and zeroes them). `max_norm` None or 0 only measures. One host sync: the norm's read, before the step
    (`optimizer_step_on_device` decides on the device instead). How the clip is applied: `_clip_and_step`.
    """
    params = _params(model_or_params)
    total = gradient_norm(optimizer, params) if norm is None else norm
    value = float(total.item())
    if not skip and math.isfinite(value):
        _clip_and_step(optimizer, params, max_norm, total)
    return value


def optimizer_step_on_device(optimizer: torch.optim.Optimizer,
                             model_or_params: nn.Module | Iterable[torch.Tensor], max_norm: float | None,
                             norm: torch.Tensor, found_inf: torch.Tensor) -> None:
    """`optimizer_step` without a host sync: the step is enqueued and skips itself on the device where the
    one-element `found_inf` is not 0 (the caller's verdict on the loss and `norm`; parameters, moments and
    step counts stay as they were). Needs an optimizer that `skips_on_device`."""
    if not skips_on_device(optimizer):
        raise ValueError(f"optimizer_step_on_device: {type(optimizer).__name__} (not fused) cannot skip a step "
                         "on the device; use optimizer_step")
    _clip_and_step(optimizer, _params(model_or_params), max_norm, norm, found_inf)


def _clip_and_step(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], max_norm: float | None,
                   norm: torch.Tensor, found_inf: torch.Tensor | None = None) -> None:
    """Clip to `max_norm` (None or 0: no clip) given the gradients' `norm`, and step. Where the optimizer
    `skips_on_device` the clip is folded into the update: the step divides every gradient by
    `optimizer.grad_scale`, here max(1, (norm + 1e-6) / max_norm), so the gradients are read for the norm and
    then by the update, with no clipping pass of their own (torch's fused kernel also writes the scaled
    gradient back; `TritonAdamW` leaves it unclipped). It divides where torch's clip multiplies by
    min(1, max_norm / (norm + 1e-6)): while clipping is active a clipped gradient can differ in its last bit;
    otherwise the scale is exactly 1. foreach AdamW (the CPU default): clip, then step."""
    if not skips_on_device(optimizer):  # found_inf is None here: optimizer_step_on_device refuses these
        if max_norm:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        optimizer.step()
        return
    if getattr(optimizer, "grad_scale", None) is not None or getattr(optimizer, "found_inf", None) is not None:
        raise RuntimeError("optimizer_step: the optimizer already carries a grad_scale or found_inf (a GradScaler "
                           "step?)")
    if max_norm:
        optimizer.grad_scale = torch.clamp((norm.float() + 1e-6) / max_norm, min=1.0)
    if found_inf is not None:
        optimizer.found_inf = found_inf.float()
    try:
        optimizer.step()
    finally:
        optimizer.__dict__.pop("grad_scale", None)
        optimizer.__dict__.pop("found_inf", None)
