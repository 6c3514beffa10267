r"""Built-in verifiers for the common cases, named ``"builtin:<name>"`` in ``scoring.verifier``.

Each reads what it compares against from the prompt's ``metadata`` (a JSON object), returns
1.0 or 0.0, and raises ``ValueError`` when the metadata lacks its key (the sample's score is
then FAILED with that message: a data error is not a wrong answer).

``builtin:math`` (:func:`math_answer`): the completion's answer compared numerically with
``metadata["answer"]``. The answer is the content of the last ``\boxed{...}`` when there is
one, else the last number in the text. Numbers may carry thousands separators, decimals or be
fractions (``3/4``, ``\frac{3}{4}``); they are compared exactly as rationals::

    completion "... so the total is 1,200."      answer 1200     -> 1.0
    completion "x = \boxed{\frac{1}{2}}"         answer "0.5"    -> 1.0
    completion "3 apples, then \boxed{7} left"   answer 3        -> 0.0  (the boxed one counts)
    completion "about 0.33"                      answer "1/3"    -> 0.0  (exact, not rounded)

``builtin:exact`` (:func:`exact_match`): the completion with surrounding whitespace stripped
equals ``str(metadata["answer"])`` (also stripped)::

    completion " Paris\n"   answer "Paris"   -> 1.0
    completion "paris"      answer "Paris"   -> 0.0

``builtin:regex`` (:func:`regex_match`): ``re.search(metadata["pattern"], completion)`` finds a
match anywhere in the completion; anchor the pattern (``\A...\Z``) to require the whole of it,
and use inline flags (``(?s)``, ``(?i)``) for the rest::

    completion "<think>...</think> 42"   pattern "</think>\s*\d+\s*\Z"   -> 1.0
    completion "Hello"                   pattern "(?i)\Ahello\Z"         -> 1.0
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

from rolloutd.scoring.inputs import ScoringInput

BUILTINS = {
    "math": "rolloutd.scoring.builtins:math_answer",
    "exact": "rolloutd.scoring.builtins:exact_match",
    "regex": "rolloutd.scoring.builtins:regex_match",
}
"""``builtin:<name>`` -> the entry point it stands for."""

_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_FRAC = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
_BOXED = "\\boxed{"


def _metadata(sample: ScoringInput, key: str) -> Any:
    if not isinstance(sample.metadata, Mapping) or key not in sample.metadata:
        raise ValueError(f"the prompt's metadata has no {key!r} (metadata: {sample.metadata!r})")
    return sample.metadata[key]


def last_boxed(text: str) -> str | None:
    r"""The content of the last ``\boxed{...}`` in ``text`` (braces may nest), or None."""
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth, begin = 1, start + len(_BOXED)
    for end in range(begin, len(text)):
        if text[end] == "{":
            depth += 1
        elif text[end] == "}":
            depth -= 1
            if depth == 0:
                return text[begin:end]
    return None


def parse_number(text: str) -> Fraction | None:
    r"""``text`` as a rational number (``"1,200"``, ``"-0.5"``, ``"3/4"``, ``"\frac{3}{4}"``,
    ``"$12$"``), or None when it is not one."""
    text = _FRAC.sub(r"(\1)/(\2)", text).replace("$", "").replace(" ", "")
    text = text.replace("(", "").replace(")", "").replace(",", "").rstrip(".")
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def final_answer(completion: str) -> Fraction | None:
    r"""The completion's answer: the last ``\boxed{}`` when there is one, else its last number."""
    boxed = last_boxed(completion)
    if boxed is not None:
        return parse_number(boxed)
    numbers = _NUMBER.findall(completion)
    return parse_number(numbers[-1]) if numbers else None


def math_answer(sample: ScoringInput) -> float:
    """1.0 when the completion's final answer equals ``metadata["answer"]`` as a number."""
    expected = parse_number(str(_metadata(sample, "answer")))
    if expected is None:
        raise ValueError(f"metadata answer {sample.metadata['answer']!r} is not a number")
    return 1.0 if final_answer(sample.completion) == expected else 0.0


def exact_match(sample: ScoringInput) -> float:
    """1.0 when the stripped completion equals ``str(metadata["answer"])``, stripped."""
    return 1.0 if sample.completion.strip() == str(_metadata(sample, "answer")).strip() else 0.0


def regex_match(sample: ScoringInput) -> float:
    """1.0 when ``re.search(metadata["pattern"], completion)`` finds a match."""
    return 1.0 if re.search(str(_metadata(sample, "pattern")), sample.completion) else 0.0
