"""The sharded half of `fp8train.train.checkpoint`: FSDP2 state through torch.distributed.checkpoint (DCP).

Why DCP, and how it reads nothing it has to trust. A sharded checkpoint keeps DCP's format because
resharding is its value: each rank writes its own shards, and a load at any world size (a single
process included) reads just the slices each rank needs. Writing our own safetensors-shards + JSON
layout would mean re-implementing that planning (and every DTensor placement FSDP2 may use) by hand.
DCP has two reads that unpickle, and this module replaces both:

- `dcp/.metadata` is a pickle (DCP's `FileSystemReader.read_metadata` calls `pickle.load`, and when
  that fails it tries the per-rank `__<rank>.metadata`). `read_metadata` below reads it through an
  unpickler that admits only the classes DCP's metadata is made of (`torch.distributed.checkpoint.
  metadata`, `_StorageInfo`, `torch.Size`, dtypes, layouts, `pathlib` paths) and fails closed on any
  other global, then checks every field: tensor entries only, every storage entry in a file the
  manifest lists under `dcp/`, its byte range inside that file, no stream transforms. `_Reader`
  hands DCP that checked object and never reads a metadata file itself.
- Non-tensor state-dict entries ("bytes" items) are loaded by DCP's `DefaultLoadPlanner.load_bytes`
  with `torch.load(weights_only=False)`. Nothing non-tensor goes into DCP here: the optimizer's
  param_groups travel in train_state.pt (read with weights_only=True), the metadata check refuses
  bytes entries, and `_Planner.load_bytes` refuses them again.

Tensor shards themselves are read by DCP's `FileSystemReader.read_data` with `torch.load(weights_only=True)`
(torch 2.11 and 2.13). Only public DCP classes are subclassed (FileSystemReader, DefaultLoadPlanner).
"""

from __future__ import annotations

import importlib
import pickle
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..fp8.fsdp import unwrap
from .checkpoint import CorruptCheckpointError, tied_names

__all__ = ["load_full_state", "named_optimizer_state", "read_dcp", "read_metadata", "write_dcp"]

_MD = "torch.distributed.checkpoint.metadata"
# Every global a DCP metadata pickle names (torch 2.11-2.13), and nothing else.
_ALLOWED = {(_MD, n) for n in ("Metadata", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
                               "ChunkStorageMetadata", "TensorProperties", "MetadataIndex", "_MEM_FORMAT_ENCODING")}
