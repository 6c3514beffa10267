"""A vLLM request's outputs, collected as they arrive and turned into a :class:`Sample`.

- **Exact capture.** Token ids come from vLLM's outputs; logprobs are requested with
  ``logprobs=0`` (the sampled token only) as flat lists, so a sample holds exactly one logprob per
  generated token without a Python object per token.
- **Policy versions come from the engine.** vLLM labels every output token with the weight version
  that produced it, and a sample's ``policy_version`` is read from the labels of its own tokens.
"""

from __future__ import annotations

import time
from array import array
from dataclasses import dataclass, field

from vllm.logprobs import FlatLogprobs
from vllm.outputs import CompletionOutput, RequestOutput

from rolloutd.domain.engine import EngineError, GenerationRequest
from rolloutd.domain.group import Sample
from rolloutd.domain.partial import join_parts
from rolloutd.engines.stop_boundary import Decode, cut_at_stop


@dataclass
class Collected:
    """A request's completion as its outputs arrive: whole outputs, or deltas to join."""

    token_ids: array[int] = field(default_factory=lambda: array("i"))
    logprobs: array[float] = field(default_factory=lambda: array("f"))
    text: list[str] = field(default_factory=list)
    versions: set[str] = field(default_factory=set)
    finish_reason: str | None = None
    prompt_token_ids: list[int] | None = None
    stopped_at: str | None = None
    """Text of prefix and continuation cut before a stop string that spans their boundary."""

    def add(self, rid: str, out: RequestOutput) -> None:
        """Adds one output (a delta, or the whole final output)."""
        (completion,) = out.outputs
        self.token_ids.extend(completion.token_ids)
        self.logprobs.extend(sampled_logprobs(rid, completion))
        self.text.append(completion.text)
        self.versions.update(weight_labels(completion))
        if out.finished:
            self.finish_reason = str(completion.finish_reason)


def weight_labels(completion: CompletionOutput) -> set[str]:
    """The weight-version labels vLLM attached to the output's tokens."""
    return {span.version for span in completion.weight_versions or []}


def version_of(rid: str, versions: set[str], current: int) -> int:
    """The version label vLLM attached to this request's tokens.

    Weights change only while generation is paused and paused requests are either finished
    (wait) or aborted (abort) first, so one request's tokens carry one label.
    """
    if not versions:
        # No token was generated, so no weights were used; the current version is as good as
        # any and keeps such samples from looking stale.
        return current
    if len(versions) > 1:
        raise EngineError(f"request {rid} straddles weight versions {sorted(versions)}")
    return int(next(iter(versions)))


def sampled_logprobs(rid: str, completion: CompletionOutput) -> array[float]:
    """One float32 logprob per generated token: the sampled token's own (``logprobs=0``)."""
    flat = completion.logprobs
    if not isinstance(flat, FlatLogprobs):
        raise EngineError(f"request {rid}: expected flat logprobs, got {type(flat).__name__}")
    if flat.token_ids != list(completion.token_ids):
        raise EngineError(
            f"request {rid}: {len(flat.token_ids)} logprobs for "
            f"{len(completion.token_ids)} tokens, or for other tokens"
        )
    return array("f", flat.logprobs)


def to_sample(
    request: GenerationRequest, got: Collected, started: float, *, current: int, decode: Decode
) -> Sample:
    """The sample of a finished request; a resumed one joins its prefix and the continuation.
    ``current``: the engine's policy version now; ``decode``: its tokenizer's."""
    rid = request.request_id
    if got.finish_reason in ("abort", "error"):
        raise EngineError(
            f"request {rid} finished with '{got.finish_reason}' "
            "(aborted by a weight update or failed in the engine); it may be retried"
        )
    prefix = request.prefix
    version = version_of(rid, got.versions, current)
    if prefix is None:
        return Sample(
            index=request.index,
            token_ids=got.token_ids,
            logprobs=got.logprobs,
            text="".join(got.text),
            finish_reason=str(got.finish_reason),
            policy_version=version,
            prompt_token_ids=array("i", got.prompt_token_ids or ()),
            seed=request.seed,
            started_at=started,
            finished_at=time.time(),
        )
    token_ids = prefix.token_ids() + got.token_ids
    parts = join_parts(prefix.parts(), len(prefix), version, len(got.token_ids))
    text = got.stopped_at
    if text is None:
        text = cut_at_stop(decode(token_ids), request.params.stop)
    return Sample(
        index=request.index,
        token_ids=token_ids,
        logprobs=prefix.logprobs() + got.logprobs,
        text=text,
        finish_reason=str(got.finish_reason),
        policy_version=min(p.policy_version for p in parts) if parts else version,
        prompt_token_ids=array("i", got.prompt_token_ids or ()),
        seed=request.seed,
        started_at=started,
        finished_at=time.time(),
        resumed_at=len(prefix),
        parts=parts,
    )
