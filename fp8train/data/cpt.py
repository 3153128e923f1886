"""Continual-pretraining data: documents -> memory-mapped token cache -> fixed-length packed rows.

A document is a text file, a JSONL line, or a row of a parquet or Arrow table (`sources.py`). The cache
holds every document's tokens followed by EOS, concatenated, as a flat uint32 memmap (`tokens.bin`) plus
the document offsets (`offsets.npy`). It is keyed by the inputs (path, size, mtime), the tokenizer and the
reading options, and written atomically, so any number of runs share it. Reading streams: a large text
file is read and tokenized in pieces cut at blank lines, tables row batch by row batch.
"""

from __future__ import annotations

import codecs
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

from .sources import HfDatasetConfig, Source, iter_records, list_sources, source_size, source_stats

__all__ = ["CptDataConfig", "PackedDataset", "build_cpt_datasets"]

logger = logging.getLogger(__name__)

_CACHE_VERSION = 2  # 2: text files tokenized in pieces; tables and datasets sources; files that are not text
_BATCH_DOCS = 512
_BATCH_CHARS = 4 << 20
_READ_BYTES = 1 << 20  # a text file is read this much at a time ...
_PIECE_CHARS = 4 << 20  # ... and tokenized in pieces of about this many characters, cut at a blank line
_SNIFF_BYTES = 1 << 16  # whether a file is text is decided on its first 64 KiB (as `file` and git do)
_MAX_INVALID = 0.01  # a text file may hold at most this fraction of bytes that are not UTF-8 (become U+FFFD)


class PackedDataset(Dataset):
    """Rows of `seq_len` tokens, each a run of segments cut from one flat token stream.

    Row `i` is the concatenation of segments `row_ptr[i]:row_ptr[i + 1]`, right-padded with `pad_id`
    (labels -100). `position_ids` restart at 0 at every segment when `document_masking` is set; otherwise
    they run 0..S-1. Items are dicts of 1-D int64 tensors: `input_ids`, `labels`, `position_ids`.

    Restarting position_ids alone does not keep attention within a segment: transformers derives the
    per-segment mask from them only when the model runs without a KV cache, and `config.use_cache` defaults
    to True, so a model loaded as usual lets every token attend to the earlier segments of its row.
    fp8train's trainer turns the cache off and passes the mask (`fp8train.train.attention.document_mask`);
    other callers must call the model with `use_cache=False` or pass that mask.
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
    """Text, JSONL, parquet or Arrow files, `datasets` folders (save_to_disk), or folders searched recursively
    for files matching `include`. Relative paths in a config file are relative to that file."""
    include: list[str] = field(
        default_factory=lambda: ["*.txt", "*.md", "*.rst", "*.py", "*.jsonl", "*.parquet", "*.arrow"]
    )
    """File-name glob patterns selecting files inside folders (files named in `paths` are always read)."""
    hf_dataset: HfDatasetConfig | None = None
    """A dataset read with `datasets.load_dataset` (section: name, config, split, column, cache_dir), after `paths`."""
    text_field: str = "text"
    """The text field of JSONL records and the text column of parquet and Arrow tables."""
    seq_len: int = 2048
    """Tokens per packed row."""
    document_masking: bool = True
    """Restart position_ids after each EOS so that no token attends across documents."""
    val_fraction: float = 0.0
    """Fraction of documents held out for validation (chosen by the seed); 0 disables validation. Too few
    documents for it (one large file) are split into chunks of seq_len tokens, and the log says so."""
    cache_dir: str = ".cache/tokens"
    """Folder of the token caches, shared by runs that read the same files with the same tokenizer."""
    max_tokens: int | None = None
    """Stop tokenizing after this many tokens (files in `paths` order, folders sorted); None reads all."""

    def __post_init__(self):
        if isinstance(self.paths, str):
            self.paths = [self.paths]
        if not self.paths and self.hf_dataset is None:
            raise ValueError("data.paths is empty: give at least one file or folder (or a data.hf_dataset)")
        if self.seq_len < 2:
            raise ValueError(f"data.seq_len must be >= 2, got {self.seq_len}")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(f"data.val_fraction must be in [0, 1), got {self.val_fraction}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"data.max_tokens must be positive, got {self.max_tokens}")


def _sources(cfg: CptDataConfig) -> list[Source]:
    return list_sources(cfg.paths, cfg.include, other="text", hf=cfg.hf_dataset)


class _NotText(ValueError):
    """A file that is not UTF-8 text."""


def _not_text(head: bytes) -> str | None:
    """Why the first bytes of a file say it is not text, or None."""
    if b"\x00" in head:
        return f"NUL bytes in its first {len(head)} bytes"
    text = head.decode("utf-8", errors="replace")
    invalid = text.count("\ufffd") - head.count("\ufffd".encode()) - 3  # a character cut at the end is fine
    if invalid > _MAX_INVALID * len(head):
        return f"{invalid} of its first {len(head)} bytes are not UTF-8"
    return None


def _read_text(path: Path) -> Iterator[tuple[str, int, bool]]:
    """(text, bytes read, last piece) of a text file, in pieces of about _PIECE_CHARS characters cut after
    a blank line (else a newline, else anywhere), so that a large file never sits in memory whole."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # rare bad bytes become U+FFFD
    with path.open("rb") as f:
        head = f.read(_SNIFF_BYTES)
        reason = _not_text(head)
        if reason:
            raise _NotText(f"{path} is not text ({reason})")
        pending, nbytes, block = decoder.decode(head), len(head), head
        while block:
            block = f.read(_READ_BYTES)
            pending += decoder.decode(block, final=not block)
            nbytes += len(block)
            while len(pending) >= _PIECE_CHARS:
                cut = pending.rfind("\n\n", 0, _PIECE_CHARS)
                cut = cut + 2 if cut > 0 else pending.rfind("\n", 0, _PIECE_CHARS) + 1 or _PIECE_CHARS
                yield pending[:cut], nbytes, False
                pending, nbytes = pending[cut:], 0
    yield pending, nbytes, True


