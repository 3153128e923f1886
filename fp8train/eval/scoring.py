"""Answer extraction and equivalence: math final answers and multiple-choice letters.

Math: `extract_math_answer` finds the final answer of a model output (the last well-formed
`\\boxed{...}`, then `#### N`, then "the answer is X", then the last number); `extract_gold` reads a
dataset's reference answer the same way but falls back to the whole string; `math_equal` decides
equivalence by normalized string, then exact number (commas, units, `$`, `%`, LaTeX fractions), then
numeric evaluation of simple expressions through sympy. Model output is untrusted text: sympy only
sees strings made of digits, operators, single-letter symbols and a few function names, small enough
and with bounded exponents, evaluated under a time limit, so a pathological string cannot run code
or hang the evaluation.

Multiple choice (GPQA style): `shuffle_choices` permutes options deterministically per (seed, key);
`extract_choice` reads the chosen letter ("Answer: C", "\\boxed{C}", "(C)", a final lone letter).
"""

from __future__ import annotations

import math
import random
import re
import signal
import threading
import time
from contextlib import contextmanager
from fractions import Fraction

__all__ = [
    "extract_math_answer", "extract_gold", "normalize_math_answer", "math_equal",
    "LETTERS", "shuffle_choices", "extract_choice",
]

LETTERS = "ABCDEFGHIJ"
_SYMPY_MAX_LEN = 120
_SYMPY_MAX_EXP = 64
_SYMPY_TIMEOUT_S = 2.0
_FUNCS = ("sqrt", "pi", "log", "ln", "exp", "sin", "cos", "tan")


# ---------------------------------------------------------------- extraction

def _braced(text: str, start: int) -> tuple[str, int] | None:
    """The contents of the balanced {...} opening at text[start], and the index after it."""
    if start >= len(text) or text[start] != "{":
        return None
    depth = 0
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + 1: i], i + 1
    return None


def _last_boxed(text: str) -> str | None:
    """Contents of the last well-formed \\boxed{...} / \\fbox{...} (nested braces allowed), or \\boxed X."""
    for m in reversed(list(re.finditer(r"\\(?:boxed|fbox)", text))):
        rest = m.end()
        while rest < len(text) and text[rest] == " ":
            rest += 1
        got = _braced(text, rest)
        if got is not None:
            return got[0].strip()
        bare = re.match(r"\s+([^\s$]+)", text[m.end():])  # "\boxed 5"
        if bare:
            return bare.group(1)
    return None


_ANSWER_IS = re.compile(r"(?i:answer)\s*(?:(?i:is)\b|[:：])\s*[:：]?\s*(.+)")
_NUMBER = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|(?<![\w.])-?\.\d+")


def _cut_sentence(s: str) -> str:
    """Drop what follows the first sentence end (a period then space), e.g. '$5$. I hope it is correct.'"""
    s = re.split(r"\.\s+(?=\S)", s.strip(), maxsplit=1)[0]
    return s.strip().strip("*").strip().rstrip(".").strip()


def extract_math_answer(text: str) -> str | None:
    """The final answer in a model output, or None when there is none."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    hashes = re.findall(r"####\s*(.+)", text)
    if hashes:
        return hashes[-1].strip()
    for start in reversed([m.start() for m in re.finditer(r"(?i:answer)", text)]):  # last phrase wins
        said = _ANSWER_IS.match(text, start)
        if said and _cut_sentence(said.group(1)):
            return _cut_sentence(said.group(1))
    nums = _NUMBER.findall(text)
    return nums[-1] if nums else None


def extract_gold(answer: str) -> str:
    """A dataset's reference answer: its \\boxed{} or `#### N` part if it has one, else the whole string."""
    answer = str(answer)
    boxed = _last_boxed(answer)
    if boxed is not None:
        return boxed
    hashes = re.findall(r"####\s*(.+)", answer)
    return hashes[-1].strip() if hashes else answer.strip()


# ---------------------------------------------------------------- normalization

def _replace_frac(s: str) -> str:
    """\\frac{a}{b} -> (a)/(b) (recursively; \\frac12 shorthand too); plain tokens lose their parens."""
    while True:
        m = re.search(r"\\frac", s)
        if not m:
            return s
        i = m.end()
        while i < len(s) and s[i] == " ":
            i += 1
        parts = []
        for _ in range(2):
            got = _braced(s, i)
            if got is not None:
                parts.append(got[0])
                i = got[1]
            elif i < len(s) and s[i] not in "{}\\":
                parts.append(s[i])
                i += 1
            else:
                return s  # malformed: leave it as is
        num, den = (_replace_frac(p) for p in parts)
        num, den = (p if re.fullmatch(r"-?\w+(?:\.\d+)?", p) else f"({p})" for p in (num, den))
        s = f"{s[:m.start()]}{num}/{den}{s[i:]}"


