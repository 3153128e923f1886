"""`fp8train eval`: load problems, sample completions, score them, write results and metrics.

Outputs in `EvalConfig.out`, which must not hold earlier results (by default eval_results/<model>_<data>,
then _2, _3, ... for later evals of the same pair):
  results.jsonl  one line per problem: prompt, gold, outputs, extracted answers, verdicts, majority vote
  metrics.json   pass@1 (mean over problems of the mean over samples), maj@k, pass@k, counts, the config
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..threads import cpu_threads
from ..train.checkpoint import hf_model_dir
from ..train.files import write_text_atomic
from .generate import BACKENDS, SamplingConfig, generate, load_tokenizer_for, render_prompts, resolve_backend
from .scoring import LETTERS, extract_choice, extract_gold, extract_math_answer, math_equal, shuffle_choices

__all__ = ["EvalConfig", "Problem", "load_problems", "run_eval", "add_cli", "MATH_INSTRUCTION", "MC_INSTRUCTION"]

TASKS = ("math", "mc")
_RESULTS = ("results.jsonl", "metrics.json")
MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
MC_INSTRUCTION = (
    "Answer the following multiple choice question. The last line of your response should be of the "
    "following format: 'Answer: $LETTER' (without quotes) where LETTER is one of {letters}. "
    "Think step by step before answering."
)


@dataclass(kw_only=True)
class EvalConfig(SamplingConfig):
    """What `fp8train eval` runs: the sampling (`SamplingConfig`'s keys; greedy decoding needs samples 1, and
    `seed` also shuffles mc options), the problems and how to read and prompt them, where the results go."""
    model: str
    """Model directory (config, weights and tokenizer), e.g. an `fp8train export` output or a training
    checkpoint (its model/ directory is used)."""
    data: str
    """Problems: JSONL (one object per line) or JSON (a list, or an object with a `problems` list/dict)."""
    task: str = "math"
    """`math` (final-answer equivalence) or `mc` (multiple-choice letter)."""
    force_think: bool = False
    """Open the assistant turn with "<think>\\n" so the model starts by reasoning."""
    question_field: str = "question"
    """Field holding the problem text."""
    answer_field: str = "answer"
    """Field holding the reference: a final answer, a `#### N` or `\\boxed{}` solution; for mc a letter,
    an index or the text of the correct choice."""
    choices_field: tuple[str, ...] = ("choices",)
    """mc: one field holding a list of options, or several fields holding one option each."""
    out: str | None = None
    """Output directory, refused when it holds earlier results; default eval_results/<model dir name>_<data
    file stem>, or the first of its _2, _3, ... siblings that holds none."""
    backend: str = "auto"
    """`hf` (transformers), `vllm`, or `auto` (vLLM when importable and a GPU is present)."""
    limit: int | None = None
    """Evaluate only the first N problems."""
    chat_template: bool = True
    """Wrap the prompt in the tokenizer's chat template."""
    system_prompt: str | None = None
    """Optional system message."""
    instruction: str | None = None
    """Text appended to every question; default MATH_INSTRUCTION or MC_INSTRUCTION."""
    cpu_threads: int = 1
    """torch threads when generating on the CPU; 0 = torch's default (`fp8train.threads` says why one)."""

    def __post_init__(self):
        checks = {
            "task": self.task in TASKS, "backend": self.backend in BACKENDS, "samples": self.samples >= 1,
            "batch_size": self.batch_size >= 1, "max_new_tokens": self.max_new_tokens >= 1,
            "top_p": 0 < self.top_p <= 1, "temperature": self.greedy or self.temperature > 0,
            "limit": self.limit is None or self.limit >= 1, "choices_field": len(self.choices_field) >= 1,
            "cpu_threads": self.cpu_threads >= 0,
        }
        for key, ok in checks.items():
            if not ok:
                flag = "--threads" if key == "cpu_threads" else f"--{key.replace('_', '-')}"
                raise ValueError(f"eval: invalid {key}={getattr(self, key)!r} ({flag})")
        if self.greedy and self.samples > 1:
            raise ValueError("eval: greedy decoding with samples > 1 gives identical samples; use --samples 1 (or "
                             "sample with a --temperature instead of --greedy)")
        self.choices_field = tuple(self.choices_field)

    def out_dir(self) -> Path:
        """Where this eval writes: `out`, refused when it holds earlier results, or the first default folder
        without any."""
        if self.out is not None:
            out = Path(self.out)
            if out.exists() and not out.is_dir():
                raise FileExistsError(f"eval: --out {out} is a file, not a folder")
            if any((out / name).exists() for name in _RESULTS):
                raise FileExistsError(f"eval: {out} already holds the results of an earlier eval (metrics.json); "
                                      "pass another --out, or remove them")
            return out
        base = Path("eval_results") / f"{Path(self.model).resolve().name}_{Path(self.data).stem}"
        n = 1
        while (out := base.with_name(base.name + (f"_{n}" if n > 1 else ""))).exists() and (
                not out.is_dir() or any((out / name).exists() for name in _RESULTS)):
            n += 1
        return out


