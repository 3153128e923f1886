"""Checkpoints for exact resume: one format for single-process and FSDP2-sharded runs, verified before
anything in it is read.

    root/step_00001000/
        manifest.json    written last: format, version, kind, step, world_size, size + sha256 of every file
        train_state.pt   step, scheduler, the trainer's train_state, RNG states (and, sharded, the
                         optimizer's param_groups)
        config.yaml      the run's resolved config when the trainer saves (what resume compares)
      kind "single" (a plain model in one process):
        model/           Hugging Face directory: config, safetensors weights as trained (FP32), tokenizer
        optimizer.pt     optimizer.state_dict()
      kind "sharded" (an FSDP2 model, any world size; every rank writes its shards):
        dcp/             a torch.distributed.checkpoint directory (.metadata, __<rank>_<n>.distcp)

`save_checkpoint` writes the kind the model calls for; `load_checkpoint` loads either kind into a plain
or a sharded model (DCP reshards a sharded one; a single-process one is read whole and each rank keeps
its shard); `verify_checkpoint` is the one check in front of both. Everything is written into
`root/.tmp_step_...`, fsynced, the manifest last, and renamed into place by rank 0 once every rank has
written, so a crash at any point leaves the earlier checkpoints and at most an ignored temp directory,
and a directory without a manifest is never picked up. One writer per root. Files and directories get
the permissions of the process umask, as other tools' outputs do, so a serving container can read them.

Trust: a checkpoint is untrusted input whose author may have written every file, the manifest included.
The manifest's sizes and sha256 sums catch torn writes, truncation and bit rot, and files that are not
listed or are links are refused; against a forger they prove nothing, so nothing is read in a way that
runs code: weights are safetensors, .pt files load with `torch.load(weights_only=True)`, config.yaml
with `yaml.safe_load`, and DCP's pickled metadata through a restricted unpickler (see `_sharded.py`).
Every refusal is a `CorruptCheckpointError` whose message is one line naming the file.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import numpy as np
import torch
import torch.distributed as dist
import yaml
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from . import files as fs
from .distributed import all_ranks_ok, get_rank, is_sharded_model
from .lora import ADAPTER_DIR, is_lora, load_lora_model, save_lora_model
from .model import index_weight_names

__all__ = ["Checkpoint", "CorruptCheckpointError", "capture_rng_state", "find_latest_checkpoint", "hf_model_dir",
           "load_checkpoint", "read_model_weights", "restore_rng_state", "save_checkpoint", "save_model_dir", "tied_names",
           "verify_checkpoint"]

MANIFEST = "manifest.json"
FORMAT = "fp8train-checkpoint"
VERSION = 2  # 1: single-process only, no `kind`; read as kind "single"
_REQUIRED = {"single": ("model/config.json", "optimizer.pt", "train_state.pt"),
             "sharded": ("dcp/.metadata", "train_state.pt")}
_WEIGHTS = ("model/model.safetensors", "model/model.safetensors.index.json")
_STEP_DIR = re.compile(r"^step_(\d{8,})$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_MAX_MANIFEST = 64 << 20


class CorruptCheckpointError(ValueError):
    """A checkpoint that is incomplete, torn, modified or not in fp8train's format; one line naming the file."""


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint directory that matched its manifest (what `verify_checkpoint` returns)."""

    path: Path
    kind: str
    """`single` or `sharded`."""
    step: int
    world_size: int
    """Ranks that wrote it."""
    files: dict
    """Posix path relative to `path` -> {"size", "sha256"}, the manifest itself excluded."""


# ---------------------------------------------------------------------------------------------- RNG


def capture_rng_state() -> dict:
    """The states of torch (CPU and every CUDA device when available), python `random` and numpy."""
    name, key, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        # as tensors and builtins so that the file loads with weights_only=True
        "numpy": {"name": name, "key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "gauss": float(gauss)},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict) -> None:
    """Inverse of `capture_rng_state`; CUDA states are restored for the devices present."""
    torch.set_rng_state(state["torch"].cpu())
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    n = state["numpy"]
    np.random.set_state((n["name"], n["key"].cpu().numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        for device, cuda_state in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state.cpu(), device)


# ------------------------------------------------------------------------------------ model + tokenizer


def save_model_dir(model: nn.Module, out_dir: Path, tokenizer=None, state_dict: dict | None = None) -> None:
    """`model` (and `tokenizer`) as a Hugging Face directory (safetensors)."""
    if is_lora(model):  # the adapter in out_dir/lora, the frozen base as a plain Hugging Face model in out_dir
        model, state_dict = save_lora_model(model, out_dir)
    if not hasattr(model, "save_pretrained"):
        raise TypeError(f"model must be a Hugging Face PreTrainedModel (unwrapped), got {type(model).__name__}")
    # transformers >= 5 always writes safetensors; save_pretrained drops tied aliases by storage pointer.
    model.save_pretrained(out_dir, state_dict=state_dict)
    if tokenizer is None:
        return
    if not hasattr(tokenizer, "save_pretrained"):
        from tokenizers import Tokenizer
        from transformers import PreTrainedTokenizerFast

        if not isinstance(tokenizer, Tokenizer):
            raise TypeError(f"tokenizer must be a transformers tokenizer or a tokenizers.Tokenizer, "
                            f"got {type(tokenizer).__name__}")
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    tokenizer.save_pretrained(out_dir)


_WRAPPERS = {"_orig_mod", "_checkpoint_wrapped_module"}


def _state_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """model.state_dict(keep_vars=True) in state-dict spelling (no `_orig_mod.` / checkpoint-wrapper segments)."""
    return {".".join(p for p in name.split(".") if p not in _WRAPPERS): t
            for name, t in model.state_dict(keep_vars=True).items()}


def tied_names(model: nn.Module) -> dict[str, list[str]]:
    """Each state-dict name -> every name of the same tensor (tied embeddings), first-registered first."""
    by_tensor: dict[int, list[str]] = {}
    for name, tensor in _state_tensors(model).items():
        by_tensor.setdefault(id(tensor), []).append(name)
    return {name: names for names in by_tensor.values() for name in names}


def read_model_weights(model: nn.Module, model_dir: Path) -> dict[str, torch.Tensor]:
    """The safetensors weights of `model_dir` as a full state dict of `model`, tied aliases filled in;
    a `ValueError` names every key that does not match the model."""
    index = model_dir / "model.safetensors.index.json"
    names = ["model.safetensors"]
    if index.is_file():
        names = index_weight_names(index)
    state: dict[str, torch.Tensor] = {}
    for name in names:
        try:
            state.update(load_file(model_dir / name))
        except (OSError, SafetensorError) as e:
            raise ValueError(f"{model_dir / name} is not a readable safetensors file ({e})") from None
    tied, shapes = tied_names(model), {k: tuple(v.shape) for k, v in _state_tensors(model).items()}
    unexpected = sorted(k for k in state if k not in tied)
    missing = sorted(k for k, aliases in tied.items() if not any(a in state for a in aliases))
    if missing or unexpected:
        raise ValueError(f"weights in {model_dir} do not match the model: missing keys {missing}, "
                         f"unexpected keys {unexpected}")
    wrong = [f"{k} {tuple(v.shape)} (model: {shapes[k]})" for k, v in state.items() if tuple(v.shape) != shapes[k]]
    if wrong:
        raise ValueError(f"weights in {model_dir} do not match the model's shapes: {', '.join(wrong[:4])}"
                         + (f" and {len(wrong) - 4} more" if len(wrong) > 4 else ""))
    for key, aliases in tied.items():
        present = [a for a in aliases if a in state]
        if any(not torch.equal(state[present[0]], state[a]) for a in present[1:]):
            raise ValueError(f"weights in {model_dir} hold different values for {present[0]!r} and {present[1]!r}, "
                             "which are tied in the model")
        state.setdefault(key, state[present[0]])
    return state


# ------------------------------------------------------------------------------------------------ save


def _check_plain(value, where: str) -> None:
    """What goes into train_state.pt must load with weights_only=True: builtins, containers of them, tensors."""
    if value is None or isinstance(value, (bool, int, float, str, bytes, torch.Tensor)):
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, (str, int)):
                raise TypeError(f"{where} has a key {k!r} of type {type(k).__name__}; use str or int keys")
            _check_plain(v, f"{where}[{k!r}]")
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_plain(v, f"{where}[{i}]")
        return
    raise TypeError(f"{where} is a {type(value).__module__}.{type(value).__name__}; {where.split('[')[0]} may hold "
                    "only None, bool, int, float, str, bytes, tensors, and dicts/lists/tuples of them")


def save_checkpoint(root: str | os.PathLike, step: int, *, model: nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler=None, train_state: dict | None = None, tokenizer=None, config: dict | None = None,
                    keep_last: int | None = None) -> Path:
    """Write `root/step_{step:08d}` atomically and return it; then keep only the newest `keep_last`.

    A model sharded by FSDP2 is saved as kind "sharded", and every rank must call this (each writes its
    shards, rank 0 the rest); any other model as kind "single". Weights are saved in the dtype they
    train in (FP32 master weights), so resume is bit-exact. `config` (a plain dict) becomes config.yaml.
    """
    from ._sharded import write_dcp

    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"keep_last must be None or an integer >= 1, got {keep_last!r}")
    train_state = {} if train_state is None else train_state
    if not isinstance(train_state, dict):
        raise TypeError(f"train_state must be a dict, got {type(train_state).__name__}")
    _check_plain(train_state, "train_state")
    root, sharded, main = Path(root), is_sharded_model(model), get_rank() == 0
    final = root / f"step_{step:08d}"
    tmp = root / f"{fs.TMP_PREFIX}{final.name}"  # the same name on every rank; one writer per root

    def begin():
        if main:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()

    def finish():
        if not main:
            return
        if not sharded:
            save_model_dir(model, tmp / "model", tokenizer)
            torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(state, tmp / "train_state.pt")
        if config is not None:
            (tmp / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
        files = fs.sync_tree(tmp, digest=True)
        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        fs.write_json(tmp / MANIFEST, {"format": FORMAT, "version": VERSION, "step": step, "world_size": world_size,
                                       "kind": "sharded" if sharded else "single", "files": files})
        fs.fsync_dir(tmp)
        fs.commit(tmp, final, sync=False)

    state = {"step": step, "scheduler": None if scheduler is None else scheduler.state_dict(),
             "train_state": train_state, "rng": capture_rng_state()}
    try:
        all_ranks_ok(begin, f"preparing checkpoint {final}")
        if sharded:  # collective: DCP turns a failure on any rank into an error on every rank
            state["optimizer_param_groups"] = write_dcp(tmp / "dcp", model, optimizer)
        all_ranks_ok(finish, f"writing checkpoint {final}")
    except BaseException:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if main:
        if keep_last is not None:
            for _, path in _complete_checkpoints(root)[:-keep_last]:
                if path != final:  # a lower step saved after a higher one is still the one just written
                    fs.remove(path)
        fs.remove_leftovers(root)
    return final


def _complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and (p / MANIFEST).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def find_latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The highest-step complete checkpoint under `root` (one with a manifest), or None."""
    complete = _complete_checkpoints(Path(root))
    return complete[-1][1] if complete else None