_TEXT_WRAPPERS = r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox|operatorname)\s*"


def normalize_math_answer(s: str) -> str:
    """Canonical string form of an answer: LaTeX spacing, units, `$`, `%`, degrees, thousands commas
    and `var =` removed, fractions as a/b, no spaces, no trailing period."""
    s = str(s).strip()
    for a, b in (("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("\\left", ""), ("\\right", ""),
                 ("\\displaystyle", ""), ("\\!", ""), ("\\,", ""), ("\\;", ""), ("\\:", ""), ("\\ ", " "),
                 ("^{\\circ}", ""), ("^\\circ", ""), ("°", ""), ("\\%", ""), ("%", ""), ("\\$", ""), ("$", ""),
                 ("\\(", ""), ("\\)", ""), ("\\[", ""), ("\\]", ""), ("\\cdot", "*"), ("\\times", "*"),
                 ("\\div", "/")):
        s = s.replace(a, b)
    # a number followed by a \text{unit} (with an optional power): keep the number
    s = re.sub(rf"^(.*?\d)\s*{_TEXT_WRAPPERS}\{{[^{{}}]*\}}(?:\^\{{?\d\}}?)?\s*\.?$", r"\1", s)
    s = re.sub(rf"{_TEXT_WRAPPERS}\{{([^{{}}]*)\}}", r"\1", s)  # other \text{...}: keep the words
    s = s.strip().rstrip(".").strip()
    # plain-word units after a number: "72 clips", "5 cm", "10 dollars"
    m = re.fullmatch(r"(-?[\d.,/]*\d)\s+([a-zA-Z][a-zA-Z. ]*)", s)
    if m and m.group(2).strip(". ").lower() not in ("pi", "i", "e"):
        s = m.group(1)
    if s.count("=") == 1 and re.match(r"^[a-zA-Z](?:_\{?\w+\}?)?\s*=", s):  # "x = 3"
        s = s.split("=", 1)[1]
    s = re.sub(r"\\sqrt\s*(\w)", r"\\sqrt{\1}", s)
    s = _replace_frac(s)
    s = re.sub(r"\s+", "", s).rstrip(".")
    if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):
        s = s.replace(",", "")
    while len(s) > 2 and s[0] == "{" and s[-1] == "}" and _braced(s, 0) == (s[1:-1], len(s)):
        s = s[1:-1]
    return s.lstrip("+")


def _to_fraction(s: str) -> Fraction | None:
    m = re.fullmatch(r"(-?)\(?(-?\d+(?:\.\d+)?|-?\.\d+)\)?(?:/\(?(\d+(?:\.\d+)?)\)?)?", s)
    if not m:
        return None
    try:
        val = Fraction(m.group(2)) / (Fraction(m.group(3)) if m.group(3) else 1)
    except (ValueError, ZeroDivisionError):
        return None
    return -val if m.group(1) else val


# ---------------------------------------------------------------- sympy (guarded)

