"""Supervised fine-tuning data: JSONL chats -> chat-template tokens with assistant-only labels -> packed rows.

Assistant spans come from rendering prefixes of the conversation with the tokenizer's own chat
template: for each assistant message, the text before it (with the generation prompt) and the text
through it must both be prefixes of the whole rendering. The whole conversation is then tokenized
once, and a token is labelled when it starts inside an assistant span (its content and its
end-of-turn token, e.g. `<|im_end|>`, not the newline after it).
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from transformers import PreTrainedTokenizerBase

from .cpt import PackedDataset
from .sources import HfDatasetConfig, iter_records, list_sources
from .tokenizer import has_chatml_tokens

__all__ = ["SftDataConfig", "SftStats", "build_sft_datasets", "read_sft_holdout"]

logger = logging.getLogger(__name__)

_ROLES = ("system", "user", "assistant")


@dataclass
class SftDataConfig:
    """Supervised fine-tuning data."""

    paths: list[str] = field(default_factory=list)
    """JSONL, parquet or Arrow files, `datasets` folders (save_to_disk), or folders searched recursively for
    *.jsonl, *.parquet and *.arrow; samples are read in this order. Relative paths in a config file are
    relative to that file."""
    hf_dataset: HfDatasetConfig | None = None
    """A dataset read with `datasets.load_dataset` (section: name, config, split, column, cache_dir), after `paths`."""
    messages_field: str = "messages"
    """Field holding a chat: a list of {"role": system|user|assistant, "content": str}."""
    prompt_field: str = "prompt"
    """Field of the user turn, for records without `messages_field`."""
    response_field: str = "response"
    """Field of the assistant turn, for records without `messages_field`."""
    system_prompt: str | None = None
    """System message put first in every chat that has none; None adds nothing."""
    seq_len: int = 2048
    """Tokens per packed row; the token budget of packing."""
    overlong: Literal["truncate", "skip"] = "truncate"
    """What to do with a sample longer than seq_len: keep its first seq_len tokens, or drop it."""
    val_fraction: float = 0.0
    """Fraction of samples held out for validation (chosen by the seed); 0 disables validation."""
    holdout_last: int = 0
    """The last this-many samples of the files are never trained or validated on (kept for evaluation)."""
    max_samples: int | None = None
    """Use at most this many samples (the first ones, after `holdout_last`); None uses all."""

    def __post_init__(self):
        if isinstance(self.paths, str):
            self.paths = [self.paths]
        if not self.paths and self.hf_dataset is None:
            raise ValueError("data.paths is empty: give at least one JSONL file (or a data.hf_dataset)")
        if self.seq_len < 2:
            raise ValueError(f"data.seq_len must be >= 2, got {self.seq_len}")
        if self.overlong not in ("truncate", "skip"):
            raise ValueError(f"data.overlong must be 'truncate' or 'skip', got {self.overlong!r}")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(f"data.val_fraction must be in [0, 1), got {self.val_fraction}")
        if self.holdout_last < 0:
            raise ValueError(f"data.holdout_last must be >= 0, got {self.holdout_last}")
        if self.max_samples is not None and self.max_samples < 1:
            raise ValueError(f"data.max_samples must be positive, got {self.max_samples}")


@dataclass
class SftStats:
    """What SFT data preparation kept and dropped."""

    num_samples: int = 0
    """Samples used for train + val (after `holdout_last` and `max_samples`)."""
    num_holdout: int = 0
    """Samples reserved by `holdout_last`."""
    num_train: int = 0
    """Training samples packed."""
    num_val: int = 0
    """Validation samples packed."""
    num_truncated: int = 0
    """Overlong samples cut to seq_len (train + val)."""
    num_skipped: int = 0
    """Samples dropped (train + val): overlong under overlong='skip', or no assistant token within seq_len."""
    num_no_answer: int = 0
    """Of `num_skipped`: samples that truncating to seq_len would leave with no assistant token (the prompt
    alone is that long)."""
    num_train_tokens: int = 0
    """Tokens in the training rows, padding excluded."""
    num_train_label_tokens: int = 0
    """Assistant tokens that carry loss in the training rows."""
    num_train_rows: int = 0
    """Packed training rows."""
    seq_len: int = 0
    """Tokens per row."""

    @property
    def packing_efficiency(self) -> float:
        """Fraction of the training rows filled with real tokens."""
        return self.num_train_tokens / max(1, self.num_train_rows * self.seq_len)


def _parse_record(record: dict, cfg: SftDataConfig, where: str, messages_field: str) -> list[dict[str, str]]:
    if messages_field in record:
        messages = record[messages_field]
        if messages is None:
            raise ValueError(f"{where}: {messages_field!r} is missing (null)")
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"{where}: {messages_field!r} must be a non-empty list of messages")
        chat = []
        for k, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("content"), str):
                raise ValueError(f"{where}: message {k} needs a string 'content'")
            if m.get("role") not in _ROLES:
                raise ValueError(f"{where}: message {k} has role {m.get('role')!r}; expected one of {_ROLES}")
            chat.append({"role": m["role"], "content": m["content"]})
    elif cfg.prompt_field in record and cfg.response_field in record:
        prompt, response = record[cfg.prompt_field], record[cfg.response_field]
        for name, value in ((cfg.prompt_field, prompt), (cfg.response_field, response)):
            if value is None:  # a null JSON value or an empty table cell
                raise ValueError(f"{where}: {name!r} is missing (null)")
            if not isinstance(value, str):
                raise ValueError(f"{where}: {name!r} must be a string, got {type(value).__name__}")
        chat = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    else:
        raise ValueError(
            f"{where}: neither a {messages_field!r} field nor {cfg.prompt_field!r} + "
            f"{cfg.response_field!r} fields (data.messages_field / data.prompt_field / data.response_field); "
            f"has {sorted(record)}"
        )
    if not any(m["role"] == "assistant" for m in chat):
        raise ValueError(f"{where}: no assistant message, so nothing to learn")
    if cfg.system_prompt is not None and chat[0]["role"] != "system":
        chat.insert(0, {"role": "system", "content": cfg.system_prompt})
    return chat


_SFT_FILES = ["*.jsonl", "*.parquet", "*.arrow"]


def _chat_columns(cfg: SftDataConfig, messages_field: str, named: bool = False):
    """Picks a table's chat column, else its prompt and response columns; only the chat column where it is
    `named` (data.hf_dataset.column: a column the user names and the table lacks is an error, not a fallback)."""

    def pick(names: list[str], where: str) -> list[str]:
        if messages_field in names:
            return [messages_field]
        if named:
            raise ValueError(f"{where}: no column {messages_field!r} (data.hf_dataset.column); columns: {names}")
        if cfg.prompt_field in names and cfg.response_field in names:
            return [cfg.prompt_field, cfg.response_field]
        raise ValueError(f"{where} row 0: neither a {messages_field!r} column nor {cfg.prompt_field!r} + "
                         f"{cfg.response_field!r} columns (data.messages_field / data.prompt_field / "
                         f"data.response_field); columns: {names}")

    return pick


def _read_samples(cfg: SftDataConfig) -> list[tuple[str, list[dict[str, str]]]]:
    """All samples of all sources as (where, messages), in order; `where` is file:line or `<source> row N`."""
    samples = []
    for src in list_sources(cfg.paths, _SFT_FILES, other="jsonl", hf=cfg.hf_dataset):
        named = src.hf is not None and src.hf.column is not None
        messages_field = src.hf.column if named else cfg.messages_field
        for where, record, _ in iter_records(src, _chat_columns(cfg, messages_field, named)):
            if record is not None:
                samples.append((where, _parse_record(record, cfg, where, messages_field)))
    if not samples:
        raise ValueError(f"data.paths: no samples in {[str(p) for p in cfg.paths]}"
                         + (f" or {cfg.hf_dataset.describe()}" if cfg.hf_dataset else ""))
    return samples


def read_sft_holdout(cfg: SftDataConfig) -> list[list[dict[str, str]]]:
    """The chats reserved by `holdout_last` (never trained on), for evaluation."""
    samples = _read_samples(cfg)
    return [chat for _, chat in samples[len(samples) - cfg.holdout_last :]] if cfg.holdout_last else []


def _render(tokenizer: PreTrainedTokenizerBase, chat: list[dict[str, str]], where: str, gen: bool = False):
    try:
        return tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
    except Exception as e:  # jinja errors say nothing about which sample
        raise ValueError(f"{where}: the chat template failed on this chat: {e}") from e


def _assistant_spans(
    tokenizer: PreTrainedTokenizerBase, chat: list[dict[str, str]], where: str
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered chat and the character spans of its assistant turns (content + end-of-turn token)."""
    full = _render(tokenizer, chat, where)
    spans = []
    for i, message in enumerate(chat):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, chat[:i], where, gen=True)
        through = _render(tokenizer, chat[: i + 1], where)
        if not (through.startswith(before) and full.startswith(through)):
            raise ValueError(
                f"{where}: the chat template does not render a chat's prefix as a prefix of the whole chat "
                f"(message {i}), so the assistant tokens cannot be located"
            )
        if message["content"].strip() not in through[len(before) :]:
            raise ValueError(f"{where}: the chat template does not render assistant message {i} verbatim")
        spans.append((len(before), len(through.rstrip())))
    return full, spans


