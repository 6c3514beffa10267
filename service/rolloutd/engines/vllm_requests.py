"""How a :class:`GenerationRequest` is put to vLLM: its prompt rendered by vLLM's own renderer, its
sampling parameters, how often its tokens stream, and the trace headers it carries.

- **Exact capture.** Logprobs are requested with ``logprobs=0`` (the sampled token only) as flat
  lists, so a sample holds exactly one logprob per generated token without a Python object per
  token (:mod:`rolloutd.engines.vllm_outputs` collects them).
- **Resume.** A request with a prefix (a sibling resumed after a restart) asks only for the
  ``max_tokens`` the prefix left.

Only :mod:`rolloutd.engines.vllm` imports it: it imports vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

from vllm import SamplingParams as VLLMSamplingParams
from vllm.exceptions import VLLMClientError
from vllm.inputs import EngineInput
from vllm.renderers.params import ChatParams
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.async_llm import AsyncLLM

from rolloutd.domain.engine import EngineError, GenerationRequest
from rolloutd.domain.group import Prompt

STREAM_TOKENS = 64
"""Tokens per streamed delta. Each delta is a vLLM output object and a wake-up of the request's
task in the service process, which shares the cores with the engine: with 16 siblings of the tiny
model on 2 CPU cores that process spent 49 ms of CPU per 1,000 tokens without streaming, 64 with a
delta per token, 51 with one every 16 tokens and 49 with one every 64. A checkpoint then misses at
most this many tokens of each sibling, well under what a sibling generates between checkpoints
(about 150 tokens per second per sibling here, with checkpoints seconds apart). A resumed request
with stop strings streams every token, so that a stop string across the boundary ends the sample
at the exact token."""

_CHAT_PARAMS = ChatParams(chat_template_kwargs={"add_generation_prompt": True})
"""Chat prompts end with the assistant's turn opener, so the completion is the assistant's reply."""


async def render(llm: AsyncLLM, prompt: Prompt) -> EngineInput:
    """``prompt`` as the engine sees it: ``messages`` through the tokenizer's chat template, or
    the text; a prompt vLLM rejects raises :class:`EngineError`."""
    try:
        if prompt.messages:
            messages = cast(Any, [dict(m) for m in prompt.messages])
            _, inputs = await llm.renderer.render_chat_async([messages], _CHAT_PARAMS)
        else:
            inputs = await llm.renderer.render_cmpl_async([{"prompt": prompt.text}])
    except VLLMClientError as exc:
        raise EngineError(f"prompt {prompt.prompt_id} rejected: {exc}") from exc
    engine_input: EngineInput = inputs[0]
    return engine_input


def sampling_params(
    request: GenerationRequest, *, stream: bool, every_token: bool
) -> VLLMSamplingParams:
    """vLLM's sampling parameters for what ``request`` has left to generate. ``stream``: deltas
    rather than only the final output, every :data:`STREAM_TOKENS` tokens, or every token with
    ``every_token`` (a resumed request whose stop strings may span the boundary)."""
    p = request.params
    done = len(request.prefix) if request.prefix is not None else 0
    return VLLMSamplingParams(
        n=1,
        max_tokens=p.max_tokens - done,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        min_p=p.min_p,
        seed=request.seed,
        stop=list(p.stop) or None,
        logprobs=0,
        flat_logprobs=True,
        output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
        stream_interval=None if every_token else STREAM_TOKENS,
    )


def trace_headers(
    otlp_traces_endpoint: str | None, headers: Mapping[str, str]
) -> Mapping[str, str] | None:
    """vLLM only accepts trace headers with its tracing on; it would warn on every request."""
    if otlp_traces_endpoint is None or not headers:
        return None
    return dict(headers)
