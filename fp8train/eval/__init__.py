"""Reasoning evaluation: sampling (transformers or vLLM), answer extraction and scoring, pass@1 / maj@k.

`fp8train eval MODEL --data FILE.jsonl` is registered by `add_cli`; `run_eval(EvalConfig(...))` is the
Python entry point.
"""

from .generate import Completion, SamplingConfig, generate, load_tokenizer_for, render_prompts
from .runner import EvalConfig, Problem, add_cli, load_problems, run_eval
from .scoring import (
    extract_choice, extract_gold, extract_math_answer, math_equal, normalize_math_answer, shuffle_choices,
)

__all__ = [
    "Completion", "EvalConfig", "Problem", "SamplingConfig", "add_cli", "extract_choice", "extract_gold",
    "extract_math_answer", "generate", "load_problems", "load_tokenizer_for", "math_equal",
    "normalize_math_answer", "render_prompts", "run_eval", "shuffle_choices",
]
