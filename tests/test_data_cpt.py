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
    block-diagonal causal mask: docB's logits inside a packed row equal docB's logits alone. With the KV
    cache on (`config.use_cache`'s default) it does not, as PackedDataset's docstring warns; the trainer's
    `document_mask` keeps the documents apart either way."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from fp8train.train.attention import document_mask

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
        ids, positions = row["input_ids"][None], row["position_ids"][None]
        cached = model(ids, position_ids=positions).logits[0]
        mask = document_mask(config, positions, ids.device)
        masked = model(ids, position_ids=positions, attention_mask=mask).logits[0]
    torch.testing.assert_close(packed[b], alone, atol=2e-5, rtol=0)
    assert (leaky[b] - alone).abs().max() > 1e-3  # without restarts docB attends to docA
    assert config.use_cache and (cached[b] - alone).abs().max() > 1e-3  # cache on (the default): they leak
    torch.testing.assert_close(masked[b], alone, atol=2e-5, rtol=0)


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
    with pytest.raises(ValueError, match="fewer than data.seq_len=4096"):
        build_cpt_datasets(CptDataConfig(paths=[str(corpus)], seq_len=4096, cache_dir=cache), tok, 0)
    (tmp_path / "junk.parquet").write_bytes(b"not a parquet file " * 8)
    with pytest.raises(ValueError, match=rf"^data\.paths: {tmp_path / 'junk.parquet'}: not readable \(ArrowInvalid: "
                                         "Parquet magic bytes not found"):
        build_cpt_datasets(CptDataConfig(paths=[str(tmp_path / "junk.parquet")], cache_dir=cache), tok, 0)
    # a page damaged past a sound footer: found while reading the rows, and named all the same
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"text": [f"row {i} " * 20 for i in range(300)]}), tmp_path / "torn.parquet")
    torn = bytearray((tmp_path / "torn.parquet").read_bytes())
    torn[4:60] = b"\xff" * 56  # the first page's header
    (tmp_path / "torn.parquet").write_bytes(bytes(torn))
    with pytest.raises(ValueError, match=rf"^data\.paths: {tmp_path / 'torn.parquet'}: not readable \(OSError: "):
        build_cpt_datasets(CptDataConfig(paths=[str(tmp_path / "torn.parquet")], cache_dir=cache), tok, 0)
    with pytest.raises(ValueError, match="val_fraction"):
        CptDataConfig(paths=["x"], val_fraction=1.0)
    with pytest.raises(ValueError, match="paths is empty"):
        CptDataConfig()


# ------------------------------------------------------------------ not text, one big file, datasets sources


def _cache(cfg, tok):
    """The token stream and document offsets of the cache `cfg` builds."""
    tokens, offsets = cpt_module._load_or_build_cache(cfg, tok)
    return np.asarray(tokens), offsets


def test_lone_surrogate_escapes_become_replacement_characters(tok, tmp_path):
    """`"\\udc00"` alone is valid JSON but no text a tokenizer encodes: it becomes U+FFFD, as a bad byte of a
    text file does (docs/training.md); an escaped pair (an emoji) stays the character it encodes."""
    path = tmp_path / "s.jsonl"
    path.write_text('{"text": "x\\udc00y \\ud83d\\ude00 z\\uD800"}\n{"text": "plain"}\n')
    tokens, offsets = _cache(CptDataConfig(paths=[str(path)], seq_len=4, cache_dir=str(tmp_path / "cache")), tok)
    docs = [tokens[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])]
    assert docs == _docs(tok, ["x\ufffdy \U0001f600 z\ufffd", "plain"])


def test_a_file_that_is_not_text_is_refused_by_name(tok, tmp_path):
    cache = str(tmp_path / "cache")
    binary = tmp_path / "ls"
    binary.write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)) * 64)  # an executable's kind of bytes
    with pytest.raises(ValueError, match=rf"data\.paths: {binary} is not text \(NUL bytes"):
        build_cpt_datasets(CptDataConfig(paths=[str(binary)], cache_dir=cache), tok, 0)
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("Déjà vu à la française, où l'été est très beau. ".encode("latin-1") * 100)
    with pytest.raises(ValueError, match=rf"{latin1} is not text \(\d+ of its first \d+ bytes are not UTF-8"):
        build_cpt_datasets(CptDataConfig(paths=[str(latin1)], cache_dir=cache), tok, 0)


