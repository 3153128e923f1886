"""Where training data comes from: files and folders in `data.paths` (JSONL, parquet, Arrow, a `datasets`
folder written by `Dataset.save_to_disk`, and for CPT plain text), and `data.hf_dataset`.

CPT and SFT list and read their sources here, one record at a time (a JSONL line, a row of a parquet or
Arrow table), so that a large corpus streams: parquet is read by row batches and Arrow data, the format of
`datasets`, is memory-mapped. Arrow files, `datasets` folders and `data.hf_dataset` need the `datasets`
package (the `data` extra).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["HfDatasetConfig", "Source", "iter_records", "list_sources", "source_size", "source_stats"]

_TABLE_KINDS = ("parquet", "arrow", "saved", "hf")
_BATCH_ROWS = 1024
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass
class HfDatasetConfig:
    """A dataset loaded with `datasets.load_dataset` (the `data.hf_dataset` section)."""

    name: str
    """What `datasets.load_dataset` takes: a Hub dataset (read from the local cache when offline,
    HF_HUB_OFFLINE=1), or a local folder of data files."""
    config: str | None = None
    """The dataset's configuration (subset) name; null = its default."""
    split: str = "train"
    """The split to read."""
    column: str | None = None
    """CPT: the text column (null = data.text_field); SFT: the chat column (null = data.messages_field)."""
    cache_dir: str | None = None
    """datasets' cache folder; null = its default (HF_DATASETS_CACHE, ~/.cache/huggingface/datasets)."""

    def describe(self) -> str:
        return f"data.hf_dataset: {self.name!r}" + (f" ({self.config})" if self.config else "") + f"[{self.split}]"


@dataclass(frozen=True)
class Source:
    """One input: a file, a `datasets` folder, or the `data.hf_dataset`."""

    kind: str
    """`text`, `jsonl`, `parquet`, `arrow`, `saved` (a save_to_disk folder) or `hf`."""
    path: Path | None = None
    named: bool = True
    """Named in data.paths itself (not found inside a folder)."""
    hf: HfDatasetConfig | None = None

    def __str__(self) -> str:
        return self.hf.describe() if self.hf is not None else str(self.path)


def _kind(path: Path, other: str) -> str:
    return {".jsonl": "jsonl", ".parquet": "parquet", ".arrow": "arrow"}.get(path.suffix, other)


def _saved_dataset(path: Path) -> bool:
    """A folder written by `Dataset.save_to_disk`; a `DatasetDict` one must be narrowed to a split."""
    if (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if (p / "state.json").is_file())
        raise ValueError(f"data.paths: {path} is a `datasets` DatasetDict; name one split's folder, e.g. "
                         f"{path / (splits[0] if splits else 'train')} (splits: {splits})")
    return (path / "state.json").is_file() and (path / "dataset_info.json").is_file()


def list_sources(paths: list[str], include: list[str], *, other: str, hf: HfDatasetConfig | None = None
                 ) -> list[Source]:
    """The sources of `data.paths` in order (folders searched recursively and sorted, their files matched
    against the `include` globs; a file reached twice is read once), then `hf`. A file that is not .jsonl,
    .parquet or .arrow is of kind `other` (`text` for CPT); a path that does not exist is an error."""
    import fnmatch

    sources: list[Source] = []
    for entry in paths:
        path = Path(entry).expanduser()
        if path.is_dir() and _saved_dataset(path):
            sources.append(Source("saved", path.resolve()))
        elif path.is_dir():
            found: list[tuple[Path, str]] = []
            for root, dirs, files in os.walk(path):
                here = Path(root)
                for d in list(dirs):
                    if _saved_dataset(here / d):
                        found.append(((here / d).resolve(), "saved"))
                        dirs.remove(d)
                found += [((here / f).resolve(), _kind(here / f, other)) for f in files
                          if any(fnmatch.fnmatch(f, pat) for pat in include)]
            if not found:
                raise ValueError(f"config key 'data.paths': folder {path} has no file matching data.include {include}")
            sources += [Source(kind, p, named=False) for p, kind in sorted(found)]
        elif path.is_file():
            sources.append(Source(_kind(path, other), path.resolve()))
        else:
            raise FileNotFoundError(f"data.paths: {entry}: no such file or directory")
    seen: set[Path] = set()
    unique = [s for s in sources if not (s.path in seen or seen.add(s.path))]  # a file reached twice: read once
    return unique + ([Source("hf", hf=hf)] if hf is not None else [])


def _datasets():
    try:
        import datasets
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError("Arrow files, `datasets` folders and data.hf_dataset are read with the `datasets` "
                                  "package: pip install 'fp8train[data]'") from e
    return datasets


def _unreadable(src: Source, e: BaseException) -> ValueError:
    """One line naming the source (with its config key) and the error `e`."""
    what = f"{src.hf.describe()} could not be loaded" if src.hf else f"data.paths: {src.path}: not readable"
    return ValueError(f"{what} ({type(e).__name__}: {' '.join(str(e).split())[:300]})")


