"""Token-level resume on the real vLLM engine and the tiny model: streamed deltas, continuation from
a captured prefix, stop strings across the boundary. Float32 greedy decoding on CPU is
deterministic here (checked by the first test), which the others rely on."""

from __future__ import annotations

from array import array
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import pytest_asyncio

from rolloutd.domain.engine import GenerationRequest, SamplingParams
from rolloutd.domain.group import Prompt, Sample, SamplePart
from rolloutd.domain.partial import PartialSibling, TokenDelta
from rolloutd.engines.vllm_config import VLLMConfig

if TYPE_CHECKING:
    from rolloutd.engines.vllm import VLLMEngine

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module")]

SETTINGS = VLLMConfig(
    dtype="float32", max_model_len=1024, kv_cache_memory_gib=1, enforce_eager=True, max_num_seqs=16
)
PROMPT = Prompt("arith", "What is 3 + 4?")
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def model(tiny_model: Path) -> Path:
    return tiny_model


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def engine(model: Path) -> AsyncIterator[VLLMEngine]:
    from rolloutd.engines.vllm import VLLMEngine

    eng = VLLMEngine(SETTINGS, model, max_sequences=16)
    await eng.start()
    yield eng
    await eng.stop()


def request(
    rid: str,
    *,
    prefix: PartialSibling | None = None,
    stop: tuple[str, ...] = (),
    max_tokens: int = MAX_TOKENS,
) -> GenerationRequest:
    return GenerationRequest(
        request_id=rid,
        group_id=1,
        index=0,
        prompt=PROMPT,
        seed=7,
        params=SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=stop),
        prefix=prefix,
    )


def prefix_of(sample: Sample, n: int) -> PartialSibling:
    return PartialSibling.of(
        1, 0, sample.token_ids[:n], sample.logprobs[:n], [SamplePart(0, sample.policy_version)]
    )


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def reference(engine: VLLMEngine) -> Sample:
    """The uninterrupted greedy sibling, streamed."""
    deltas: list[TokenDelta] = []
    sample = await engine.generate(request("reference"), deltas.append)
    assert sample.finish_reason == "length", "the tiny model should not stop early on this prompt"
    assert len(deltas) > 1, "tokens come in several deltas while generating"
    assert sum((d.token_ids for d in deltas), array("i")) == sample.token_ids
    assert sum((d.logprobs for d in deltas), array("f")) == sample.logprobs
    assert {d.policy_version for d in deltas} == {sample.policy_version}
    assert sample.resumed_at is None and sample.parts == ()
    return sample


async def test_greedy_float32_decoding_is_deterministic(engine: VLLMEngine, reference: Sample):
    again = await engine.generate(request("again"))
    assert again.token_ids == reference.token_ids
    assert again.logprobs == reference.logprobs


@pytest.mark.parametrize("cut", [1, 17, MAX_TOKENS - 1])
async def test_a_resumed_greedy_sibling_equals_the_uninterrupted_one(
    engine: VLLMEngine, reference: Sample, cut: int
):
    deltas: list[TokenDelta] = []
    resumed = await engine.generate(
        request(f"resumed-{cut}", prefix=prefix_of(reference, cut)), deltas.append
    )
    assert resumed.token_ids[:cut] == reference.token_ids[:cut]
    assert resumed.logprobs[:cut] == reference.logprobs[:cut], "the prefix comes back exactly"
    assert resumed.token_ids == reference.token_ids, "token for token"
    assert resumed.logprobs[cut:].tolist() == pytest.approx(
        reference.logprobs[cut:].tolist(), abs=1e-4
    )
    assert resumed.text == reference.text
    assert resumed.finish_reason == reference.finish_reason
    assert resumed.prompt_token_ids == reference.prompt_token_ids
    assert resumed.resumed_at == cut
    assert resumed.parts == (SamplePart(0, reference.policy_version),)
    # Only the continuation is streamed: the prefix is already staged.
    assert sum((d.token_ids for d in deltas), array("i")) == reference.token_ids[cut:]


async def test_a_prefix_that_already_reached_max_tokens_is_returned_as_it_is(
    engine: VLLMEngine, reference: Sample
):
    whole = await engine.generate(request("whole", prefix=prefix_of(reference, MAX_TOKENS)))
    assert whole.token_ids == reference.token_ids and whole.logprobs == reference.logprobs
    assert whole.finish_reason == "length" and whole.text == reference.text


def spanning_stop(engine: VLLMEngine, reference: Sample, cut: int) -> str:
    """A stop string made of the text just before and just after token ``cut``, that occurs
    nowhere earlier in the text."""
    text = reference.text
    before = len(engine._decode(reference.token_ids[:cut]))
    for width in range(2, 12):
        stop = text[before - width // 2 : before + (width + 1) // 2]
        if len(stop) == width and text.find(stop) == before - width // 2 and stop.strip():
            return stop
    raise AssertionError(f"no stop string spans token {cut} of {text!r}")


@pytest.mark.parametrize("cut", [9, 30])
async def test_a_stop_string_spanning_the_boundary_ends_the_sample_where_it_would_have(
    engine: VLLMEngine, reference: Sample, cut: int
):
    stop = spanning_stop(engine, reference, cut)
    uninterrupted = await engine.generate(request(f"stop-ref-{cut}", stop=(stop,)))
    assert uninterrupted.finish_reason == "stop"
    assert len(uninterrupted.token_ids) > cut, "the stop string ends after the boundary"
    resumed = await engine.generate(
        request(f"stop-resumed-{cut}", stop=(stop,), prefix=prefix_of(reference, cut))
    )
    assert resumed.token_ids == uninterrupted.token_ids
    assert resumed.text == uninterrupted.text
    assert resumed.finish_reason == "stop"
    assert resumed.resumed_at == cut
