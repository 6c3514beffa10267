"""What a submission must be before any of it is accepted: metadata a trainer can be sent, a
size within the byte budget, and generation settings the service and its engine can honour.
Each check raises :class:`InvalidArgument` naming the prompt and the field."""

from __future__ import annotations

from collections.abc import Sequence

from rolloutd.domain.encoder import metadata_problem, tools_problem
from rolloutd.domain.engine import EngineError, PromptMeter
from rolloutd.domain.errors import InvalidArgument
from rolloutd.domain.group import Prompt
from rolloutd.domain.sampler import prompt_bytes
from rolloutd.domain.spec import SpecError, SpecLimits, check, check_prompt_length


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
