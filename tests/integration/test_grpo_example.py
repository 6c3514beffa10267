"""The GRPO example end to end, short: real vLLM, real trainer, both SIGKILLed mid-run.

It asserts the mechanics a trainer relies on, not the learning: weight updates reach the engine
(samples carry new policy versions), the trainer's recomputed logprobs match rolloutd's, and after
the crash ``Rewind(S)`` brings back exactly the groups acked after S, each once, and nothing the
restored checkpoint already trained on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.process, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
STEPS, CRASH_AT, CHECKPOINT_EVERY = 8, 5, 2


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("grpo")
    args = ["--steps", str(STEPS), "--crash-at", str(CRASH_AT)]
    args += ["--checkpoint-every", str(CHECKPOINT_EVERY), "--groups-per-step", "2"]
    args += ["--run-dir", str(run / "run"), "--json", str(run / "report.json")]
    args += ["--temperatures", "0.5,2.0"]  # two dataset sources, each at its own temperature
    done = subprocess.run(
        [sys.executable, str(REPO / "examples" / "grpo.py"), *args],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return run


def test_report_holds_the_figures_the_issue_names(run: Path) -> None:
    report = json.loads((run / "report.json").read_text())
    assert report["resumed"] is True
    assert report["resumed_from_step"] == CRASH_AT - CRASH_AT % CHECKPOINT_EVERY
    assert report["steps"] == STEPS
    assert report["steps_executed"] == STEPS + CRASH_AT - report["resumed_from_step"]
    # One update per executed step, plus the resumed trainer's own weights.
    assert report["weight_updates"] == report["steps_executed"] + 1
    assert report["stale_groups"] == 0
    assert report["duplicate_groups"] == 0
    assert report["redelivery_missing"] == 0
    assert (run / "report.png").stat().st_size > 0


def test_weight_updates_change_the_samples_policy_version(run: Path) -> None:
    ledger = lines(run / "run" / "ledger.jsonl")
    first_life = [r for r in ledger if r["life"] == 0]
    assert {v for vs in first_life[0]["sample_versions"] for v in vs} == {0}
    seen = [max(v for vs in r["sample_versions"] for v in vs) for r in first_life]
    assert seen[-1] >= 2, f"samples never carried a pushed version: {seen}"
    for r in ledger:
        # A sample is never from weights newer than the trainer's.
        assert all(v <= r["version"] for vs in r["sample_versions"] for v in vs)
        assert r["new_version"] == r["version"] + 1


def test_recomputed_logprobs_match_what_rolloutd_delivered(run: Path) -> None:
    report = json.loads((run / "report.json").read_text())
    assert report["logprob_tokens_compared"] > 100
    assert report["logprob_abs_diff_mean"] <= 1e-3
    # each group's logprobs are those of its own source's temperature
    by_temperature = report["logprob_abs_diff_mean_by_temperature"]
    assert sorted(by_temperature) == ["0.5", "2"]
    assert all(diff <= 1e-3 for diff in by_temperature.values()), by_temperature
    # A misaligned token would cost whole nats, not fractions of one.
    assert report["logprob_abs_diff_max"] < 0.05


def test_rewind_redelivers_exactly_the_groups_acked_after_the_checkpoint(run: Path) -> None:
    """Counted by prompt position (epoch, prompt): a group acked after S comes back once, as
    itself, or re-generated under a new id when its samples were never durable."""
    ledger = lines(run / "run" / "ledger.jsonl")
    (resumed,) = lines(run / "run" / "events.jsonl")
    s = resumed["from_step"]

    def groups(records: list[dict[str, Any]]) -> list[tuple[int, str]]:
        return [
            (g, p) for r in records for g, p in zip(r["group_ids"], r["positions"], strict=True)
        ]

    held = groups([r for r in ledger if r["life"] == 0 and r["step"] <= s])
    lost = groups([r for r in ledger if r["life"] == 0 and r["step"] > s])
    again = groups([r for r in ledger if r["life"] == 1])
    assert lost and sorted(p for _, p in lost) == resumed["acked_after_checkpoint"]
    positions = Counter(p for _, p in again)
    assert {p: positions[p] for _, p in lost} == {p: 1 for _, p in lost}
    assert not {p for _, p in held} & set(positions), "a position S holds came back"
    assert not {g for g, _ in held} & {g for g, _ in again}, "a group S holds came back"
    assert max(positions.values()) == 1
    regenerated = [(g, p) for g, p in again if (g, p) not in lost and p in dict(lost).values()]
    # Re-generated: samples never durable (Rewind re-admits the prompt), or the group had become
    # too stale for the resumed trainer's version (UpdateWeights evicts it and re-admits it).
    assert len(regenerated) <= resumed["rewind_readmitted"] + resumed["evicted_at_resume"]
    assert [r["step"] for r in ledger if r["life"] == 1] == list(range(s + 1, STEPS + 1))


def test_a_group_id_names_one_prompt_for_the_life_of_the_store(run: Path) -> None:
    ledger = lines(run / "run" / "ledger.jsonl")
    named: dict[int, set[str]] = {}
    for r in ledger:
        for g, p in zip(r["group_ids"], r["positions"], strict=True):
            named.setdefault(g, set()).add(p)
    assert {g: ps for g, ps in named.items() if len(ps) > 1} == {}
