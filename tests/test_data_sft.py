import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fp8train.data import SftDataConfig, build_sft_datasets, load_tokenizer, read_sft_holdout

IM_END = "<|im_end|>"
GSM8K = Path(__file__).resolve().parents[1] / "configs" / "data" / "gsm8k" / "train_320.jsonl"  # shipped

CHATS = [
    {"messages": [{"role": "system", "content": "You answer in one line."},
                  {"role": "user", "content": "What is 2 + 2?"},
                  {"role": "assistant", "content": "2 + 2 = 4."},
                  {"role": "user", "content": "And 3 * 3?"},
                  {"role": "assistant", "content": "3 * 3 = 9, naïvely."}]},
    {"prompt": "Name a prime.", "response": "  7 is prime.\n"},
    {"messages": [{"role": "user", "content": "Say <|im_start|> nothing"},
                  {"role": "assistant", "content": ""}]},
    {"prompt": "Write code.", "response": "def f(x):\n    return x * 2"},
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def _write(path: Path, records) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def _segments(ds):
    """Every packed sample as (input_ids, labels), split where position_ids restart, padding removed."""
    out = []
    for i in range(len(ds)):
        row = ds[i]
        starts = (row["position_ids"] == 0).nonzero().flatten().tolist() + [ds.seq_len]
        for lo, hi in zip(starts[:-1], starts[1:]):
            ids, labels = row["input_ids"][lo:hi], row["labels"][lo:hi]
            if (labels == -100).all() and (ids == ds.pad_id).all():
                continue  # padding
            out.append((ids, labels))
    return out


def _labelled_runs(ids: torch.Tensor, labels: torch.Tensor) -> list[list[int]]:
    assert torch.equal(labels[labels != -100], ids[labels != -100])  # a label is the token itself
    runs, current = [], []
    for t, lab in zip(ids.tolist(), labels.tolist()):
        if lab != -100:
            current.append(t)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


def _as_chat(record, system=None):
    chat = record.get("messages") or [{"role": "user", "content": record["prompt"]},
                                      {"role": "assistant", "content": record["response"]}]
    return ([{"role": "system", "content": system}] if system and chat[0]["role"] != "system" else []) + chat


def test_labels_only_on_assistant_tokens(tok, tmp_path):
    path = _write(tmp_path / "chats.jsonl", CHATS)
    train, val, stats = build_sft_datasets(SftDataConfig(paths=[str(path)], seq_len=96), tok, seed=0)
    assert val is None and stats.num_train == len(CHATS) and stats.num_truncated == stats.num_skipped == 0
    segments = _segments(train)
    assert len(segments) == len(CHATS)
    by_tokens = {tuple(ids.tolist()): labels for ids, labels in segments}
    for record in CHATS:
        chat = _as_chat(record)
        ids = tok.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"]
        labels = by_tokens[tuple(ids)]  # the sample's tokens are exactly the template's
        runs = [tok.decode(run) for run in _labelled_runs(torch.tensor(ids), labels)]
        assert runs == [m["content"] + IM_END for m in chat if m["role"] == "assistant"]
    assert stats.num_train_label_tokens == sum(int((lab != -100).sum()) for _, lab in segments)


def test_packing_by_token_budget(tok, tmp_path):
    records = [{"prompt": f"Question {i}: " + "word " * (i % 7), "response": f"Answer {i}. " * (1 + i % 3)}
               for i in range(40)]
    path = _write(tmp_path / "many.jsonl", records)
    seq_len = 128
    train, _, stats = build_sft_datasets(SftDataConfig(paths=[str(path)], seq_len=seq_len), tok, seed=1)
    lengths = [len(tok.apply_chat_template(_as_chat(r), tokenize=True, return_dict=True)["input_ids"])
               for r in records]
    segments = _segments(train)
    assert sorted(len(ids) for ids, _ in segments) == sorted(lengths)  # every sample once, whole
    assert train.num_tokens == stats.num_train_tokens == sum(lengths)
    assert len(train) <= -(-sum(lengths) // seq_len) + 1  # best fit: at most one row more than the minimum
    assert len(train) < len(records) / 3  # rows really hold several samples
    for i in range(len(train)):
        row = train[i]
        assert all(v.shape == (seq_len,) and v.dtype == torch.int64 for v in row.values())
        used = int((row["labels"] != -100).sum())
        assert used > 0
        pad = seq_len - sum(len(ids) for ids, _ in _segments_of_row(row, train.pad_id))
        if pad:
            assert (row["input_ids"][-pad:] == train.pad_id).all() and (row["labels"][-pad:] == -100).all()
            assert row["position_ids"][-pad:].tolist() == list(range(pad))
    again, _, _ = build_sft_datasets(SftDataConfig(paths=[str(path)], seq_len=seq_len), tok, seed=1)
    assert all(torch.equal(again[i]["input_ids"], train[i]["input_ids"]) for i in range(len(train)))
    other, _, _ = build_sft_datasets(SftDataConfig(paths=[str(path)], seq_len=seq_len), tok, seed=2)
    assert not torch.equal(other[0]["input_ids"], train[0]["input_ids"])


def _segments_of_row(row, pad_id):
    starts = (row["position_ids"] == 0).nonzero().flatten().tolist() + [len(row["input_ids"])]
    return [(row["input_ids"][lo:hi], row["labels"][lo:hi]) for lo, hi in zip(starts[:-1], starts[1:])
            if not ((row["labels"][lo:hi] == -100).all() and (row["input_ids"][lo:hi] == pad_id).all())]


def test_system_prompt_is_added_and_not_labelled(tok, tmp_path):
    path = _write(tmp_path / "p.jsonl", CHATS[1:2])
    cfg = SftDataConfig(paths=[str(path)], seq_len=64, system_prompt="Think step by step.")
    train, _, _ = build_sft_datasets(cfg, tok, seed=0)
    ((ids, labels),) = _segments(train)
    assert tok.decode(ids).startswith("<|im_start|>system\nThink step by step.<|im_end|>\n<|im_start|>user")
    assert [tok.decode(r) for r in _labelled_runs(ids, labels)] == ["  7 is prime.\n" + IM_END]


@pytest.mark.parametrize("overlong", ["truncate", "skip"])
def test_overlong_samples(tok, tmp_path, overlong):
    short = {"prompt": "Hi", "response": "Hello."}
    long = {"prompt": "Count.", "response": " ".join(str(i) for i in range(60))}
    long_prompt = {"prompt": "x " * 80, "response": "ok"}  # nothing to learn left after truncation
    path = _write(tmp_path / "o.jsonl", [short, long, short, long, long_prompt])
    cfg = SftDataConfig(paths=[str(path)], seq_len=32, overlong=overlong)
    train, _, stats = build_sft_datasets(cfg, tok, seed=0)
    segments = _segments(train)
    if overlong == "truncate":
        assert (stats.num_truncated, stats.num_skipped, stats.num_no_answer, stats.num_train) == (2, 1, 1, 4)
        full = tok.apply_chat_template(_as_chat(long), tokenize=True, return_dict=True)["input_ids"]
        cut = [ids.tolist() for ids, _ in segments if len(ids) == 32]
        assert cut == [full[:32], full[:32]]
    else:
        assert (stats.num_truncated, stats.num_skipped, stats.num_no_answer, stats.num_train) == (0, 3, 0, 2)
        assert all(len(ids) < 32 for ids, _ in segments)
    assert len(segments) == stats.num_train


def test_splits_holdout_and_max_samples(tok, tmp_path):
    records = [{"prompt": f"Q{i}?", "response": f"Answer number {i}."} for i in range(20)]
    path = _write(tmp_path / "s.jsonl", records)
    cfg = SftDataConfig(paths=[str(path)], seq_len=128, val_fraction=0.25, holdout_last=3, max_samples=16)
    train, val, stats = build_sft_datasets(cfg, tok, seed=0)
    assert (stats.num_samples, stats.num_holdout, stats.num_train, stats.num_val) == (16, 3, 12, 4)

    def answers(ds):
        return {tok.decode(r) for ids, labels in _segments(ds) for r in _labelled_runs(ids, labels)}

    train_answers, val_answers = answers(train), answers(val)
    assert len(train_answers) == 12 and len(val_answers) == 4 and not train_answers & val_answers
    assert train_answers | val_answers == {f"Answer number {i}.{IM_END}" for i in range(16)}
    held_out = [chat[-1]["content"] for chat in read_sft_holdout(cfg)]
    assert held_out == [f"Answer number {i}." for i in (17, 18, 19)]


def test_template_that_breaks_prefixes_is_refused(tok, tmp_path):
    path = _write(tmp_path / "t.jsonl", CHATS[:1])
    saved = tok.chat_template
    # Like reasoning templates that rewrite earlier assistant turns: rendering a prefix is not a prefix.
    tok.chat_template = (
        "{%- for m in messages %}{{ m['role'] }}: "
        "{{ m['content'] if loop.last or m['role'] != 'assistant' else '[...]' }}\n{%- endfor %}"
    )
    try:
        with pytest.raises(ValueError, match=r"t\.jsonl:1: the chat template does not render a chat's prefix"):
            build_sft_datasets(SftDataConfig(paths=[str(path)], seq_len=128), tok, seed=0)
    finally:
        tok.chat_template = saved


def test_bad_inputs(tok, tmp_path):
    def build(path, **kw):
        return build_sft_datasets(SftDataConfig(paths=[str(path)], seq_len=64, **kw), tok, seed=0)

    with pytest.raises(FileNotFoundError, match="nothere.jsonl"):
        build(tmp_path / "nothere.jsonl")
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: malformed JSON"):
        build(_write(tmp_path / "bad.jsonl", [CHATS[1], "", '{"prompt": "a", "response": }']))
    with pytest.raises(ValueError, match=r"fields\.jsonl:2: neither a 'messages' field nor 'prompt' \+ 'resp"):
        build(_write(tmp_path / "fields.jsonl", [CHATS[1], {"question": "q", "answer": "a"}]))
    with pytest.raises(ValueError, match=r"role\.jsonl:1: message 1 has role 'robot'"):
        build(_write(tmp_path / "role.jsonl", [{"messages": [{"role": "user", "content": "a"},
                                                              {"role": "robot", "content": "b"}]}]))
    with pytest.raises(ValueError, match=r"noasst\.jsonl:1: no assistant message"):
        build(_write(tmp_path / "noasst.jsonl", [{"messages": [{"role": "user", "content": "a"}]}]))
    (tmp_path / "empty.jsonl").write_text("\n \n")
    with pytest.raises(ValueError, match="no samples"):
        build(tmp_path / "empty.jsonl")
    with pytest.raises(ValueError, match=r"fields\.jsonl:2: 'response' is missing \(null\)"):
        build(_write(tmp_path / "fields.jsonl", [CHATS[1], {"prompt": "q", "response": None}]))
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"prompt": ["q", "r"], "response": ["a", None]}), tmp_path / "null.parquet")
    with pytest.raises(ValueError, match=r"null\.parquet row 1: 'response' is missing \(null\)"):  # an empty cell
        build(tmp_path / "null.parquet")
    with pytest.raises(ValueError, match=r"fields\.jsonl:1: 'prompt' must be a string, got int"):
        build(_write(tmp_path / "fields.jsonl", [{"prompt": 7, "response": "a"}]))
    with pytest.raises(ValueError, match=r"fields\.jsonl:1: 'messages' is missing \(null\)"):
        build(_write(tmp_path / "fields.jsonl", [{"messages": None}]))
    long_prompt = _write(tmp_path / "long.jsonl", [{"prompt": "x " * 100, "response": "y"}])
    with pytest.raises(ValueError, match=r"every sample was dropped: 1 longer than data\.seq_len=64 "
                                         r"\(data\.overlong: skip\)$"):
        build(long_prompt, overlong="skip")
    with pytest.raises(ValueError, match=r"every sample was dropped: 1 with no assistant token in their first "
                                         r"data\.seq_len=64 tokens \(the prompt alone is that long\)$"):
        build(long_prompt, overlong="truncate")  # not for its length: truncating it leaves nothing to learn
    with pytest.raises(ValueError, match="holdout_last=1 leaves none"):
        build(_write(tmp_path / "one.jsonl", [CHATS[1]]), holdout_last=1)
    with pytest.raises(ValueError, match="overlong"):
        SftDataConfig(paths=["x"], overlong="cut")


