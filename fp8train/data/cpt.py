"""Continual-pretraining data: documents -> memory-mapped token cache -> fixed-length packed rows.

The cache holds every document's tokens followed by EOS, concatenated, as a flat uint32 memmap
(`tokens.bin`) plus the document offsets (`offsets.npy`). It is keyed by the input files (path, size,
mtime), the tokenizer and the reading options, and written atomically, so any number of runs share it.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import os
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset
from tqdm import tqdm
from transformers import PreTrainedTokenizerBase

__all__ = ["CptDataConfig", "PackedDataset", "build_cpt_datasets"]

logger = logging.getLogger(__name__)

_CACHE_VERSION = 1
_BATCH_DOCS = 512
_BATCH_CHARS = 4 << 20


class PackedDataset(Dataset):
    """Rows of `seq_len` tokens, each a run of segments cut from one flat token stream.

    Row `i` is the concatenation of segments `row_ptr[i]:row_ptr[i + 1]`, right-padded with `pad_id`
    (labels -100). `position_ids` restart at 0 at every segment when `document_masking` is set, so a
    causal LM called without an attention mask attends only within a segment; otherwise they run
    0..S-1. Items are dicts of 1-D int64 tensors: `input_ids`, `labels`, `position_ids`.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        seg_starts: np.ndarray,
        seg_lengths: np.ndarray,
        row_ptr: np.ndarray,
        seq_len: int,
        pad_id: int,
        labels: np.ndarray | None = None,
        document_masking: bool = True,
    ):
        if labels is not None and labels.shape != tokens.shape:
            raise ValueError(f"labels shape {labels.shape} != tokens shape {tokens.shape}")
        if row_ptr[0] != 0 or row_ptr[-1] != len(seg_lengths) or (np.diff(row_ptr) <= 0).any():
            raise ValueError("row_ptr must rise strictly from 0 to the number of segments")
        if len(row_ptr) > 1 and np.add.reduceat(seg_lengths, row_ptr[:-1]).max() > seq_len:
            raise ValueError(f"a row holds more than seq_len={seq_len} tokens")
        self.tokens = tokens
        self.labels = labels
        self.seg_starts = np.asarray(seg_starts, dtype=np.int64)
        self.seg_lengths = np.asarray(seg_lengths, dtype=np.int64)
        self.row_ptr = np.asarray(row_ptr, dtype=np.int64)
        self.seq_len = seq_len
        self.pad_id = pad_id
        self.document_masking = document_masking
        self.num_tokens = int(self.seg_lengths.sum())
        """Tokens in all rows, padding excluded."""

    def __len__(self) -> int:
        return len(self.row_ptr) - 1

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"row {index} out of range for {len(self)} rows")
        index %= len(self)
        lo, hi = self.row_ptr[index], self.row_ptr[index + 1]
        starts, lengths = self.seg_starts[lo:hi], self.seg_lengths[lo:hi]
        ids = np.concatenate([self.tokens[s : s + n] for s, n in zip(starts, lengths)]).astype(np.int64)
        if self.labels is None:
            labels = ids.copy()
        else:
            labels = np.concatenate([self.labels[s : s + n] for s, n in zip(starts, lengths)])
            labels = labels.astype(np.int64)
        n = len(ids)
        if self.document_masking:
            seg_first = np.cumsum(lengths) - lengths
            positions = np.arange(n) - np.repeat(seg_first, lengths)
        else:
            positions = np.arange(n)
        pad = self.seq_len - n
        if pad:  # padding is a segment of its own (labels -100), so no real token attends to it
            ids = np.concatenate([ids, np.full(pad, self.pad_id, dtype=np.int64)])
            labels = np.concatenate([labels, np.full(pad, -100, dtype=np.int64)])
            positions = np.concatenate([positions, np.arange(pad)])
        return {
            "input_ids": torch.from_numpy(ids),
            "labels": torch.from_numpy(labels),
            "position_ids": torch.from_numpy(positions.astype(np.int64)),
        }

    def __getstate__(self):
        # Worker processes reopen the memmap instead of receiving a pickled copy of the whole corpus.
        state = self.__dict__.copy()
        if isinstance(self.tokens, np.memmap):
            state["tokens"] = (self.tokens.filename, self.tokens.dtype.str, self.tokens.shape)
        return state

    def __setstate__(self, state):
        if isinstance(state["tokens"], tuple):
            filename, dtype, shape = state["tokens"]
            state["tokens"] = np.memmap(filename, dtype=np.dtype(dtype), mode="r", shape=shape)
        self.__dict__.update(state)


