"""What a verifier is given: one finished sample with its prompt, as plain data."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rolloutd.domain.finishing import FinishingGroup


@dataclass(frozen=True)
class ScoringInput:
    """One sibling of a finished group and its prompt: what a verifier scores.

    Plain, picklable data (it is sent to worker processes and, as JSON, to HTTP verifiers). A
    verifier must decide the same way when given the same input again: a group whose scoring a
    crash interrupted is scored again after the restore (docs/design.md, "The pipeline").
    """

    prompt_id: str
    prompt: str
    """The prompt text (``""`` when the prompt was given as ``messages`` only)."""
    messages: tuple[dict[str, Any], ...]
    """The chat messages of the prompt (empty when it was given as text)."""
    metadata: Any
    """Exactly as submitted (any JSON value; None when none was given): a reference answer,
    tests, a pattern ..."""
    completion: str
    """The generated text."""
    token_ids: tuple[int, ...]
    """The generated token ids (the prompt's not included)."""
    finish_reason: str
    """Why generation stopped: ``"stop"``, ``"length"`` ..."""
    index: int
    """The sibling's index in its group (0 .. group size - 1)."""


def scoring_inputs(group: FinishingGroup) -> tuple[ScoringInput, ...]:
    """One input per sibling of ``group``, in index order."""
    prompt = group.prompt
    return tuple(
        ScoringInput(
            prompt_id=prompt.prompt_id,
            prompt=prompt.text,
            messages=prompt.messages,
            metadata=prompt.metadata,
            completion=sample.text,
            token_ids=tuple(sample.token_ids),
            finish_reason=sample.finish_reason,
            index=sample.index,
        )
        for sample in group.samples
    )