def _text_column(text_field: str):
    def pick(names: list[str], where: str) -> list[str]:
        if text_field not in names:
            raise ValueError(f"{where}: no column {text_field!r} (data.text_field); columns: {names}")
        return [text_field]

    return pick


def _iter_documents(sources: list[Source], text_field: str, skipped: list[str]) -> Iterator[tuple[str, int, bool]]:
    """(text, bytes read, ends a document) per piece: a text file in one or more pieces, a JSONL line, a table
    row. A file that is not text is an error when data.paths names it, else skipped and added to `skipped`."""
    for src in sources:
        if src.kind == "text":
            try:
                yield from _read_text(src.path)
            except _NotText as e:
                if src.named:
                    raise ValueError(f"data.paths: {e}; CPT reads UTF-8 text, JSONL, parquet and Arrow files") from None
                skipped.append(str(src.path))
            continue
        column = (src.hf.column if src.hf is not None else None) or text_field
        key = "data.hf_dataset.column" if src.hf is not None and src.hf.column else "data.text_field"
        for where, record, nbytes in iter_records(src, _text_column(column)):
            text = "" if record is None else record.get(column)
            if text is None and src.kind != "jsonl":
                text = ""  # a null cell of a table
            if not isinstance(text, str):
                raise ValueError(f"{where}: no string field {column!r} ({key})")
            yield text, nbytes, True


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


def _cache_key(cfg: CptDataConfig, sources: list[Source], tokenizer: PreTrainedTokenizerBase) -> str:
    payload = {
        "version": _CACHE_VERSION,
        "sources": [[src.kind, src.named, source_stats(src)] for src in sources],
        "tokenizer": _tokenizer_fingerprint(tokenizer),
        "text_field": cfg.text_field,
        "max_tokens": cfg.max_tokens,
    }
    return hashlib.sha256(json.dumps(payload).encode()).hexdigest()[:24]


