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

Checkpoints (`save_sharded` / `load_sharded`) are `torch.distributed.checkpoint` directories: each rank
writes its shards, and a load reshards to any world size (1 included, without a process group).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal


import torch
import torch.distributed as dist
from torch import nn

from ..fp8 import fsdp as _fsdp_fp8
from ..fp8.linear import FP8Linear

from .checkpoint import _fsync_dir

__all__ = ["DistributedConfig", "FsdpReport", "ParallelInfo", "all_reduce_sum", "apply_fsdp", "barrier", "destroy",
           "gather_full_state_dict", "init_distributed", "is_sharded_checkpoint", "load_sharded",
           "load_single_process_checkpoint", "save_sharded"]

MANIFEST = "manifest.json"  # the completion marker, written last (the name single-process checkpoints use too)
_FORMAT = "fp8train-sharded-checkpoint"
_VERSION = 1
_EXTRA = "extra_state.pt"


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
class ParallelInfo:
    """Where this process sits: its global rank, its rank on the node, the world size and its device."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


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
        raise RuntimeError(f"launched by torchrun but the environment variable {name} is missing "
                           "(torchrun sets RANK, LOCAL_RANK and WORLD_SIZE together)")
    try:
        return int(value)
    except ValueError:
        raise RuntimeError(f"environment variable {name}={value!r} is not an integer") from None


def init_distributed(cfg: DistributedConfig) -> ParallelInfo:
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
        return ParallelInfo(0, 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    else:
        rank, world_size, local_rank = _env_int("RANK"), _env_int("WORLD_SIZE"), _env_int("LOCAL_RANK")
        if not 0 <= rank < world_size:
            raise RuntimeError(f"RANK={rank} is outside 0..WORLD_SIZE-1 (WORLD_SIZE={world_size})")
        backend = cfg.backend if cfg.backend != "auto" else ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError("config key 'distributed.backend' is nccl but CUDA is not available; use gloo")
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} GPUs are visible")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size,
                                device_id=device if backend == "nccl" else None)
    return ParallelInfo(rank, local_rank, world_size, device)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
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


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    inner = getattr(getattr(model, "_orig_mod", model), "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"apply_fsdp: expected a Hugging Face causal LM with decoder layers at model.model.layers, "
                        f"got {type(model).__name__}")
    return layers


def apply_fsdp(model: nn.Module, cfg: DistributedConfig, info: ParallelInfo) -> FsdpReport:
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
    layers = _decoder_layers(model)
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


# ----------------------------------------------------------------------------------------- checkpoints


def _all_ok(fn: Callable[[], None], what: str) -> None:
    """Run `fn` on this rank; if it raised on any rank, raise on every rank (nobody waits forever)."""
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




def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    return _fsdp_fp8.unwrap(state)  # DCP sees plain FP32 shards; they alias the live parameters


def save_sharded(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 extra_state: dict | None = None) -> Path:
    """Write a sharded checkpoint directory at `path` (every rank calls this; each writes its shards).

    Written into a temp directory beside `path` and renamed by rank 0 once every rank has written, with
    `manifest.json` last: a rank failing mid-save raises on all ranks and leaves nothing at `path`.
    `extra_state` (step, scheduler, data position: plain values and tensors) is rank 0's. `path` must
    be on storage all ranks share.
    """
    import torch.distributed.checkpoint as dcp

    final = Path(path)
    tmp = final.with_name(f".tmp_{final.name}.sharded")
    rank0 = _rank() == 0

    state, extra = {}, io.BytesIO()

    def prepare():
        state.update(_state(model, optimizer))
        if rank0:
            torch.save(extra_state or {}, extra)
            try:  # refuse now what load_sharded could not read back
                torch.load(io.BytesIO(extra.getvalue()), weights_only=True)
            except Exception as e:
                raise TypeError(f"save_sharded: extra_state must hold only plain Python values and tensors "
                                f"(it is loaded with weights_only=True): {e}") from None
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)

    _all_ok(prepare, f"preparing checkpoint {final}")
    with warnings.catch_warnings():  # DCP warns that a single process saves alone, which is the point
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        # DCP turns a failure on any rank into an error on every rank
        dcp.save(state, checkpoint_id=str(tmp), no_dist=not _distributed())

    def finalize():
        if not rank0:
            return
        (tmp / _EXTRA).write_bytes(extra.getvalue())
        files = {}
        for p in sorted(tmp.iterdir()):
            with open(p, "rb") as f:
                os.fsync(f.fileno())
            files[p.name] = p.stat().st_size
        manifest = {"format": _FORMAT, "version": _VERSION, "world_size": dist.get_world_size() if _distributed()
                    else 1, "files": files}
        with open(tmp / MANIFEST, "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        if final.exists():  # a re-save of the same step: move the old one out of the way first
            trash = final.with_name(f".trash_{final.name}.{uuid.uuid4().hex[:12]}")
            os.replace(final, trash)
            shutil.rmtree(trash, ignore_errors=True)
        os.replace(tmp, final)
        _fsync_dir(final.parent)

    _all_ok(finalize, f"finalizing checkpoint {final}")
    return final


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """Whether `path` is a complete checkpoint written by `save_sharded`."""
    try:
        return json.loads((Path(path) / MANIFEST).read_text(encoding="utf-8")).get("format") == _FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _verify(path: Path) -> dict:
    manifest_path = path / MANIFEST
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    if not manifest_path.is_file():
        raise RuntimeError(f"{manifest_path} is missing: the checkpoint is incomplete (a save did not finish)")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        files = manifest["files"]
        if manifest.get("format") != _FORMAT or manifest.get("version") != _VERSION:
            raise ValueError(f"format {manifest.get('format')!r} version {manifest.get('version')!r}")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise RuntimeError(f"{manifest_path} is not an {_FORMAT} v{_VERSION} manifest: {e}") from None
    for name, size in files.items():
        f = path / name
        if not f.is_file() or f.stat().st_size != size:
            raise RuntimeError(f"{f} is missing or has the wrong size (torn checkpoint; {MANIFEST} says {size} bytes)")
    return manifest


def load_sharded(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Load a `save_sharded` checkpoint into `model` (and `optimizer`) at any world size; return the
    saved extra_state. Every rank calls this, after `apply_fsdp` and after building the optimizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    path = Path(path)
    state = {}

    def prepare():
        _verify(path)
        state.update(_state(model, optimizer))

    _all_ok(prepare, f"checking checkpoint {path}")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(path), no_dist=not _distributed())
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
    return torch.load(path / _EXTRA, map_location="cpu", weights_only=True)


def load_single_process_checkpoint(path: str | os.PathLike, model: nn.Module,
                                   optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Resume a sharded model from a single-process checkpoint (`fp8train.checkpoint` layout): every rank
    reads the full FP32 weights and optimizer state, and DCP's state-dict API keeps each rank's shard.
    Returns the saved train_state with the scheduler state under "scheduler". The per-process RNG states
    of the single process are not restored (the data order lives in the sampler state, which is)."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    from .checkpoint import read_model_weights, verify_checkpoint

    path = Path(path)
    state = {}

    def prepare():
        if _rank() == 0:  # hashing every file once is enough: a failure still stops every rank (_all_ok)
            verify_checkpoint(path)
        state["model"] = read_model_weights(model, path / "model")
        state["train"] = torch.load(path / "train_state.pt", map_location="cpu", weights_only=True)
        if optimizer is not None:
            state["optimizer"] = _named_optimizer_state(
                model, optimizer, torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True), path)

    _all_ok(prepare, f"reading checkpoint {path}")
    full = StateDictOptions(full_state_dict=True)  # full tensors on every rank in, this rank's shards kept
    set_model_state_dict(model, state["model"], options=full)
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optimizer"], options=full)
    return {**state["train"]["train_state"], "scheduler": state["train"]["scheduler"]}


def _named_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, saved: dict, path: Path) -> dict:
    """A plain optimizer.state_dict() (parameters numbered in param-group order) keyed by parameter name,
    the form DCP's full optimizer state dicts take. The optimizer must be built the same way (same groups)."""
    owner = _tied_owners(model)
    names_by_id = {}
    for name, p in model.named_parameters():
        names_by_id.setdefault(id(p), owner.get(name, name))
    groups = [[names_by_id[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    saved_groups = saved.get("param_groups", [])
    if [len(g["params"]) for g in saved_groups] != [len(g) for g in groups]:
        raise ValueError(f"{path / 'optimizer.pt'}: its parameter groups "
                         f"{[len(g['params']) for g in saved_groups]} do not match this model's optimizer "
                         f"{[len(g) for g in groups]}")
    name_of = {i: n for sg, g in zip(saved_groups, groups) for i, n in zip(sg["params"], g)}
    return {"state": {name_of[i]: v for i, v in saved["state"].items()},
            "param_groups": [{**sg, "params": g} for sg, g in zip(saved_groups, groups)]}


def gather_full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) model state dict as CPU tensors on rank 0, {} on other ranks; every rank
    must call it. Tied weights stay one tensor. Feed it to a plain model for the Hugging Face export."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import DTensor

    sharded = _fsdp_fp8.unwrap(get_model_state_dict(model))
    owner = _tied_owners(model)
    main = _rank() == 0
    full: dict[str, torch.Tensor | None] = {}
    for name, t in sharded.items():  # every rank gathers the same tensors in the same order
        key = owner.get(name, name)
        if key not in full:
            value = t.full_tensor() if isinstance(t, DTensor) else t
            full[key] = value.detach().cpu() if main else None
    return {name: full[owner.get(name, name)] for name in sharded} if main else {}


def _tied_owners(model: nn.Module) -> dict[str, str]:
    """State-dict name -> the first name of the same Parameter (tied embeddings), in state-dict spelling
    (without the `_orig_mod.` / `_checkpoint_wrapped_module.` wrapper segments)."""
    wrappers = {"_orig_mod", "_checkpoint_wrapped_module"}
    first: dict[int, str] = {}
    owner = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        clean = ".".join(part for part in name.split(".") if part not in wrappers)
        owner[clean] = first.setdefault(id(p), clean)
    return owner