@dataclass
class Problem:
    where: str
    """file:line (or file:record key) it came from."""
    question: str
    gold: str
    """The reference as given."""
    gold_answer: str
    """math: the final answer extracted from `gold`; mc: the correct letter after shuffling."""
    choices: list[str] = field(default_factory=list)
    """mc: options in the order shown to the model."""


def _json_type(value) -> str:
    """What a parsed JSON value is, in JSON's words."""
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    return names.get(type(value), "null")


def _records(path: Path):
    """(where, object) for every record of a JSONL or JSON file."""
    if path.is_dir():
        raise IsADirectoryError(f"eval: data file {path} is a folder, not a file; pass a .jsonl or .json file")
    if not path.is_file():
        raise FileNotFoundError(f"eval: data file {path} does not exist")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"eval: {path}:{e.lineno}: invalid JSON: {e.msg}") from None
        # The documented shapes only: a list, or e.g. CHAMP's {"problems": {id: {...}}}. Any other object
        # (a single problem, most likely) would be read as records keyed by its fields.
        problems = data.get("problems") if isinstance(data, dict) else data
        items = (problems.items() if isinstance(problems, dict) else enumerate(problems)
                 if isinstance(problems, list) else None)
        if items is None:
            if not isinstance(data, dict):
                got = _json_type(data)
            elif "problems" in data:
                got = f"'problems' holding {_json_type(problems)}"
            else:
                got = "an object without 'problems' (for a single problem, put it in a list)"
            raise ValueError(f"eval: {path}: expected a list of problem objects, or an object whose 'problems' is "
                             f"a list or an object of them; got {got}")
        for key, obj in items:
            yield f"{path}:record {key}", obj
        return
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"eval: {path}:{lineno}: invalid JSON: {e.msg}") from None
        yield f"{path}:{lineno}", obj


def _field(obj, name: str, where: str, option: str):
    if not isinstance(obj, dict):
        raise ValueError(f"eval: {where}: expected a JSON object, got {_json_type(obj)}")
    if name not in obj or obj[name] is None or obj[name] == "":
        raise ValueError(f"eval: {where}: missing field {name!r} (fields: {sorted(obj)}); choose it with {option}")
    return obj[name]


def _mc_answer_index(answer, choices: list[str], where: str) -> int:
    if isinstance(answer, int) and not isinstance(answer, bool) and 0 <= answer < len(choices):
        return answer
    text = str(answer).strip()
    matches = [i for i, c in enumerate(choices) if c.strip() == text]
    if matches:
        return matches[0]
    letter = text.strip("()").upper()
    if len(letter) == 1 and letter in LETTERS[: len(choices)]:
        return LETTERS.index(letter)
    raise ValueError(f"eval: {where}: answer {answer!r} is neither an index, a letter "
                     f"A-{LETTERS[len(choices) - 1]}, nor the text of one of the {len(choices)} choices")


