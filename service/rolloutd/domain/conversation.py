"""An episode's conversation as exact tokens.

The model's sampled tokens are never re-tokenized. Everything else (the prompt, the
environment's messages, the template's turn markers) is the chat template's rendering, cut at
the model's turns: the conversation is rendered with a *marker* in place of each model turn's
content, and the text between two markers is tokenized. So an environment step's tokens are
``render(conversation + its messages, add_generation_prompt)`` minus ``render(conversation)``,
computed without the model's text in it. A model turn that ended on a token the template also
closes the turn with (its end-of-turn token) keeps the sampled one: the template's copy is cut.

:func:`Conversation.mismatches` renders the whole conversation once more at the end and counts
the token positions that differ from the tokens the episode was generated with (a template whose
rendering of earlier turns depends on later ones, say).
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from typing import Any

from rolloutd.domain.engine import ChatRenderer
from rolloutd.domain.episode import Message

_MARK = "\ue000{}\ue001"
"""Stands for model turn ``n``'s content in a rendering (private-use characters no template or
environment writes)."""


class Conversation:
    """The messages of one episode so far, the model's turns as markers."""

    def __init__(
        self,
        renderer: ChatRenderer,
        prompt: Sequence[Message],
        tools: Sequence[Mapping[str, Any]],
    ) -> None:
        self.renderer = renderer
        self.tools = tools
        self.messages: list[Message] = list(prompt)
        self.turns = 0
        self.segments: list[array[int]] = []
        """The tokens of each rendered stretch between model turns, as generated (the first:
        the prompt's)."""

    async def _suffix(self, add_generation_prompt: bool) -> str:
        text = await self.renderer.render_chat(
            self.messages, tools=self.tools, add_generation_prompt=add_generation_prompt
        )
        if self.turns == 0:
            return text
        mark = _MARK.format(self.turns - 1)
        at = text.rfind(mark)
        if at < 0:
            raise ValueError("the chat template dropped the model's last turn")
        return text[at + len(mark) :]

    async def add_environment(
        self,
        messages: Sequence[Message],
        *,
        last_model_token: int | None = None,
        final: bool = False,
    ) -> array[int]:
        """Tokens of ``messages`` after the conversation so far (the first call: the prompt's,
        with ``reset``'s messages), ending with the generation prompt unless ``final``."""
        self.messages.extend(messages)
        ids = await self.renderer.encode(await self._suffix(not final))
        if last_model_token is not None and ids and ids[0] == last_model_token:
            ids = ids[1:]
        self.segments.append(ids)
        return ids

    def add_model(self) -> None:
        """A model turn happened; its content is a marker from now on."""
        self.messages.append({"role": "assistant", "content": _MARK.format(self.turns)})
        self.turns += 1

    async def mismatches(self, ended_by_model: Sequence[int | None], final: bool) -> int:
        """Token positions where the whole conversation, rendered again at once, differs from
        the segments generated turn by turn. ``ended_by_model[k]``: the token model turn ``k``
        ended on (as :meth:`add_environment` was told)."""
        text = await self.renderer.render_chat(
            self.messages, tools=self.tools, add_generation_prompt=not final
        )
        pieces: list[str] = []
        for k in range(self.turns):
            head, sep, text = text.partition(_MARK.format(k))
            if not sep:
                return sum(map(len, self.segments))
            pieces.append(head)
        pieces.append(text)
        differ = 0
        for k, (ours, piece) in enumerate(zip(self.segments, pieces, strict=False)):
            again = await self.renderer.encode(piece)
            last = ended_by_model[k - 1] if k else None
            if last is not None and again and again[0] == last:
                again = again[1:]
            differ += sum(a != b for a, b in zip(ours, again, strict=False))
            differ += abs(len(ours) - len(again))
        return differ
