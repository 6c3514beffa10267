"""Pauses of the service (pauses.py) and the lease deadlines they move."""

from __future__ import annotations

from rolloutd.domain.journal import Lease
from rolloutd.domain.ledger import DeliveryLedger
from rolloutd.domain.pauses import PAUSE_MIN_S, Pauses


def test_a_loop_back_late_by_a_second_or_more_was_paused_and_less_is_noise():
    pauses = Pauses()
    assert pauses.observe(1.0, 1.0 + PAUSE_MIN_S * 0.9, now=100.0) is None
    pause = pauses.observe(1.0, 41.0, now=200.0)
    assert pause is not None and pause.seconds == 40.0
    assert pauses.since(150.0) == 40.0  # granted before the pause was noticed: it does not count
    assert pauses.since(200.0) == 0.0  # granted after: nothing to discount


def test_a_lease_granted_before_a_pause_expires_that_much_later():
    ledger = DeliveryLedger()
    before = Lease("before", (), "t", created_at=100.0, expires_at=120.0)
    after = Lease("after", (), "t", created_at=170.0, expires_at=190.0)
    for lease in (before, after):
        ledger.grant(lease)
    pauses = Pauses()
    pauses.observe(1.0, 41.0, now=150.0)  # frozen from 110 to 150
    assert [x.lease_id for x in ledger.expired(155.0, pauses.since)] == []
    assert [x.lease_id for x in ledger.expired(160.0, pauses.since)] == ["before"]
    assert [x.lease_id for x in ledger.expired(190.0, pauses.since)] == ["before", "after"]
    assert [x.lease_id for x in ledger.expired(160.0)] == ["before"]
