import json
import os
import pickle

import numpy as np
import pytest
import torch

from fp8train.data import CptDataConfig, PackedDataset, build_cpt_datasets, load_tokenizer
from fp8train.data import cpt as cpt_module

EOS = 151643


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture
def corpus(tmp_path):
    """Six documents in every input format, plus a file the include patterns skip."""
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("The quick brown fox jumps over the lazy dog.\n")
    (root / "sub" / "b.md").write_text("# Title\n\nSome *markdown* text, with 3 numbers: 1, 22, 333.\n")
    (root / "c.jsonl").write_text(
        json.dumps({"text": "First JSON line: naïve café."}) + "\n\n"
        + json.dumps({"text": "Second line <|endoftext|> stays text", "id": 2}) + "\n"
    )
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    table = pa.table({"text": ["parquet row one", "def parquet_row(two): return 2"]})
    pq.write_table(table, root / "d.parquet")
    (root / "skip.bin").write_bytes(b"\x00\x01 not read")
    return root


def _docs(tok, texts):
    return [tok(t, add_special_tokens=False, split_special_tokens=True).input_ids + [EOS] for t in texts]


CORPUS_TEXTS = [  # in sorted path order: a.txt, c.jsonl, d.parquet, sub/b.md
    "The quick brown fox jumps over the lazy dog.\n",
    "First JSON line: naïve café.",
    "Second line <|endoftext|> stays text",
    "parquet row one",
    "def parquet_row(two): return 2",
    "# Title\n\nSome *markdown* text, with 3 numbers: 1, 22, 333.\n",
]


def _rows(ds: PackedDataset) -> dict[str, np.ndarray]:
    keys = ("input_ids", "labels", "position_ids")
    return {k: torch.stack([ds[i][k] for i in range(len(ds))]).numpy() for k in keys}


def _doc_order(stream: list[int], docs: list[list[int]]) -> list[int]:
    """Which documents, in which order, the stream is made of (the last one may be cut)."""
    order, pos = [], 0
    while pos < len(stream):
        tail = len(stream) - pos
        match = [k for k, d in enumerate(docs) if k not in order and stream[pos : pos + len(d)] == d[:tail]]
        assert len(match) == 1, f"no unique document at stream position {pos}"
        order.append(match[0])
        pos += len(docs[match[0]])
    return order


def _expected_positions(ids: np.ndarray) -> np.ndarray:
    """Positions restart at 0 at row start and after every EOS."""
    pos = np.zeros_like(ids)
    for r in range(ids.shape[0]):
        for j in range(1, ids.shape[1]):
            pos[r, j] = 0 if ids[r, j - 1] == EOS else pos[r, j - 1] + 1
    return pos


@pytest.mark.parametrize("document_masking", [True, False])
def test_packing_exact(tok, corpus, tmp_path, document_masking):
    docs = _docs(tok, CORPUS_TEXTS)
    cfg = CptDataConfig(paths=[str(corpus)], seq_len=16, cache_dir=str(tmp_path / "cache"),
                        document_masking=document_masking)
    train, val = build_cpt_datasets(cfg, tok, seed=3)
    assert val is None
    total = sum(map(len, docs))
    assert len(train) == total // 16 and train.num_tokens == len(train) * 16
    rows = _rows(train)
    stream = rows["input_ids"].reshape(-1).tolist()
    order = _doc_order(stream, docs)
    dropped = sorted(set(range(len(docs))) - set(order))  # only whole documents of the cut tail
    assert len(set(order)) == len(order) and sum(len(docs[k]) for k in dropped) < 16
    assert stream == sum((docs[k] for k in order + dropped), [])[: len(train) * 16]
    assert np.array_equal(rows["labels"], rows["input_ids"])
    if document_masking:
        want = _expected_positions(rows["input_ids"])
    else:
        want = np.tile(np.arange(16), (len(train), 1))
    assert np.array_equal(rows["position_ids"], want)
    assert (rows["position_ids"] == 0).sum() > len(train) or not document_masking  # restarts really happen
    # One EOS per document: the literal "<|endoftext|>" inside a document stays text.
    assert (np.asarray(train.tokens) == EOS).sum() == len(docs)


