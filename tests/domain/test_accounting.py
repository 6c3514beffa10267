"""The accounting on its own: every generated token counted once and in one fate, the staging of
generating siblings, and its part of a snapshot."""

from __future__ import annotations

from array import array

import pytest

from rolloutd.domain.accounting import Accounting, Counters
from rolloutd.domain.errors import InvariantError
from rolloutd.domain.fate import DropReason, EngineState, TokenFate
from rolloutd.domain.group import GroupState
from rolloutd.domain.partial import PartialSibling, TokenDelta
from tests.domain.fakes import Shared, sample


def delta(n: int, version: int = 0) -> TokenDelta:
    return TokenDelta(array("i", range(n)), array("f", [-0.1] * n), version)


def fates_add_up(shared: Shared) -> bool:
    account = shared.accounting.token_account(shared.buffer.groups.values())
    return sum(account.fates.values()) == account.generated


def test_streamed_tokens_count_as_generated_and_buffered_until_their_sibling_is_staged():
    shared = Shared()
    acc = shared.accounting
    shared.generating(1, size=1)
    acc.stage((1, 0))
    sink = acc.sink((1, 0))
    sink(delta(2))
    sink(delta(3))
    assert acc.counters.generated_tokens == 5
    assert acc.token_account([]).fates[TokenFate.BUFFERED] == 5
    s = sample(0, tokens=5)
    shared.buffer.stage(1, s)
    acc.staged((1, 0), s)
    assert not acc.staging((1, 0))
    assert acc.counters.generated_tokens == 5  # streamed already: not counted again
    assert fates_add_up(shared)


def test_a_sample_longer_than_what_streamed_counts_the_rest_as_generated():
    acc = Accounting()
    acc.stage((1, 0))
    acc.sink((1, 0))(delta(2))
    acc.staged((1, 0), sample(0, tokens=6))
    assert acc.counters.generated_tokens == 6
    assert acc.counters.regenerated_tokens == 0


def test_streamed_tokens_a_sample_left_out_are_regenerated():
    acc = Accounting()
    acc.stage((1, 0))
    acc.sink((1, 0))(delta(5))
    acc.staged((1, 0), sample(0, tokens=3))
    assert acc.counters.generated_tokens == 5
    assert acc.counters.regenerated_tokens == 2


def test_a_retry_throws_away_the_failed_attempts_tokens_and_ignores_its_late_deltas():
    acc = Accounting()
    prefix = PartialSibling(1, 0, [delta(2)], 1)
    acc.stage((1, 0), prefix.deltas)
    failed = acc.sink((1, 0))
    failed(delta(4))
    acc.restart((1, 0), prefix)
    assert acc.counters.regenerated_tokens == 4
    assert [len(d.token_ids) for d in acc.streams[(1, 0)]] == [2]
    failed(delta(7))  # a delta of the attempt given up: not the sibling's any more
    assert [len(d.token_ids) for d in acc.streams[(1, 0)]] == [2]
    assert acc.counters.generated_tokens == 4


def test_an_evicted_group_counts_its_staged_and_streaming_tokens_evicted():
    shared = Shared()
    acc = shared.accounting
    g = shared.generating(1, size=2)
    s = sample(0, tokens=3)
    shared.buffer.stage(1, s)
    acc.staged((1, 0), s)
    acc.stage((1, 1))
    acc.sink((1, 1))(delta(4))
    assert acc.left(g, GroupState.EVICTED) == 7
    shared.buffer.remove(1, GroupState.EVICTED)
    c = acc.counters
    assert (c.evicted_groups, c.evicted_tokens) == (1, 7)
    assert acc.streams == {}  # the streaming sibling's tokens went with its group
    assert fates_add_up(shared)


@pytest.mark.parametrize(
    ("reason", "failed"),
    [(DropReason.ENGINE_ERROR, 7), (DropReason.ZERO_VARIANCE, 0), ("too_short", 0)],
)
def test_a_dropped_group_is_counted_once_by_its_reason_and_its_tokens_by_their_fate(reason, failed):
    shared = Shared()
    acc = shared.accounting
    g = shared.finishing(1, size=1, tokens=7)
    assert acc.left(g, GroupState.DROPPED, reason) == 7
    shared.buffer.remove(1, GroupState.DROPPED)
    c = acc.counters
    assert c.dropped_groups == 1
    assert c.dropped_by_reason == {str(reason): 1}
    assert (c.dropped_tokens, c.failed_tokens) == (7, failed)
    settled = c.settled()
    assert settled[TokenFate.FAILED] == failed
    assert settled[TokenFate.DROPPED] == 7 - failed
    assert fates_add_up(shared)