# ---------------------------------------------------------------------------------------------- verify


def _parse_manifest(path: Path) -> tuple[str, int, int, dict]:
    """(kind, step, world_size, files) of manifest `path`."""
    try:
        m = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(f"{path} is unreadable: {' '.join(str(e).split())}") from None
    fmt = m.get("format") if isinstance(m, dict) else None
    if fmt == "fp8train-sharded-checkpoint":
        raise CorruptCheckpointError(f"{path}: a sharded checkpoint of an earlier fp8train, which recorded no "
                                     "checksums; it cannot be verified (resume from a newer checkpoint)")
    if fmt != FORMAT:
        raise CorruptCheckpointError(f"{path} is not an {FORMAT} manifest (format {fmt!r})")
    if m.get("version") not in (1, VERSION):
        raise CorruptCheckpointError(f"{path} has version {m.get('version')!r}; this fp8train reads 1 and {VERSION}")
    kind = m.get("kind", "single") if m["version"] == 1 else m.get("kind")
    step, world_size, files = m.get("step"), m.get("world_size", 1), m.get("files")
    if kind not in _REQUIRED:
        raise CorruptCheckpointError(f"{path} has kind {kind!r}; expected single or sharded")
    for key, value, low in (("step", step, 0), ("world_size", world_size, 1)):
        if type(value) is not int or value < low:
            raise CorruptCheckpointError(f"{path} has {key} {value!r}; expected an integer >= {low}")
    if not isinstance(files, dict):
        raise CorruptCheckpointError(f"{path} has no `files` mapping")
    for rel, entry in files.items():
        parts = PurePosixPath(rel).parts
        if (not rel or rel.startswith("/") or "\\" in rel or rel == MANIFEST or PurePosixPath(*parts).as_posix() != rel
                or any(p in (".", "..") for p in parts)):
            raise CorruptCheckpointError(f"{path} lists a path that is not a plain relative file name: {rel!r}")
        if not (isinstance(entry, dict) and type(entry.get("size")) is int and entry["size"] >= 0
                and isinstance(entry.get("sha256"), str) and _SHA256.match(entry["sha256"])):
            raise CorruptCheckpointError(f"{path} has a malformed entry for {rel!r}")
    for rel in _REQUIRED[kind]:
        if rel not in files:
            raise CorruptCheckpointError(f"{path} does not list {rel}")
    if kind == "single" and not set(_WEIGHTS) & set(files):
        raise CorruptCheckpointError(f"{path} lists no model weights (model/model.safetensors[.index.json])")
    return kind, step, world_size, files