def test_files_that_are_not_text_in_a_folder_are_skipped_and_counted(tok, tmp_path, caplog):
    root = tmp_path / "repo"
    root.mkdir()
    good = "def f(x):\n    return x + 1\n" * 20
    (root / "a.py").write_text(good)
    (root / "b.py").write_bytes(b"\x00\x01\x02 compiled, not source " * 50)
    (root / "c.txt").write_bytes((b"one stray \xff byte" + b" in long enough text." * 10) * 20)  # 0.5%: kept
    cfg = CptDataConfig(paths=[str(root)], include=["*.py", "*.txt"], seq_len=8, cache_dir=str(tmp_path / "cache"))
    with caplog.at_level("WARNING", logger="fp8train.data.cpt"):
        tokens, offsets = _cache(cfg, tok)
    assert "skipped 1 file that is not text" in caplog.text and "b.py" in caplog.text
    assert len(offsets) == 3  # a.py and c.txt
    text = tok.decode(tokens[tokens != EOS])
    assert good in text and "\x00" not in text and text.count("\ufffd") == 20


def test_one_large_text_file_is_split_for_the_validation_split(tok, tmp_path, caplog):
    paragraphs = [f"Paragraph {i}: the {'cat' if i % 2 else 'dog'} sat on mat number {i}." for i in range(400)]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(paragraphs))
    cfg = CptDataConfig(paths=[str(corpus)], seq_len=32, val_fraction=0.1, cache_dir=str(tmp_path / "cache"))
    with caplog.at_level("INFO", logger="fp8train.data.cpt"):
        train, val = build_cpt_datasets(cfg, tok, seed=0)
    assert "1 document is too few for data.val_fraction=0.1: split into" in caplog.text
    assert val is not None and 0.07 < len(val) / (len(train) + len(val)) < 0.13

    def spans(ds):  # token ranges of the cache each split reads
        return {(int(s), int(s + n)) for s, n in zip(ds.seg_starts, ds.seg_lengths)}

    positions = {name: set().union(*(range(a, b) for a, b in spans(ds))) for name, ds in (("t", train), ("v", val))}
    assert not positions["t"] & positions["v"]  # no token is in both splits
    again_train, again_val = build_cpt_datasets(cfg, tok, seed=0)
    assert spans(again_val) == spans(val)  # the same seed holds out the same chunks


def test_a_large_text_file_is_read_and_tokenized_in_pieces(tok, tmp_path, monkeypatch):
    monkeypatch.setattr(cpt_module, "_READ_BYTES", 256)
    monkeypatch.setattr(cpt_module, "_PIECE_CHARS", 1000)
    text = "\n\n".join(f"Section {i}.\nSome text, café naïve {i}, and more words." for i in range(300))
    text += "\n" + "a line without any blank line after it " * 80  # no paragraph break: cut at a newline/anywhere
    path = tmp_path / "big.txt"
    path.write_text(text)
    seen = []
    encode = cpt_module._encode_batch
    monkeypatch.setattr(cpt_module, "_encode_batch", lambda t, texts: seen.extend(map(len, texts)) or encode(t, texts))
    tokens, offsets = _cache(CptDataConfig(paths=[str(path)], seq_len=8, cache_dir=str(tmp_path / "cache")), tok)
    assert len(seen) > 10 and max(seen) <= 1000 + 256  # never the whole file at once
    assert len(offsets) == 2 and tokens[-1] == EOS and (tokens == EOS).sum() == 1  # still one document
    assert tok.decode(tokens[:-1]) == text  # nothing lost or doubled at the cuts


@pytest.fixture
def hf_texts(tmp_path):
    """Texts as a `datasets` folder (save_to_disk), a lone Arrow file, and a cached Hub dataset."""
    datasets = pytest.importorskip("datasets")
    texts = [f"Row {i}: {'lorem ipsum dolor ' * (i % 5 + 1)}end." for i in range(40)]
    ds = datasets.Dataset.from_dict({"text": texts, "body": [t.upper() for t in texts], "id": list(range(40))})
    return texts, _hf_sources(datasets, ds, tmp_path)


