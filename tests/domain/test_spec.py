"""Generation settings: a prompt's over its source's over the service's; each setting the engine
cannot honour is named; weighted sources deliver their share, each with its own cursor, and
continue after a capture and restore exactly as they would have."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from rolloutd.domain.group import Position, Prompt
from rolloutd.domain.sampler import Sampler, Source
from rolloutd.domain.spec import (
    GenerationSpec,
    SamplingParams,
    SpecError,
    SpecLimits,
    check,
    check_prompt_length,
    resolve,
)

LIMITS = SpecLimits(max_group_size=16, max_model_len=512)


def prompts(prefix: str, n: int) -> list[Prompt]:
    return [Prompt(f"{prefix}{i}", f"{prefix} question {i}") for i in range(n)]


def test_a_prompt_wins_over_its_source_and_the_source_over_the_service():
    service = SamplingParams(max_tokens=64, temperature=1.0, top_p=1.0, stop=("\n",))
    source = GenerationSpec(temperature=0.5, max_tokens=16, group_size=8)
    prompt = GenerationSpec(temperature=2.0, seed=7)
    got = resolve(prompt.over(source), service, group_size=4)
    assert got.params == SamplingParams(max_tokens=16, temperature=2.0, top_p=1.0, stop=("\n",))
    assert (got.group_size, got.seed) == (8, 7)
    assert resolve(GenerationSpec(), service, group_size=4).params == service
    assert resolve(GenerationSpec(), service, group_size=4).seed is None


@pytest.mark.parametrize(
    ("row", "field", "message"),
    [
        ({"temperature": -0.1}, "temperature", "must be at least 0"),
        ({"top_p": 0}, "top_p", r"must be in \(0, 1\]"),
        ({"top_p": 1.5}, "top_p", r"must be in \(0, 1\]"),
        ({"top_k": -2}, "top_k", "must be at least 0"),
        ({"min_p": 2}, "min_p", r"must be in \[0, 1\]"),
        ({"max_tokens": 0}, "max_tokens", "must be at least 1"),
        ({"max_tokens": 512}, "max_tokens", "engine.vllm.max_model_len=512"),
        ({"group_size": 17}, "group_size", "limits.max_group_size=16"),
        ({"seed": -1}, "seed", "must be in"),
        ({"stop": [""]}, "stop", "non-empty strings"),
        ({"temperature": "hot"}, "temperature", "must be a number, not str"),
        ({"max_tokens": 4.5}, "max_tokens", "must be a whole number"),
        ({"temprature": 1.0}, "temprature", "is not a generation setting"),
    ],
)
def test_each_setting_outside_what_the_engine_accepts_is_named(row, field, message):
    with pytest.raises(SpecError, match=message) as refused:
        check(GenerationSpec.from_json(row), LIMITS)
    assert refused.value.field == field
    assert str(refused.value).startswith(f"generation.{field} ")


def test_a_prompt_and_its_max_tokens_must_fit_the_context():
    check_prompt_length(500, 12, 512)
    with pytest.raises(SpecError, match=r"exceeds engine.vllm.max_model_len=512 \(at most 500\)"):
        check_prompt_length(501, 12, 512)
    check_prompt_length(10**6, 12, None)  # the synthetic engine has no context bound


def test_a_spec_round_trips_through_json():
    spec = GenerationSpec(temperature=0.5, top_k=40, stop=("###",), seed=3, group_size=2)
    assert GenerationSpec.from_json(spec.to_json()) == spec
    assert GenerationSpec.from_json({"stop": "###"}).stop == ("###",)
    assert not GenerationSpec() and spec


def sources(weights: tuple[float, float] = (3, 1)) -> list[Source]:
    return [
        Source("math", prompts("m", 37), weights[0], GenerationSpec(temperature=0.5)),
        Source("chat", prompts("c", 23), weights[1]),
    ]


def drain(sampler: Sampler, n: int) -> list[Position]:
    out = []
    for _ in range(n):
        admission = sampler.next()
        assert admission is not None and admission.position is not None
        out.append(admission.position)
    return out


def test_two_sources_at_weights_3_to_1_deliver_within_5_points_of_75_and_25_percent():
    positions = drain(Sampler(sources(), seed=11), 400)
    share = Counter(p.source for p in positions)
    assert abs(share[0] / 400 - 0.75) <= 0.05, share
    assert abs(share[1] / 400 - 0.25) <= 0.05, share


def test_each_source_keeps_its_own_epoch_and_cursor():
    sampler = Sampler(sources(), seed=2, epochs=2)
    positions = drain(sampler, 120)
    assert sampler.next() is None and sampler.exhausted  # 2 epochs of 37 + 23 prompts
    for source, size in ((0, 37), (1, 23)):
        mine = [p for p in positions if p.source == source]
        assert [(p.epoch, p.offset) for p in mine] == [
            (e, o) for e in range(2) for o in range(size)
        ]
        assert sampler.cursors[source] == Position(2, 0, source)
    # each epoch of a source visits each of its prompts once, in a permutation of its own
    math = [sampler.prompt_at(p).prompt_id for p in positions if p.source == 0]
    assert sorted(math[:37]) == sorted(math[37:]) == sorted(f"m{i}" for i in range(37))
    assert math[:37] != math[37:]


def test_a_restored_sampler_continues_exactly_and_a_new_weight_takes_over_from_its_cursors():
    control = Sampler(sources(), seed=5)
    expected = drain(control, 300)

    first = Sampler(sources(), seed=5)
    before = drain(first, 120)
    state = first.capture()
    second = Sampler(sources(), seed=5)
    second.restore(state)
    assert before + drain(second, 180) == expected

    reweighted = Sampler(sources((1, 3)), seed=5)
    reweighted.restore(state)
    after = drain(reweighted, 200)
    share = Counter(p.source for p in after)
    assert abs(share[1] / 200 - 0.75) <= 0.07, share
    for source in (0, 1):  # each source continues from its own cursor, nothing skipped
        mine = [p for p in before + after if p.source == source]
        assert [(p.epoch, p.offset) for p in mine][: len(mine)] == [
            divmod(i, 37 if source == 0 else 23) for i in range(len(mine))
        ]


def test_a_source_of_weight_0_is_not_drawn_from():
    sampler = Sampler([*sources()[:1], replace(sources()[1], weight=0)], seed=1)
    assert {p.source for p in drain(sampler, 50)} == {0}
