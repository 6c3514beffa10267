"""The built-in verifiers on a table of cases (called in process: they are plain functions)."""

from __future__ import annotations

from fractions import Fraction

import pytest

from rolloutd.scoring import ScoringInput
from rolloutd.scoring.builtins import exact_match, final_answer, math_answer, regex_match


def sample(completion: str, metadata: object) -> ScoringInput:
    return ScoringInput("p", "", (), metadata, completion, (), "stop", 0)


MATH = [
    ("so the total is 1,200.", 1200, 1.0),
    ("so the total is 1,200.", "1200", 1.0),
    ("x = \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("x = \\boxed{\\dfrac{1}{2}}", 0.5, 1.0),
    ("3 apples, then \\boxed{7} left", 3, 0.0),
    ("3 apples, then \\boxed{7} left", 7, 1.0),
    ("\\boxed{3} at first, finally \\boxed{ 4 }", 4, 1.0),
    ("the answer is $\\boxed{-12}$.", -12, 1.0),
    ("\\boxed{\\text{{nested}} 5}", 5, 0.0),
    ("about 0.33", "1/3", 0.0),
    ("it is 3/4", "0.75", 1.0),
    ("It is 42", "42.0", 1.0),
    ("It is 42, or 43", 42, 0.0),
    ("no number here", 1, 0.0),
    ("\\boxed{seven}", 7, 0.0),
    ("1/0 is undefined", 0, 0.0),  # not a number: no answer
    ("the truncated \\boxed{12", 12, 1.0),
]


@pytest.mark.parametrize(("completion", "answer", "reward"), MATH)
def test_math_compares_the_boxed_or_last_number_with_the_answer(completion, answer, reward):
    assert math_answer(sample(completion, {"answer": answer})) == reward


def test_math_reads_numbers_exactly():
    assert final_answer("1,234,567.5") == Fraction(2469135, 2)
    assert final_answer(".5 or -.25") == Fraction(-1, 4)
    assert final_answer("\\boxed{\\frac{3}{4}}") == Fraction(3, 4)


EXACT = [
    (" Paris\n", "Paris", 1.0),
    ("paris", "Paris", 0.0),
    ("42", 42, 1.0),
    ("Paris is the capital", "Paris", 0.0),
]


@pytest.mark.parametrize(("completion", "answer", "reward"), EXACT)
def test_exact_compares_the_stripped_completion_with_the_answer(completion, answer, reward):
    assert exact_match(sample(completion, {"answer": answer})) == reward


REGEX = [
    ("<think>...</think> 42", r"</think>\s*\d+\s*\Z", 1.0),
    ("<think>...</think> 42 and more", r"</think>\s*\d+\s*\Z", 0.0),
    ("say Hello", "Hello", 1.0),  # search: anywhere in the completion
    ("say Hello", r"\AHello\Z", 0.0),
    ("Hello", r"(?i)\Ahello\Z", 1.0),
    ("a\nb", r"a.b", 0.0),
    ("a\nb", r"(?s)a.b", 1.0),
]


@pytest.mark.parametrize(("completion", "pattern", "reward"), REGEX)
def test_regex_searches_the_completion(completion, pattern, reward):
    assert regex_match(sample(completion, {"pattern": pattern})) == reward


@pytest.mark.parametrize(
    ("verifier", "metadata", "says"),
    [
        (math_answer, None, "no 'answer'"),
        (math_answer, {"answer": "seven"}, "is not a number"),
        (exact_match, {"pattern": "x"}, "no 'answer'"),
        (regex_match, ["x"], "no 'pattern'"),
    ],
)
def test_missing_metadata_is_an_error_not_a_wrong_answer(verifier, metadata, says):
    with pytest.raises(ValueError, match=says):
        verifier(sample("7", metadata))
