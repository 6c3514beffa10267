"""Finished groups as a finishing stage receives them, built by hand."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

from rolloutd.domain.finishing import FinishingGroup
from rolloutd.domain.group import Position, Prompt, Sample


def finishing_group(
    completions: Sequence[str], metadata: Any = None, *, group_id: int = 1
) -> FinishingGroup:
    """A group of one sibling per completion (token ids: the completion's bytes)."""
    samples = [
        Sample(
            index=i,
            token_ids=array("i", list(text.encode())),
            logprobs=array("f", [-0.5] * len(text.encode())),
            text=text,
            finish_reason="stop" if i % 2 == 0 else "length",
            policy_version=2,
            prompt_token_ids=array("i", [7, 8]),
            seed=i,
            started_at=0.0,
            finished_at=1.0,
        )
        for i, text in enumerate(completions)
    ]
    prompt = Prompt(
        f"p{group_id}", "What is 6 x 7?", metadata, ({"role": "user", "content": "hi"},)
    )
    return FinishingGroup(group_id, prompt, Position(0, group_id), 2, samples)


def rewarded(rewards: Sequence[float | None], *, group_id: int = 1) -> FinishingGroup:
    """A group scored by ``tests.scoring.verifiers:from_metadata``: sibling i gets rewards[i]
    (None: its verifier raises)."""
    return finishing_group(["x"] * len(rewards), {"rewards": list(rewards)}, group_id=group_id)
