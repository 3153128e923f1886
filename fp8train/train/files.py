"""File-system helpers of checkpoints and exports: atomic directories (build beside the target, fsync,
rename into place), file digests, and the listing a checkpoint is verified against.

A directory is written into a temp sibling (`.tmp_<name>...`), every file and directory fsynced, and
renamed onto the target; an existing target is first renamed to `.trash_<name>...` and then deleted,
so at no moment does a half-written or half-deleted directory sit at the target path. New directories
and files get the permissions the process umask gives (`tempfile.mkdtemp` would make them 0700).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

__all__ = ["TMP_PREFIX", "TRASH_PREFIX", "commit", "digest_files", "files_on_disk", "fsync_dir", "new_temp_dir",
           "remove", "remove_leftovers", "sync_tree", "write_json"]

TMP_PREFIX = ".tmp_"      # being written; never read, removed by the next successful save
TRASH_PREFIX = ".trash_"  # being deleted; renamed first so a half-deleted directory never looks complete
_CHUNK = 8 << 20


def fsync_dir(path: Path) -> None:
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


def digest_files(root: Path, rels: list[str]) -> dict[str, str]:
    """{relpath: sha256 hex} of the files `rels` under `root`, hashed in parallel."""
    return dict(zip(rels, _parallel(lambda rel: _digest(root / rel)["sha256"], rels)))


def sync_tree(root: Path, digest: bool = False) -> dict[str, dict]:
    """fsync every file and directory under `root`; with `digest`, return {posix relpath: size, sha256}.

    Files and directories also get the modes the umask gives new ones (`root`'s mode, made by mkdir,
    without the x bits for files): safetensors writes its files 0600 whatever the umask says."""
    mode = root.stat().st_mode & 0o777
    for p in root.rglob("*"):
        os.chmod(p, mode if p.is_dir() else mode & 0o666)
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
        fsync_dir(d)
    return entries


def files_on_disk(root: Path) -> dict[str, int]:
    """{posix relpath: size} of every file under `root`; raises `ValueError` naming a link or special file."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            mode = os.lstat(p).st_mode
            if stat.S_ISLNK(mode):
                raise ValueError(f"{p} is a symbolic link")
            if name in filenames:
                if not stat.S_ISREG(mode):
                    raise ValueError(f"{p} is not a regular file")
                found[p.relative_to(root).as_posix()] = os.lstat(p).st_size
    return found


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` to a hidden sibling and rename it over `path`: a reader sees the old file or the new one."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_json(path: Path, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def remove(path: Path) -> None:
    """Delete directory `path`, renaming it out of the way first."""
    trash = path.with_name(f"{TRASH_PREFIX}{path.name}.{uuid.uuid4().hex[:12]}")
    os.replace(path, trash)
    fsync_dir(path.parent)
    shutil.rmtree(trash, ignore_errors=True)


def new_temp_dir(final: Path) -> Path:
    """A new empty directory beside `final` to build it in (the process umask's permissions)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f"{TMP_PREFIX}{final.name}.{uuid.uuid4().hex[:12]}")
    tmp.mkdir()
    return tmp


def commit(tmp: Path, final: Path, *, sync: bool = True) -> None:
    """Rename the finished `tmp` to `final` (fsyncing `tmp` first unless the caller did), replacing
    whatever is at `final` (a re-save of one step, an overwritten export)."""
    if sync:
        sync_tree(tmp)
    if final.is_dir() and not final.is_symlink():
        remove(final)
    elif final.exists() or final.is_symlink():
        final.unlink()
    os.replace(tmp, final)
    fsync_dir(final.parent)


def remove_leftovers(root: Path) -> None:
    """Delete the temp and trash directories that a crash left under `root`."""
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith((TMP_PREFIX, TRASH_PREFIX)):
            shutil.rmtree(p, ignore_errors=True)
