"""Intake: prompts trainers submit (``SubmitPrompts``), checked, journaled and queued.

A submission must be, before any of it is accepted: metadata a trainer can be sent, a size
within the byte budget, and generation settings the service and its engine can honour (each
check raises :class:`InvalidArgument` naming the prompt and the field). The accepted prompts
are journaled (durable) before the call returns, and a prompt id accepted once is a duplicate
forever after, also across a restart."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

from rolloutd.domain.barrier import MutationBarrier
from rolloutd.domain.encoder import metadata_problem, tools_problem
from rolloutd.domain.engine import EngineError, GenerationEngine, PromptMeter
from rolloutd.domain.errors import InvalidArgument, not_durable
from rolloutd.domain.group import Prompt
from rolloutd.domain.journal import DeliveryJournal, JournaledSubmission
from rolloutd.domain.liveness import Liveness
from rolloutd.domain.mutation import MutationKind
from rolloutd.domain.sampler import Admission, Sampler, prompt_bytes
from rolloutd.domain.spec import SpecError, SpecLimits, check, check_prompt_length
from rolloutd.domain.wakeups import Wakeups


@dataclass(frozen=True)
class IntakeConfig:
    max_metadata_bytes: int = 8 << 20
    max_submit_bytes: int = 32 << 20
    spec_limits: SpecLimits = field(default_factory=SpecLimits)
    default_max_tokens: int = 256
    """The service's ``max_tokens``: a prompt's unless it sets its own."""


class Intake:
    """Submitted prompts; see the module docstring."""

    def __init__(
        self,
        config: IntakeConfig,
        engine: GenerationEngine,
        sampler: Sampler,
        barrier: MutationBarrier,
        journal: DeliveryJournal,
        liveness: Liveness,
        wakeups: Wakeups,
    ) -> None:
        self._config = config
        self._engine = engine
        self._sampler = sampler
        self._barrier = barrier
        self._journal = journal
        self._liveness = liveness
        self._wakeups = wakeups
        self._submitting = asyncio.Lock()
        """Serialises submissions: check, journal, accept, with no other in between."""

    async def submit(self, admissions: list[Admission]) -> tuple[int, int]:
        """Queues trainer-supplied prompts; returns (accepted, duplicates)."""
        self._liveness.check_serving()
        prompts = [a.prompt for a in admissions]
        cfg = self._config
        check_sizes(prompts, cfg.max_metadata_bytes, cfg.max_submit_bytes)
        await check_settings(prompts, cfg.spec_limits, cfg.default_max_tokens, self._engine)
        async with self._submitting, self._barrier.mutation(MutationKind.ADMIT):
            fresh = self._sampler.fresh(prompts)
            if fresh:
                try:
                    await self._journal.submit(fresh)
                except OSError as exc:
                    raise not_durable("the prompts", exc) from exc
            accepted, duplicates = self._sampler.submit(prompts)
        await self._wakeups.notify()
        return accepted, duplicates

    def replay(self, submission: JournaledSubmission) -> None:
        """Prompts accepted after the snapshot, queued again (inside the RESTORE mutation)."""
        self._sampler.submit(submission.prompts, bounded=False)


def check_sizes(prompts: Sequence[Prompt], max_metadata_bytes: int, max_submit_bytes: int) -> None:
    """Refuses a submission that could not be delivered or would weigh too much: metadata or
    tools too deep or too large (naming the prompt), or more bytes in all than
    ``max_submit_bytes``."""
    total = 0
    for i, prompt in enumerate(prompts):
        if prompt.metadata is not None:
            problem = metadata_problem(prompt.metadata, max_metadata_bytes)
            if problem is not None:
                raise InvalidArgument(
                    f"prompts[{i}].metadata", f"of prompt {prompt.prompt_id!r}: {problem}"
                )
        if prompt.tools:
            problem = tools_problem(prompt.tools, max_metadata_bytes)
            if problem is not None:
                raise InvalidArgument(
                    f"prompts[{i}].tools", f"of prompt {prompt.prompt_id!r}: {problem}"
                )
        total += prompt_bytes(prompt)
    if total > max_submit_bytes:
        raise InvalidArgument(
            "prompts",
            f"{total} bytes in {len(prompts)} prompts, more than "
            f"limits.max_submit_bytes={max_submit_bytes}: submit them in smaller calls",
        )


async def check_settings(
    prompts: Sequence[Prompt], limits: SpecLimits, default_max_tokens: int, engine: object
) -> None:
    """Refuses the first prompt whose generation settings the service or the engine cannot
    honour; with an engine that measures prompts (:class:`PromptMeter`), also one whose prompt
    and ``max_tokens`` (its own, else ``default_max_tokens``) do not fit the engine's context."""
    meter = engine if isinstance(engine, PromptMeter) else None
    for i, prompt in enumerate(prompts):
        spec = prompt.generation
        try:
            check(spec, limits)
            if meter is not None:
                tokens = await meter.prompt_tokens(prompt)
                check_prompt_length(
                    spec.max_tokens or default_max_tokens, tokens, meter.max_model_len
                )
        except SpecError as exc:
            raise InvalidArgument(
                f"prompts[{i}].generation.{exc.field}",
                f"{exc.problem} (prompt {prompt.prompt_id!r})",
            ) from None
        except EngineError as exc:
            raise InvalidArgument(f"prompts[{i}]", str(exc)) from None
