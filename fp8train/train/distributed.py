"""Scale-out on PyTorch's own stack: torchrun process groups, FSDP2 sharding, DCP checkpoints.

    info = init_distributed(DistributedConfig())     # world size 1 and no process group without torchrun
    convert_to_fp8(model, recipe)                     # 1. FP8 Linears
    # 2. activation checkpointing, 3. torch.compile per decoder layer, then:
    report = apply_fsdp(model, cfg, info)             # 4. FSDP2 per decoder layer + root
    optimizer = AdamW(model.parameters(), ...)        # 5. after sharding: it must see the sharded params

Sharding: FP32 master weights, gradients and optimizer states are sharded along dim 0; each decoder layer
all-gathers its parameters in BF16 (or FP8, `fp8_param_gather`) for forward and backward and
reduce-scatters gradients in FP32, averaged over ranks (FSDP's default). With each rank's loss =
its token-loss sum / the global token count (`all_reduce_sum`), backpropagate loss x world size: the
gradient is then the global batch's per-token mean gradient at any world size.

Checkpoints of a sharded model are `fp8train.train.checkpoint`'s, kind "sharded" (DCP shards, resharded
on load at any world size); `fp8train.export.export_hf` gathers a sharded model for the Hugging Face
export (`gather_full_state_dict`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Callable, Literal

import torch
import torch.distributed as dist
from torch import nn

from ..fp8 import FP8Linear
from ..fp8 import fsdp as _fsdp_fp8
from .model import decoder_layers

__all__ = ["DistributedConfig", "FsdpReport", "World", "all_ranks_ok", "all_reduce_sum", "apply_fsdp", "barrier",
           "destroy", "gather_full_state_dict", "get_rank", "init_distributed", "is_sharded_model"]

log = logging.getLogger(__name__)


@dataclass
class DistributedConfig:
    """Multi-process training (the `distributed` section); used only when launched by torchrun."""

    fp8_param_gather: bool = False
    """All-gather the FP8 Linears' weights in FP8 with their 128x128 block scales instead of BF16 (half the bytes)."""
    reshard_after_forward: bool = True
    """Free each layer's gathered weights after its forward, gather again for backward (less memory, more traffic)."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Process-group backend: `auto` = nccl when CUDA is available, else gloo."""
    fsdp: Literal["auto", "always"] = "auto"
    """`auto`: FSDP2 when torchrun starts more than one process; `always`: also at world size 1 (torchrun --nproc-per-node 1), e.g. to check the sharded path and its checkpoints on one GPU."""


@dataclass(frozen=True)
class World:
    """Where this process sits and whether FSDP2 shards the model. The default is a single process.

    `init_distributed` fills in rank, local rank, world size and device; `fsdp` (the `distributed`
    section) turns sharding on, also at world size 1 (`distributed.fsdp: always`).
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    fsdp: DistributedConfig | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        """FSDP2 shards the model (any world size, 1 included): sharded checkpoints, gathered export."""
        return self.fsdp is not None

    def shard(self, model: nn.Module) -> FsdpReport:
        """`apply_fsdp` with this world's options (the hook `parallelize_model` runs last)."""
        report = apply_fsdp(model, self.fsdp or DistributedConfig(), self)
        if self.is_main:  # the whole report: which weights fall back to a BF16 gather, and why
            log.info("%s", report)
        return report

    @staticmethod
    def all_reduce_sum(value):
        """`all_reduce_sum` over this world's ranks (the process group; a no-op in a single process)."""
        return all_reduce_sum(value)


@dataclass
class FsdpReport:
    """What `apply_fsdp` did: the modules it sharded and, per FP8 Linear, how its weight is gathered."""

    world_size: int
    sharded: list[str] = field(default_factory=list)
    fp8_gather: list[str] = field(default_factory=list)
    bf16_gather: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        if not self.sharded:
            return "fp8train: FSDP off (single process)"
        lines = [f"fp8train: FSDP2 over {self.world_size} ranks: {len(self.sharded)} modules sharded "
                 f"({len(self.sharded) - 1} decoder layers + root); {len(self.fp8_gather)} weights all-gathered in FP8"]
        reasons: dict[str, list[str]] = {}
        for fqn, why in self.bf16_gather.items():
            reasons.setdefault(why, []).append(fqn)
        for why, names in reasons.items():
            shown = ", ".join(names[:4]) + (f", ... ({len(names)} in all)" if len(names) > 4 else "")
            lines.append(f"  BF16 all-gather ({why}): {shown}")
        return "\n".join(lines)


