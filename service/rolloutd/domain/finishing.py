"""The finishing stage: what happens to a group between "every sibling finished" and "a trainer may
lease it" (a port of the domain).

Once a group's last sibling is staged, the group is FINISHING and the controller hands it to the
stage, outside the barrier: a stage may take its time (scoring with a reward model, running tests)
while acks, fetches and checkpoints go on. It answers with a :class:`Verdict`: commit the group
(training-ready) or drop it with a reason (a filter such as zero reward variance). A dropped
group's prompt position counts as consumed: it is not admitted again.

Durability: a FINISHING group's siblings are durable like any staged row, and the group's state
is part of every snapshot. A crash during the stage loses nothing: after a restore the stage runs
again for exactly the groups the snapshot holds as FINISHING (docs/design.md, "The life of a
group"), so a stage must decide the same way when asked again (or record what it decided in what
it returns, once verdicts carry records).

A stage whose work is CPU-bound runs it off the event loop (``asyncio.to_thread`` or a process
pool): the loop serves every RPC of the service.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from rolloutd.domain.fate import DropReason
from rolloutd.domain.group import (
    GroupScores,
    Position,
    Prompt,
    Sample,
    SampleScore,
    ScoreStatus,
)

__all__ = [
    "COMMIT",
    "CommitAll",
    "DropReason",
    "FinishingGroup",
    "FinishingStage",
    "GroupScores",
    "SampleScore",
    "ScoreStatus",
    "Verdict",
]


@dataclass(frozen=True)
class FinishingGroup:
    """A group whose siblings are all staged, as the stage sees it (plain data)."""

    group_id: int
    prompt: Prompt
    """The prompt, with its ``metadata`` exactly as given (a reference answer, tests ...)."""
    position: Position | None
    """Where the prompt sits in the dataset (None: a trainer submitted it)."""
    policy_version: int
    samples: Sequence[Sample]
    """The siblings in index order."""
    source: str = ""
    """The name of the prompt's source (``submitted``: a trainer submitted it)."""


@dataclass(frozen=True)
class Verdict:
    """What the stage decided for a group."""

    drop_reason: DropReason | str | None = None
    """``None``: commit the group; otherwise drop it: a :class:`DropReason`, or a custom stage's
    own short identifier (counted by value: keep the set of them small). Text that is a
    :class:`DropReason`'s value becomes that member."""
    detail: str = ""
    """Why, in words, for the log (e.g. the rewards)."""
    scores: GroupScores | None = None
    """Recorded on the group when it is committed (None: unscored). Part of every snapshot that
    holds the group, so a restored group is never scored again."""

    def __post_init__(self) -> None:
        if isinstance(self.drop_reason, str) and not isinstance(self.drop_reason, DropReason):
            object.__setattr__(self, "drop_reason", DropReason.of(self.drop_reason))

    @property
    def commits(self) -> bool:
        return self.drop_reason is None


COMMIT = Verdict()
"""The verdict that commits a group unchanged."""


class FinishingStage(Protocol):
    """Decides whether a finished group is committed or dropped (see the module docstring)."""

    async def finish(self, group: FinishingGroup) -> Verdict: ...


class CommitAll:
    """The default stage: every finished group is committed unchanged."""

    async def finish(self, group: FinishingGroup) -> Verdict:
        return COMMIT