def load_problems(cfg: EvalConfig) -> list[Problem]:
    """Read and validate every problem (before any model is loaded, so bad data fails fast)."""
    path = Path(cfg.data)
    problems = []
    for i, (where, obj) in enumerate(_records(path)):
        if cfg.limit is not None and len(problems) >= cfg.limit:
            break
        question = str(_field(obj, cfg.question_field, where, "--question-field"))
        gold = _field(obj, cfg.answer_field, where, "--answer-field")
        if cfg.task == "math":
            problems.append(Problem(where, question, str(gold), extract_gold(str(gold))))
            continue
        if len(cfg.choices_field) == 1:
            choices = _field(obj, cfg.choices_field[0], where, "--choices-field")
            if not isinstance(choices, list):
                raise ValueError(f"eval: {where}: field {cfg.choices_field[0]!r} must be a list of options")
        else:
            choices = [_field(obj, f, where, "--choices-field") for f in cfg.choices_field]
        choices = [str(c) for c in choices]
        if not 2 <= len(choices) <= len(LETTERS):
            raise ValueError(f"eval: {where}: {len(choices)} choices; expected 2 to {len(LETTERS)}")
        shown, idx = shuffle_choices(choices, _mc_answer_index(gold, choices, where), cfg.seed, i)
        problems.append(Problem(where, question, str(gold), LETTERS[idx], shown))
    if not problems:
        raise ValueError(f"eval: {path}: no problems (the file is empty)")
    return problems


def _user_message(p: Problem, cfg: EvalConfig) -> str:
    if cfg.task == "math":
        return f"{p.question}\n\n{cfg.instruction or MATH_INSTRUCTION}"
    letters = LETTERS[: len(p.choices)]
    instruction = cfg.instruction or MC_INSTRUCTION.format(letters=letters)
    options = "\n".join(f"{letter}) {c}" for letter, c in zip(letters, p.choices))
    return f"{instruction}\n\n{p.question}\n\n{options}"


def _majority(answers: list[str | None], same) -> int | None:
    """Index of the first member of the largest group of equivalent answers (ties: earliest group)."""
    groups: list[list[int]] = []
    for i, a in enumerate(answers):
        if a is None:
            continue
        for g in groups:
            if same(a, answers[g[0]]):
                g.append(i)
                break
        else:
            groups.append([i])
    return max(groups, key=len)[0] if groups else None