# ------------------------------------------------------------------------------------ process group


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise ValueError(f"launched by torchrun but the environment variable {name} is missing "
                         "(torchrun sets RANK, LOCAL_RANK and WORLD_SIZE together)")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def init_distributed(cfg: DistributedConfig) -> World:
    """Join the process group torchrun set up (RANK / LOCAL_RANK / WORLD_SIZE, its contract).

    Not launched by torchrun: nothing happens, world size 1 on CUDA when available, else the CPU. With
    NCCL each process uses GPU `local_rank`; with gloo, the CPU.
    """
    if cfg.backend not in ("auto", "nccl", "gloo"):
        raise ValueError(f"config key 'distributed.backend' must be auto, nccl or gloo, got {cfg.backend!r}")
    if dist.is_initialized():  # joined already (by an earlier call or by the caller): describe it
        rank, world_size, backend = dist.get_rank(), dist.get_world_size(), dist.get_backend()
        local_rank = _env_int("LOCAL_RANK") if "LOCAL_RANK" in os.environ else rank
    elif "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
        return World(0, 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    else:
        rank, world_size, local_rank = _env_int("RANK"), _env_int("WORLD_SIZE"), _env_int("LOCAL_RANK")
        if not 0 <= rank < world_size:
            raise ValueError(f"RANK={rank} is outside 0..WORLD_SIZE-1 (WORLD_SIZE={world_size})")
        backend = cfg.backend if cfg.backend != "auto" else ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise ValueError("config key 'distributed.backend' is nccl but CUDA is not available; use gloo")
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} GPUs are visible")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size,
                                device_id=device if backend == "nccl" else None)
    return World(rank, local_rank, world_size, device)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if _distributed() else 0


def barrier() -> None:
    """Wait for every rank (no-op in a single process)."""
    if _distributed():
        dist.barrier()


def destroy() -> None:
    """Leave the process group (no-op in a single process)."""
    if _distributed():
        dist.destroy_process_group()


def _comm_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def all_reduce_sum(value):
    """Sum of `value` over all ranks: a tensor (returned as a new tensor, same dtype and device) or a
    Python number (float64 on the wire, returned as int for an int). Token counts, loss sums."""
    if isinstance(value, torch.Tensor):
        if not _distributed():
            return value.detach().clone()
        t = value.detach().to(_comm_device(), copy=True)
        dist.all_reduce(t)
        return t.to(value.device)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"all_reduce_sum: expected a tensor or a number, got {type(value).__name__}")
    if not _distributed():
        return value
    t = torch.tensor(float(value), dtype=torch.float64, device=_comm_device())
    dist.all_reduce(t)
    return int(t.item()) if isinstance(value, int) else t.item()


# ------------------------------------------------------------------------------------------------ FSDP


def apply_fsdp(model: nn.Module, cfg: DistributedConfig, info: World) -> FsdpReport:
    """Shard `model` in place with FSDP2: each decoder layer, then the root (embeddings, final norm, head).

    Call after FP8 conversion, activation checkpointing and torch.compile, and before building the
    optimizer. In a single process (no process group) this does nothing. BF16 (or FP8) all-gather,
    FP32 reduce-scatter, gradients averaged over ranks.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    report = FsdpReport(info.world_size)
    if not _distributed():
        if info.world_size != 1:
            raise RuntimeError(f"apply_fsdp: world size {info.world_size} but no process group; call init_distributed")
        return report
    layers = decoder_layers(model)
    for fqn, module in model.named_modules():
        if isinstance(module, FP8Linear) and module.recipe.enabled:
            why = module.prepare_fsdp(info.world_size, cfg.fp8_param_gather)
            if why is None:
                report.fp8_gather.append(fqn)
            elif cfg.fp8_param_gather:
                report.bf16_gather[fqn] = why
    mesh = init_device_mesh(info.device.type, (info.world_size,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    names = {id(m): n for n, m in model.named_modules()}
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=cfg.reshard_after_forward)
        report.sharded.append(names[id(layer)])
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=cfg.reshard_after_forward)
    report.sharded.append("<root>")
    if dist.get_backend() == "gloo":  # gloo has no AVG: reduce with SUM, then divide by the world size
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)
    return report


def is_sharded_model(model: nn.Module) -> bool:
    """Whether FSDP2 (`fully_shard`) sharded `model`."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def gather_full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) model state dict as CPU tensors on rank 0, {} on other ranks; every rank
    must call it. Tied weights stay one tensor. Feed it to a plain model for the Hugging Face export."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import DTensor

    from .checkpoint import tied_names  # checkpoint builds on this module

    sharded = _fsdp_fp8.unwrap(get_model_state_dict(model))
    owner = {name: aliases[0] for name, aliases in tied_names(model).items()}
    main = get_rank() == 0
    full: dict[str, torch.Tensor | None] = {}
    for name, t in sharded.items():  # every rank gathers the same tensors in the same order
        key = owner.get(name, name)
        if key not in full:
            value = t.full_tensor() if isinstance(t, DTensor) else t
            full[key] = value.detach().cpu() if main else None
    return {name: full[owner.get(name, name)] for name in sharded} if main else {}


def all_ranks_ok(fn: Callable[[], None], what: str) -> None:
    """Run `fn` on this rank; if it raised on any rank, raise on every rank (nobody waits forever).

    The rank that failed raises its own error; the others raise "`what` failed on rank N"."""
    error = None
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - re-raised below, on every rank
        error = e
    if _distributed():
        flag = torch.tensor([0 if error is None else dist.get_rank() + 1], device=_comm_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        failed = int(flag.item()) - 1
    else:
        failed = -1 if error is None else 0
    if error is not None:
        raise error
    if failed >= 0:
        raise RuntimeError(f"{what} failed on rank {failed}")