def _hf_sources(datasets, ds, tmp_path) -> dict:
    """Write `ds` as a save_to_disk folder, an Arrow file, and the local cache of a Hub dataset `someone/corpus`
    as `load_dataset` leaves it (then readable with HF_HUB_OFFLINE=1)."""
    import glob
    import shutil

    from datasets.data_files import DataFilesDict
    from datasets.packaged_modules.parquet.parquet import Parquet

    ds.save_to_disk(str(tmp_path / "saved"))
    arrow = tmp_path / "one.arrow"
    shutil.copy(next((tmp_path / "saved").glob("*.arrow")), arrow)
    ds.to_parquet(str(tmp_path / "src.parquet"))
    cache = tmp_path / "hf_cache"
    builder = Parquet(cache_dir=str(cache / "build"), dataset_name="corpus", config_name="default", hash="0123",
                      data_files=DataFilesDict.from_patterns({"train": [str(tmp_path / "src.parquet")]}))
    builder.download_and_prepare()
    (cache / "someone___corpus").mkdir()
    shutil.move(glob.glob(str(cache / "build" / "corpus" / "default-*"))[0], cache / "someone___corpus" / "default")
    return {"saved": tmp_path / "saved", "arrow": arrow, "cache": cache}


@pytest.fixture
def offline(monkeypatch):
    """No network: any connection attempt fails the test; datasets is told it is offline, as a user would."""
    import socket

    import datasets

    def refuse(*args, **kwargs):
        raise AssertionError("tried to reach the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


def test_datasets_folders_arrow_files_and_hub_cache(tok, tmp_path, hf_texts, offline):
    from fp8train.data import HfDatasetConfig

    texts, src = hf_texts
    want = _docs(tok, texts)
    cache = str(tmp_path / "cache")
    for paths in ([str(src["saved"])], [str(src["arrow"])]):
        tokens, offsets = _cache(CptDataConfig(paths=paths, seq_len=8, cache_dir=cache), tok)
        assert [tokens[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])] == want, paths
    hub = HfDatasetConfig(name="someone/corpus", split="train", cache_dir=str(src["cache"]))
    tokens, offsets = _cache(CptDataConfig(hf_dataset=hub, seq_len=8, cache_dir=cache), tok)
    assert [tokens[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])] == want
    body = HfDatasetConfig(name="someone/corpus", column="body", cache_dir=str(src["cache"]))
    tokens, _ = _cache(CptDataConfig(hf_dataset=body, seq_len=8, cache_dir=cache), tok)
    assert tok.decode(tokens[:len(want[0]) + 3]).startswith(texts[0].upper())
    tokens, offsets = _cache(CptDataConfig(paths=[str(src["saved"])], hf_dataset=hub, seq_len=8, cache_dir=cache), tok)
    assert [tokens[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])] == want + want  # files, then the dataset
    with pytest.raises(ValueError, match=r"no column 'content' \(data\.text_field\).*\['text', 'body', 'id'\]"):
        _cache(CptDataConfig(paths=[str(src["saved"])], text_field="content", cache_dir=cache), tok)
    with pytest.raises(ValueError, match=r"data\.hf_dataset: 'someone/missing'.*could not be loaded"):
        _cache(CptDataConfig(hf_dataset=HfDatasetConfig(name="someone/missing", cache_dir=str(src["cache"])),
                             cache_dir=cache), tok)
    folder = tmp_path / "local"  # a local folder of data files, one malformed: datasets raises no ValueError
    folder.mkdir()
    (folder / "train.jsonl").write_text('{"text": "ok"}\n{"text": broken\n')
    local = HfDatasetConfig(name=str(folder), cache_dir=str(tmp_path / "hf_local"))
    with pytest.raises(ValueError, match=rf"^data\.hf_dataset: '{folder}'\[train\] could not be loaded \(ArrowInvalid: "
                                         "JSON parse error"):
        _cache(CptDataConfig(hf_dataset=local, cache_dir=cache), tok)
