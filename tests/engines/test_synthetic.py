"""The synthetic engine: deterministic, valid samples of the configured lengths, deltas that add
up to the sample, and a resumed sibling that ends as it would have without a restart."""

from __future__ import annotations

import math
from array import array

import pytest

from rolloutd.domain.engine import GenerationRequest, SamplingParams
from rolloutd.domain.group import Prompt, SamplePart
from rolloutd.domain.partial import PartialSibling, TokenDelta
from rolloutd.engines import synthetic
from rolloutd.engines.synthetic import SyntheticConfig, SyntheticEngine

PROMPT = Prompt("p1", "What is two plus two?")


def request(
    seed: int, max_tokens: int = 32, prefix: PartialSibling | None = None
) -> GenerationRequest:
    return GenerationRequest(
        request_id=f"r{seed}",
        group_id=1,
        index=seed % 8,
        prompt=PROMPT,
        seed=seed,
        params=SamplingParams(max_tokens=max_tokens),
        prefix=prefix,
    )


def instant(min_tokens: int = 8) -> SyntheticEngine:
    return SyntheticEngine(SyntheticConfig(tokens_per_s=0, min_tokens=min_tokens))


async def test_a_request_gives_the_same_sample_every_time():
    first = await instant().generate(request(7))
    again = await instant().generate(request(7))
    other = await instant().generate(request(8))
    assert (first.token_ids, first.logprobs, first.text) == (
        again.token_ids,
        again.logprobs,
        again.text,
    )
    assert first.token_ids != other.token_ids


async def test_samples_are_valid_and_their_lengths_span_the_configured_range():
    engine = instant(min_tokens=4)
    samples = [await engine.generate(request(seed, max_tokens=12)) for seed in range(400)]
    lengths = [len(s.token_ids) for s in samples]
    assert set(lengths) == set(range(4, 13))  # uniform in [min_tokens, max_tokens]
    for s in samples:
        assert s.token_ids.typecode == "i" and s.logprobs.typecode == "f"
        assert len(s.logprobs) == len(s.token_ids)
        assert all(3 <= t < 32_000 for t in s.token_ids)
        assert all(math.isfinite(lp) and lp <= 0 for lp in s.logprobs)
        assert s.text.split(" ") == [f"t{t}" for t in s.token_ids]
        assert s.finish_reason == ("length" if len(s.token_ids) == 12 else "stop")
        assert list(s.prompt_token_ids) == list(PROMPT.text.encode())
    assert engine.counters().generation_tokens == sum(lengths)


async def test_a_sample_longer_than_the_stream_wraps_around_it(monkeypatch):
    monkeypatch.setattr(synthetic, "_STREAM_TOKENS", 64)
    monkeypatch.setattr(synthetic, "_stream", synthetic.functools.cache(synthetic._Stream))
    engine = SyntheticEngine(SyntheticConfig(tokens_per_s=0, min_tokens=200))
    sample = await engine.generate(request(3, max_tokens=200))
    ids = list(sample.token_ids)
    assert len(ids) == 200
    assert ids[64:128] == ids[:64] and ids[128:192] == ids[:64]  # round the stream and on
    assert len(set(ids[:64])) > 32  # but not one token repeated
    assert sample.text.split(" ") == [f"t{t}" for t in ids]


@pytest.mark.parametrize("tokens_per_s", [0.0, 20_000.0])
async def test_deltas_are_exactly_the_sample_tokens_in_order(tokens_per_s):
    engine = SyntheticEngine(SyntheticConfig(tokens_per_s=tokens_per_s))
    deltas: list[TokenDelta] = []
    sample = await engine.generate(request(5), deltas.append)
    assert array("i", [t for d in deltas for t in d.token_ids]) == sample.token_ids
    assert array("f", [lp for d in deltas for lp in d.logprobs]) == sample.logprobs
    assert {d.policy_version for d in deltas} == {sample.policy_version}


async def test_a_resumed_sibling_ends_as_it_would_have_without_a_restart():
    whole = await instant().generate(request(11))
    cut = len(whole.token_ids) // 2
    prefix = PartialSibling.of(
        1, 11 % 8, whole.token_ids[:cut], whole.logprobs[:cut], [SamplePart(0, 0)]
    )
    resumed = await instant().generate(request(11, prefix=prefix))
    assert resumed.token_ids == whole.token_ids
    assert resumed.logprobs == whole.logprobs
    assert resumed.text == whole.text
    assert resumed.resumed_at == cut