_ALLOWED |= {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
             ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
             ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath")}


def _cls(module: str, name: str):
    return getattr(importlib.import_module(module), name)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return _cls(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which DCP metadata never holds")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("it holds a persistent reference, which DCP metadata never holds")


def _size(value, ndim: int | None = None) -> bool:
    return (type(value) is torch.Size and all(type(v) is int and v >= 0 for v in value)
            and (ndim is None or len(value) == ndim))


def _check_metadata(md, files: dict[str, int]) -> str | None:
    """What is wrong with unpickled metadata `md`, or None. `files`: the manifest's dcp/ files -> size."""
    if type(md) is not _cls(_MD, "Metadata"):
        return f"it holds a {type(md).__name__}, not DCP Metadata"
    if not isinstance(md.state_dict_metadata, dict) or not md.state_dict_metadata:
        return "its state_dict_metadata is not a non-empty mapping"
    tensor_md, props, chunk_md = (_cls(_MD, n) for n in ("TensorStorageMetadata", "TensorProperties",
                                                          "ChunkStorageMetadata"))
    for fqn, entry in md.state_dict_metadata.items():
        if type(fqn) is not str or type(entry) is not tensor_md:
            return f"entry {fqn!r} is not a tensor entry (fp8train writes tensors only)"
        if (type(entry.properties) is not props or not isinstance(entry.properties.dtype, torch.dtype)
                or not _size(entry.size) or not isinstance(entry.chunks, list)):
            return f"entry {fqn!r} has malformed properties"
        for c in entry.chunks:
            if (type(c) is not chunk_md or not _size(c.offsets, len(entry.size)) or not _size(c.sizes, len(entry.size))
                    or any(o + s > n for o, s, n in zip(c.offsets, c.sizes, entry.size))):
                return f"entry {fqn!r} has a chunk outside its tensor"
    index_cls, info_cls = _cls(_MD, "MetadataIndex"), _cls("torch.distributed.checkpoint.filesystem", "_StorageInfo")
    if not isinstance(md.storage_data, dict):
        return "its storage_data is not a mapping"
    for index, info in md.storage_data.items():
        if type(index) is not index_cls or index.fqn not in md.state_dict_metadata or type(info) is not info_cls:
            return "its storage_data has a malformed entry"
        size = files.get(info.relative_path) if type(info.relative_path) is str else None
        if size is None:
            return f"entry {index.fqn!r} points to {info.relative_path!r}, which the manifest does not list under dcp/"
        if not (type(info.offset) is int and type(info.length) is int and 0 <= info.offset
                and 0 <= info.length <= size - info.offset):
            return f"entry {index.fqn!r} has a byte range outside {info.relative_path}"
        if getattr(info, "transform_descriptors", None):
            return f"entry {index.fqn!r} asks for stream transforms ({info.transform_descriptors!r})"
    if not (md.planner_data is None or isinstance(md.planner_data, dict)):
        return "its planner_data is not a mapping"
    if not (md.storage_meta is None or type(md.storage_meta) is _cls(_MD, "StorageMeta")):
        return "its storage_meta is malformed"
    return None


def read_metadata(dcp_dir: Path, files: dict[str, int]):
    """The checked DCP metadata of `dcp_dir`; `CorruptCheckpointError` (one line naming the file) otherwise."""
    path = dcp_dir / ".metadata"
    try:
        with open(path, "rb") as f:
            md = _MetadataUnpickler(f).load()
    except Exception as e:  # noqa: BLE001 - whatever a forged pickle raises, the verdict is the same
        raise CorruptCheckpointError(f"{path} is not DCP checkpoint metadata ({type(e).__name__}: "
                                     f"{' '.join(str(e).split())}); refusing to load it") from None
    why = _check_metadata(md, files)
    if why is not None:
        raise CorruptCheckpointError(f"{path} is not fp8train's DCP checkpoint metadata: {why}; refusing to load it")
    return md


def _reader_and_planner(dcp_dir: Path, metadata):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class _Reader(FileSystemReader):
        """DCP's file reader, given metadata that `read_metadata` already read and checked."""

        def read_metadata(self, *args, **kwargs):
            if kwargs.get("rank") is not None:  # torch 2.13's fallback to per-rank metadata files: none here
                raise FileNotFoundError("fp8train checkpoints have no per-rank metadata")
            if metadata.storage_meta is not None:
                metadata.storage_meta.load_id = self.load_id
            return metadata

    class _Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):  # DCP would torch.load(weights_only=False) these
            raise CorruptCheckpointError(f"{dcp_dir}: entry {read_item.dest_index.fqn!r} is not a tensor; "
                                         "refusing to unpickle it")

    return _Reader(dcp_dir), _Planner()


# ------------------------------------------------------------------------------------------ state dicts


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _tensor_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, list]:
    """({"model": ..., "optimizer": per-parameter state}, optimizer param_groups): DCP gets the tensors."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    osd = get_optimizer_state_dict(model, optimizer)
    state = unwrap({"model": get_model_state_dict(model), "optimizer": osd["state"]})  # plain FP32 shards
    return state, osd["param_groups"]


def write_dcp(dcp_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> list:
    """Every rank writes its shards of the model and optimizer state to `dcp_dir`; returns the optimizer's
    param_groups (plain values, for train_state.pt). A failure on any rank raises on every rank."""
    import torch.distributed.checkpoint as dcp

    state, groups = _tensor_state(model, optimizer)
    for fqn, entries in state["optimizer"].items():
        for k, v in entries.items():
            if not isinstance(v, torch.Tensor):
                raise TypeError(f"optimizer state {fqn}.{k} is a {type(v).__name__}; sharded checkpoints hold tensors")
    with warnings.catch_warnings():  # DCP warns that a single process saves alone, which is the point
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=str(dcp_dir), no_dist=not _distributed())
    return groups


def read_dcp(dcp_dir: Path, metadata, model: nn.Module, optimizer: torch.optim.Optimizer | None,
             param_groups: list | None) -> None:
    """Load `dcp_dir`, whose `metadata` `read_metadata` returned, into `model` (plain or sharded, at any
    world size) and `optimizer`. Every rank calls it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    reader, planner = _reader_and_planner(dcp_dir, metadata)
    if optimizer is not None:
        state, groups = _tensor_state(model, optimizer)
    else:
        state, groups = unwrap({"model": _model_state(model)}), None
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=reader, planner=planner, no_dist=not _distributed())
    except CheckpointException as e:  # DCP gathers every rank's error; report the first one, on one line
        first = next(iter(e.failures.values()))[0]
        if isinstance(first, CorruptCheckpointError):
            raise first from None
        raise CorruptCheckpointError(f"{dcp_dir} could not be loaded: {type(first).__name__}: "
                                     f"{' '.join(str(first).split())}"[:2000]) from None
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        if not isinstance(param_groups, list) or len(param_groups) != len(groups):
            raise CorruptCheckpointError(f"{dcp_dir.parent / 'train_state.pt'}: its optimizer param_groups do not "
                                         f"match this optimizer's {len(groups)} groups")
        set_optimizer_state_dict(model, optimizer, {"state": state["optimizer"], "param_groups": param_groups})


def _model_state(model: nn.Module) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model)


def named_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, saved: dict, where: Path) -> dict:
    """A plain optimizer.state_dict() (parameters numbered in param-group order) keyed by parameter name,
    the form DCP's full optimizer state dicts take. The optimizer must be built the same way (same groups)."""
    owner = {name: aliases[0] for name, aliases in tied_names(model).items()}
    names_by_id = {}
    for name, p in model.named_parameters():
        names_by_id.setdefault(id(p), owner.get(name, name))
    groups = [[names_by_id[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    saved_groups = saved.get("param_groups", []) if isinstance(saved, dict) else []
    if [len(g["params"]) for g in saved_groups] != [len(g) for g in groups]:
        raise ValueError(f"{where}: its parameter groups {[len(g['params']) for g in saved_groups]} do not match "
                         f"this model's optimizer {[len(g) for g in groups]}")
    name_of = {i: n for sg, g in zip(saved_groups, groups) for i, n in zip(sg["params"], g)}
    return {"state": {name_of[i]: v for i, v in saved["state"].items()},
            "param_groups": [{**sg, "params": g} for sg, g in zip(saved_groups, groups)]}


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, model_state: dict,
                    optimizer_state: dict | None) -> None:
    """Load full (unsharded) state dicts into a sharded model: every rank passes the full tensors and
    keeps its own shards (DCP's full-state-dict API)."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    full = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, model_state, options=full)
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, optimizer_state, options=full)
