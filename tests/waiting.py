"""Waiting for the condition a test checks, never for a fixed time.

A fixed sleep is either too short on a loaded machine (the test flakes) or longer than needed
everywhere else. These poll a condition until it holds, and fail naming what never happened.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


def until(what: str, check: Callable[[], T], timeout_s: float = 30.0, every_s: float = 0.02) -> T:
    """``check()``'s first truthy value, polled every ``every_s``; AssertionError naming ``what``
    and the last value after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what} (last: {value!r})")
        time.sleep(every_s)
    return value


async def eventually(
    what: str,
    check: Callable[[], T | Awaitable[T]],
    timeout_s: float = 30.0,
    every_s: float = 0.02,
) -> T:
    """:func:`until` for a test on the event loop; ``check`` may be a coroutine function."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value  # type: ignore[return-value]
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what} (last: {value!r})")
        await asyncio.sleep(every_s)
