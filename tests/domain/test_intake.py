"""The intake room on its own: submitted prompts checked whole before any is accepted, journaled
before the call returns, duplicates accepted once."""

from __future__ import annotations

import pytest

from rolloutd.domain.errors import (
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
)
from rolloutd.domain.group import Prompt
from rolloutd.domain.intake import Intake, IntakeConfig
from rolloutd.domain.journal import JournaledSubmission
from rolloutd.domain.sampler import Admission, Sampler
from rolloutd.domain.spec import GenerationSpec
from tests.domain.fakes import Shared
from tests.fakes import GatedEngine


class MeteredEngine(GatedEngine):
    """An engine with a bounded context: a prompt is as many tokens as its text has words."""

    max_model_len = 16

    async def prompt_tokens(self, prompt: Prompt) -> int:
        return len(prompt.text.split())


def room(shared: Shared | None = None, **config) -> tuple[Intake, Shared]:  # type: ignore[no-untyped-def]
    shared = shared or Shared(sampler=Sampler([], seed=0))
    s = shared
    intake = Intake(
        IntakeConfig(**config), s.engine, s.sampler, s.barrier, s.journal, s.liveness, s.wakeups
    )
    return intake, shared


def submitted(*prompts: Prompt) -> list[Admission]:
    return [Admission(p, None) for p in prompts]


def queued(sampler: Sampler) -> list[str]:
    return [a.prompt.prompt_id for a in iter(sampler.next, None)]


async def test_accepted_prompts_are_journaled_and_queued_for_admission():
    intake, s = room()
    a, b = Prompt("a", "one"), Prompt("b", "two")
    assert await intake.submit(submitted(a, b)) == (2, 0)
    assert s.journal.of("submit") == [(a, b)]
    assert queued(s.sampler) == ["a", "b"]


async def test_a_prompt_accepted_before_is_a_duplicate_and_not_journaled_again():
    intake, s = room()
    a, b = Prompt("a", "one"), Prompt("b", "two")
    await intake.submit(submitted(a))
    assert await intake.submit(submitted(a, b)) == (1, 1)
    assert await intake.submit(submitted(a, b)) == (0, 2)
    assert s.journal.of("submit") == [(a,), (b,)]
    assert queued(s.sampler) == ["a", "b"]


async def test_a_prompt_id_resubmitted_with_another_prompt_is_refused():
    intake, s = room()
    await intake.submit(submitted(Prompt("a", "one")))
    with pytest.raises(FailedPrecondition, match="another text"):
        await intake.submit(submitted(Prompt("a", "other")))
    assert len(s.journal.of("submit")) == 1


@pytest.mark.parametrize(
    ("prompt", "field"),
    [
        (Prompt("deep", "q", metadata=[[[[1]]]]), "prompts[1].metadata"),
        (Prompt("big", "q", metadata="x" * 64), "prompts[1].metadata"),
        (Prompt("tools", "q", tools=("not a schema",)), "prompts[1].tools"),  # type: ignore[arg-type]
        (
            Prompt("hot", "q", generation=GenerationSpec(temperature=-1)),
            "prompts[1].generation.temperature",
        ),
        (
            Prompt("n", "q", generation=GenerationSpec(group_size=0)),
            "prompts[1].generation.group_size",
        ),
    ],
)
async def test_a_submission_with_one_bad_prompt_is_refused_whole_naming_it(
    monkeypatch, prompt, field
):
    monkeypatch.setattr("rolloutd.domain.encoder.MAX_METADATA_DEPTH", 3)
    intake, s = room(max_metadata_bytes=32)
    with pytest.raises(InvalidArgument) as refused:
        await intake.submit(submitted(Prompt("fine", "q"), prompt))
    assert refused.value.field == field
    assert repr(prompt.prompt_id) in str(refused.value)
    assert s.journal.records == [] and queued(s.sampler) == []


async def test_a_submission_heavier_than_its_budget_is_refused_whole():
    intake, s = room(max_submit_bytes=10)
    with pytest.raises(InvalidArgument, match="max_submit_bytes=10") as refused:
        await intake.submit(submitted(Prompt("a", "12345"), Prompt("b", "123456")))
    assert refused.value.field == "prompts"
    assert s.journal.records == []


async def test_a_prompt_whose_max_tokens_cannot_fit_the_engines_context_is_refused():
    intake, s = room(
        Shared(engine=MeteredEngine(), sampler=Sampler([], seed=0)), default_max_tokens=8
    )
    fits = Prompt("fits", "a b c d e f g")  # 7 + 8 < 16
    assert await intake.submit(submitted(fits)) == (1, 0)
    with pytest.raises(InvalidArgument, match="prompts\\[0\\]"):
        await intake.submit(submitted(Prompt("long", "a b c d e f g h i")))
    own = Prompt("own", "a b c d e f g h i", generation=GenerationSpec(max_tokens=4))
    assert await intake.submit(submitted(own)) == (1, 0)
    assert queued(s.sampler) == ["fits", "own"]


async def test_prompts_that_cannot_be_journaled_are_not_accepted():
    intake, s = room()
    s.journal.fail = OSError("disk full")
    with pytest.raises(Unavailable, match="prompts could not be made durable"):
        await intake.submit(submitted(Prompt("a", "q")))
    s.journal.fail = None
    assert await intake.submit(submitted(Prompt("a", "q"))) == (1, 0)  # not a duplicate


async def test_a_submission_over_the_pending_limit_is_refused_and_journals_nothing():
    intake, s = room(Shared(sampler=Sampler([], seed=0, max_pending=2)))
    await intake.submit(submitted(Prompt("a", "q")))
    with pytest.raises(ResourceExhausted, match="max_pending_prompts=2"):
        await intake.submit(submitted(Prompt("b", "q"), Prompt("c", "q")))
    assert s.journal.of("submit") == [(Prompt("a", "q"),)]


async def test_a_submission_is_refused_once_the_service_drains():
    intake, s = room()
    s.liveness.drain()
    with pytest.raises(Unavailable):
        await intake.submit(submitted(Prompt("a", "q")))
    assert s.journal.records == []


def test_prompts_accepted_after_the_snapshot_are_queued_again_by_replay_beyond_the_limit():
    intake, s = room(Shared(sampler=Sampler([], seed=0, max_pending=1)))
    intake.replay(JournaledSubmission((Prompt("a", "q"), Prompt("b", "q"))))
    assert queued(s.sampler) == ["a", "b"]
    assert s.journal.records == []  # journaled already