def test_a_group_dropped_without_a_reason_or_leaving_without_a_token_fate_is_refused():
    shared = Shared()
    g = shared.finishing(1, size=1)
    with pytest.raises(InvariantError, match="for a reason"):
        shared.accounting.left(g, GroupState.DROPPED)
    with pytest.raises(InvariantError, match="finalized"):
        shared.accounting.left(g, GroupState.FINALIZED)
    assert shared.accounting.counters.dropped_groups == 0


def test_a_lost_groups_tokens_count_as_delivered():
    shared = Shared()
    g = shared.finishing(1, size=2, tokens=3)
    assert shared.accounting.left(g, GroupState.LOST) == 6
    shared.buffer.remove(1, GroupState.LOST)
    assert shared.accounting.counters.delivered_tokens == 6
    assert fates_add_up(shared)


def test_acks_deliver_tokens_by_source_and_a_rewind_takes_them_back():
    acc = Accounting()
    acc.acked(["dataset", "dataset", "submitted"], 30)
    c = acc.counters
    assert c.acked_groups == 3 and c.acked_by_source == {"dataset": 2, "submitted": 1}
    assert c.delivered_tokens == 30
    acc.rewound(groups=3, evicted=1, tokens=20)
    assert c.delivered_tokens == 10
    assert c.requeued_groups == 2  # the evicted one is not available again


def test_commits_are_counted_by_source_with_their_tokens():
    acc = Accounting()
    acc.committed("math", 10)
    acc.committed("code", 4)
    acc.committed("math", 1)
    c = acc.counters
    assert (c.committed_groups, c.committed_tokens) == (3, 15)
    assert c.committed_by_source == {"math": 2, "code": 1}
    assert c.committed_tokens_by_source == {"math": 11, "code": 4}


def test_an_expired_lease_counts_one_expiry_and_its_groups_requeued():
    acc = Accounting()
    acc.requeued(3)
    assert (acc.counters.expired_leases, acc.counters.requeued_groups) == (1, 3)


def test_the_engines_time_is_split_by_the_state_it_was_in():
    acc = Accounting()
    state = [EngineState.GENERATING]
    acc.start_clock(lambda: state[0])
    state[0] = EngineState.WEIGHT_UPDATE
    acc.clock_engine()
    acc.stop_clock()
    seconds = acc.counters.engine_seconds
    assert set(seconds) == {"generating", "weight_update"}
    assert all(s >= 0 for s in seconds.values())
    acc.clock_engine(read=True)  # stopped: nothing more is counted
    assert acc.counters.engine_seconds == seconds


def test_a_captured_counter_copy_does_not_move_with_the_live_counters():
    acc = Accounting()
    acc.dropped(DropReason.REFUSED, 3)
    counters, _ = acc.capture()
    acc.dropped(DropReason.REFUSED, 2)
    acc.committed("dataset", 1)
    assert counters.dropped_by_reason == {"refused": 1}
    assert counters.dropped_tokens == 3 and counters.committed_groups == 0


def test_capture_then_load_gives_the_same_counters_and_staged_tokens():
    shared = Shared()
    acc = shared.accounting
    shared.generating(1, size=2)
    acc.stage((1, 0))
    acc.sink((1, 0))(delta(3))
    acc.stage((1, 1))  # nothing streamed yet: no partial to keep
    acc.committed("dataset", 9)
    acc.dropped(DropReason.ZERO_VARIANCE, 4)
    counters, partials = acc.capture()
    assert [(p.group_id, p.index, len(p)) for p in partials] == [(1, 0, 3)]

    fresh = Accounting()
    fresh.load(counters, partials, shared.buffer.groups)
    assert fresh.counters == acc.counters
    assert fresh.counters is not counters  # the loaded counters are its own
    assert [len(d.token_ids) for d in fresh.take((1, 0)) or []] == [3]
    assert fresh.take((1, 1)) is None


def test_loading_counters_from_before_tokens_were_counted_starts_the_account_there():
    shared = Shared()
    shared.finishing(1, size=2, tokens=3)
    acc = Accounting()
    acc.load(
        Counters(committed_groups=5), [PartialSibling(2, 0, [delta(4)], 1)], shared.buffer.groups
    )
    assert acc.counters.generated_tokens == 6 + 4
    assert acc.counters.committed_groups == 5