def test_gsm8k_smoke(tok):
    cfg = SftDataConfig(paths=[str(GSM8K)], prompt_field="question", response_field="answer", seq_len=512,
                        max_samples=200, val_fraction=0.1)
    train, val, stats = build_sft_datasets(cfg, tok, seed=0)
    assert (stats.num_train, stats.num_val) == (180, 20)
    assert stats.packing_efficiency > 0.85
    runs = [tok.decode(r) for ids, labels in _segments(train) for r in _labelled_runs(ids, labels)]
    assert len(runs) == 180 and all("####" in r and r.endswith(IM_END) for r in runs)
    batch = torch.stack([train[i]["labels"] for i in range(len(train))])
    assert int((batch != -100).sum()) == stats.num_train_label_tokens
    assert np.isclose(stats.num_train_tokens / (len(train) * 512), stats.packing_efficiency)


def test_datasets_folders_arrow_files_and_hub_cache(tok, tmp_path, monkeypatch):
    """SFT reads `messages` or prompt/response columns from a save_to_disk folder, an Arrow file and a
    cached Hub dataset (offline, the network refused) exactly as from JSONL."""
    import socket

    datasets = pytest.importorskip("datasets")
    from fp8train.data import HfDatasetConfig
    from test_data_cpt import _hf_sources

    def refuse(*args, **kwargs):
        raise AssertionError("tried to reach the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    chats = [[{"role": "user", "content": f"What is {i} + {i}?"}, {"role": "assistant", "content": f"{2 * i}."}]
             for i in range(12)]
    reference = build_sft_datasets(SftDataConfig(paths=[str(_write(tmp_path / "c.jsonl", [{"messages": c} for c in chats]))],
                                                 seq_len=64), tok, seed=0)[0]
    pairs = {"question": [c[0]["content"] for c in chats], "solution": [c[1]["content"] for c in chats]}
    for name, ds, extra in (("chats", datasets.Dataset.from_dict({"messages": chats}), {}),
                            ("pairs", datasets.Dataset.from_dict(pairs), dict(prompt_field="question",
                                                                             response_field="solution"))):
        src = _hf_sources(datasets, ds, tmp_path / name)
        hub = HfDatasetConfig(name="someone/corpus", cache_dir=str(src["cache"]))
        for cfg in (SftDataConfig(paths=[str(src["saved"])], seq_len=64, **extra),
                    SftDataConfig(paths=[str(src["arrow"])], seq_len=64, **extra),
                    SftDataConfig(hf_dataset=hub, seq_len=64, **extra)):
            train, _, stats = build_sft_datasets(cfg, tok, seed=0)
            assert stats.num_train == 12, (name, cfg)
            assert np.array_equal(np.asarray(train.tokens), np.asarray(reference.tokens)), (name, cfg)
            assert np.array_equal(train.labels, reference.labels), (name, cfg)
    with pytest.raises(ValueError, match=r"row 0: neither a 'messages' column nor 'prompt' \+ 'response'"):
        build_sft_datasets(SftDataConfig(paths=[str(tmp_path / "pairs" / "saved")], seq_len=64), tok, seed=0)
    # a chat column the user names and the dataset lacks: refused, not read as the prompt/response columns
    named = HfDatasetConfig(name="someone/corpus", cache_dir=str(src["cache"]), column="dialog")  # (the pairs)
    with pytest.raises(ValueError, match=r"no column 'dialog' \(data.hf_dataset.column\); columns: \['question'"):
        build_sft_datasets(SftDataConfig(hf_dataset=named, seq_len=64, prompt_field="question",
                                         response_field="solution"), tok, seed=0)


