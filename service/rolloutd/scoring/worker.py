"""A verifier worker: ``python -m rolloutd.scoring.worker``, started by :class:`WorkerPool`.

It reads :class:`Call` frames on stdin and answers each with one frame holding a list of
:class:`SampleScore` (one per input). Anything the verifier prints goes to stderr, so it cannot
corrupt the answers on stdout. It ignores SIGINT (the pool stops it: end of stdin) and exits
when the service that started it is gone, even in the middle of a call that hangs.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import pickle
import signal
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from rolloutd.domain.finishing import SampleScore
from rolloutd.entrypoints import load
from rolloutd.scoring.results import ScoreFailure, failed, score_of
from rolloutd.scoring.wire import READY, Call, frame, read_frame

PARENT_POLL_S = 1.0


def _exit_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    os._exit(0)


def _raised(exc: BaseException) -> str:
    where = traceback.extract_tb(exc.__traceback__)[-1:]
    at = f" (at {os.path.basename(where[0].filename)}:{where[0].lineno})" if where else ""
    return f"{type(exc).__name__}: {exc}{at}"


class Evaluator:
    """Calls verifiers by entry point, each loaded once; async ones on one event loop kept for
    the worker's life (so a verifier may keep a client between calls)."""

    def __init__(self) -> None:
        self._loaded: dict[str, Callable[..., Any]] = {}
        self._runner: asyncio.Runner | None = None

    def __call__(self, call: Call) -> list[SampleScore]:
        n = len(call.inputs)
        try:
            verifier = self._loaded.get(call.spec)
            if verifier is None:
                verifier = self._loaded[call.spec] = load(call.spec)
            value = verifier(list(call.inputs) if call.group else call.inputs[0])
            if inspect.isawaitable(value):
                value = self._run(value)
        except Exception as exc:
            return [failed(ScoreFailure.RAISED, _raised(exc))] * n
        if not call.group:
            return [score_of(value)]
        if not isinstance(value, list | tuple) or len(value) != n:
            got = f"{len(value)} values" if isinstance(value, list | tuple) else repr(value)[:80]
            bad = failed(ScoreFailure.BAD_RESULT, f"returned {got}; expected {n}, one a sibling")
            return [bad] * n
        return [score_of(v) for v in value]

    def _run(self, awaitable: Any) -> Any:
        async def wait() -> Any:
            return await awaitable

        if self._runner is None:
            self._runner = asyncio.Runner()
        return self._runner.run(wait())


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    requests = os.fdopen(os.dup(0), "rb")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    evaluate = Evaluator()
    answers.write(frame(READY))
    answers.flush()
    while (body := read_frame(requests)) is not None:
        answers.write(frame(evaluate(pickle.loads(body))))
        answers.flush()


if __name__ == "__main__":
    main()
