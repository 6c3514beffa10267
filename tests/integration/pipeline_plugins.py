"""A finishing stage and a sibling runner that a real ``rolloutd serve`` loads by entry point
(``pipeline.*``) in the pipeline's process tests. Both wait at a gate the test opens (a file in
``$PIPELINE_TEST_GATE``) and write what they were asked into ``$PIPELINE_TEST_GATE/calls``, one
line per call, so the test sees what a restarted process did again."""

from __future__ import annotations

import asyncio
import os
from dataclasses import replace
from pathlib import Path

from rolloutd.domain.finishing import COMMIT, FinishingGroup, Verdict
from rolloutd.domain.group import Sample
from rolloutd.domain.partial import PartialSibling, TokenDelta
from rolloutd.domain.runner import SiblingJob

FIRST_CALL_TOKENS = 4
"""Tokens the runner's first engine call generates."""


def _gate() -> Path:
    return Path(os.environ["PIPELINE_TEST_GATE"])


def _record(*words: object) -> None:
    with (_gate() / "calls").open("a") as f:
        f.write(" ".join(map(str, words)) + "\n")
        f.flush()
        os.fsync(f.fileno())


async def _wait_open() -> None:
    # the gate is a file the test (another process) creates: nothing to wait on but the file
    while not (_gate() / "open").exists():  # noqa: ASYNC110
        await asyncio.sleep(0.02)


class GatedStage:
    """Commits the groups of even-numbered prompts (``q0``, ``q2`` ...) at once; holds the
    others at the gate, then commits them."""

    async def finish(self, group: FinishingGroup) -> Verdict:
        _record("start", group.prompt.prompt_id)
        if int(group.prompt.prompt_id[1:]) % 2:
            await _wait_open()
        _record("done", group.prompt.prompt_id)
        return COMMIT


class TwoCallRunner:
    """Produces a sibling in two engine calls: its first :data:`FIRST_CALL_TOKENS` tokens, then
    (once the gate is open) the rest, continued from the first call's tokens. A restored prefix
    that covers the first call skips it."""

    async def run(self, job: SiblingJob) -> Sample:
        request = job.request
        prefix = request.prefix
        if prefix is None or len(prefix) < FIRST_CALL_TOKENS:
            _record("call1", request.request_id, 0 if prefix is None else len(prefix))
            deltas: list[TokenDelta] = [] if prefix is None else list(prefix.deltas)

            def keep(delta: TokenDelta) -> None:
                deltas.append(delta)
                if job.on_delta is not None:
                    job.on_delta(delta)

            first = replace(request, params=replace(request.params, max_tokens=FIRST_CALL_TOKENS))
            await job.engine.generate(first, keep)
            prefix = PartialSibling(request.group_id, request.index, deltas, len(deltas))
            _record("between", request.request_id, len(prefix))
            await _wait_open()
        _record("call2", request.request_id, len(prefix))
        return await job.engine.generate(replace(request, prefix=prefix), job.on_delta)