@dataclass
class CptDataConfig:
    """Continual-pretraining data."""

    paths: list[str] = field(default_factory=list)
    """Text, JSONL or parquet files, or folders searched recursively for files matching `include`."""
    include: list[str] = field(
        default_factory=lambda: ["*.txt", "*.md", "*.rst", "*.py", "*.jsonl", "*.parquet"]
    )
    """File-name glob patterns selecting files inside folders (files named in `paths` are always read)."""
    text_field: str = "text"
    """The text field of JSONL records and the text column of parquet files."""
    seq_len: int = 2048
    """Tokens per packed row."""
    document_masking: bool = True
    """Restart position_ids after each EOS so that no token attends across documents."""
    val_fraction: float = 0.0
    """Fraction of documents held out for validation (chosen by the seed); 0 disables validation."""
    cache_dir: str = ".cache/tokens"
    """Folder of the token caches, shared by runs that read the same files with the same tokenizer."""
    max_tokens: int | None = None
    """Stop tokenizing after this many tokens (files in `paths` order, folders sorted); None reads all."""

    def __post_init__(self):
        if isinstance(self.paths, str):
            self.paths = [self.paths]
        if not self.paths:
            raise ValueError("data.paths is empty: give at least one file or folder")
        if self.seq_len < 2:
            raise ValueError(f"data.seq_len must be >= 2, got {self.seq_len}")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(f"data.val_fraction must be in [0, 1), got {self.val_fraction}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"data.max_tokens must be positive, got {self.max_tokens}")


def _list_files(cfg: CptDataConfig) -> list[Path]:
    files: list[Path] = []
    for entry in cfg.paths:
        path = Path(entry).expanduser()
        if path.is_file():
            files.append(path.resolve())
        elif path.is_dir():
            found = sorted(
                p.resolve()
                for p in path.rglob("*")
                if p.is_file() and any(fnmatch.fnmatch(p.name, pat) for pat in cfg.include)
            )
            if not found:
                raise ValueError(f"data.paths: folder {path} has no file matching {cfg.include}")
            files.extend(found)
        else:
            raise FileNotFoundError(f"data.paths: {entry}: no such file or directory")
    return list(dict.fromkeys(files))  # a file reached twice is read once


def _read_jsonl(path: Path, text_field: str) -> Iterator[tuple[str, int]]:
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                yield "", len(raw)
                continue
            try:
                record = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{path}:{lineno}: malformed JSON ({e})") from None
            text = record.get(text_field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise ValueError(
                    f"{path}:{lineno}: no string field {text_field!r} (data.text_field)"
                )
            yield text, len(raw)


def _read_parquet(path: Path, text_field: str) -> Iterator[tuple[str, int]]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    if text_field not in pf.schema_arrow.names:
        raise ValueError(
            f"{path}: no column {text_field!r} (data.text_field); columns: {pf.schema_arrow.names}"
        )
    size, rows = path.stat().st_size, max(pf.metadata.num_rows, 1)
    for batch in pf.iter_batches(columns=[text_field], batch_size=1024):
        for text in batch.column(0).to_pylist():
            yield text or "", size // rows


def _iter_documents(files: list[Path], text_field: str) -> Iterator[tuple[str, int]]:
    """Yields (text, bytes read) per document: a JSONL line, a parquet row, or a whole text file."""
    for path in files:
        if path.suffix == ".jsonl":
            yield from _read_jsonl(path, text_field)
        elif path.suffix == ".parquet":
            yield from _read_parquet(path, text_field)
        else:  # undecodable bytes become U+FFFD rather than failing a whole corpus
            data = path.read_bytes()
            yield data.decode("utf-8", errors="replace"), len(data)


def _encode_batch(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> list[list[int]]:
    # Special-token strings inside raw text stay text: only the packer places EOS.
    out = tokenizer(texts, add_special_tokens=False, split_special_tokens=True, verbose=False)
    return out["input_ids"]


def _tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise TypeError(f"{type(tokenizer).__name__}: the token cache needs a fast (Rust) tokenizer")
    digest = hashlib.sha256(backend.to_str().encode())
    digest.update(str(tokenizer.eos_token_id).encode())
    return digest.hexdigest()


def _cache_key(cfg: CptDataConfig, files: list[Path], tokenizer: PreTrainedTokenizerBase) -> str:
    stats = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    payload = {
        "version": _CACHE_VERSION,
        "files": stats,
        "tokenizer": _tokenizer_fingerprint(tokenizer),
        "text_field": cfg.text_field,
        "max_tokens": cfg.max_tokens,
    }
    return hashlib.sha256(json.dumps(payload).encode()).hexdigest()[:24]


def _tokenize_to(
    tmp: Path, files: list[Path], cfg: CptDataConfig, tokenizer: PreTrainedTokenizerBase
) -> None:
    """Writes tokens.bin, offsets.npy and meta.json of the cache into the folder `tmp`."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no EOS token, which separates packed documents")
    budget = cfg.max_tokens if cfg.max_tokens is not None else float("inf")
    lengths: list[int] = []
    total = 0
    bar = tqdm(total=sum(p.stat().st_size for p in files), unit="B", unit_scale=True, desc="tokenizing")
    with (tmp / "tokens.bin").open("wb") as out:

        def flush(texts: list[str]) -> None:
            nonlocal total
            for ids in _encode_batch(tokenizer, texts):
                doc = np.asarray([*ids, eos], dtype=np.uint32)[: int(min(len(ids) + 1, budget - total))]
                doc[-1] = eos  # a document cut by max_tokens still ends with EOS
                out.write(doc.tobytes())
                lengths.append(len(doc))
                total += len(doc)
                if total >= budget:
                    return

        batch: list[str] = []
        chars = 0
        for text, nbytes in _iter_documents(files, cfg.text_field):
            bar.update(nbytes)
            if not text.strip():
                continue
            batch.append(text)
            chars += len(text)
            if len(batch) >= _BATCH_DOCS or chars >= _BATCH_CHARS:
                flush(batch)
                batch, chars = [], 0
                if total >= budget:
                    break
        if batch and total < budget:
            flush(batch)
        out.flush()
        os.fsync(out.fileno())  # the cache is renamed into place only once its bytes are on disk
    bar.close()
    if not lengths:
        raise ValueError(f"data.paths: no non-empty document in {len(files)} file(s)")
    with (tmp / "offsets.npy").open("wb") as f:
        np.save(f, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
        f.flush()
        os.fsync(f.fileno())
    meta = {"files": [str(p) for p in files], "documents": len(lengths), "tokens": total}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))


def _load_or_build_cache(
    cfg: CptDataConfig, tokenizer: PreTrainedTokenizerBase
) -> tuple[np.memmap, np.ndarray]:
    files = _list_files(cfg)
    final = Path(cfg.cache_dir).expanduser() / f"cpt-{_cache_key(cfg, files, tokenizer)}"
    if not final.is_dir():
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            _tokenize_to(tmp, files, cfg, tokenizer)
            os.replace(tmp, final)
            logger.info("token cache written: %s", final)
        except OSError:
            if not final.is_dir():  # not a concurrent writer that finished first
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    else:
        logger.info("token cache reused: %s", final)
    offsets = np.load(final / "offsets.npy")
    tokens = np.memmap(final / "tokens.bin", dtype=np.uint32, mode="r")
    if len(tokens) != offsets[-1]:
        raise ValueError(
            f"{final}: token cache is corrupt ({len(tokens)} != {offsets[-1]} tokens); delete the folder"
        )
    return tokens, offsets


def _pack_documents(
    tokens: np.ndarray,
    offsets: np.ndarray,
    docs: np.ndarray,
    seq_len: int,
    pad_id: int,
    document_masking: bool,
    split: str,
) -> PackedDataset:
    """Concatenates `docs` (in that order) and cuts the stream into full rows; the remainder is dropped."""
    starts, lengths = offsets[docs], offsets[docs + 1] - offsets[docs]
    cum = np.concatenate([[0], np.cumsum(lengths)])
    num_rows = int(cum[-1]) // seq_len
    if num_rows == 0:
        raise ValueError(
            f"CPT {split} split has {int(cum[-1])} tokens, fewer than data.seq_len={seq_len}"
        )
    end = num_rows * seq_len
    # A segment is cut at every document start and every row start.
    bounds = np.union1d(np.arange(0, end + 1, seq_len), cum[cum <= end])
    seg_begin = bounds[:-1]
    doc = np.searchsorted(cum, seg_begin, side="right") - 1
    seg_starts = starts[doc] + (seg_begin - cum[doc])
    row_ptr = np.searchsorted(seg_begin, np.arange(num_rows + 1) * seq_len)
    row_ptr[-1] = len(seg_begin)
    seg_lengths = np.diff(bounds)
    return PackedDataset(tokens, seg_starts, seg_lengths, row_ptr, seq_len, pad_id,
                         document_masking=document_masking)


def build_cpt_datasets(
    cfg: CptDataConfig, tokenizer: PreTrainedTokenizerBase, seed: int
) -> tuple[PackedDataset, PackedDataset | None]:
    """Tokenize (or reuse the cache), split documents into train/val and pack each into rows.

    The seed picks the validation documents and the order in which training documents are
    concatenated; the same cache, config and seed always give the same rows.
    """
    tokens, offsets = _load_or_build_cache(cfg, tokenizer)
    num_docs = len(offsets) - 1
    order = np.random.default_rng(seed).permutation(num_docs)
    num_val = max(1, round(cfg.val_fraction * num_docs)) if cfg.val_fraction > 0 else 0
    if num_val >= num_docs:
        raise ValueError(
            f"data.val_fraction={cfg.val_fraction} leaves no training document out of {num_docs}"
        )
    pack = dict(seq_len=cfg.seq_len, pad_id=tokenizer.eos_token_id, document_masking=cfg.document_masking)
    train = _pack_documents(tokens, offsets, order[num_val:], split="train", **pack)
    val = _pack_documents(tokens, offsets, np.sort(order[:num_val]), split="val", **pack) if num_val else None
    logger.info(
        "CPT data: %d documents, %d tokens; train %d rows, val %s rows of %d",
        num_docs, int(offsets[-1]), len(train), len(val) if val else 0, cfg.seq_len,
    )
    return train, val
