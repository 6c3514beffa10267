"""The accounting of generation: what happened to groups, where every generated token went, and
what the engine's time went to (docs/design.md, "Where generation goes").

:class:`Accounting` is the one writer of :class:`Counters`: the rooms tell
it what happened (a group admitted, committed, acked, dropped ...) and it counts. It also holds
the tokens generating siblings have streamed so far (the *staging*): they count as generated and
``buffered`` until their sibling is staged or its group leaves, and a checkpoint captures them so
that a restart continues each sibling from its tokens. So every token is generated once and sits
in one fate (``domain/fate.py``), and the counters, in every snapshot with the tokens it holds,
add up to the generated tokens across restarts.

The engine's time is split by :class:`EngineState` here too: :meth:`clock_engine` counts the
time since the last change in the state the engine was in, whenever the state may have changed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from rolloutd.domain.engine import DeltaSink
from rolloutd.domain.errors import InvariantError
from rolloutd.domain.fate import DropReason, EngineState, TokenAccount, TokenFate, drop_fate
from rolloutd.domain.group import Group, GroupState, Sample
from rolloutd.domain.partial import PartialSibling, TokenDelta, delta_tokens


@dataclass
class Counters:
    """Cumulative over the life of the store (they survive restarts). Only
    :class:`Accounting` changes them."""

    admitted_groups: int = 0
    committed_groups: int = 0
    acked_groups: int = 0
    finalized_groups: int = 0
    evicted_groups: int = 0
    requeued_groups: int = 0
    dropped_groups: int = 0
    """Groups dropped: by a finishing stage's verdict, an engine error, or a failed stage."""
    committed_tokens: int = 0
    expired_leases: int = 0
    dropped_by_reason: dict[str, int] = field(default_factory=dict)
    """``dropped_groups`` by reason (``Verdict.drop_reason``, or ``engine_error``,
    ``stage_failed``, ``undeliverable``, ``lease_expiries``)."""
    dropped_tokens: int = 0
    """Generated tokens of the dropped groups' siblings, staged or partial (fates ``dropped``
    and ``failed``)."""
    committed_by_source: dict[str, int] = field(default_factory=dict)
    """``committed_groups`` by the name of the group's source (``submitted``: a submitted
    prompt's)."""
    committed_tokens_by_source: dict[str, int] = field(default_factory=dict)
    acked_by_source: dict[str, int] = field(default_factory=dict)
    """``acked_groups`` by source: what each source delivered to training."""
    generated_tokens: int = 0
    """Tokens the engine handed to the service: streamed to a sibling's staging, or returned in
    a sample beyond what was streamed (domain/fate.py)."""
    delivered_tokens: int = 0
    """Tokens of acked groups (less those a ``Rewind`` made available again)."""
    evicted_tokens: int = 0
    failed_tokens: int = 0
    """Of ``dropped_tokens``, those of groups dropped for a failure (``DropReason.failed``)."""
    regenerated_tokens: int = 0
    engine_seconds: dict[str, float] = field(default_factory=dict)
    """Seconds of the engine's time by ``EngineState`` value while the controller ran."""

    def settled(self) -> dict[TokenFate, int]:
        """Tokens by terminal fate (every fate but ``buffered``)."""
        return {
            TokenFate.DELIVERED: self.delivered_tokens,
            TokenFate.EVICTED: self.evicted_tokens,
            TokenFate.DROPPED: self.dropped_tokens - self.failed_tokens,
            TokenFate.REGENERATED: self.regenerated_tokens,
            TokenFate.FAILED: self.failed_tokens,
        }

    @property
    def buffered_tokens(self) -> int:
        """The generated tokens no terminal fate holds: what the buffer and the staging of
        generating siblings hold, when the accounting is right."""
        return self.generated_tokens - sum(self.settled().values())

    def copy(self) -> Counters:
        """A copy that shares nothing with this one: a capture's counters are encoded after the
        hold ends, while drops and commits go on counting into the live ones."""
        return replace(
            self,
            dropped_by_reason=dict(self.dropped_by_reason),
            committed_by_source=dict(self.committed_by_source),
            committed_tokens_by_source=dict(self.committed_tokens_by_source),
            acked_by_source=dict(self.acked_by_source),
            engine_seconds=dict(self.engine_seconds),
        )


SiblingKey = tuple[int, int]
"""(group id, sibling index)"""


def _add(counts: dict[str, int], key: str, n: int = 1) -> None:
    counts[key] = counts.get(key, 0) + n