def _verify_here(path: Path, digest: bool) -> Checkpoint:
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    manifest = path / MANIFEST
    if not manifest.exists() and not manifest.is_symlink():
        raise CorruptCheckpointError(f"{manifest} is missing: the checkpoint is incomplete (a save did not finish)")
    try:
        on_disk = fs.files_on_disk(path)
    except ValueError as e:
        raise CorruptCheckpointError(f"{e}; a checkpoint holds regular files only") from None
    if on_disk.get(MANIFEST, 0) > _MAX_MANIFEST:
        raise CorruptCheckpointError(f"{manifest} is larger than any manifest fp8train writes")
    kind, step, world_size, files = _parse_manifest(manifest)
    for rel, entry in files.items():
        if rel not in on_disk:
            raise CorruptCheckpointError(f"{path / rel} is missing (listed in {MANIFEST})")
        if on_disk[rel] != entry["size"]:
            raise CorruptCheckpointError(f"{path / rel} has {on_disk[rel]} bytes, {MANIFEST} says {entry['size']} "
                                         "(truncated or torn write)")
    unlisted = sorted(set(on_disk) - set(files) - {MANIFEST})
    if unlisted:
        raise CorruptCheckpointError(f"{path / unlisted[0]} is not listed in {MANIFEST} (added after the save)")
    if digest:
        actual = fs.digest_files(path, list(files))
        for rel, entry in files.items():
            if actual[rel] != entry["sha256"]:
                raise CorruptCheckpointError(f"{path / rel} has sha256 {actual[rel]}, {MANIFEST} says "
                                             f"{entry['sha256']} (corrupted or modified)")
    return Checkpoint(path, kind, step, world_size, files)