def _open_dataset(src: Source):
    """The memory-mapped `datasets.Dataset` of an Arrow file, a save_to_disk folder or data.hf_dataset."""
    datasets = _datasets()
    from datasets.exceptions import DatasetsError  # what a dataset that fails to build raises; no ValueError

    try:
        if src.kind == "arrow":
            return datasets.Dataset.from_file(str(src.path))
        if src.kind == "saved":
            return datasets.load_from_disk(str(src.path))
        h = src.hf
        return datasets.load_dataset(h.name, h.config, split=h.split, cache_dir=h.cache_dir)
    except DatasetsError as e:  # e.g. a malformed file of a local folder; its own message says only that it failed
        raise _unreadable(src, e.__cause__ or e) from None
    except (OSError, ValueError, ConnectionError) as e:
        raise _unreadable(src, e) from None


def _dataset_size(ds) -> int:
    return sum(os.path.getsize(f["filename"]) for f in ds.cache_files) or ds.data.nbytes


def source_size(src: Source) -> int:
    """Bytes on disk (for a progress bar)."""
    if src.kind == "hf":
        return _dataset_size(_open_dataset(src))
    if src.kind == "saved":
        return sum(p.stat().st_size for p in src.path.rglob("*") if p.is_file())
    return src.path.stat().st_size


def source_stats(src: Source) -> list:
    """What identifies the source's content for a cache key: (path, size, mtime) of its files, and the
    dataset's name, config, split and column for data.hf_dataset."""
    if src.kind == "hf":
        files = sorted(Path(f["filename"]) for f in _open_dataset(src).cache_files)
        head = [src.hf.name, src.hf.config, src.hf.split, src.hf.column]
    elif src.kind == "saved":
        files, head = sorted(p for p in src.path.rglob("*") if p.is_file()), []
    else:
        files, head = [src.path], []
    return head + [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files]


def _iter_jsonl(path: Path) -> Iterator[tuple[str, dict | None, int]]:
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            if not raw.strip():
                yield where, None, len(raw)
                continue
            try:
                record = json.loads(raw)
            except json.JSONDecodeError as e:  # (its own "line 2" would be the line's end, not the file's)
                raise ValueError(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None
            except UnicodeDecodeError as e:
                raise ValueError(f"{where}: malformed JSON (not UTF-8: {e.reason} at byte {e.start})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
            if b"\\ud" in raw or b"\\uD" in raw:  # only an escape can make a lone surrogate, which tokenizers refuse
                record = _without_surrogates(record)
            yield where, record, len(raw)


def _without_surrogates(value):
    """`value` with every lone surrogate (a `\\ud800`-`\\udfff` escape json left unpaired) in its strings
    replaced by U+FFFD, as a bad byte of a text file is."""
    if isinstance(value, str):
        return _LONE_SURROGATE.sub("\ufffd", value)
    if isinstance(value, list):
        return [_without_surrogates(v) for v in value]
    if isinstance(value, dict):
        return {_without_surrogates(k): _without_surrogates(v) for k, v in value.items()}
    return value


def _parquet_batches(src: Source, pf, picked: list[str]) -> Iterator[dict]:
    """The parquet file's rows in column batches; a page damaged past the footer is one line naming the file."""
    try:
        for batch in pf.iter_batches(columns=picked, batch_size=_BATCH_ROWS):
            yield batch.to_pydict()
    except (OSError, ValueError) as e:  # pyarrow's message does not name the file
        raise _unreadable(src, e) from None


def iter_records(src: Source, columns: Callable[[list[str], str], list[str]]) -> Iterator[tuple[str, dict | None, int]]:
    """(where, record, bytes) for every record of a JSONL or table source; `where` is file:line or
    `<source> row N`, a blank JSONL line gives None. For tables, `columns(names, where)` picks the columns
    to read from the table's column names (and raises when the ones it needs are missing)."""
    if src.kind == "jsonl":
        yield from _iter_jsonl(src.path)
        return
    if src.kind not in _TABLE_KINDS:
        raise ValueError(f"{src}: not a table or JSONL source")
    if src.kind == "parquet":
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(src.path)
        except (OSError, ValueError) as e:  # pyarrow's message does not name the file
            raise _unreadable(src, e) from None
        names, rows, size = pf.schema_arrow.names, pf.metadata.num_rows, src.path.stat().st_size
        picked = columns(names, str(src))
        batches = _parquet_batches(src, pf, picked)
    else:
        ds = _open_dataset(src)
        names, rows, size = list(ds.column_names), len(ds), _dataset_size(ds)
        picked = columns(names, str(src))
        batches = ds.select_columns(picked).iter(batch_size=_BATCH_ROWS)
    per_row = size // max(rows, 1)
    i = 0
    for batch in batches:
        for j in range(len(batch[picked[0]]) if picked else 0):
            yield f"{src} row {i}", {c: batch[c][j] for c in picked}, per_row
            i += 1