def _tokenize(
    tokenizer: PreTrainedTokenizerBase, samples: list, seq_len: int, overlong: str, stats: SftStats
) -> list[tuple[np.ndarray, np.ndarray]]:
    """(input_ids, labels) per sample; overlong ones truncated or dropped and counted in `stats`."""
    rendered = [_assistant_spans(tokenizer, chat, where) for where, chat in samples]
    enc = tokenizer(
        [text for text, _ in rendered], add_special_tokens=False, return_offsets_mapping=True, verbose=False
    )
    out = []
    for (text, spans), ids, offsets in zip(rendered, enc["input_ids"], enc["offset_mapping"]):
        ids = np.asarray(ids, dtype=np.int32)
        starts = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)[:, 0]
        inside = np.zeros(len(ids), dtype=bool)
        for lo, hi in spans:
            inside |= (starts >= lo) & (starts < hi)
        labels = np.where(inside, ids, -100).astype(np.int32)
        if len(ids) > seq_len:
            if overlong == "skip" or not inside[:seq_len].any():
                stats.num_skipped += 1
                stats.num_no_answer += overlong == "truncate"
                continue
            stats.num_truncated += 1
            ids, labels = ids[:seq_len], labels[:seq_len]
        out.append((ids, labels))
    return out


def _best_fit(lengths: list[int], seq_len: int) -> list[list[int]]:
    """Best-fit bin packing of sample lengths into rows of seq_len, in the given order."""
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (remaining room, row), sorted
    for k, n in enumerate(lengths):
        j = bisect.bisect_left(free, (n, -1))
        if j < len(free):
            room, row = free.pop(j)
        else:
            room, row = seq_len, len(rows)
            rows.append([])
        rows[row].append(k)
        if room - n > 0:
            bisect.insort(free, (room - n, row))
    return rows


