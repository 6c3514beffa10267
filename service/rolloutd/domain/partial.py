"""Partial siblings: the tokens an unfinished sibling has generated so far, captured by checkpoints
and continued from after a restart (``recovery.granularity: token``).

An engine streams :class:`TokenDelta` values while it generates; the controller appends each to
the sibling's staging list. The list is append-only while the sibling generates and is dropped
(never edited) when it finishes, so a checkpoint's exclusive hold takes a cut of it in constant
time: the list and its current length (:class:`PartialSibling`). Joining the tokens happens later,
outside the hold, when the snapshot is written.
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rolloutd.domain.group import SamplePart


@dataclass(frozen=True)
class TokenDelta:
    """Tokens one engine request produced since its previous delta, with one logprob each, and the
    policy version of the weights that produced them."""

    token_ids: array[int]
    logprobs: array[float]
    policy_version: int

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(
                f"a delta of {len(self.token_ids)} tokens has {len(self.logprobs)} logprobs"
            )


@dataclass(frozen=True, eq=False)
class PartialSibling:
    """The first ``count`` deltas of sibling ``index`` of group ``group_id``.

    ``chunks`` may be a staging list still growing: deltas past ``count`` are not part of this
    value, and the first ``count`` never change, so reading them later gives what the cut saw.
    """

    group_id: int
    index: int
    chunks: Sequence[TokenDelta]
    count: int
    turn: int | None = None
    """An episode's model turn the tokens belong to (None: not an episode)."""
    episode: Sequence[Any] = ()
    """An episode's records (``domain/episode_log.py``): the first ``episode_count`` of them."""
    episode_count: int = 0

    @property
    def episode_records(self) -> Sequence[Any]:
        return self.episode[: self.episode_count]

    @classmethod
    def of(
        cls,
        group_id: int,
        index: int,
        token_ids: array[int],
        logprobs: array[float],
        parts: Sequence[SamplePart],
    ) -> PartialSibling:
        """A partial sibling from whole arrays and its parts (as a snapshot stores it)."""
        if len(token_ids) != len(logprobs):
            raise ValueError(f"{len(token_ids)} tokens but {len(logprobs)} logprobs")
        bounds = [p.start for p in parts] + [len(token_ids)]
        if not parts or bounds[0] != 0 or any(a >= b for a, b in itertools.pairwise(bounds)):
            raise ValueError(f"parts {list(parts)} do not cover {len(token_ids)} tokens in order")
        chunks = [
            TokenDelta(token_ids[a:b], logprobs[a:b], p.policy_version)
            for p, (a, b) in zip(parts, itertools.pairwise(bounds), strict=True)
        ]
        return cls(group_id, index, chunks, len(chunks))

    @property
    def deltas(self) -> Sequence[TokenDelta]:
        return self.chunks[: self.count]

    def __len__(self) -> int:
        return sum(len(d.token_ids) for d in self.deltas)

    def token_ids(self) -> array[int]:
        out = array("i")
        for d in self.deltas:
            out.extend(d.token_ids)
        return out

    def logprobs(self) -> array[float]:
        out = array("f")
        for d in self.deltas:
            out.extend(d.logprobs)
        return out

    def parts(self) -> tuple[SamplePart, ...]:
        """Runs of tokens of one policy version, each with its first token's offset."""
        parts: list[SamplePart] = []
        offset = 0
        for d in self.deltas:
            if d.token_ids and (not parts or parts[-1].policy_version != d.policy_version):
                parts.append(SamplePart(offset, d.policy_version))
            offset += len(d.token_ids)
        return tuple(parts)


def delta_tokens(deltas: Sequence[TokenDelta]) -> int:
    """Tokens of ``deltas``."""
    return sum(len(d.token_ids) for d in deltas)


def join_parts(
    prefix: Sequence[SamplePart], prefix_tokens: int, version: int, continued: int
) -> tuple[SamplePart, ...]:
    """The parts of a prefix of ``prefix_tokens`` tokens followed by ``continued`` tokens of
    ``version`` (merged into the last part when the version is the same)."""
    parts = list(prefix)
    if continued and (not parts or parts[-1].policy_version != version):
        parts.append(SamplePart(prefix_tokens, version))
    return tuple(parts)