def verify_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Check every file of `path` against its manifest (size and sha256; nothing unlisted, no links) and
    return the `Checkpoint`; raise `CorruptCheckpointError` otherwise. In a process group every rank
    calls it: rank 0 hashes the files, the others check the manifest and sizes, and a failure on any
    rank raises on every rank."""
    out = []
    all_ranks_ok(lambda: out.append(_verify_here(Path(path), digest=get_rank() == 0)), f"verifying checkpoint {path}")
    return out[0]


def hf_model_dir(path: str | os.PathLike) -> Path:
    """The Hugging Face model directory to read for `path` (export, eval): the `model/` of a training
    checkpoint (a directory with manifest.json, or with model/ and no config.json), verified first;
    otherwise `path` itself."""
    path = Path(path)
    if not ((path / MANIFEST).exists() or ((path / "model").is_dir() and not (path / "config.json").exists())):
        return path
    if verify_checkpoint(path).kind != "single":
        raise ValueError(f"{path} is a sharded (FSDP2) checkpoint, which holds no Hugging Face model directory; "
                         "use the run's final/ export (resume the run to its end to write it)")
    return path / "model"


# ------------------------------------------------------------------------------------------------ load


def _torch_load(path: Path, map_location):
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001 - weights_only refuses what it cannot load safely; say so on one line
        raise CorruptCheckpointError(f"{path} does not load with torch.load(weights_only=True) "
                                     f"({type(e).__name__}); refusing it") from None


def _read(ckpt: Checkpoint, model: nn.Module, optimizer, sharded_model: bool, map_location) -> dict:
    """Everything of `ckpt` this rank needs, read and checked, before any of it touches the model."""
    from . import _sharded

    state = _torch_load(ckpt.path / "train_state.pt", map_location)
    if not (isinstance(state, dict) and state.get("step") == ckpt.step and isinstance(state.get("train_state"), dict)
            and isinstance(state.get("rng"), dict)):
        raise CorruptCheckpointError(f"{ckpt.path / 'train_state.pt'} does not hold the training state of step {ckpt.step}")
    if ckpt.kind == "sharded":
        dcp_files = {rel[4:]: e["size"] for rel, e in ckpt.files.items() if rel.startswith("dcp/")}
        state["dcp_metadata"] = _sharded.read_metadata(ckpt.path / "dcp", dcp_files)
        return state
    model_dir = ckpt.path / "model"
    if is_lora(model):  # read with the adapter by load_lora_model
        pass
    elif (model_dir / ADAPTER_DIR).is_dir():
        raise ValueError(f"{model_dir} holds LoRA adapters ({ADAPTER_DIR}/): load it with the config key "
                         "'model.lora.rank' set as in the run that wrote it")
    else:
        state["model"] = read_model_weights(model, model_dir)
    if optimizer is not None:
        state["optimizer"] = _torch_load(ckpt.path / "optimizer.pt", map_location)
        if sharded_model:
            state["optimizer"] = _sharded.named_optimizer_state(model, optimizer, state["optimizer"],
                                                                ckpt.path / "optimizer.pt")
    return state


def load_checkpoint(checkpoint: str | os.PathLike | Checkpoint, *, model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None, scheduler=None,
                    map_location: str | torch.device = "cpu") -> dict:
    """Restore model, optimizer, scheduler and RNG states from a checkpoint of either kind into a plain
    or an FSDP2-sharded model (after `apply_fsdp` and building the optimizer; every rank calls it), and
    return the saved train_state. A path is verified first; a `Checkpoint` was verified already.

    RNG states are restored into a plain model only: the ranks of a sharded one keep their own (the
    data order lives in train_state, which is restored)."""
    from . import _sharded

    ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else verify_checkpoint(checkpoint)
    sharded_model = is_sharded_model(model)
    state: dict = {}
    all_ranks_ok(lambda: state.update(_read(ckpt, model, optimizer, sharded_model, map_location)),
                 f"reading checkpoint {ckpt.path}")
    if ckpt.kind == "sharded":
        _sharded.read_dcp(ckpt.path / "dcp", state["dcp_metadata"], model, optimizer,
                          state.get("optimizer_param_groups"))
    elif sharded_model:
        _sharded.load_full_state(model, optimizer, state["model"], state.get("optimizer"))
    else:
        if is_lora(model):  # (LoRA runs are single-process: apply_lora refuses FSDP)
            load_lora_model(model, ckpt.path / "model")
        else:
            model.load_state_dict(state["model"])
        if optimizer is not None:
            optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None:
        if state["scheduler"] is None:
            raise CorruptCheckpointError(f"{ckpt.path / 'train_state.pt'} holds no scheduler state")
        scheduler.load_state_dict(state["scheduler"])
    if not sharded_model:
        restore_rng_state(state["rng"])
    return state["train_state"]