def test_deterministic_per_seed(tok, corpus, tmp_path):
    cfg = CptDataConfig(paths=[str(corpus)], seq_len=8, cache_dir=str(tmp_path / "cache"))
    a, b, c = (_rows(build_cpt_datasets(cfg, tok, seed=s)[0]) for s in (0, 0, 1))
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["input_ids"], c["input_ids"])


def test_validation_split_holds_out_whole_documents(tok, corpus, tmp_path):
    docs = _docs(tok, CORPUS_TEXTS)
    cfg = CptDataConfig(paths=[str(corpus)], seq_len=4, val_fraction=0.34, cache_dir=str(tmp_path / "cache"))
    train, val = build_cpt_datasets(cfg, tok, seed=0)
    train_order = _doc_order(_rows(train)["input_ids"].reshape(-1).tolist(), docs)
    val_order = _doc_order(_rows(val)["input_ids"].reshape(-1).tolist(), docs)
    assert len(val_order) == 2 and not set(train_order) & set(val_order)
    assert val_order == sorted(val_order)
    assert set(train_order) | set(val_order) == set(range(len(docs)))  # every document is > 4 tokens


def test_cache_is_reused_and_invalidated(tok, corpus, tmp_path, monkeypatch):
    cfg = CptDataConfig(paths=[str(corpus)], seq_len=8, cache_dir=str(tmp_path / "cache"))
    first = _rows(build_cpt_datasets(cfg, tok, seed=0)[0])
    caches = os.listdir(tmp_path / "cache")
    assert len(caches) == 1 and caches[0].startswith("cpt-")  # no temporary folder left behind

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("re-tokenized although the cache is valid")

    monkeypatch.setattr(cpt_module, "_encode_batch", no_tokenizing)
    train, _ = build_cpt_datasets(cfg, tok, seed=0)
    assert isinstance(train.tokens, np.memmap)
    second = _rows(train)
    assert all(np.array_equal(first[k], second[k]) for k in first)

    # An edited file changes the key: the next build tokenizes again.
    (corpus / "a.txt").write_text("A different first document, long enough to matter.\n")
    with pytest.raises(AssertionError, match="re-tokenized"):
        build_cpt_datasets(cfg, tok, seed=0)
    assert len(os.listdir(tmp_path / "cache")) == 1  # the failed build left no partial cache


def test_max_tokens_caps_and_ends_with_eos(tok, corpus, tmp_path):
    docs = _docs(tok, CORPUS_TEXTS)
    cap = len(docs[0]) + 5  # cuts the second document
    cfg = CptDataConfig(paths=[str(corpus)], seq_len=4, max_tokens=cap, cache_dir=str(tmp_path / "cache"))
    train, _ = build_cpt_datasets(cfg, tok, seed=0)
    tokens = np.asarray(train.tokens)
    assert tokens.tolist() == docs[0] + docs[1][:4] + [EOS]
    assert len(train) == cap // 4


def test_pickled_dataset_reopens_memmap(tok, corpus, tmp_path):
    cfg = CptDataConfig(paths=[str(corpus)], seq_len=8, cache_dir=str(tmp_path / "cache"))
    train, _ = build_cpt_datasets(cfg, tok, seed=0)
    blob = pickle.dumps(train)
    assert np.asarray(train.tokens).tobytes() not in blob  # the corpus itself is not pickled
    again = pickle.loads(blob)
    assert isinstance(again.tokens, np.memmap)
    assert all(torch.equal(again[i]["input_ids"], train[i]["input_ids"]) for i in range(len(train)))
    with pytest.raises(IndexError):
        train[len(train)]


