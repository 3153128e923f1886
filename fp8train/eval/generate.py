"""Sampling completions from a model directory: transformers (batched, left padding) or vLLM."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["SamplingConfig", "Completion", "BACKENDS", "check_model_dir", "resolve_backend", "load_tokenizer_for",
           "render_prompts", "generate"]

BACKENDS = ("auto", "hf", "vllm")


@dataclass
class SamplingConfig:
    samples: int = 1
    """Completions per prompt (k of pass@1 averaging and maj@k)."""
    temperature: float = 0.6
    """Sampling temperature (ignored with greedy)."""
    top_p: float = 0.95
    """Nucleus sampling mass (ignored with greedy)."""
    max_new_tokens: int = 2048
    """Longest completion; longer ones are cut and counted as unfinished."""
    batch_size: int = 8
    """Sequences per transformers generate() call (vLLM schedules its own batches)."""
    greedy: bool = False
    """Greedy decoding instead of sampling."""
    seed: int = 0
    """Seed of the sampler."""


@dataclass
class Completion:
    text: str
    """Generated text after the prompt, special tokens removed."""
    num_tokens: int
    """Generated tokens, including the stop token."""
    finished: bool
    """Ended with an end-of-sequence token (False: cut at max_new_tokens)."""


def resolve_backend(name: str) -> str:
    """`auto` -> vLLM when it is importable and a GPU is present, else transformers."""
    if name not in BACKENDS:
        raise ValueError(f"eval: unknown backend {name!r}; expected one of {list(BACKENDS)}")
    has_vllm = importlib.util.find_spec("vllm") is not None
    if name == "vllm" and not has_vllm:
        raise ImportError("eval: --backend vllm needs the vllm package (pip install vllm)")
    if name == "auto":
        return "vllm" if has_vllm and torch.cuda.is_available() else "hf"
    return name


def check_model_dir(model: str | Path) -> Path:
    """`model` as a local model directory with config.json, complete safetensors weights and a tokenizer;
    anything else is an error naming the path (eval never reaches for a hub)."""
    from ..data.tokenizer import has_tokenizer_files
    from ..train.model import weight_files

    path = Path(model)
    if not path.exists():
        raise FileNotFoundError(f"eval: model directory {path} does not exist")
    if not path.is_dir() or not (path / "config.json").is_file():
        raise FileNotFoundError(f"eval: {path} is not a model directory (no config.json)")
    if not has_tokenizer_files(path):
        raise FileNotFoundError(
            f"eval: {path} has no tokenizer (tokenizer.json or tokenizer_config.json); save the tokenizer with "
            f"the model (`fp8train export` copies it from the checkpoint)"
        )
    weight_files(path, "eval")
    return path


def load_tokenizer_for(model: str | Path):
    """The tokenizer saved with the model directory `model` (checked by `check_model_dir`)."""
    from transformers import AutoTokenizer

    path = check_model_dir(model)
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # tokenizer files of any kind: the message says which model
        raise ValueError(f"eval: could not load the tokenizer of {path}: {str(e).splitlines()[0]}") from None


def render_prompts(tokenizer, conversations: list[list[dict]], chat_template: bool, force_think: bool) -> list[str]:
    """Prompt strings: the chat template with the assistant turn opened (and "<think>\\n" when forced)."""
    if chat_template and not tokenizer.chat_template:
        raise ValueError("eval: the tokenizer has no chat template; add one or pass --no-chat-template")
    out = []
    for conv in conversations:
        if chat_template:
            text = tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        else:
            text = "\n\n".join(m["content"] for m in conv) + "\n"
        out.append(text + "<think>\n" if force_think else text)
    return out


def _stop_ids(tokenizer, model_dir: str) -> list[int]:
    """EOS ids of the generation config and the tokenizer, plus the end-of-turn tokens the vocab has."""
    from transformers import GenerationConfig

    try:
        gen_eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except OSError:  # no generation_config.json
        gen_eos = None
    from ..data.tokenizer import end_of_turn_ids

    ids = end_of_turn_ids(tokenizer, also=gen_eos)
    if not ids:
        raise ValueError(f"eval: {model_dir} defines no eos token; generation could never stop")
    return ids


def _generate_hf(model_dir: str, tokenizer, prompts: list[str], cfg: SamplingConfig, add_special: bool,
                 device: str | None = None):
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM

    stop = _stop_ids(tokenizer, model_dir)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    # device_map puts an fp8-block export straight on the GPU (FP8 GEMMs); on CPU it is dequantized.
    extra = {"device_map": device} if device == "cuda" else {}
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto", **extra).to(device).eval()
    except (OSError, RuntimeError) as e:  # e.g. weights whose shapes disagree with config.json
        raise ValueError(f"eval: transformers could not load {model_dir}: {str(e).splitlines()[0]}") from None
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop[0]
    enc = tokenizer(prompts, add_special_tokens=add_special)["input_ids"]
    jobs = [(p, s) for p in range(len(prompts)) for s in range(cfg.samples)]
    jobs.sort(key=lambda j: -len(enc[j[0]]))  # similar lengths share a batch: less padding
    # use_cache: a training checkpoint's config says False (training needs no KV cache); generating does.
    kwargs = dict(max_new_tokens=cfg.max_new_tokens, eos_token_id=stop, pad_token_id=pad_id, do_sample=not cfg.greedy,
                  use_cache=True)
    if not cfg.greedy:  # top_k=0: plain nucleus sampling, whatever the model's generation_config says
        kwargs.update(temperature=cfg.temperature, top_p=cfg.top_p, top_k=0)
    results: list[list[Completion | None]] = [[None] * cfg.samples for _ in prompts]
    torch.manual_seed(cfg.seed)  # generate() samples from the default generator
    with torch.inference_mode(), tqdm(total=len(jobs), desc="generate", unit="seq") as bar:
        for i in range(0, len(jobs), cfg.batch_size):
            chunk = jobs[i: i + cfg.batch_size]
            width = max(len(enc[p]) for p, _ in chunk)  # left padding: every prompt ends at `width`
            ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for r, (p, _) in enumerate(chunk):
                ids[r, width - len(enc[p]):] = torch.tensor(enc[p])
                mask[r, width - len(enc[p]):] = 1
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **kwargs)
            for r, (p, s) in enumerate(chunk):
                new = out[r, width:].tolist()
                end = next((j for j, t in enumerate(new) if t in stop), None)
                kept = new if end is None else new[:end]
                text = tokenizer.decode(kept, skip_special_tokens=True)
                results[p][s] = Completion(text, len(new) if end is None else end + 1, end is not None)
            bar.update(len(chunk))
    return results


def _generate_vllm(model_dir: str, tokenizer, prompts: list[str], cfg: SamplingConfig, add_special: bool,
                   device: str | None = None):
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, seed=cfg.seed)
    params = SamplingParams(
        n=cfg.samples, max_tokens=cfg.max_new_tokens,
        temperature=0.0 if cfg.greedy else cfg.temperature, top_p=1.0 if cfg.greedy else cfg.top_p,
        stop_token_ids=_stop_ids(tokenizer, model_dir),
    )
    # Token ids, not text: the same tokenization as the transformers path (no second BOS).
    enc = tokenizer(prompts, add_special_tokens=add_special)["input_ids"]
    outs = llm.generate([{"prompt_token_ids": ids} for ids in enc], params, use_tqdm=True)
    return [[Completion(o.text, len(o.token_ids), o.finish_reason == "stop") for o in req.outputs] for req in outs]


def generate(model_dir: str, tokenizer, prompts: list[str], cfg: SamplingConfig, backend: str = "hf",
             add_special_tokens: bool = False, device: str | None = None) -> list[list[Completion]]:
    """`cfg.samples` completions for each prompt string, in prompt order.

    transformers batches prompts of similar length with left padding and a KV cache, on `device` (default:
    CUDA when available, else the CPU); vLLM places the model itself.
    """
    fn = _generate_vllm if backend == "vllm" else _generate_hf
    return fn(str(model_dir), tokenizer, prompts, cfg, add_special_tokens, device)
