"""Verifiers the scoring tests name by entry point (``tests.scoring.verifiers:<name>``); the
workers import them from the Python path they inherit."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from rolloutd.scoring import ScoringInput


def length(sample: ScoringInput) -> float:
    return float(len(sample.token_ids))


def with_pid(sample: ScoringInput) -> tuple[float, dict[str, Any]]:
    """Reward 1 and the worker's process id: tells which worker ran the call."""
    return 1.0, {"pid": os.getpid(), "index": sample.index}


async def async_echo(sample: ScoringInput) -> tuple[float, dict[str, Any]]:
    await asyncio.sleep(0)
    return float(sample.index), {"completion": sample.completion}


def ranked(samples: list[ScoringInput]) -> list[float | tuple[float, dict[str, Any]]]:
    """A group verifier: the longest completion gets 1, the others 0 (with their rank)."""
    longest = max(len(s.completion) for s in samples)
    return [(1.0, {"rank": 0}) if len(s.completion) == longest else 0.0 for s in samples]


def too_few(samples: list[ScoringInput]) -> list[float]:
    return [1.0] * (len(samples) - 1)


def from_metadata(sample: ScoringInput) -> float:
    """The reward ``metadata["rewards"][index]``; a missing one (null) raises."""
    reward = sample.metadata["rewards"][sample.index]
    if reward is None:
        raise ValueError(f"no reward for sibling {sample.index}")
    return float(reward)


def raises(sample: ScoringInput) -> float:
    raise ValueError("the reference answer is unreadable")


def hangs(sample: ScoringInput) -> float:
    time.sleep(3600)
    return 1.0


def exits(sample: ScoringInput) -> float:
    os._exit(3)


def nan(sample: ScoringInput) -> float:
    return float("nan")


def not_a_number(sample: ScoringInput) -> str:
    return "1.0"


def prints(sample: ScoringInput) -> float:
    print("a verifier's print goes to stderr, not into the answers")
    return 0.5


def first_token_even(sample: ScoringInput) -> float:
    """Reward 1 when the first generated token id is even: about one half on the synthetic
    engine, so about 2 x 0.5^4 of groups of four have equal rewards."""
    return 1.0 if sample.token_ids and sample.token_ids[0] % 2 == 0 else 0.0


def even_length(sample: ScoringInput) -> tuple[float, dict[str, Any]]:
    """Reward 1 when the completion has an even number of characters, with that number as its
    info: about half of a random model's completions, so siblings often disagree."""
    chars = len(sample.completion)
    return (1.0 if chars % 2 == 0 else 0.0), {"chars": chars}
