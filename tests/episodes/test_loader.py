"""Environment classes in process (rolloutd.episodes.loader): sync and async methods, the
worker threads, timeouts, exceptions, malformed results, state, and the start-up errors that
name their key."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from rolloutd.episodes import (
    EnvironmentFailure,
    EnvironmentPort,
    EpisodeEnd,
    EpisodeStart,
    StepResult,
)
from rolloutd.episodes.loader import LocalEnvironment, load_environment
from tests.episodes.environments import AsyncHangs, Counting, Echo, Hangs
from tests.waiting import eventually

ENV = "tests.episodes.environments"
START = EpisodeStart(
    episode_id="g1-s0",
    group_id=1,
    sibling=0,
    prompt_id="p1",
    messages=({"role": "user", "content": "hi"},),
    metadata={"answer": 4},
    tools=({"type": "function", "function": {"name": "echo"}},),
)


def load(name: str, config: dict[str, Any] | None = None, **kw: Any) -> LocalEnvironment:
    settings: dict[str, Any] = {"step_timeout_s": 5.0, "retries": 2, **kw}
    port = load_environment(f"{ENV}:{name}", config or {}, **settings)
    assert isinstance(port, LocalEnvironment)
    assert isinstance(port, EnvironmentPort)
    return port


async def test_a_sync_environment_runs_in_worker_threads_and_answers_as_the_port_says():
    port = load("Echo", {"turns": 2, "greeting": "ready"})
    echo: Echo = port.environment
    assert not port.has_state
    assert await port.reset(START) == ({"role": "system", "content": "ready"},)
    first = await port.step("g1-s0", 0, "two plus two")
    assert first == StepResult(
        messages=({"role": "tool", "content": "TWO PLUS TWO", "name": "echo"},), done=False
    )
    last = await port.step("g1-s0", 1, "4", replay=True)
    assert (last.done, last.reward) == (True, 2.0)
    assert echo.steps == [("g1-s0", 0, "two plus two", False), ("g1-s0", 1, "4", True)]
    assert threading.get_ident() not in echo.threads
    await port.close()
    assert echo.closed


async def test_a_blocking_sync_step_leaves_the_event_loop_free():
    port = load("Hangs")
    hangs: Hangs = port.environment
    stalled = asyncio.create_task(port.step("g1-s0", 0, "x"))
    ticks = 0

    def ticked() -> bool:
        nonlocal ticks
        ticks += 1
        return ticks > 5 and hangs.entered.is_set()

    await eventually("the loop turns while step blocks its thread", ticked)
    assert (await port.step("quick", 0, "y")).done  # another call is served meanwhile
    assert not stalled.done()
    Hangs.release.set()
    try:
        assert (await stalled).done
    finally:
        Hangs.release.clear()
        await port.close()


async def test_an_async_environment_with_state_round_trips_its_bytes():
    port = load("Counting")
    counting: Counting = port.environment
    assert port.has_state
    assert await port.reset(START) == ({"role": "user", "content": "tools: 1"},)
    result = await port.step("g1-s0", 0, "abcdef")  # a mapping, converted
    assert result == StepResult(messages=({"role": "tool", "content": "6"},), done=False)
    state = await port.state("g1-s0")
    assert state == (6).to_bytes(4, "big") + b"\xff\x00"
    counting.totals.clear()
    await port.restore(START, state)
    assert counting.restored == [("g1-s0", state)]
    assert (await port.step("g1-s0", 1, "abcdef")).done  # 12 > 10: the restored count went on


@pytest.mark.parametrize("name", ["Hangs", "AsyncHangs"])
async def test_a_step_past_its_timeout_ends_with_step_timeout(name: str):
    port = load(name, step_timeout_s=0.2)
    hangs: Hangs = port.environment
    started = time.monotonic()
    try:
        with pytest.raises(EnvironmentFailure) as failure:
            await port.step("g1-s0", 3, "x")
        assert failure.value.end is EpisodeEnd.STEP_TIMEOUT
        assert "step(g1-s0, turn 3): no answer within 0.2 s" in failure.value.detail
        assert time.monotonic() - started < 5
        assert hangs.entered.is_set()
        assert (await port.step("quick", 0, "y")).done  # the adapter still serves
    finally:
        Hangs.release.set()
        await port.close()
        Hangs.release.clear()
    assert isinstance(hangs, AsyncHangs if name == "AsyncHangs" else Hangs)


@pytest.mark.parametrize(
    ("raises", "end", "detail"),
    [
        ("", EpisodeEnd.STEP_FAILED, "raised ConnectionError: sandbox busy (1)"),
        ("timeout", EpisodeEnd.STEP_FAILED, "raised TimeoutError: the sandbox timed out"),
        ("failure", EpisodeEnd.MALFORMED, "the environment says so"),
    ],
)
async def test_an_exception_ends_the_episode_with_what_was_raised(raises, end, detail):
    port = load("Echo", {"fail_first": 1}) if not raises else load("Returns", {"raises": raises})
    with pytest.raises(EnvironmentFailure) as failure:
        await port.step("g1-s0", 0, "x")
    assert failure.value.end is end
    assert detail in failure.value.detail


GOOD_MESSAGE = {"role": "tool", "content": "4"}


@pytest.mark.parametrize(
    ("config", "detail"),
    [
        ({"result": "done"}, "must return a StepResult or a mapping, got str 'done'"),
        ({"result": None}, "must return a StepResult or a mapping, got NoneType"),
        ({"result": {"messages": "4"}}, "messages must be a list of messages, got str"),
        ({"result": {"messages": {"role": "tool"}}}, "messages must be a list of messages"),
        ({"result": {"messages": [["tool", "4"]]}}, "message 0 must be a mapping"),
        ({"result": {"messages": [GOOD_MESSAGE, {"role": "tool"}]}}, "message 1 has no 'content'"),
        ({"result": {"messages": [{"role": 1, "content": "4"}]}}, "'role' must be a string"),
        ({"result": {"messages": [{"role": "", "content": "4"}]}}, "'role' is empty"),
        ({"result": {"messages": [{"role": "tool", "content": 4}]}}, "'content' must be a string"),
        ({"result": {"done": "yes"}}, "'done' must be true or false, got str 'yes'"),
        ({"result": {"done": 1}}, "'done' must be true or false, got int 1"),
        ({"result": {"done": True, "reward": "high"}}, "'reward' must be a number or None"),
        ({"result": {"done": True, "reward": True}}, "'reward' must be a number or None"),
        ({"special": "nan"}, "'reward' must be finite, got nan"),
        ({"result": {"done": True, "score": 1}}, "unknown keys ['score']"),
        ({"special": "object"}, "message 0 is not JSON"),
    ],
)
async def test_a_malformed_step_result_names_what_is_wrong(config, detail):
    port = load("Returns", config)
    with pytest.raises(EnvironmentFailure) as failure:
        await port.step("g1-s0", 2, "x")
    assert failure.value.end is EpisodeEnd.MALFORMED
    assert "Returns.step(g1-s0, turn 2)" in failure.value.detail
    assert detail in failure.value.detail


async def test_good_results_in_every_accepted_form():
    port = load("Returns", {"result": {"messages": [GOOD_MESSAGE], "done": True, "reward": 1}})
    assert await port.step("g1-s0", 0, "x") == StepResult((GOOD_MESSAGE,), True, 1.0)
    assert await load("Returns", {"result": {}}).step("g1-s0", 0, "x") == StepResult()


async def test_malformed_reset_and_state_answers():
    port = load("Returns", {"special": "reset", "result": "hello"})
    with pytest.raises(EnvironmentFailure, match=r"reset\(g1-s0\): messages must be a list"):
        await port.reset(START)
    port = load("Returns", {"state": "not bytes"})
    with pytest.raises(EnvironmentFailure, match=r"state\(g1-s0\) must return bytes, got str"):
        await port.state("g1-s0")
    assert await load("Returns", {"state": "x"}).reset(START) == ()


async def test_state_of_an_environment_without_it_is_a_failure_not_a_crash():
    port = load("Echo")
    with pytest.raises(EnvironmentFailure, match=r"has no state\(\) and restore\(\)"):
        await port.state("g1-s0")


@pytest.mark.parametrize(
    ("spec", "config", "message"),
    [
        ("nowhere.at_all:Env", {}, "episodes.environment: cannot import 'nowhere.at_all'"),
        (f"{ENV}:Missing", {}, "episodes.environment: 'tests.episodes.environments' has no"),
        ("not a spec", {}, "episodes.environment: 'not a spec' is not of the form"),
        (f"{ENV}:not_a_class", {}, "is a function, not a class"),
        (f"{ENV}:NoStep", {}, "has no step(); an environment has reset(start) and step("),
        (f"{ENV}:NoReplay", {}, "step takes no 'replay' keyword, and the class has no state()"),
        (f"{ENV}:NeedsLimit", {}, "episodes.environment_config: tests.episodes.environments:"),
        (f"{ENV}:NeedsLimit", {"limit": -1}, "refused it (ValueError: limit must be positive"),
        (f"{ENV}:Echo", {"colour": "red"}, "unexpected keyword argument 'colour'"),
    ],
)
def test_a_wrong_setting_is_a_start_up_error_naming_its_key(spec, config, message):
    with pytest.raises(ValueError) as error:
        load_environment(spec, config, step_timeout_s=1.0, retries=0)
    assert message in str(error.value)


def test_a_source_override_is_named_as_such_and_the_timeout_must_be_positive():
    key = "dataset.sources[1].environment"
    with pytest.raises(ValueError, match=r"^dataset\.sources\[1\]\.environment_config: "):
        load_environment(f"{ENV}:NeedsLimit", {}, step_timeout_s=1.0, retries=0, key=key)
    with pytest.raises(ValueError, match=r"episodes\.step_timeout_s must be above 0"):
        load_environment(f"{ENV}:Echo", {}, step_timeout_s=0, retries=0)
