"""The calculator environment: the model is asked an arithmetic question and may call a
``calculator`` tool before it answers.

Each model turn is read as either

* a tool call, ``<calc>EXPRESSION</calc>`` or ``<tool_call>{"name": "calculator", "arguments":
  {"expression": "..."}}</tool_call>``: the expression is evaluated (:func:`evaluate`, never
  ``eval``) and the result comes back as a ``{"role": "tool", ...}`` message; or
* a final answer (a turn with no tool call): the last number in it, or the one inside
  ``<answer>...</answer>``. The episode ends with reward 1.0 when it equals the prompt's
  ``metadata.answer``, else 0.0.

With ``strict=True`` only ``<answer>...</answer>`` is a final answer: a turn with neither a call
nor that tag gets a reminder of the format (a user message) and the episode goes on. After
``max_turns`` turns without an answer the episode ends with reward 0.0. Episode state (the
turns taken and the tool calls made) comes back after a restart through :meth:`state` /
:meth:`restore`; the calculator has no side effects, so a replayed step simply computes again.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import re
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from rolloutd.episodes import EpisodeStart, Message, StepResult

TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluates an arithmetic expression: numbers, parentheses and "
        "+ - * / // % **.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. (3 + 4) * 12"}},
            "required": ["expression"],
        },
    },
}
"""The tool's JSON schema, as a dataset row's ``tools`` carries it to the chat template."""

MAX_LENGTH = 200
"""Characters an expression may have."""
MAX_EXPONENT = 64
"""Largest ``|b|`` of ``a ** b``."""
MAX_DIGITS = 40
"""Largest number of digits of any value along the way (integers are exact in Python, so a
chain of products could otherwise grow without bound)."""

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {
    ast.UAdd: operator.pos,
    ast.USub: operator.neg,
}
CALC = re.compile(r"<calc>(.*?)</calc>", re.S)
TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class CalcError(ValueError):
    """An expression the calculator refuses or cannot compute; the message says why."""


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression: numbers, parentheses, unary ``+ -`` and binary
    ``+ - * / // % **``, nothing else (no names, calls, attributes, comparisons). Bounded by
    :data:`MAX_LENGTH`, :data:`MAX_EXPONENT` and :data:`MAX_DIGITS`; raises :class:`CalcError`."""
    if len(expression) > MAX_LENGTH:
        raise CalcError(f"expression longer than {MAX_LENGTH} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise CalcError(f"not an arithmetic expression: {expression.strip()[:50]!r}") from None
    return _value(tree.body)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, int | float):
            raise CalcError(f"only numbers are allowed, not {node.value!r}")
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        try:
            result = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalcError("division by zero") from None
        except OverflowError:
            raise CalcError("the result is too large") from None
        if isinstance(result, complex):
            raise CalcError("the result is not a real number")
        return _bounded(result)
    raise CalcError(f"{type(node).__name__} is not allowed: only numbers and + - * / // % **")


def _check_power(base: float, exponent: float) -> None:
    if abs(exponent) > MAX_EXPONENT:
        raise CalcError(f"exponents are limited to {MAX_EXPONENT}")
    if abs(base) > 1 and exponent > 0 and exponent * math.log10(abs(base)) > MAX_DIGITS:
        raise CalcError(f"the result would have more than {MAX_DIGITS} digits")


def _bounded(value: int | float) -> int | float:
    if isinstance(value, float) and not math.isfinite(value):
        raise CalcError("the result is too large")
    if abs(value) >= 10**MAX_DIGITS:
        raise CalcError(f"the result has more than {MAX_DIGITS} digits")
    return value


def show(value: int | float) -> str:
    """A value as the tool answers it: integers exactly, other numbers to 12 digits."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(value) if isinstance(value, int) else f"{value:.12g}"


def tool_call(completion: str) -> str | None:
    """The expression a model turn asks the calculator for, or None when it asks nothing."""
    if m := CALC.search(completion):
        return m[1]
    if m := TOOL_CALL.search(completion):
        try:
            call = json.loads(m[1])
            expression = call["arguments"]["expression"]
        except (ValueError, KeyError, TypeError):
            return m[1]  # a malformed call is still a call: the tool says what is wrong
        return expression if isinstance(expression, str) else str(expression)
    return None


def final_answer(completion: str) -> float | None:
    """The number a final turn answers: inside ``<answer>`` if present, else the last one."""
    m = ANSWER.search(completion)
    numbers = NUMBER.findall(m[1] if m else completion)
    return float(numbers[-1]) if numbers else None


@dataclass
class Episode:
    """What the environment keeps of one episode (its :meth:`Calculator.state`)."""

    answer: float | None
    turns: int = 0
    calls: list[str] = field(default_factory=list)


REMINDER = (
    "Call the calculator with <calc>EXPRESSION</calc> or answer with <answer>NUMBER</answer>."
)
"""What ``strict`` says to a turn that neither calls the tool nor answers."""


class Calculator:
    """The environment (see the module docstring). ``max_turns``: model turns before an episode
    without an answer ends (``episodes.max_turns`` bounds it too); ``strict``: only an
    ``<answer>`` tag ends an episode before that."""

    def __init__(self, max_turns: int = 4, strict: bool = False) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be at least 1, got {max_turns}")
        self.max_turns = max_turns
        self.strict = strict
        self._episodes: dict[str, Episode] = {}
        self._lock = threading.Lock()  # sync methods run in several threads at once

    def reset(self, start: EpisodeStart) -> list[Message]:
        episode = Episode(answer=_number(start.metadata))
        with self._lock:
            self._episodes[start.episode_id] = episode
        return []

    def step(
        self, episode_id: str, turn: int, completion: str, *, replay: bool = False
    ) -> StepResult:
        with self._lock:
            episode = self._episodes[episode_id]
        episode.turns = turn + 1
        expression = tool_call(completion)
        if expression is not None:
            episode.calls.append(expression)
            try:
                content = show(evaluate(expression))
            except CalcError as exc:
                content = f"error: {exc}"
            message = {"role": "tool", "name": "calculator", "content": content}
            return self._goes_on(episode_id, episode, message)
        if self.strict and not ANSWER.search(completion):
            return self._goes_on(episode_id, episode, {"role": "user", "content": REMINDER})
        given, expected = final_answer(completion), episode.answer
        right = given is not None and expected is not None and math.isclose(given, expected)
        reward = 1.0 if right else 0.0
        with self._lock:
            del self._episodes[episode_id]
        return StepResult(done=True, reward=reward)

    def _goes_on(self, episode_id: str, episode: Episode, message: Message) -> StepResult:
        """``message`` back to the model, or the end without an answer after ``max_turns``."""
        done = episode.turns >= self.max_turns
        if done:
            with self._lock:
                del self._episodes[episode_id]
        return StepResult(messages=(message,), done=done, reward=0.0 if done else None)

    def state(self, episode_id: str) -> bytes:
        with self._lock:
            episode = self._episodes.get(episode_id)
        return b"" if episode is None else json.dumps(asdict(episode)).encode()

    def restore(self, start: EpisodeStart, state: bytes) -> None:
        if not state:  # saved after the episode's last step: nothing left to restore
            return
        with self._lock:
            self._episodes[start.episode_id] = Episode(**json.loads(state))


def _number(metadata: Any) -> float | None:
    answer = metadata.get("answer") if isinstance(metadata, dict) else None
    try:
        return float(answer) if answer is not None else None
    except (TypeError, ValueError):
        return None
