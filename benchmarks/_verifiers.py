"""Verifiers ``scoring.py`` names by entry point (``_verifiers:<name>``, with ``benchmarks/`` on
the service's Python path). Not a benchmark: ``run_all.py`` skips names that start with ``_``."""

from __future__ import annotations

import os
import time

from rolloutd.scoring import ScoringInput

CALLS_ENV = "BENCH_SCORING_CALLS"
"""The file :func:`first_token_even` appends one line per call to."""


def first_token_even(sample: ScoringInput) -> float:
    """Reward 1 when the first generated token id is even, else 0: a known pass rate (the
    synthetic engine's token ids are uniform in [3, 32000), so about one half).

    Every call appends ``<service pid> <prompt id> <index> <first token id> <reward>`` to the
    file named by ``BENCH_SCORING_CALLS``, in one ``write`` (shorter than ``PIPE_BUF``,
    so lines of concurrent workers never interleave): the service's process id tells which run
    of the service asked, so calls made after a restore can be counted by group.
    """
    first = sample.token_ids[0] if sample.token_ids else -1
    reward = 1.0 if first >= 0 and first % 2 == 0 else 0.0
    line = f"{os.getppid()} {sample.prompt_id} {sample.index} {first} {reward:g}\n"
    fd = os.open(os.environ[CALLS_ENV], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)
    return reward


def sleep_1ms(sample: ScoringInput) -> float:
    """A verifier that takes 1 ms (a sleep, so it costs no CPU) and rewards the length."""
    time.sleep(0.001)
    return float(len(sample.token_ids))