def test_lone_surrogate_escapes_become_replacement_characters(tok, tmp_path):
    """`"\\ud800"` alone is valid JSON but no text a tokenizer encodes: it becomes U+FFFD, as a bad byte does;
    an escaped pair (an emoji) stays the character it encodes."""
    path = tmp_path / "s.jsonl"
    path.write_text('{"prompt": "a\\ud800b \\ud83d\\ude00", "response": "ok \\uDC00"}\n'
                    '{"messages": [{"role": "user", "content": "x\\udbff"}, {"role": "assistant", "content": "y"}]}\n')
    train, _, stats = build_sft_datasets(SftDataConfig(paths=[str(path)], seq_len=64), tok, seed=0)
    assert stats.num_train == 2
    texts = sorted(tok.decode(ids) for ids, _ in _segments(train))
    assert "user\na\ufffdb \U0001f600<|im_end|>" in texts[0] and "assistant\nok \ufffd<|im_end|>" in texts[0]
    assert "user\nx\ufffd<|im_end|>" in texts[1]


def test_tokenizer_without_chat_template_or_chatml_tokens_is_refused(tmp_path):
    from test_tokenizer import byte_tokenizer_without_chatml

    plain = load_tokenizer(str(byte_tokenizer_without_chatml(tmp_path / "bytes")))
    path = _write(tmp_path / "c.jsonl", CHATS[1:2])
    with pytest.raises(ValueError, match=r"^config key 'model\.tokenizer': SFT renders chats with the tokenizer's chat "
                                         r"template, and this tokenizer has none \(nor the ChatML special tokens "
                                         r"<\|im_start\|>, <\|im_end\|>\); use a tokenizer with a chat template"):
        build_sft_datasets(SftDataConfig(paths=[str(path)], seq_len=64), plain, seed=0)
