"""The calculator example environment: safe arithmetic (names, calls, huge powers refused),
tool calls and final answers, rewards, state that survives a restore, and its dataset."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from rolloutd.config import load_config
from rolloutd.episodes import EpisodeStart, StepResult
from rolloutd.episodes.loader import LocalEnvironment, load_environment

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from calculator.environment import (
    MAX_DIGITS,
    REMINDER,
    TOOL,
    CalcError,
    Calculator,
    evaluate,
    final_answer,
    show,
    tool_call,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def start(episode_id: str = "g1-s0", answer: object = 5104) -> EpisodeStart:
    return EpisodeStart(
        episode_id=episode_id,
        group_id=1,
        sibling=0,
        prompt_id="calc-0",
        messages=({"role": "user", "content": "What is 51 * 99 + 55?"},),
        metadata={"answer": answer},
        tools=(TOOL,),
    )


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("51 * 99 + 55", 5104),
        ("(3 + 4) * 12", 84),
        ("-2 ** 2", -4),
        ("7 / 2", 3.5),
        ("7 // 2", 3),
        ("-7 % 3", 2),
        ("2 ** 64", 2**64),
        ("2 ** -1", 0.5),
        ("1.5e3 + 1", 1501.0),
        ("+5", 5),
    ],
)
def test_arithmetic_is_computed(expression: str, value: float) -> None:
    assert evaluate(expression) == value


@pytest.mark.parametrize(
    ("expression", "why"),
    [
        ("__import__('os').system('true')", "Call is not allowed"),
        ("x + 1", "Name is not allowed"),
        ("(1).real", "Attribute is not allowed"),
        ("[1, 2]", "List is not allowed"),
        ("1 < 2", "Compare is not allowed"),
        ("1 if 1 else 2", "IfExp is not allowed"),
        ("lambda: 1", "Lambda is not allowed"),
        ("'a' * 3", "only numbers are allowed"),
        ("True + 1", "only numbers are allowed"),
        ("1j * 2", "only numbers are allowed"),
        ("~1", "UnaryOp is not allowed"),
        ("1 << 100", "BinOp is not allowed"),
        ("9 ** 9 ** 9", "exponents are limited to 64"),
        ("10 ** 64", "more than 40 digits"),
        ("99999999999 ** 5", "more than 40 digits"),
        ("(-8) ** 0.5", "not a real number"),
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("1e30 * 1e30", "more than 40 digits"),
        ("9" * 41, f"more than {MAX_DIGITS} digits"),
        ("1" + " + 1" * 60, "longer than 200 characters"),
        ("import os", "not an arithmetic expression"),
        ("", "not an arithmetic expression"),
    ],
)
def test_anything_but_bounded_arithmetic_is_refused(expression: str, why: str) -> None:
    with pytest.raises(CalcError, match=why):
        evaluate(expression)


def test_a_chain_of_products_cannot_grow_without_bound() -> None:
    with pytest.raises(CalcError, match="more than 40 digits"):
        evaluate(" * ".join(["99999999"] * 6))


def test_turns_are_read_as_tool_calls_or_final_answers() -> None:
    assert tool_call("let me see <calc>51 * 99</calc> then") == "51 * 99"
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>'
    assert tool_call(call) == "2+2"
    assert tool_call("<tool_call>{not json}</tool_call>") == "{not json}"
    assert tool_call("the answer is 4") is None
    assert final_answer("I think <answer>5104</answer>, not 12") == 5104
    assert final_answer("so 5049 + 55 = 5104") == 5104
    assert final_answer("no idea") is None
    assert (show(2.0), show(0.1 + 0.2), show(10**20)) == ("2", "0.3", "100000000000000000000")


def test_an_episode_calls_the_tool_then_answers_and_is_rewarded() -> None:
    env = Calculator(max_turns=4)
    assert env.reset(start()) == []
    first = env.step("g1-s0", 0, "<calc>51 * 99</calc>")
    assert first == StepResult(
        messages=({"role": "tool", "name": "calculator", "content": "5049"},), done=False
    )
    refused = env.step("g1-s0", 1, "<calc>__import__('os')</calc>")
    assert (
        refused.messages[0]["content"]
        == "error: Call is not allowed: only numbers and + - * / // % **"
    )
    assert env.step("g1-s0", 2, "<answer>5104</answer>") == StepResult(done=True, reward=1.0)
    env.reset(start("g1-s1"))
    assert env.step("g1-s1", 0, "5105") == StepResult(done=True, reward=0.0)
    env.reset(start("g1-s2", answer="5104"))  # an answer given as text counts the same
    assert env.step("g1-s2", 0, "it is 5104") == StepResult(done=True, reward=1.0)


def test_an_episode_without_an_answer_ends_after_max_turns() -> None:
    env = Calculator(max_turns=2)
    env.reset(start())
    assert not env.step("g1-s0", 0, "<calc>1+1</calc>").done
    last = env.step("g1-s0", 1, "<calc>2+2</calc>")
    assert (last.done, last.reward, last.messages[0]["content"]) == (True, 0.0, "4")


def test_a_strict_calculator_reminds_a_turn_that_neither_calls_nor_answers() -> None:
    env = Calculator(max_turns=3, strict=True)
    env.reset(start())
    reminded = env.step("g1-s0", 0, "so 5049 + 55 = 5104")  # a number, but not in <answer>
    assert reminded == StepResult(messages=({"role": "user", "content": REMINDER},), done=False)
    assert env.step("g1-s0", 1, "<calc>51 * 99 + 55</calc>").messages[0]["content"] == "5104"
    assert env.step("g1-s0", 2, "<answer>5104</answer>") == StepResult(done=True, reward=1.0)
    env.reset(start("g1-s1"))
    env.step("g1-s1", 0, "hmm")
    env.step("g1-s1", 1, "hmm")
    last = env.step("g1-s1", 2, "hmm")
    assert (last.done, last.reward, env.state("g1-s1")) == (True, 0.0, b"")


def test_state_brings_an_episode_back_in_a_new_process() -> None:
    before = Calculator()
    before.reset(start())
    before.step("g1-s0", 0, "<calc>51 * 99</calc>")
    state = before.state("g1-s0")
    after = Calculator()  # as after a restart: nothing in memory
    after.restore(start(), state)
    assert after.state("g1-s0") == state
    assert after.step("g1-s0", 1, "<answer>5104</answer>") == StepResult(done=True, reward=1.0)
    assert after.state("g1-s0") == b""  # over: nothing left to save
    after.restore(start(), b"")


async def test_the_service_loads_it_by_its_entry_point() -> None:
    port = load_environment(
        "calculator.environment:Calculator", {"max_turns": 3}, step_timeout_s=5, retries=0
    )
    assert isinstance(port, LocalEnvironment) and port.has_state
    await port.reset(start())
    result = await port.step("g1-s0", 0, "<calc>(3 + 4) * 12</calc>")
    assert result.messages == ({"role": "tool", "name": "calculator", "content": "84"},)
    with pytest.raises(ValueError, match="max_turns must be at least 1"):
        load_environment(
            "calculator.environment:Calculator", {"max_turns": 0}, step_timeout_s=5, retries=0
        )


def test_the_dataset_holds_questions_whose_answers_are_right() -> None:
    rows = [json.loads(line) for line in (EXAMPLES / "calculator" / "questions.jsonl").open()]
    assert len(rows) == 16
    assert len({r["id"] for r in rows}) == 16
    for row in rows:
        assert row["tools"] == [TOOL]
        assert [m["role"] for m in row["messages"]] == ["system", "user"]
        expression = row["metadata"]["expression"]
        assert row["messages"][1]["content"] == f"What is {expression}?"
        assert evaluate(expression) == row["metadata"]["answer"]


def test_its_configuration_loads_and_names_what_the_service_serves() -> None:
    """``rolloutd.yaml`` as ``rolloutd serve --config`` reads it: every key known and valid, the
    environment built from it as the service builds it, its dataset where it says."""
    config = load_config(EXAMPLES / "calculator" / "rolloutd.yaml", environ={})
    episodes = config.episodes
    assert config.episodes_configured()
    assert episodes.environment == "calculator.environment:Calculator"
    assert episodes.environment_config == {"max_turns": 4, "strict": True}
    assert episodes.durable_turns
    assert config.engine.max_tokens < episodes.max_total_tokens
    port = load_environment(
        episodes.environment,
        episodes.environment_config,
        step_timeout_s=episodes.step_timeout_s,
        retries=episodes.retries,
    )
    assert isinstance(port, LocalEnvironment) and port.has_state
    assert config.dataset.path is not None
    assert (EXAMPLES.parent / config.dataset.path).is_file()
