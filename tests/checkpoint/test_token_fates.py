"""Where generation goes: every generated token in exactly one fate, through a run of the
synthetic engine with a retried sibling, engine errors, a filter's drops, acks and a rewind,
evictions, and a restore from a real store (docs/design.md, "Where generation goes")."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from rolloutd.checkpoint.checkpointer import Checkpointer, CheckpointerConfig
from rolloutd.checkpoint.restore import Granularity, restore
from rolloutd.checkpoint.segments import ArrowSealer
from rolloutd.checkpoint.store import SnapshotStore
from rolloutd.domain.controller import Controller, ControllerConfig
from rolloutd.domain.engine import DeltaSink, EngineError, GenerationRequest, SamplingParams
from rolloutd.domain.episode import EpisodeLimits
from rolloutd.domain.episode_runner import EpisodeRunner
from rolloutd.domain.fate import EngineState, TokenAccount, TokenFate
from rolloutd.domain.finishing import COMMIT, FinishingGroup, Verdict
from rolloutd.domain.group import Prompt, Sample
from rolloutd.domain.partial import TokenDelta
from rolloutd.domain.report import Outcome, Trigger
from rolloutd.domain.sampler import Sampler
from rolloutd.engines.synthetic import SyntheticConfig, SyntheticEngine
from tests.checkpoint.test_checkpointer import nodes  # noqa: F401  (the fixture)
from tests.checkpoint.test_episode_replay import GatedEnv
from tests.controllers import fetch
from tests.fakes import settle

PROMPTS = [Prompt(f"p{i}", f"question {i}") for i in range(200)]
FINGERPRINT = {"model": "synthetic", "group_size": 2}
FAST_EPISODES = SyntheticConfig(tokens_per_s=0, min_tokens=4)


@dataclass
class Flaky:
    """The synthetic engine, but a request named in ``once`` fails its first attempt and one in
    ``always`` every attempt, each after streaming its first delta."""

    inner: SyntheticEngine
    once: set[str] = field(default_factory=set)
    always: set[str] = field(default_factory=set)
    failed: list[str] = field(default_factory=list)

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    @property
    def policy_version(self) -> int:
        return self.inner.policy_version

    async def generate(
        self, request: GenerationRequest, on_delta: DeltaSink | None = None
    ) -> Sample:
        rid = request.request_id
        if on_delta is None or not (rid in self.always or rid in self.once):
            return await self.inner.generate(request, on_delta)
        self.once.discard(rid)

        def fail_after_first(delta: TokenDelta) -> None:
            on_delta(delta)
            self.failed.append(rid)
            raise EngineError(f"{rid}: the engine lost the request")

        return await self.inner.generate(request, fail_after_first)


class EveryThirdDropped:
    """A filter: drops every third group (as a zero-variance filter would)."""

    async def finish(self, group: FinishingGroup) -> Verdict:
        return Verdict("zero_variance") if group.group_id % 3 == 0 else COMMIT


def node(root: Path, engine: Flaky) -> tuple[Controller, Checkpointer]:
    store = SnapshotStore(str(root))
    controller = Controller(
        ControllerConfig(
            group_size=2,
            max_in_flight=4,
            buffer_capacity=8,
            max_staleness=0,
            rewind_window=100,
            sibling_retries=1,
            reap_interval_s=0.02,
            sampling=SamplingParams(max_tokens=48),
        ),
        engine,
        Sampler(PROMPTS, seed=1),
        journal=store.journal,
        sealer=ArrowSealer(),
        stage=EveryThirdDropped(),
    )
    checkpointer = Checkpointer(
        controller, store, store.journal, CheckpointerConfig(keep_latest=2), FINGERPRINT
    )
    return controller, checkpointer


def synthetic() -> Flaky:
    return Flaky(SyntheticEngine(SyntheticConfig(tokens_per_s=400, min_tokens=24)))


def exact(c: Controller) -> TokenAccount:
    """The account, checked: the fates add up to the generated tokens, what is left buffered is
    what the buffer and the staging hold, and the staging holds nothing of a group gone."""
    assert {gid for gid, _ in c.rooms.accounting.streams} <= set(c.rooms.buffer.groups)
    account = c.token_account()
    assert set(account.fates) == set(TokenFate)
    assert all(n >= 0 for n in account.fates.values()), account
    assert sum(account.fates.values()) == account.generated, account
    assert account.fates[TokenFate.BUFFERED] == c.rooms.accounting.counters.buffered_tokens
    return account


async def test_every_generated_token_ends_in_exactly_one_fate(tmp_path):
    weights = tmp_path / "weights"
    weights.mkdir()
    engine = synthetic()
    engine.once.add("g1-s0")  # retried, then generated whole: regenerated
    engine.always.add("g2-s1")  # past its retries: the group fails
    a, ckpt_a = node(tmp_path / "store", engine)
    a.start()
    try:
        await settle(
            lambda: (
                a.rooms.accounting.counters.committed_groups >= 3
                and a.rooms.accounting.counters.dropped_groups >= 2
            )
        )
        assert "g1-s0" in engine.failed and engine.failed.count("g2-s1") == 2
        for step in (1, 2):
            lease, _ = await fetch(a, 1, 5_000, "trainer")
            await a.ack(lease.lease_id, step)
        before_rewind = exact(a).fates[TokenFate.DELIVERED]
        await a.rewind(1)  # the group acked at step 2 goes back to the buffer
        assert 0 < exact(a).fates[TokenFate.DELIVERED] < before_rewind
        await a.update_weights(1, str(weights))  # max_staleness 0: all of version 0 is evicted
        account = exact(a)
        assert account.fates[TokenFate.EVICTED] > 0
        assert account.fates[TokenFate.FAILED] > 0  # g2's siblings, partial ones too
        assert account.fates[TokenFate.DROPPED] > 0  # the filter's
        assert account.fates[TokenFate.REGENERATED] > 0  # g1-s0's first attempt
        # a checkpoint while siblings stream: their partial tokens are in the snapshot
        await settle(lambda: sum(map(len, a.rooms.accounting.streams.values())) >= 4)
        report = await ckpt_a.checkpoint(Trigger.ON_DEMAND)
        assert report.outcome is Outcome.COMPLETED
        snapshot = report.sequence
    finally:
        await a.stop()
    exact(a)
    captured = ckpt_a.store.load(snapshot)
    assert ckpt_a.store.read_partials(captured)

    # a restart from that snapshot: the counters and the tokens it holds come back together;
    # what was generated after it is counted nowhere, and the partial siblings it held are
    # generated again (granularity sibling)
    b, ckpt_b = node(tmp_path / "store", synthetic())
    await restore(b, ckpt_b.store, ckpt_b, "latest", FINGERPRINT, Granularity.SIBLING)
    restored = exact(b)
    assert restored.generated <= exact(a).generated
    assert restored.fates[TokenFate.REGENERATED] > account.fates[TokenFate.REGENERATED]
    committed = b.rooms.accounting.counters.committed_groups
    b.start()
    try:
        await settle(lambda: b.rooms.accounting.counters.committed_groups >= committed + 2)
        # one of them: staleness gating (on) admits no more than the trainers' pace, so the
        # other is what stays buffered
        lease, _ = await fetch(b, 1, 5_000, "trainer")
        await b.ack(lease.lease_id, 3)
    finally:
        await b.stop()
    final = exact(b)
    assert final.generated > restored.generated
    assert all(final.fates[f] > 0 for f in TokenFate), final
    assert final.goodput == final.fates[TokenFate.DELIVERED] / final.generated
    assert final.engine_seconds[EngineState.GENERATING] > 0
    assert final.engine_seconds[EngineState.WEIGHT_UPDATE] > 0


ACCOUNTING = (
    "generated_tokens", "delivered_tokens", "evicted_tokens", "failed_tokens",
    "regenerated_tokens", "engine_seconds",
)  # fmt: skip
"""The counters a snapshot written before token accounting lacks."""


async def test_a_snapshot_from_before_the_accounting_starts_it_at_the_restore(tmp_path):
    a, ckpt_a = node(tmp_path / "store", synthetic())
    a.start()
    try:
        await settle(lambda: a.rooms.accounting.counters.committed_groups >= 4)
        lease, _ = await fetch(a, 2, 5_000, "trainer")
        await a.ack(lease.lease_id, 1)
        report = await ckpt_a.checkpoint(Trigger.ON_DEMAND)
    finally:
        await a.stop()
    store = ckpt_a.store
    manifest = store.load(report.sequence)
    sidecar = store.open(manifest).sidecar
    for key in ACCOUNTING:
        del sidecar["controller"]["counters"][key]
    older = replace(
        manifest,
        sequence=manifest.sequence + 1,
        sidecar=store.write_sidecar_json(manifest.sequence + 1, json.dumps(sidecar).encode()),
    )
    store.publish(older)

    b, ckpt_b = node(tmp_path / "store", synthetic())
    await restore(b, store, ckpt_b, "latest", FINGERPRINT, Granularity.SIBLING)
    account = exact(b)
    buffered, acked = b.rooms.accounting.held_tokens(b.rooms.buffer.groups.values())
    assert account.fates[TokenFate.DELIVERED] == acked > 0
    # the partial siblings it held are generated again (granularity sibling)
    wasted = (
        b.rooms.accounting.counters.dropped_tokens + b.rooms.accounting.counters.regenerated_tokens
    )
    assert account.generated == buffered + acked + wasted


async def test_a_restored_episode_mid_turn_keeps_the_account(nodes):  # noqa: F811
    """An episode counts when its sample is staged: the tokens of a model turn a snapshot caught
    mid-generation were never counted, so a restore neither holds them buffered nor, when the
    turn is generated again, counts them regenerated."""
    env = GatedEnv()
    runner = EpisodeRunner({}, env, EpisodeLimits(max_turns=5))
    slow = SyntheticEngine(SyntheticConfig(tokens_per_s=150, min_tokens=32))
    a = nodes(engine=slow, runner=runner, max_in_flight=2, buffer_capacity=4)
    a.controller.start()
    episodes = a.controller.rooms.flight.episodes
    # some episodes staged (counted), others mid-turn (their tokens not counted yet)
    await settle(
        lambda: (
            a.controller.rooms.accounting.counters.generated_tokens > 0
            and sum(len(e.deltas) for e in episodes.values()) >= 2
        )
    )
    await a.checkpoint()
    await a.controller.stop()
    exact(a.controller)

    for granularity in (Granularity.SIBLING, Granularity.TOKEN):
        b = nodes(engine=SyntheticEngine(FAST_EPISODES), runner=runner, max_in_flight=2)
        await b.restore(granularity=granularity)
        exact(b.controller)
        b.controller.start()
        await settle(lambda: b.controller.rooms.accounting.counters.committed_groups >= 2)  # noqa: B023
        await b.controller.stop()
        assert exact(b.controller).generated > 0
