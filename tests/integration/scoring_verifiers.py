"""Verifiers the scoring process tests name by entry point
(``tests.integration.scoring_verifiers:<name>``)."""

from __future__ import annotations

import os
import time

from rolloutd.scoring import ScoringInput


def first_token_even(sample: ScoringInput) -> float:
    """Reward 1 when the first generated token id is even: about one half on the synthetic
    engine, independently per sibling, so a group of 4 has equal rewards 2 x 0.5^4 of the time."""
    return float(bool(sample.token_ids) and sample.token_ids[0] % 2 == 0)


def first_token_odd(sample: ScoringInput) -> float:
    """The opposite of :func:`first_token_even`: a changed verifier for ``rolloutd rescore``."""
    return 1.0 - first_token_even(sample)


def by_mode(sample: ScoringInput) -> float:
    """What ``metadata["mode"]`` asks for: a reward by sibling index (``ok``), or a failure:
    ``raise``, ``hang`` (past any timeout) or ``exit`` (kills the worker)."""
    mode = sample.metadata["mode"]
    if mode == "raise":
        raise ValueError("no reference answer")
    if mode == "hang":
        time.sleep(3600)
    if mode == "exit":
        os._exit(3)
    return float(sample.index)
