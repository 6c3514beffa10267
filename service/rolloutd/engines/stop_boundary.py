"""Stop strings for a resumed sample, checked across the boundary between prefix and continuation.

A sibling resumed after a restart is a new engine request whose prompt ends with the tokens it had
generated (the prefix). vLLM checks stop strings on the continuation's text only, so a stop string
that begins in the prefix and ends in the continuation goes unseen there. While the continuation
is shorter than the longest stop string, the joined text is checked here, and such a stop string
ends the sample where an uninterrupted run would have.

Kept free of vLLM imports: the engine hands in its tokenizer's decode.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from typing import TypeAlias

Decode: TypeAlias = "Callable[[array[int]], str]"
"""Token ids to text, as the engine's incremental detokenizer would show them."""


class StopBoundary:
    """Checks a resumed request's joined text for a stop string ending past the prefix, while the
    continuation is too short for vLLM's own check to have seen the whole stop string."""

    def __init__(self, decode: Decode, prefix: array[int], stops: tuple[str, ...]) -> None:
        self._decode = decode
        self._prefix = prefix
        self._stops = stops
        self._prefix_chars = len(decode(prefix))
        self._window = max(map(len, stops))

    def check(self, continuation: array[int]) -> str | None:
        """The joined text cut before the first stop string that ends after the prefix, if any."""
        text = self._decode(self._prefix + continuation)
        found = [
            at
            for stop in self._stops
            if (at := text.find(stop, max(0, self._prefix_chars - len(stop) + 1))) >= 0
        ]
        return text[: min(found)] if found else None

    def passed(self, continuation_text: list[str]) -> bool:
        """Whether the continuation alone is long enough to hold any stop string whole."""
        return sum(map(len, continuation_text)) >= self._window


def cut_at_stop(text: str, stops: Sequence[str]) -> str:
    """``text`` up to the first stop string in it (a stop string is not part of the text)."""
    cut = [text.find(stop) for stop in stops if stop in text]
    return text[: min(cut)] if cut else text
