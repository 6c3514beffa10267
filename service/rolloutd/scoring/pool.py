"""A pool of verifier worker processes that survives its verifiers.

:class:`concurrent.futures.ProcessPoolExecutor` is broken for good once one of its workers
dies, and cannot stop a call that hangs. Here each worker is a child process
(``python -m rolloutd.scoring.worker``) spoken to over its stdin and stdout with asyncio's
subprocess pipes, one call at a time, so the event loop never blocks on a verifier:

- a verifier that raises, or returns something that is not a finite reward, fails that call's
  scores with the reason; the worker goes on;
- a call that runs past ``timeout_s`` fails with ``timeout``; its worker is killed;
- a worker that dies (``os._exit``, a crash, the OOM killer) fails its call with
  ``worker_died`` and its exit code;
- a call cancelled by its caller (its group was evicted) kills its worker, whose answer would
  otherwise be read by the next call.

A killed or dead worker's place is taken by a fresh one, started when that place is next used.
Workers import entry points from the service's Python path: they get its ``sys.path`` as
``PYTHONPATH``. A pool belongs to the event loop that first uses it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import signal
import sys
from collections.abc import Sequence

from rolloutd.domain.finishing import SampleScore
from rolloutd.scoring.inputs import ScoringInput
from rolloutd.scoring.results import ScoreFailure, failed
from rolloutd.scoring.wire import HEADER, READY, Call, frame

log = logging.getLogger(__name__)

START_TIMEOUT_S = 60.0
"""How long a new worker may take to import rolloutd and say it is ready."""


class WorkerDied(Exception):
    """The worker's process ended; the message says how."""


def _how_it_ended(returncode: int | None) -> str:
    if returncode is None:
        return "its pipe closed"
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exit code {returncode}"


class Worker:
    """One worker process (see the module docstring)."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        assert process.stdin is not None and process.stdout is not None
        self._stdin = process.stdin
        self._stdout = process.stdout

    @classmethod
    async def start(cls) -> Worker:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in sys.path)
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "rolloutd.scoring.worker",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=env,
        )
        worker = cls(process)
        try:
            async with asyncio.timeout(START_TIMEOUT_S):
                ready = await worker._answer()
        except BaseException:
            worker.kill()
            raise
        if ready != READY:
            worker.kill()
            raise WorkerDied(f"the worker said {ready[:40]!r} instead of that it was ready")
        log.debug("scoring worker %d started", process.pid)
        return worker

    async def call(self, request: Call) -> list[SampleScore]:
        self._stdin.write(frame(request))
        try:
            await self._stdin.drain()
        except ConnectionError:
            raise WorkerDied(await self._ended()) from None
        scores: list[SampleScore] = pickle.loads(await self._answer())
        return scores

    async def _answer(self) -> bytes:
        try:
            (size,) = HEADER.unpack(await self._stdout.readexactly(HEADER.size))
            return await self._stdout.readexactly(size)
        except asyncio.IncompleteReadError:
            raise WorkerDied(await self._ended()) from None

    async def _ended(self) -> str:
        return _how_it_ended(await self.process.wait())

    def kill(self) -> None:
        """Ends the process now; asyncio reaps it."""
        if self.process.returncode is None:
            self.process.kill()
        self._stdin.close()

    async def stop(self, grace_s: float = 1.0) -> None:
        """Asks the worker to exit (end of its stdin), and kills it after ``grace_s``."""
        self._stdin.close()
        try:
            async with asyncio.timeout(grace_s):
                await self.process.wait()
        except TimeoutError:
            self.kill()
            await self.process.wait()


class WorkerPool:
    """``workers`` worker processes; each call has ``timeout_s`` (see the module docstring)."""

    def __init__(self, workers: int, timeout_s: float) -> None:
        if workers < 1:
            raise ValueError(f"a pool needs at least one worker, not {workers}")
        self.timeout_s = timeout_s
        self._idle: asyncio.Queue[Worker | None] = asyncio.Queue()
        for _ in range(workers):
            self._idle.put_nowait(None)
        self._all: set[Worker] = set()
        self._closed = False

    async def start(self) -> None:
        """Starts every worker that is not running (optional: a call starts its worker)."""
        places = [self._idle.get_nowait() for _ in range(self._idle.qsize())]
        started = await asyncio.gather(*(self._started(w) for w in places), return_exceptions=True)
        for worker in started:
            self._idle.put_nowait(worker if isinstance(worker, Worker) else None)
        for error in started:
            if isinstance(error, BaseException):
                raise error

    async def _started(self, worker: Worker | None) -> Worker:
        if worker is not None and worker.process.returncode is None:
            return worker
        self._forget(worker)
        worker = await Worker.start()
        self._all.add(worker)
        return worker

    def idle(self) -> int:
        """How many places are free for a call (of ``workers``)."""
        return self._idle.qsize()

    def pids(self) -> list[int]:
        """The process ids of the live workers."""
        return sorted(w.process.pid for w in self._all if w.process.returncode is None)

    async def call(
        self, spec: str, inputs: Sequence[ScoringInput], *, group: bool = False
    ) -> list[SampleScore]:
        """The scores of ``inputs`` by the verifier ``spec``: called once per input, or once
        with all of them when ``group``. Never raises for what a verifier or its worker does."""
        if self._closed:
            raise RuntimeError("the scoring pool is closed")
        request = Call(spec, tuple(inputs), group)
        place = await self._idle.get()
        worker: Worker | None = None
        try:
            try:
                worker = await self._started(place)
            except (WorkerDied, TimeoutError) as exc:
                why = str(exc) or f"not ready within {START_TIMEOUT_S:g} s"
                return [failed(ScoreFailure.WORKER_DIED, f"no worker could start ({why})")] * (
                    len(inputs)
                )
            return await self._call(worker, request)
        except BaseException:
            self._forget(worker)
            worker = None
            raise
        finally:
            self._idle.put_nowait(worker if worker is None or worker in self._all else None)

    async def _call(self, worker: Worker, request: Call) -> list[SampleScore]:
        n, spec = len(request.inputs), request.spec
        try:
            async with asyncio.timeout(self.timeout_s):
                return await worker.call(request)
        except TimeoutError:
            log.warning(
                "scoring worker %d killed: %s ran past its timeout", worker.process.pid, spec
            )
            self._forget(worker)
            why = f"ran past {self.timeout_s:g} s; its worker was killed"
            return [failed(ScoreFailure.TIMEOUT, why)] * n
        except WorkerDied as exc:
            self._forget(worker)
            return [failed(ScoreFailure.WORKER_DIED, f"its worker died ({exc})")] * n

    def _forget(self, worker: Worker | None) -> None:
        if worker is not None:
            worker.kill()
            self._all.discard(worker)

    async def aclose(self) -> None:
        """Stops every worker; idempotent."""
        self._closed = True
        workers, self._all = self._all, set()
        await asyncio.gather(*(w.stop() for w in workers))