def _tokenize_to(
    tmp: Path, sources: list[Source], cfg: CptDataConfig, tokenizer: PreTrainedTokenizerBase
) -> None:
    """Writes tokens.bin, offsets.npy and meta.json of the cache into the folder `tmp`."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no EOS token, which separates packed documents")
    budget = cfg.max_tokens if cfg.max_tokens is not None else float("inf")
    lengths: list[int] = []  # tokens per finished document
    total = open_len = 0  # tokens written; tokens of the document still open (a text file read in pieces)
    skipped: list[str] = []
    size = sum(source_size(s) for s in sources)
    with tqdm(total=size, unit="B", unit_scale=True, desc="tokenizing") as bar, (tmp / "tokens.bin").open("wb") as out:

        def flush(batch: list[tuple[str, bool]]) -> None:
            nonlocal total, open_len
            for (_, ends), ids in zip(batch, _encode_batch(tokenizer, [text for text, _ in batch])):
                piece = np.asarray(ids + [eos] if ends else ids, dtype=np.uint32)
                if len(piece) >= budget - total:  # max_tokens ends here: the cut document still ends with EOS
                    piece = piece[: int(budget - total)]
                    piece[-1], ends = eos, True
                out.write(piece.tobytes())
                total += len(piece)
                open_len += len(piece)
                if ends:
                    lengths.append(open_len)
                    open_len = 0
                if total >= budget:
                    return

        batch: list[tuple[str, bool]] = []
        chars = 0
        has_text = False  # the document being read has text so far (whitespace-only documents are dropped)
        for text, nbytes, ends in _iter_documents(sources, cfg.text_field, skipped):
            bar.update(nbytes)
            if not text.strip() and not has_text:
                continue
            has_text = not ends
            batch.append((text, ends))
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
    if skipped:
        _warn_skipped(skipped)
    if not lengths:
        raise ValueError(f"data.paths: no non-empty document in {len(sources)} source(s)"
                         + (f" ({len(skipped)} skipped as not text)" if skipped else ""))
    with (tmp / "offsets.npy").open("wb") as f:
        np.save(f, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
        f.flush()
        os.fsync(f.fileno())
    meta = {"sources": [str(s) for s in sources], "documents": len(lengths), "tokens": total, "skipped": skipped}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))


def _warn_skipped(skipped: list[str]) -> None:
    names = ", ".join(skipped[:5]) + (f" and {len(skipped) - 5} more" if len(skipped) > 5 else "")
    logger.warning("skipped %d file%s that %s not text (NUL bytes or not UTF-8), found in data.paths folders: %s",
                   len(skipped), "" if len(skipped) == 1 else "s", "is" if len(skipped) == 1 else "are", names)


def _load_or_build_cache(
    cfg: CptDataConfig, tokenizer: PreTrainedTokenizerBase
) -> tuple[np.memmap, np.ndarray]:
    sources = _sources(cfg)
    final = Path(cfg.cache_dir).expanduser() / f"cpt-{_cache_key(cfg, sources, tokenizer)}"
    if not final.is_dir():
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            _tokenize_to(tmp, sources, cfg, tokenizer)
            os.replace(tmp, final)
            logger.info("token cache written: %s", final)
        except OSError:
            if not final.is_dir():  # not a concurrent writer that finished first
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    else:
        logger.info("token cache reused: %s", final)
        skipped = json.loads((final / "meta.json").read_text()).get("skipped") if (final / "meta.json").is_file() else None
        if skipped:
            _warn_skipped(skipped)
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


def _split(offsets: np.ndarray, val_fraction: float, seed: int) -> tuple[np.ndarray, int]:
    """(document order, number of validation documents) for these document boundaries."""
    num_docs = len(offsets) - 1
    order = np.random.default_rng(seed).permutation(num_docs)
    num_val = max(1, round(val_fraction * num_docs)) if val_fraction > 0 else 0
    return order, num_val


def _chunked(offsets: np.ndarray, size: int) -> np.ndarray:
    """Document boundaries with every document also cut every `size` tokens."""
    starts = [np.arange(a, b, size) for a, b in zip(offsets[:-1], offsets[1:])]
    return np.concatenate([*starts, offsets[-1:]]).astype(np.int64)


def build_cpt_datasets(
    cfg: CptDataConfig, tokenizer: PreTrainedTokenizerBase, seed: int
) -> tuple[PackedDataset, PackedDataset | None]:
    """Tokenize (or reuse the cache), split documents into train/val and pack each into rows.

    The seed picks the validation documents and the order in which training documents are
    concatenated; the same cache, config and seed always give the same rows. When the documents are too
    few for `val_fraction` (one large file: no training document would be left, or a split would get less
    than a row), they are cut into chunks of `seq_len` tokens that the split holds out instead, as a
    validation split of one corpus usually is; the log says so.
    """
    tokens, offsets = _load_or_build_cache(cfg, tokenizer)
    num_docs = len(offsets) - 1
    bounds = offsets
    order, num_val = _split(bounds, cfg.val_fraction, seed)
    if num_val and (num_val >= num_docs or _too_small(bounds, order, num_val, cfg.seq_len)):
        bounds = _chunked(offsets, cfg.seq_len)
        order, num_val = _split(bounds, cfg.val_fraction, seed)
        logger.info("CPT data: %d document%s too few for data.val_fraction=%s: split into %d chunks of %d tokens "
                    "(data.seq_len), %d of them held out for validation", num_docs,
                    " is" if num_docs == 1 else "s are", cfg.val_fraction, len(bounds) - 1, cfg.seq_len, num_val)
        if num_val >= len(bounds) - 1:
            raise ValueError(f"data.val_fraction={cfg.val_fraction} leaves no training data: the corpus has "
                             f"{int(offsets[-1])} tokens, {len(bounds) - 1} chunks of data.seq_len={cfg.seq_len}")
    pack = dict(seq_len=cfg.seq_len, pad_id=tokenizer.eos_token_id, document_masking=cfg.document_masking)
    train = _pack_documents(tokens, bounds, order[num_val:], split="train", **pack)
    val = _pack_documents(tokens, bounds, np.sort(order[:num_val]), split="val", **pack) if num_val else None
    logger.info(
        "CPT data: %d documents, %d tokens; train %d rows, val %s rows of %d",
        num_docs, int(offsets[-1]), len(train), len(val) if val else 0, cfg.seq_len,
    )
    return train, val


def _too_small(bounds: np.ndarray, order: np.ndarray, num_val: int, seq_len: int) -> bool:
    """Whether the validation or the training documents hold less than one row."""
    lengths = np.diff(bounds)[order]
    return bool(lengths[:num_val].sum() < seq_len or lengths[num_val:].sum() < seq_len)
