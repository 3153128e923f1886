"""fp8train.eval.scoring: final-answer extraction, equivalence and multiple-choice letters."""

import time

import pytest

from fp8train.eval.scoring import (
    extract_choice, extract_gold, extract_math_answer, math_equal, normalize_math_answer, shuffle_choices,
)

EXTRACT = [
    ("The answer is $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),
    ("First \\boxed{3}, corrected: \\boxed{\\frac{a}{\\sqrt{b}}}", "\\frac{a}{\\sqrt{b}}"),   # last one wins
    ("so $x = \\boxed{\\{1, 2\\}}$ done", "\\{1, 2\\}"),
    ("We get \\boxed{5} and then \\boxed{unbalanced", "5"),       # a truncated last box is skipped
    ("\\boxed 7", "7"),
    ("\\fbox{12}", "12"),
    ("Natalia sold 48/2 = 24 clips.\n#### 1,000", "1,000"),
    ("Final Answer: The final answer is $5$. I hope it is correct.", "$5$"),
    ("Therefore, the answer is 72 clips.", "72 clips"),
    ("The answer is: -0.5.", "-0.5"),
    ("Let me answer this step by step. 3 + 4 = 7, so 7 - 2 = 5", "5"),  # "answer" without is/: -> last number
    ("We have 48/2 = 24 so in total 72.", "72"),
    ("It costs $1,250.50 in total", "1,250.50"),
    ("no number at all", None),
]


@pytest.mark.parametrize("text,want", EXTRACT)
def test_extract_math_answer(text, want):
    assert extract_math_answer(text) == want


def test_extract_gold():
    assert extract_gold("48/2 = <<48/2=24>>24 clips.\n#### 72") == "72"
    assert extract_gold("So the sum is $\\boxed{2\\sqrt{3}}$.") == "2\\sqrt{3}"
    assert extract_gold("C(n+1, 2m+1)") == "C(n+1, 2m+1)"   # CHAMP final answers are given as they are
    assert extract_gold(239) == "239"


EQUAL = [
    ("1,000", "1000"), ("1,000,000", "1e6"), ("72", "72."), ("$72", "72"), ("\\$72.00", "72"),
    ("72 clips", "72"), ("5 \\text{ cm}", "5"), ("10 \\text{cm}^2", "10"), ("5\\text{ dollars}", "5"),
    ("\\frac{1}{2}", "\\dfrac{1}{2}"), ("\\tfrac12", "1/2"), ("0.5", "\\frac{1}{2}"), ("0.50", "1/2"),
    ("-\\frac{3}{4}", "-0.75"), ("\\frac{-3}{4}", "-3/4"), ("-5", "-5.0"),
    ("x = 3", "3"), ("k=\\frac{1}{3}", "\\frac13"),
    ("50\\%", "50"), ("50%", "0.5"), ("90^\\circ", "90"), ("90^{\\circ}", "90"),
    ("\\left( 1, 2 \\right)", "(1,2)"), ("(0.5, -1)", "(\\frac{1}{2}, -1)"),
    ("\\text{No}", "No"), ("yes", "Yes"),
    ("\\sqrt{2}/2", "\\frac{1}{\\sqrt{2}}"), ("\\frac{\\sqrt3}{2}", "\\frac{\\sqrt{3}}{2}"),
    ("2x+2", "2(x+1)"), ("x^2-1", "(x-1)(x+1)"), ("\\pi/2", "\\frac{\\pi}{2}"), ("\\sqrt[3]{8}", "2"),
    ("2^{10}", "1024"), ("1\\,000", "1000"), ("{7}", "7"),
]
NOT_EQUAL = [
    ("3", "4"), ("-5", "5"), ("1/3", "0.333"), ("1,000", "1,001"), ("x^2", "x^3"), ("(1,2)", "(2,1)"),
    ("(1,2)", "(1,2,3)"), ("2x", "2y"), (None, "3"), ("", "3"), ("\\frac{1}{0}", "1"), ("No", "Yes"),
]


@pytest.mark.parametrize("a,b", EQUAL)
def test_math_equal(a, b):
    assert math_equal(a, b) and math_equal(b, a)


@pytest.mark.parametrize("a,b", NOT_EQUAL)
def test_math_not_equal(a, b):
    assert not math_equal(a, b)


def test_normalize():
    assert normalize_math_answer("\\dfrac{3}{4}") == normalize_math_answer("\\frac34") == "3/4"
    assert normalize_math_answer(" \\left( \\frac{a+1}{b} \\right). ") == "((a+1)/b)"
    assert normalize_math_answer("1,234,567.5") == "1234567.5"
    assert normalize_math_answer("(1,234)") == "(1,234)"   # a tuple keeps its comma


@pytest.mark.parametrize("hostile", [
    "9^{9^{9^{9}}}",                          # a huge power: refused before evaluation
    "10^{10^{10}}-1",
    "(" * 200 + "1" + ")" * 200,              # too long for sympy
    "__import__('os').system('true')",        # never reaches eval: not a whitelisted expression
    "x.conjugate()",
    "exec(1)",
])
def test_pathological_strings_are_fast_and_false(hostile):
    t = time.perf_counter()
    assert not math_equal(hostile, "1")
    assert time.perf_counter() - t < 2.5


CHOICE = [
    ("Let me think... Answer: C", "C"),
    ("The correct answer is (B).", "B"),
    ("so the answer is $\\boxed{D}$", "D"),
    ("\\boxed{\\text{(A)}}", "A"),
    ("A is tempting, but B fits.\n\n**Answer: D**", "D"),
    ("Options (A) and (C) fail, so (B)", "B"),
    ("After all that:\nB", "B"),
    ("the answer is: A.", "A"),
    ("A cat sat here.", None),                 # an article is not an answer
    ("Answer: E", None),                       # out of range for 4 choices
    ("nothing", None),
]


@pytest.mark.parametrize("text,want", CHOICE)
def test_extract_choice(text, want):
    assert extract_choice(text, 4) == want


def test_extract_choice_more_options():
    assert extract_choice("Answer: E", 5) == "E"


def test_shuffle_choices_deterministic():
    choices = ["right", "w1", "w2", "w3"]
    a = shuffle_choices(choices, 0, seed=1, key=7)
    assert a == shuffle_choices(choices, 0, seed=1, key=7)
    assert a[0][a[1]] == "right" and sorted(a[0]) == sorted(choices)
    orders = {tuple(shuffle_choices(choices, 0, seed=s, key=k)[0]) for s in range(3) for k in range(10)}
    assert len(orders) > 10                               # seeds and keys change the order
    positions = [shuffle_choices(choices, 0, seed=0, key=k)[1] for k in range(200)]
    assert set(positions) == {0, 1, 2, 3} and max(positions.count(i) for i in range(4)) < 80


def test_sympy_comparison_has_a_time_limit(monkeypatch):
    import fp8train.eval.scoring as scoring

    def forever(text):
        while True:
            pass

    monkeypatch.setattr(scoring, "_sympy_expr", forever)
    monkeypatch.setattr(scoring, "_SYMPY_TIMEOUT_S", 0.2)
    t = time.perf_counter()
    assert not scoring.math_equal("2x+2", "2(x+1)")   # equal, but the (stuck) check gives up
    assert time.perf_counter() - t < 1.5
