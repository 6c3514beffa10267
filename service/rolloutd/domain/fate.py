"""Where generation goes: the fate of every generated token, and the state of the engine's time
(docs/design.md, "Where generation goes").

Every token the engine hands to the service is *generated* once and then sits in exactly one
:class:`TokenFate`. The terminal fates are counted in :class:`~rolloutd.domain.accounting.Counters`
as they happen (a token can leave ``delivered`` again only by a ``Rewind``); ``buffered`` is what
the buffer and the staging of generating siblings hold. So the fates add up to the generated
tokens exactly, a restart included: the counters are in every snapshot together with the tokens
it holds, and a restore takes both back to that cut.

The engine's time is likewise split by :class:`EngineState` while the controller runs.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass


class TokenFate(enum.Enum):
    """What became of a generated token (see :data:`MEANINGS`)."""

    DELIVERED = "delivered"
    EVICTED = "evicted"
    DROPPED = "dropped"
    REGENERATED = "regenerated"
    FAILED = "failed"
    BUFFERED = "buffered"


MEANINGS: Mapping[TokenFate, str] = {
    TokenFate.DELIVERED: "in a group a trainer acknowledged (AckGroups); a Rewind takes the "
    "group's tokens back to buffered. A group a restore found leased or acked in the journal "
    "after its snapshot (lost) counts here with the tokens the snapshot held of it.",
    TokenFate.EVICTED: "in a group evicted for being more than limits.max_staleness policy "
    "versions old, whether still generating (its partial siblings too) or ready.",
    TokenFate.DROPPED: "in a group the finishing stage dropped by its verdict (a filter: "
    "zero_variance, or a custom stage's reason).",
    TokenFate.REGENERATED: "thrown away to be generated again: the tokens of a sibling's failed "
    "attempt that is retried, tokens a restore held but generates again "
    "(recovery.granularity sibling or group), and streamed tokens a runner left out of the "
    "sample it returned.",
    TokenFate.FAILED: "in a group that failed: a score or an episode that failed "
    "(scoring_failed), an engine error past limits.sibling_retries (engine_error), a request "
    "the engine refused (refused), a finishing stage that raised (stage_failed), a group no "
    "trainer can receive (undeliverable) or whose leases expired too often (lease_expiries). "
    "An episode's tokens include its environment's between model turns, as its sample does.",
    TokenFate.BUFFERED: "still held: staged or partial siblings of generating groups, and groups "
    "finishing, ready or leased.",
}
"""What each fate holds, for the documentation (docs/metrics.md)."""

TERMINAL = tuple(f for f in TokenFate if f is not TokenFate.BUFFERED)
"""The fates counted as they happen; ``buffered`` is what is left."""


class DropReason(enum.StrEnum):
    """Why a group was dropped before delivery: the one list of the reasons the service and its
    scoring stage give (``GetStatus`` and the metrics count them by value). A custom finishing
    stage may give a reason of its own (free text); its tokens are ``dropped``, and the metrics
    count it as ``other``. A string member compares equal to its value."""

    ZERO_VARIANCE = "zero_variance"
    """The scoring stage's filter: its rewards' standard deviation is at most
    ``filter.min_reward_std`` (no GRPO signal)."""
    SCORING_FAILED = "scoring_failed"
    """A sibling's score, or its episode, failed and ``scoring.on_failure`` is ``drop``."""
    ENGINE_ERROR = "engine_error"
    """A sibling's engine error outlasted its retries."""
    REFUSED = "refused"
    """The engine can never serve the group's request as asked (a prompt and ``max_tokens``
    that do not fit its context)."""
    STAGE_FAILED = "stage_failed"
    """The finishing stage raised."""
    UNDELIVERABLE = "undeliverable"
    """The group cannot be sent to a trainer (the fetch's encoder refused it)."""
    LEASE_EXPIRIES = "lease_expiries"
    """The group's leases expired ``limits.max_lease_expiries`` times."""

    @property
    def failed(self) -> bool:
        """A failure (its tokens are ``failed``), not a filter's verdict (``dropped``)."""
        return self is not DropReason.ZERO_VARIANCE

    @classmethod
    def of(cls, reason: str) -> DropReason | str:
        """``reason`` as a member when it is one's value, else the free text it is."""
        try:
            return cls(reason)
        except ValueError:
            return reason


def drop_fate(reason: DropReason | str) -> TokenFate:
    """The fate of the tokens of a group dropped for ``reason``."""
    known = DropReason.of(reason)
    return TokenFate.FAILED if isinstance(known, DropReason) and known.failed else TokenFate.DROPPED


class EngineState(enum.Enum):
    """What the engine's time went to while the controller ran (see :data:`STATES`)."""

    GENERATING = "generating"
    WEIGHT_UPDATE = "weight_update"
    IDLE_NO_WORK = "idle_no_work"
    IDLE_BUFFER_FULL = "idle_buffer_full"


STATES: Mapping[EngineState, str] = {
    EngineState.GENERATING: "at least one sibling request in flight.",
    EngineState.WEIGHT_UPDATE: "loading new weights (the engine's whole update_weights call, "
    "which pauses generation).",
    EngineState.IDLE_NO_WORK: "nothing in flight and admission started nothing: no prompt to "
    "admit, admission paused, or the in-flight limit held by groups in their finishing stage.",
    EngineState.IDLE_BUFFER_FULL: "nothing in flight because the buffer was full "
    "(limits.buffer_capacity): trainers took groups slower than they were generated.",
}
"""What each state means, for the documentation (docs/metrics.md)."""


@dataclass(frozen=True)
class TokenAccount:
    """Where the generated tokens went, and the engine's time, as plain data (GetStatus)."""

    generated: int
    """Tokens the engine handed to the service, over the life of the store."""
    fates: Mapping[TokenFate, int]
    """``generated`` by fate, every fate present. ``buffered`` is counted in the buffer and the
    staging of generating siblings, not derived from the others, so the fates adding up to
    ``generated`` checks the accounting."""
    engine_seconds: Mapping[EngineState, float]
    """Seconds of the engine's time by state, over the life of the store."""

    @property
    def goodput(self) -> float:
        """Delivered over generated tokens (0 before any token)."""
        return self.fates[TokenFate.DELIVERED] / self.generated if self.generated else 0.0