@contextmanager
def _time_limit(seconds: float):
    """Raise TimeoutError after `seconds` (main thread on Unix; elsewhere only the static guards apply)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def _raise(signum, frame):
        raise TimeoutError("sympy comparison timed out")

    old = signal.signal(signal.SIGALRM, _raise)
    outer, start = signal.setitimer(signal.ITIMER_REAL, seconds), time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        if outer[0] > 0:  # give back a caller's pending timer, less the time spent here
            signal.setitimer(signal.ITIMER_REAL, max(outer[0] - (time.monotonic() - start), 1e-3), outer[1])


def _to_sympy_text(s: str) -> str | None:
    """Normalized LaTeX-ish answer -> a whitelisted plain expression, or None if it is not one."""
    s = re.sub(r"\\sqrt\[(\w+)\]\{([^{}]*)\}", r"(\2)^(1/(\1))", s)
    for a, b in (("\\sqrt", "sqrt"), ("\\pi", "pi"), ("\\ln", "log"), ("\\log", "log"), ("\\exp", "exp"),
                 ("\\sin", "sin"), ("\\cos", "cos"), ("\\tan", "tan"), ("{", "("), ("}", ")"), ("^", "**")):
        s = s.replace(a, b)
    if len(s) > _SYMPY_MAX_LEN or not re.fullmatch(r"[0-9a-zA-Z+\-*/(). ]+", s):
        return None
    if re.search(r"[a-zA-Z]\.|\.[a-zA-Z]", s):  # no attribute access
        return None
    if any(len(w) > 1 and w not in _FUNCS for w in re.findall(r"[a-zA-Z]+", s)):
        return None
    return s


def _sympy_expr(text: str):
    import sympy
    from sympy.parsing.sympy_parser import (
        convert_xor, implicit_multiplication_application, parse_expr, standard_transformations,
    )

    names = {f: getattr(sympy, f) for f in _FUNCS if f != "ln"} | {"ln": sympy.log, "E": sympy.E}
    names |= {c: sympy.Symbol(c) for c in set(re.findall(r"\b[a-zA-Z]\b", text)) if c not in ("E",)}
    expr = parse_expr(text, local_dict=names, evaluate=False,
                      transformations=standard_transformations + (implicit_multiplication_application, convert_xor))
    for node in sympy.postorder_traversal(expr):  # inner exponents first: never evaluate a huge one
        if isinstance(node, sympy.Pow) and node.exp.is_number and abs(float(node.exp)) > _SYMPY_MAX_EXP:
            raise ValueError("exponent too large")
        if isinstance(node, sympy.Integer) and abs(int(node)) > 10**30:
            raise ValueError("integer too large")
    return expr


def _sympy_equal(a: str, b: str) -> bool:
    ta, tb = _to_sympy_text(a), _to_sympy_text(b)
    if ta is None or tb is None:
        return False
    try:
        with _time_limit(_SYMPY_TIMEOUT_S):
            ea, eb = _sympy_expr(ta), _sympy_expr(tb)
            syms = sorted(ea.free_symbols | eb.free_symbols, key=str)
            points = [dict(zip(syms, (0.3711 + 0.6173 * k + 0.1093 * j for j in range(len(syms))))) for k in range(3)]
            for point in points if syms else [{}]:
                va, vb = complex(ea.evalf(30, subs=point)), complex(eb.evalf(30, subs=point))
                if not (math.isfinite(abs(va)) and abs(va - vb) <= 1e-9 * max(1.0, abs(vb))):
                    return False
            return True
    except Exception:  # parse errors, TimeoutError, non-numeric results: not provably equal
        return False


def math_equal(pred: str | None, gold: str | None) -> bool:
    """True if two final answers are the same value (see the module docstring for what is tried)."""
    if pred is None or gold is None:
        return False
    pct = "%" in str(pred) or "%" in str(gold)
    a, b = normalize_math_answer(pred), normalize_math_answer(gold)
    if not a or not b:
        return False
    if a.lower() == b.lower():
        return True
    fa, fb = _to_fraction(a), _to_fraction(b)
    if fa is not None and fb is not None:
        cands = [fa, fa * 100, fa / 100] if pct else [fa]
        return any(c == fb or math.isclose(c, fb, rel_tol=1e-6, abs_tol=1e-12) for c in cands)
    for open_, close in ("()", "[]"):  # tuples / intervals: element by element
        if a[:1] == b[:1] == open_ and a[-1:] == b[-1:] == close and "," in a:
            xs, ys = _split_top(a[1:-1]), _split_top(b[1:-1])
            return len(xs) == len(ys) and all(math_equal(x, y) for x, y in zip(xs, ys))
    return _sympy_equal(a, b)


def _split_top(s: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in s:
        depth += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return out + [cur]


# ---------------------------------------------------------------- multiple choice

def shuffle_choices(choices: list[str], answer_index: int, seed: int, key: str | int) -> tuple[list[str], int]:
    """Deterministically permute `choices` for (seed, key); returns the options and the new answer index."""
    order = list(range(len(choices)))
    random.Random(f"{seed}:{key}").shuffle(order)
    return [choices[i] for i in order], order.index(answer_index)


def extract_choice(text: str, num_choices: int = 4) -> str | None:
    """The chosen option letter in a model output, or None."""
    valid = LETTERS[:num_choices]
    letter = rf"([{valid}])"
    boxed = _last_boxed(text)
    if boxed is not None:
        inner = re.sub(rf"{_TEXT_WRAPPERS}\{{([^{{}}]*)\}}", r"\1", boxed).strip()
        m = re.match(rf"\(?{letter}\)?(?![A-Za-z])", inner)
        if m:
            return m.group(1)
    hits = re.findall(rf"(?i:answer)(?:\s+(?i:is))?\s*[:：]?\s*[*_$]*\s*\(?{letter}\)?(?![A-Za-z])", text)
    if hits:
        return hits[-1]
    hits = re.findall(rf"\({letter}\)", text)
    if hits:
        return hits[-1]
    lines = [ln.strip().strip("*_$ ") for ln in text.strip().splitlines() if ln.strip()]
    if lines:
        m = re.fullmatch(rf"\(?{letter}\)?[.:)]?", lines[-1]) or re.search(rf"(?:^|\s){letter}[.)]?$", lines[-1])
        if m:
            return m.group(1)
    return None