class Accounting:
    """The counters, the staging of generating siblings and the engine's clock; see the module
    docstring. Every method is called inside a barrier mutation, or by the one task that owns
    the sibling it names."""

    def __init__(self) -> None:
        self._counters = Counters()
        self._staging: dict[SiblingKey, list[TokenDelta]] = {}
        """(group id, index) -> the deltas of a generating sibling so far, its restored prefix
        first. Append-only while the sibling generates; removed in the mutation that stages the
        sibling's sample or removes its group, so a capture never holds both."""
        self._state_of: Callable[[], EngineState] = lambda: EngineState.IDLE_NO_WORK
        self._engine: tuple[EngineState, float] | None = None
        """The engine's state since a monotonic instant, while the controller runs."""

    @property
    def counters(self) -> Counters:
        """The counters as they are (read them; never change them)."""
        return self._counters

    # --- groups ----------------------------------------------------------------------------

    def admitted(self) -> None:
        self._counters.admitted_groups += 1

    def committed(self, source: str, tokens: int) -> None:
        c = self._counters
        c.committed_groups += 1
        c.committed_tokens += tokens
        _add(c.committed_by_source, source)
        _add(c.committed_tokens_by_source, source, tokens)

    def acked(self, sources: Sequence[str], tokens: int) -> None:
        """Groups acked, one source name each, with the tokens they held (delivered)."""
        c = self._counters
        c.acked_groups += len(sources)
        for source in sources:
            _add(c.acked_by_source, source)
        c.delivered_tokens += tokens

    def rewound(self, groups: int, evicted: int, tokens: int) -> None:
        """A rewind made ``groups`` acked groups available again (``evicted`` of them too stale
        to deliver): their ``tokens`` are not delivered any more."""
        self._counters.delivered_tokens -= tokens
        self._counters.requeued_groups += groups - evicted

    def finalized(self, groups: int) -> None:
        self._counters.finalized_groups += groups

    def requeued(self, groups: int) -> None:
        """An expired lease's groups are available again."""
        self._counters.requeued_groups += groups
        self._counters.expired_leases += 1

    def left(self, group: Group, fate: GroupState, reason: DropReason | str | None = None) -> int:
        """A group leaves the buffer (inside the mutation that removes it) with its staged
        siblings and the tokens its generating ones streamed: counts them in ``fate``'s token
        fate (EVICTED, DROPPED with its ``reason``, or LOST: delivered after the snapshot a
        restore started from); returns how many."""
        tokens = group.generated_tokens + self.release(group.group_id)
        if fate is GroupState.EVICTED:
            self._counters.evicted_groups += 1
            self._counters.evicted_tokens += tokens
        elif fate is GroupState.DROPPED:
            if reason is None:
                raise InvariantError("a group is dropped for a reason")
            self.dropped(reason, tokens)
        elif fate is GroupState.LOST:
            self._counters.delivered_tokens += tokens
        else:
            raise InvariantError(f"a group leaves as {fate.value} without tokens to count")
        return tokens

    def dropped(self, reason: DropReason | str, tokens: int) -> None:
        """One dropped group with ``tokens`` (0 for one no snapshot held: a journal replay)."""
        c = self._counters
        c.dropped_groups += 1
        _add(c.dropped_by_reason, reason.value if isinstance(reason, DropReason) else reason)
        c.dropped_tokens += tokens
        if drop_fate(reason) is TokenFate.FAILED:
            c.failed_tokens += tokens

    def regenerated(self, tokens: int) -> None:
        """Tokens thrown away to be generated again (a restore that runs a group again)."""
        self._counters.regenerated_tokens += tokens

    # --- the staging of generating siblings ------------------------------------------------

    def stage(self, key: SiblingKey, prefix: Sequence[TokenDelta] = ()) -> None:
        """A sibling starts streaming, after ``prefix`` (a restore's captured tokens)."""
        self._staging[key] = list(prefix)

    @property
    def streams(self) -> Mapping[SiblingKey, Sequence[TokenDelta]]:
        """(group id, index) -> the deltas each streaming sibling staged so far (read them
        only)."""
        return self._staging

    def staging(self, key: SiblingKey) -> bool:
        return key in self._staging

    def sink(self, key: SiblingKey) -> DeltaSink:
        """Where a sibling's attempt streams its tokens: its staging, each token counted as
        generated. A delta that arrives after the attempt was given up (its group removed, a
        retry begun) is not its sibling's any more and is left out."""
        counters, staging = self._counters, self._staging
        deltas = staging[key]

        def sink(delta: TokenDelta) -> None:
            if staging.get(key) is deltas:
                deltas.append(delta)
                counters.generated_tokens += len(delta.token_ids)

        return sink

    def restart(self, key: SiblingKey, prefix: PartialSibling | None) -> None:
        """A retried sibling starts again from its prefix: the failed attempt's tokens are
        thrown away (``regenerated``)."""
        kept = list(prefix.deltas) if prefix else []
        thrown = self._staging.get(key, [])
        self._counters.regenerated_tokens += delta_tokens(thrown) - delta_tokens(kept)
        self._staging[key] = kept

    def staged(self, key: SiblingKey, sample: Sample) -> None:
        """A sibling's sample replaces its staged tokens (inside the mutation that stages it).
        What it holds beyond them was never streamed and counts as generated now (all of it
        without ``capture_partials``); streamed tokens it left out are ``regenerated``."""
        unseen = len(sample.token_ids) - delta_tokens(self._staging.pop(key, []))
        if unseen >= 0:
            self._counters.generated_tokens += unseen
        else:
            self._counters.regenerated_tokens -= unseen

    def take(self, key: SiblingKey) -> list[TokenDelta] | None:
        """A restored sibling's captured tokens, taken out for its resumption (None: none)."""
        return self._staging.pop(key, None)

    def release(self, group_id: int) -> int:
        """Forgets the staged tokens of a group's generating siblings (its group leaves the
        buffer, or they are generated again); returns how many tokens they held."""
        keys = [key for key in self._staging if key[0] == group_id]
        return sum(delta_tokens(self._staging.pop(key)) for key in keys)

    def partials(self) -> tuple[PartialSibling, ...]:
        """The tokens of every streaming sibling so far (constant time each: a reference and a
        length); inside the exclusive hold."""
        return tuple(
            PartialSibling(gid, index, chunks, len(chunks))
            for (gid, index), chunks in self._staging.items()
            if chunks
        )

    # --- the account -----------------------------------------------------------------------

    def held_tokens(self, groups: Iterable[Group]) -> tuple[int, int]:
        """Tokens held, counted group by group: (buffered, acked). Buffered are the siblings of
        groups generating, finishing, ready or leased and the staged tokens of generating
        siblings; acked are those of groups acked and not yet finalized (delivered). Linear in
        the buffer: for status, not for every scrape."""
        buffered = sum(delta_tokens(deltas) for deltas in self._staging.values())
        acked = 0
        for g in groups:
            if g.state is GroupState.ACKED:
                acked += g.generated_tokens
            else:
                buffered += g.generated_tokens
        return buffered, acked

    def token_account(self, groups: Iterable[Group]) -> TokenAccount:
        """Where the generated tokens went (``buffered`` counted in ``groups`` and the staging),
        and the engine's time so far."""
        self.clock_engine(read=True)
        c = self._counters
        fates = {**c.settled(), TokenFate.BUFFERED: self.held_tokens(groups)[0]}
        seconds = {s: c.engine_seconds.get(s.value, 0.0) for s in EngineState}
        return TokenAccount(c.generated_tokens, fates, seconds)

    # --- the engine's time -----------------------------------------------------------------

    def start_clock(self, state_of: Callable[[], EngineState]) -> None:
        """Starts splitting the engine's time by state (the controller starts)."""
        self._state_of = state_of
        self._engine = (state_of(), time.monotonic())

    def clock_engine(self, *, read: bool = False) -> None:
        """When the engine's state changed, counts the time since the last change in the state
        it was in. Called whenever the state may have changed (a sibling starts or ends, a
        weight update, every notification); with ``read``, counts the time so far even when it
        did not change (before the counters are read)."""
        if self._engine is None:
            return
        held, since = self._engine
        state = self._state_of()
        if state is held and not read:
            return  # the cheap common case: a sibling ends while others run
        now = time.monotonic()
        key = held.value
        seconds = self._counters.engine_seconds
        seconds[key] = seconds.get(key, 0.0) + now - since
        self._engine = (state, now)

    def stop_clock(self) -> None:
        """Counts the last stretch and stops (the controller stops)."""
        self.clock_engine(read=True)
        self._engine = None

    # --- snapshots -------------------------------------------------------------------------

    def capture(self) -> tuple[Counters, tuple[PartialSibling, ...]]:
        """A copy of the counters (encoded after the hold, while counting goes on) and the
        plain siblings' partial tokens; inside the exclusive hold."""
        self.clock_engine(read=True)
        return self._counters.copy(), self.partials()

    def load(
        self, counters: Counters, partials: Iterable[PartialSibling], groups: Mapping[int, Group]
    ) -> None:
        """A snapshot's counters, and the partial tokens of its plain siblings, which wait in
        the staging until their group resumes or leaves. A snapshot written before tokens were
        accounted for holds tokens it never counted as generated: the account starts at this
        restore, with them buffered (or delivered, for acked groups)."""
        self._counters = counters.copy()
        self._staging = {(p.group_id, p.index): list(p.deltas) for p in partials}
        c = self._counters
        if c.generated_tokens:
            return
        buffered, acked = self.held_tokens(groups.values())
        c.delivered_tokens += acked
        c.generated_tokens = sum(c.settled().values()) + buffered