def test_document_masking_gives_each_document_its_own_attention(tok, tmp_path):
    """transformers turns restarting position_ids (no attention_mask, use_cache=False) into a
    block-diagonal causal mask: docB's logits inside a packed row equal docB's logits alone."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    texts = ["Packing puts documents side by side.", "So the second one must not see the first."]
    (tmp_path / "a.txt").write_text(texts[0])
    (tmp_path / "b.txt").write_text(texts[1])
    doc_a, doc_b = _docs(tok, texts)
    total = len(doc_a) + len(doc_b)
    rows = {}
    for masking in (True, False):
        cfg = CptDataConfig(paths=[str(tmp_path / "a.txt"), str(tmp_path / "b.txt")], seq_len=total,
                            document_masking=masking, cache_dir=str(tmp_path / "cache"))
        train, _ = build_cpt_datasets(cfg, tok, seed=0)
        rows[masking] = train[0]
    row = rows[True]
    first = row["input_ids"][: len(doc_a)].tolist()
    if first != doc_a:  # the seed put docB first
        doc_a, doc_b = doc_b, doc_a
    assert row["input_ids"].tolist() == doc_a + doc_b
    assert row["position_ids"].tolist() == list(range(len(doc_a))) + list(range(len(doc_b)))

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=True, attn_implementation="sdpa")
    model = Qwen2ForCausalLM(config).float().eval()
    b = slice(len(doc_a), total)
    with torch.no_grad():
        alone = model(torch.tensor([doc_b])).logits[0]
        packed, leaky = (
            model(r["input_ids"][None], position_ids=r["position_ids"][None], use_cache=False).logits[0]
            for r in (row, rows[False])
        )
    torch.testing.assert_close(packed[b], alone, atol=2e-5, rtol=0)
    assert (leaky[b] - alone).abs().max() > 1e-3  # without restarts docB attends to docA


def test_bad_inputs(tok, corpus, tmp_path):
    cache = str(tmp_path / "cache")
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        build_cpt_datasets(CptDataConfig(paths=[str(tmp_path / "missing.txt")], cache_dir=cache), tok, 0)
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": broken\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: malformed JSON"):
        build_cpt_datasets(CptDataConfig(paths=[str(tmp_path / "bad.jsonl")], cache_dir=cache), tok, 0)
    (tmp_path / "latin1.jsonl").write_bytes(b'{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"latin1\.jsonl:1: malformed JSON"):
        build_cpt_datasets(CptDataConfig(paths=[str(tmp_path / "latin1.jsonl")], cache_dir=cache), tok, 0)
    (tmp_path / "nofield.jsonl").write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(ValueError, match=r"nofield\.jsonl:2: no string field 'text'"):
        build_cpt_datasets(CptDataConfig(paths=[str(tmp_path / "nofield.jsonl")], cache_dir=cache), tok, 0)
    with pytest.raises(ValueError, match="no column 'content'"):
        cfg = CptDataConfig(paths=[str(corpus / "d.parquet")], text_field="content", cache_dir=cache)
        build_cpt_datasets(cfg, tok, 0)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "blank.txt").write_text("  \n")
    with pytest.raises(ValueError, match="no non-empty document"):
        build_cpt_datasets(CptDataConfig(paths=[str(tmp_path / "empty")], cache_dir=cache), tok, 0)
    with pytest.raises(ValueError, match="no file matching"):
        cfg = CptDataConfig(paths=[str(tmp_path / "empty")], include=["*.py"], cache_dir=cache)
        build_cpt_datasets(cfg, tok, 0)
    with pytest.raises(ValueError, match="fewer than CptDataConfig.seq_len=4096"):
        build_cpt_datasets(CptDataConfig(paths=[str(corpus)], seq_len=4096, cache_dir=cache), tok, 0)
    with pytest.raises(ValueError, match="val_fraction"):
        CptDataConfig(paths=["x"], val_fraction=1.0)
    with pytest.raises(ValueError, match="paths is empty"):
        CptDataConfig()
