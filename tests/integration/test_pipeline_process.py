"""The pipeline's seams in a real ``rolloutd serve``, loaded by entry point and SIGKILLed: a
finishing stage that holds groups runs again after ``--restore latest`` for exactly the groups
it had not finished, and a sibling runner of two engine calls continues from the first call's
tokens."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from rolloutd.client import RolloutClient
from tests.integration.pipeline_plugins import FIRST_CALL_TOKENS
from tests.integration.proc import ServeProcess

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parents[2]


def _serve(tmp_path: Path, store: Path, gate: Path, pipeline: dict[str, str]) -> ServeProcess:
    tmp_path.mkdir(parents=True, exist_ok=True)
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"{i} + {i}"}) + "\n"
                               for i in range(8)))  # fmt: skip
    config = tmp_path / "rolloutd.yaml"
    config.write_text(
        json.dumps(  # YAML is a superset of JSON
            {
                "pipeline": pipeline,
                "engine": {"max_tokens": 12, "synthetic": {"min_tokens": 12}},
                "dataset": {"epochs": 1, "path": str(dataset)},
                "limits": {"max_in_flight": 8, "buffer_capacity": 16},
            }
        )
    )
    gate.mkdir(exist_ok=True)
    return ServeProcess.synthetic(
        store,
        "--config",
        str(config),
        "--group-size",
        "2",
        "--checkpoint-interval",
        "0",
        env={
            "PIPELINE_TEST_GATE": str(gate),
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        },
        cwd=tmp_path,
    )


def _calls(gate: Path) -> list[list[str]]:
    path = gate / "calls"
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


def _wait(what: str, predicate: Callable[[], bool], p: ServeProcess, within_s: float = 120) -> None:
    deadline = time.monotonic() + within_s
    while not predicate():
        if p.proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached (exit {p.proc.poll()})\n{p.output[-3000:]}")
        time.sleep(0.05)


def _fetch_all(client: RolloutClient, n: int, step: int) -> list:  # type: ignore[type-arg]
    groups: list = []  # type: ignore[type-arg]
    deadline = time.monotonic() + 120
    while len(groups) < n:
        assert time.monotonic() < deadline, f"{len(groups)} of {n} groups delivered"
        lease = client.fetch(max_groups=n - len(groups), wait_ms=2000)
        if lease is not None:
            groups += lease.groups
            client.ack(lease, step)
    return groups


def test_a_blocked_stage_blocks_nothing_else_and_runs_again_only_for_what_it_had_not_finished(
    tmp_path,
):
    store, gate = tmp_path / "ckpt", tmp_path / "gate"
    pipeline = {"finishing_stage": "tests.integration.pipeline_plugins:GatedStage"}
    even, odd = {f"q{i}" for i in range(0, 8, 2)}, {f"q{i}" for i in range(1, 8, 2)}
    p = _serve(tmp_path, store, gate, pipeline)
    try:
        address = p.wait_listening()

        def started(kind: str, prompts: set[str]) -> bool:
            return {c[1] for c in _calls(gate) if c[0] == kind} >= prompts

        _wait("odd groups held, even ones done", lambda: started("start", odd) and
              started("done", even), p)  # fmt: skip
        with RolloutClient(address, interceptors=[]) as client:
            # while the stage holds four groups: fetch, ack and a checkpoint all complete
            delivered = _fetch_all(client, 4, step=1)
            assert {g.prompt_id for g in delivered} == even
            [saved] = client.checkpoint(trainer_step=1).values()
            assert saved.sequence > 0
        p.kill()
        assert not started("done", odd)
        (gate / "calls").rename(gate / "calls-before-crash")

        (gate / "open").touch()
        p = _serve(tmp_path, store, gate, pipeline)
        address = p.wait_listening()
        with RolloutClient(address, interceptors=[]) as client:
            delivered = _fetch_all(client, 4, step=2)
        assert {g.prompt_id for g in delivered} == odd
        again = _calls(gate)
        assert sorted(c[1] for c in again if c[0] == "start") == sorted(odd)  # once each
        assert sorted(c[1] for c in again if c[0] == "done") == sorted(odd)
    finally:
        p.kill()


def _run_to_the_end(tmp_path: Path, *, crash: bool) -> tuple[dict[str, list[list[int]]], list]:  # type: ignore[type-arg]
    """Every group's samples' tokens by prompt id, and the runner's calls after the last start."""
    store, gate = tmp_path / "ckpt", tmp_path / "gate"
    pipeline = {"sibling_runner": "tests.integration.pipeline_plugins:TwoCallRunner"}
    p = _serve(tmp_path, store, gate, pipeline)
    if not crash:
        (gate / "open").touch()
    try:
        address = p.wait_listening()
        if crash:
            # every sibling between its two calls: the snapshot holds its first call's tokens
            _wait("16 siblings between calls",
                  lambda: sum(c[0] == "between" for c in _calls(gate)) == 16, p)  # fmt: skip
            with RolloutClient(address, interceptors=[]) as client:
                [saved] = client.checkpoint().values()
                assert saved.sequence > 0
            p.kill()
            (gate / "calls").rename(gate / "calls-before-crash")
            (gate / "open").touch()
            p = _serve(tmp_path, store, gate, pipeline)
            address = p.wait_listening()
        with RolloutClient(address, interceptors=[]) as client:
            groups = _fetch_all(client, 8, step=1)
        tokens = {g.prompt_id: [list(s.token_ids) for s in g.samples] for g in groups}
        return tokens, _calls(gate)
    finally:
        p.kill()


def test_a_runner_of_two_engine_calls_resumes_from_the_first_calls_tokens(tmp_path):
    control, _ = _run_to_the_end(tmp_path / "control", crash=False)
    resumed, calls = _run_to_the_end(tmp_path / "crashed", crash=True)
    assert resumed == control  # token for token, every sibling of every group
    assert all(len(s) == 12 for samples in resumed.values() for s in samples)
    # after the restart no first call was made again: each sibling continued from its tokens
    assert [c[0] for c in calls] == ["call2"] * 16
    assert {int(c[2]) for c in calls} == {FIRST_CALL_TOKENS}
