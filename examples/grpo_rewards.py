"""The GRPO example's reward, as a verifier the service runs (``scoring.verifier:
grpo_rewards:answer_shaped``, with ``examples/`` on the service's ``PYTHONPATH``)."""

from __future__ import annotations

import re

from rolloutd.scoring import ScoringInput

_SMALL_NUMBER = re.compile(r"\d{1,2}")


def answer_shaped(sample: ScoringInput) -> float:
    """Share of the completion's words that are whole numbers of one or two digits (0 if empty).

    The bundled prompts are arithmetic questions whose answers are small numbers, so this rewards
    answer-shaped output: short numbers instead of long digit runs and stray letters. A random tiny
    model scores about 0.1 and can climb it within minutes; it does not check the arithmetic.
    """
    words = sample.completion.split()
    if not words:
        return 0.0
    return sum(_SMALL_NUMBER.fullmatch(w) is not None for w in words) / len(words)