def run_eval(cfg: EvalConfig) -> dict:
    """Evaluate `cfg.model` on `cfg.data`; writes results.jsonl and metrics.json, returns the metrics."""
    start = time.time()
    problems = load_problems(cfg)
    out = cfg.out_dir()  # before any model loads: earlier results are never overwritten
    backend = resolve_backend(cfg.backend)
    model = hf_model_dir(cfg.model)  # a training checkpoint: its model/, verified against the manifest
    tokenizer = load_tokenizer_for(model)
    convs = [([{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else [])
             + [{"role": "user", "content": _user_message(p, cfg)}] for p in problems]
    prompts = render_prompts(tokenizer, convs, cfg.chat_template, cfg.force_think)
    on_cpu = backend == "hf" and not torch.cuda.is_available()
    with cpu_threads(cfg.cpu_threads if on_cpu else None):
        completions = generate(model, tokenizer, prompts, cfg, backend,
                               add_special_tokens=not cfg.chat_template)

    math = cfg.task == "math"
    same = math_equal if math else (lambda a, b: a == b)
    rows, n_extracted, n_finished, n_tokens = [], 0, 0, 0
    for p, prompt, comps in zip(problems, prompts, completions):
        answers = [extract_math_answer(c.text) if math else extract_choice(c.text, len(p.choices)) for c in comps]
        verdicts = [same(a, p.gold_answer) if a is not None else False for a in answers]
        maj = _majority(answers, same)
        n_extracted += sum(a is not None for a in answers)
        n_finished += sum(c.finished for c in comps)
        n_tokens += sum(c.num_tokens for c in comps)
        rows.append({
            "where": p.where, "prompt": prompt, "question": p.question, "gold": p.gold, "gold_answer": p.gold_answer,
            **({"choices": p.choices} if p.choices else {}),
            "outputs": [c.text for c in comps], "num_tokens": [c.num_tokens for c in comps],
            "finished": [c.finished for c in comps], "extracted": answers, "correct": verdicts,
            "pass@1": sum(verdicts) / len(verdicts),
            "maj_answer": None if maj is None else answers[maj], "maj_correct": maj is not None and verdicts[maj],
        })

    n, total = len(rows), len(rows) * cfg.samples
    metrics = {
        "pass@1": sum(r["pass@1"] for r in rows) / n,
        "maj@k": sum(r["maj_correct"] for r in rows) / n,
        "pass@k": sum(any(r["correct"]) for r in rows) / n,
        "k": cfg.samples,
        "num_problems": n,
        "num_samples": total,
        "extracted_rate": n_extracted / total,
        "finished_rate": n_finished / total,
        "mean_new_tokens": n_tokens / total,
        "task": cfg.task, "model": str(cfg.model), "data": str(cfg.data), "backend": backend, "out": str(out),
        "elapsed_s": round(time.time() - start, 3),
        "config": json.loads(json.dumps(asdict(cfg))),  # as metrics.json holds it (tuples as lists)
    }
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "results.jsonl", "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    write_text_atomic(out / "metrics.json", json.dumps(metrics, indent=2) + "\n")
    return metrics


def _run_cli(args: argparse.Namespace) -> int:
    fields = {k: v for k, v in vars(args).items() if k in EvalConfig.__dataclass_fields__}
    metrics = run_eval(EvalConfig(**fields))
    k = metrics["k"]
    extra = f"  maj@{k} {metrics['maj@k']:.4f}  pass@{k} {metrics['pass@k']:.4f}" if k > 1 else ""
    print(f"{metrics['num_problems']} problems x {k} samples: pass@1 {metrics['pass@1']:.4f}{extra}"
          f"  -> {metrics['out']}")
    return 0


_HELP = {
    "samples": "completions per problem (pass@1 averages them, maj@k votes)", "temperature": "sampling temperature",
    "top_p": "nucleus sampling mass", "max_new_tokens": "longest completion", "seed": "sampler and mc shuffle seed",
    "batch_size": "sequences per transformers generate() call", "limit": "evaluate only the first N problems",
    "greedy": "greedy decoding (needs --samples 1)", "force_think": 'start the answer with "<think>\\n"',
    "chat_template": "wrap prompts in the tokenizer's chat template", "question_field": "field with the problem",
    "answer_field": "field with the reference answer (final answer, '#### N', \\boxed{}; mc: letter/index/text)",
    "out": "output directory; one that holds earlier results is refused (default eval_results/<model>_<data>, "
           "then _2, _3, ...)", "system_prompt": "optional system message",
    "instruction": "text appended to each question (default: the task's instruction)",
}


def add_cli(subparsers) -> argparse.ArgumentParser:
    """Register `fp8train eval MODEL --data FILE.jsonl [...]`."""
    d = EvalConfig.__dataclass_fields__
    p = subparsers.add_parser(
        "eval", help="sample a model on math / multiple-choice problems and score it (pass@1, maj@k)",
        description="Generate completions with transformers or vLLM and score final answers.",
    )
    p.add_argument("model", help="model directory (with its tokenizer)")
    p.add_argument("--data", required=True, help="problems, .jsonl or .json")
    p.add_argument("--task", choices=TASKS, default=d["task"].default, help="math (default) or mc (multiple choice)")
    for name, typ in (("samples", int), ("temperature", float), ("top_p", float), ("max_new_tokens", int),
                      ("batch_size", int), ("seed", int), ("limit", int)):
        p.add_argument(f"--{name.replace('_', '-')}", type=typ, default=d[name].default, help=_HELP[name])
    for name in ("greedy", "force_think", "chat_template"):
        p.add_argument(f"--{name.replace('_', '-')}", action=argparse.BooleanOptionalAction, default=d[name].default,
                       help=_HELP[name])
    for name in ("question_field", "answer_field", "out", "system_prompt", "instruction"):
        p.add_argument(f"--{name.replace('_', '-')}", default=d[name].default, help=_HELP[name])
    p.add_argument("--choices-field", nargs="+", default=list(d["choices_field"].default),
                   help="mc: one field holding a list, or several fields holding one option each")
    p.add_argument("--backend", choices=BACKENDS, default=d["backend"].default,
                   help="auto (default): vLLM when importable and a GPU is present, else transformers")
    p.add_argument("--threads", dest="cpu_threads", type=int, default=d["cpu_threads"].default,
                   help="torch threads when generating on a CPU (default 1, fastest on a busy machine; 0 = torch's "
                        "default)")
    p.set_defaults(func=_run_cli)
    return p
