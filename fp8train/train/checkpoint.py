"""Atomic, verified single-process checkpoints for exact resume, and the final Hugging Face export.

One checkpoint is a directory::

    root/step_00001000/
        model/           Hugging Face directory: config, safetensors weights as trained (FP32), tokenizer
        optimizer.pt     optimizer.state_dict()
        train_state.pt   scheduler state, the trainer's train_state, RNG states (torch, CUDA, random, numpy)
        manifest.json    size and sha256 of every file above; written last

Everything is written into a temp directory beside the final one, fsynced, and renamed into place, so
a crash at any point leaves the earlier checkpoints and at most an ignored temp directory; a checkpoint
without a manifest is never picked up, and a torn or tampered one is refused on load. One writer per
root. A sharded (FSDP2, torch.distributed.checkpoint) variant can sit beside this with the same layout.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import random
import re
import shutil
import tempfile
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file
from torch import nn

from .lora import ADAPTER_DIR, is_lora, load_lora_model, merged_model, save_lora_model

__all__ = [
    "CorruptCheckpointError",
    "capture_rng_state",
    "export_hf",
    "find_latest_checkpoint",
    "load_checkpoint",
    "restore_rng_state",
    "save_checkpoint",
    "verify_checkpoint",
]

MANIFEST = "manifest.json"
_FORMAT = "fp8train-checkpoint"
_VERSION = 1
_STEP_DIR = re.compile(r"^step_(\d{8,})$")
_TMP = ".tmp_"      # being written; never read, removed by the next successful save
_TRASH = ".trash_"  # being deleted; renamed first so a half-deleted checkpoint never looks complete
_REQUIRED = ("optimizer.pt", "train_state.pt", "model/config.json")
_CHUNK = 8 << 20


class CorruptCheckpointError(RuntimeError):
    """A checkpoint whose files do not match its manifest (torn write, truncation, tampering)."""


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


# --------------------------------------------------------------------------------------- file system


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _digest(path: Path, sync: bool = False) -> dict:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
        if sync:  # one pass reads the bytes back for the hash and flushes them to disk
            os.fsync(f.fileno())
    return {"size": path.stat().st_size, "sha256": digest.hexdigest()}


def _parallel(fn, items: list) -> list:
    with ThreadPoolExecutor(max_workers=min(8, max(1, len(items)))) as pool:  # hashlib releases the GIL
        return list(pool.map(fn, items))


def _sync_tree(root: Path, digest: bool = False) -> dict[str, dict]:
    """fsync every file and directory under `root`; with `digest`, return {posix relpath: size, sha256}."""
    files = sorted(p for p in root.rglob("*") if p.is_file())
    if digest:
        entries = dict(zip((p.relative_to(root).as_posix() for p in files),
                           _parallel(lambda p: _digest(p, sync=True), files)))
    else:
        entries = {}
        for p in files:
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    for d in sorted({p.parent for p in files} | {root}, key=lambda p: len(p.parts), reverse=True):
        _fsync_dir(d)
    return entries


def _write_json(path: Path, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def _remove(path: Path) -> None:
    trash = path.with_name(f"{_TRASH}{path.name}.{uuid.uuid4().hex[:12]}")
    os.replace(path, trash)
    _fsync_dir(path.parent)
    shutil.rmtree(trash, ignore_errors=True)


def _commit(tmp: Path, final: Path) -> None:
    """Rename the finished `tmp` to `final`, replacing an existing `final` (e.g. a re-save of one step)."""
    if final.exists():
        _remove(final)
    os.replace(tmp, final)
    _fsync_dir(final.parent)


def _remove_leftovers(root: Path) -> None:
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith((_TMP, _TRASH)):
            shutil.rmtree(p, ignore_errors=True)


# ------------------------------------------------------------------------------------ model + tokenizer


def _save_tokenizer(tokenizer, out_dir: Path) -> None:
    if hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(out_dir)
        return
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    if not isinstance(tokenizer, Tokenizer):
        raise TypeError(f"tokenizer must be a transformers tokenizer or a tokenizers.Tokenizer, "
                        f"got {type(tokenizer).__name__}")
    PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(out_dir)


def _save_model_dir(model: nn.Module, out_dir: Path, tokenizer, state_dict: dict | None = None) -> None:
    if is_lora(model):  # the adapter in out_dir/lora, the frozen base as a plain Hugging Face model in out_dir
        model, state_dict = save_lora_model(model, out_dir)
    if not hasattr(model, "save_pretrained"):
        raise TypeError(f"model must be a Hugging Face PreTrainedModel (unwrapped), got {type(model).__name__}")
    # transformers >= 5 always writes safetensors; save_pretrained drops tied aliases by storage pointer.
    model.save_pretrained(out_dir, state_dict=state_dict)
    if tokenizer is not None:
        _save_tokenizer(tokenizer, out_dir)


def _tied_names(model: nn.Module) -> dict[str, list[str]]:
    """For each state_dict key, the other keys that name the same tensor (tied embeddings)."""
    by_tensor: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        by_tensor.setdefault(id(tensor), []).append(name)
    return {name: [n for n in names if n != name] for names in by_tensor.values() for name in names}


def read_model_weights(model: nn.Module, model_dir: Path) -> dict[str, torch.Tensor]:
    """The safetensors weights of `model_dir` as a full state dict of `model`, tied aliases filled in;
    an error names every key that does not match the model."""
    index = model_dir / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() \
        else ["model.safetensors"]
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(model_dir / name))
    tied = _tied_names(model)
    unexpected = sorted(k for k in state if k not in tied)
    missing = sorted(k for k, aliases in tied.items() if k not in state and not any(a in state for a in aliases))
    if missing or unexpected:
        raise RuntimeError(f"weights in {model_dir} do not match the model: missing keys {missing}, "
                           f"unexpected keys {unexpected}")
    for key, aliases in tied.items():
        for alias in aliases:
            if key in state and alias in state and not torch.equal(state[key], state[alias]):
                raise RuntimeError(f"weights in {model_dir} hold different values for {key!r} and {alias!r}, "
                                   "which are tied in the model")
    for key, aliases in tied.items():
        if key not in state:
            state[key] = next(state[a] for a in aliases if a in state)
    return state


def _load_model_weights(model: nn.Module, model_dir: Path) -> None:
    if is_lora(model):
        return load_lora_model(model, model_dir)
    if (model_dir / ADAPTER_DIR).is_dir():
        raise ValueError(f"{model_dir} holds LoRA adapters ({ADAPTER_DIR}/): load it with the config key "
                         "'model.lora.rank' set as in the run that wrote it")
    model.load_state_dict(read_model_weights(model, model_dir))


# ------------------------------------------------------------------------------------------ checkpoints


def _check_plain(value, where: str) -> None:
    """train_state must load with weights_only=True: builtins, containers of them, and tensors."""
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
    raise TypeError(f"{where} is a {type(value).__module__}.{type(value).__name__}; train_state may hold only "
                    "None, bool, int, float, str, bytes, tensors, and dicts/lists/tuples of them")


def save_checkpoint(root: str | os.PathLike, step: int, *, model: nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler, train_state: dict, tokenizer=None, keep_last: int | None = None) -> Path:
    """Write `root/step_{step:08d}` atomically and return it; then keep only the newest `keep_last`.

    The model is saved in the dtype it trains in (FP32 master weights), so resume is bit-exact.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"keep_last must be None or an integer >= 1, got {keep_last!r}")
    if not isinstance(train_state, dict):
        raise TypeError(f"train_state must be a dict, got {type(train_state).__name__}")
    _check_plain(train_state, "train_state")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP}{final.name}.", dir=root))
    try:
        _save_model_dir(model, tmp / "model", tokenizer)
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save({"step": step, "scheduler": scheduler.state_dict(), "train_state": train_state,
                    "rng": capture_rng_state()}, tmp / "train_state.pt")
        files = _sync_tree(tmp, digest=True)
        _write_json(tmp / MANIFEST, {"format": _FORMAT, "version": _VERSION, "step": step, "files": files})
        _fsync_dir(tmp)
        _commit(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep_last is not None:
        complete = _complete_checkpoints(root)
        for _, path in complete[:-keep_last]:
            if path != final:  # a lower step saved after a higher one is still the one just written
                _remove(path)
    _remove_leftovers(root)
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


def verify_checkpoint(path: str | os.PathLike) -> dict:
    """Check every file against the manifest; return the manifest or raise `CorruptCheckpointError`."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CorruptCheckpointError(f"{manifest_path} is missing: the checkpoint is incomplete")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        files = manifest["files"]
        if manifest.get("format") != _FORMAT or not isinstance(files, dict):
            raise ValueError(f"not an {_FORMAT} manifest")
        for rel, entry in files.items():
            if not (isinstance(entry, dict) and isinstance(entry.get("size"), int)
                    and isinstance(entry.get("sha256"), str)):
                raise ValueError(f"bad entry for {rel!r}")
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptCheckpointError(f"{manifest_path} is unreadable: {e}") from None
    if manifest.get("version") != _VERSION:
        raise CorruptCheckpointError(f"{manifest_path} has version {manifest.get('version')!r}; "
                                     f"this fp8train reads version {_VERSION}")
    for rel in _REQUIRED:
        if rel not in files:
            raise CorruptCheckpointError(f"{manifest_path} does not list {rel}")
    if not {"model/model.safetensors", "model/model.safetensors.index.json"} & set(files):
        raise CorruptCheckpointError(f"{manifest_path} lists no model weights (model/model.safetensors[.index.json])")
    for rel, entry in files.items():
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise CorruptCheckpointError(f"{manifest_path} lists a path outside the checkpoint: {rel!r}")
        f = path / rel
        if not f.is_file():
            raise CorruptCheckpointError(f"{f} is missing (listed in {MANIFEST})")
        if f.stat().st_size != entry["size"]:
            raise CorruptCheckpointError(f"{f} has {f.stat().st_size} bytes, {MANIFEST} says {entry['size']} "
                                         "(truncated or torn write)")
    actual = dict(zip(files, _parallel(lambda rel: _digest(path / rel)["sha256"], list(files))))
    for rel, entry in files.items():
        if actual[rel] != entry["sha256"]:
            raise CorruptCheckpointError(f"{path / rel} has sha256 {actual[rel]}, {MANIFEST} says "
                                         f"{entry['sha256']} (corrupted or modified)")
    return manifest


def load_checkpoint(path: str | os.PathLike, *, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    scheduler=None, map_location: str | torch.device = "cpu") -> dict:
    """Verify, then restore model, optimizer, scheduler and RNG states; return the saved train_state."""
    path = Path(path)
    verify_checkpoint(path)
    _load_model_weights(model, path / "model")
    state = torch.load(path / "train_state.pt", map_location=map_location, weights_only=True)
    if optimizer is not None:
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location=map_location, weights_only=True))
    if scheduler is not None:
        scheduler.load_state_dict(state["scheduler"])
    restore_rng_state(state["rng"])
    return state["train_state"]


# ----------------------------------------------------------------------------------------------- export


def export_hf(model: nn.Module, out_dir: str | os.PathLike, tokenizer=None, dtype: torch.dtype = torch.bfloat16,
              *, overwrite: bool = False) -> Path:
    """Write `model` as a Hugging Face directory in `dtype` (safetensors, config, tokenizer), atomically.

    A model with its Linears swapped for FP8 subclasses exports exactly like the original: only the
    shared parameters are written. An existing non-empty `out_dir` is replaced only with `overwrite`.
    """
    out_dir = Path(out_dir)
    if is_lora(model):
        model = merged_model(model, dtype=dtype)  # adapters merged into the projections
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())) and not overwrite:
        raise FileExistsError(f"{out_dir} exists and is not empty; pass overwrite=True to replace it")
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP}{out_dir.name}.", dir=out_dir.parent))
    try:
        params = model.state_dict(keep_vars=True)
        cast: dict[int, torch.Tensor] = {}  # cast each tensor once so that tied aliases stay one storage
        for t in params.values():
            if id(t) not in cast:
                cast[id(t)] = t.detach().to(dtype) if t.is_floating_point() else t.detach()
        state = {name: cast[id(t)] for name, t in params.items()}
        _save_model_dir(model, tmp, tokenizer, state_dict=state)
        config = copy.deepcopy(model.config)
        config.dtype = dtype  # save_pretrained records the in-memory (FP32) dtype
        config.use_cache = True  # training turns the KV cache off; generation from the export wants it
        config.save_pretrained(tmp)
        _sync_tree(tmp)
        if out_dir.exists() and not out_dir.is_dir():
            out_dir.unlink()
        _commit(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