def _pack(encoded: list[tuple[np.ndarray, np.ndarray]], seq_len: int, pad_id: int) -> PackedDataset:
    rows = _best_fit([len(ids) for ids, _ in encoded], seq_len)
    order = [k for row in rows for k in row]
    lengths = np.asarray([len(encoded[k][0]) for k in order], dtype=np.int64)
    tokens = np.concatenate([encoded[k][0] for k in order])
    labels = np.concatenate([encoded[k][1] for k in order])
    seg_starts = np.cumsum(lengths) - lengths
    row_ptr = np.concatenate([[0], np.cumsum([len(row) for row in rows])])
    return PackedDataset(tokens, seg_starts, lengths, row_ptr, seq_len, pad_id, labels, document_masking=True)


def build_sft_datasets(
    cfg: SftDataConfig, tokenizer: PreTrainedTokenizerBase, seed: int
) -> tuple[PackedDataset, PackedDataset | None, SftStats]:
    """Read, template, label and pack SFT samples into (train, val, stats).

    The seed picks the validation samples and the order in which samples are packed. Each sample is a
    segment of its own (position_ids restart at 0; `PackedDataset` says what keeps attention inside it).
    """
    if not tokenizer.chat_template:  # load_tokenizer gives ChatML only to a tokenizer whose vocabulary has its tokens
        nor = "" if has_chatml_tokens(tokenizer) else " (nor the ChatML special tokens <|im_start|>, <|im_end|>)"
        raise ValueError(f"config key 'model.tokenizer': SFT renders chats with the tokenizer's chat template, and "
                         f"this tokenizer has none{nor}; use a tokenizer with a chat template, e.g. the model's "
                         "instruct tokenizer")
    samples = _read_samples(cfg)
    if cfg.holdout_last >= len(samples):
        raise ValueError(
            f"data.holdout_last={cfg.holdout_last} leaves none of {len(samples)} samples"
        )
    stats = SftStats(num_holdout=cfg.holdout_last, seq_len=cfg.seq_len)
    samples = samples[: len(samples) - cfg.holdout_last][: cfg.max_samples]
    stats.num_samples = len(samples)
    order = np.random.default_rng(seed).permutation(len(samples))
    num_val = max(1, round(cfg.val_fraction * len(samples))) if cfg.val_fraction > 0 else 0
    if num_val >= len(samples):
        raise ValueError(
            f"data.val_fraction={cfg.val_fraction} leaves no training sample of {len(samples)}"
        )
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_id is None:
        raise ValueError("the tokenizer has neither a pad nor an EOS token to pad rows with")

    def split(indices: np.ndarray, name: str) -> tuple[PackedDataset, int]:
        skipped, no_answer = stats.num_skipped, stats.num_no_answer
        encoded = _tokenize(tokenizer, [samples[k] for k in indices], cfg.seq_len, cfg.overlong, stats)
        if not encoded:
            no_answer = stats.num_no_answer - no_answer
            too_long = stats.num_skipped - skipped - no_answer
            why = [f"{too_long} longer than data.seq_len={cfg.seq_len} (data.overlong: skip)"] if too_long else []
            why += [f"{no_answer} with no assistant token in their first data.seq_len={cfg.seq_len} tokens (the "
                    "prompt alone is that long)"] if no_answer else []
            raise ValueError(f"SFT {name} split: every sample was dropped: {', '.join(why)}")
        return _pack(encoded, cfg.seq_len, pad_id), len(encoded)

    train, stats.num_train = split(order[num_val:], "train")
    val, stats.num_val = split(order[:num_val], "val") if num_val else (None, 0)
    stats.num_train_rows = len(train)
    stats.num_train_tokens = train.num_tokens
    stats.num_train_label_tokens = int((train.labels != -100).sum())
    if stats.num_truncated or stats.num_skipped:
        logger.warning(
            "SFT: %d samples longer than seq_len=%d truncated, %d skipped (%d of them with no assistant token "
            "within seq_len)", stats.num_truncated, cfg.seq_len, stats.num_skipped, stats.num_no_answer,
        )
    logger.info(
        "SFT data: %d train samples in %d rows (%.1f%% filled), %d val samples, %d held out",
        stats.num_train, stats.num_train_rows, 100 * stats.packing_efficiency, stats.num_val,
        stats.num_holdout,
    )
    return train, val, stats
