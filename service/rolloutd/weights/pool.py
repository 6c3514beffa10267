"""The weights updater's own threads, and the rule that one update runs at a time.

What must hold, however a transfer behaves:

- the blocking work of updates (listing, copying, hashing, decoding) runs on this small pool,
  never on the event loop's default executor, which the journal and checkpoints use: a URL that
  never answers cannot stall leases, acks or snapshots;
- a transfer ends at its deadline (``weights.transfer_timeout_s``, ``DEADLINE_EXCEEDED``), and a
  full staging disk is ``RESOURCE_EXHAUSTED``;
- one update runs at a time (any source); a second is ``FAILED_PRECONDITION`` at once, and so is
  every update while the threads of one abandoned after its timeout have not ended, so the
  updater never holds more than its own few threads.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from rolloutd.domain.errors import DeadlineExceeded, FailedPrecondition
from rolloutd.weights.staging import disk_full

if TYPE_CHECKING:
    from rolloutd.weights.fetch import Source

logger = logging.getLogger(__name__)

T = TypeVar("T")

POOL_THREADS = 2
"""Threads of the updater's own pool: one update's blocking step, and a receiver's writer join."""


class UpdatePool:
    """Runs the blocking steps of updates, bounds their transfers, and admits one at a time."""

    def __init__(self, transfer_timeout_s: float) -> None:
        self.transfer_timeout_s = transfer_timeout_s
        self.executor = ThreadPoolExecutor(POOL_THREADS, thread_name_prefix="rolloutd-weights")
        self._threads: list[Future[Any]] = []
        """Work submitted to the pool that may still run (an abandoned transfer's included)."""
        self._in_progress: str | None = None
        """The update running, or the one whose abandoned threads have not ended; None: idle."""

    def close(self) -> None:
        """Stops the pool (without waiting for a transfer that hangs on the network)."""
        self.executor.shutdown(wait=False, cancel_futures=True)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the updater's pool; a full staging disk is RESOURCE_EXHAUSTED."""
        future = self.executor.submit(fn, *args)
        self._threads = [f for f in self._threads if not f.done()] + [future]
        try:
            return await asyncio.wrap_future(future)
        except OSError as exc:
            if (full := disk_full(exc)) is not None:
                raise full from exc
            raise

    async def transfer(
        self, deadline: float, source: Source | None, fn: Callable[..., T], *args: Any
    ) -> T:
        """:meth:`run` bounded by the update's transfer ``deadline`` (loop time)."""
        bound = asyncio.timeout_at(deadline)
        try:
            async with bound:
                return await self.run(fn, *args)
        except TimeoutError:
            if not bound.expired():
                raise
            if source is not None:
                source.abandon()
            raise DeadlineExceeded(
                "weights_path: the transfer took longer than weights.transfer_timeout_s "
                f"({self.transfer_timeout_s:g} s) and was abandoned"
            ) from None

    def deadline(self) -> float:
        return asyncio.get_running_loop().time() + self.transfer_timeout_s

    async def one_at_a_time(self, what: str, work: Coroutine[Any, Any, T]) -> T:
        """Runs ``work`` unless another update runs, or its abandoned threads still do."""
        if self._in_progress is not None:
            work.close()
            raise FailedPrecondition(
                f"weights: {self._in_progress} is in progress; updates run one at a time, retry "
                "when it has ended"
            )
        self._in_progress = what
        try:
            return await work
        finally:
            self._release(what)

    def _release(self, what: str) -> None:
        running = [f for f in self._threads if not f.done()]
        if not running:
            self._in_progress = None
            return
        logger.warning(
            "weights: the abandoned transfer of %s still holds %d thread(s); updates are refused "
            "until it ends", what, len(running),
        )  # fmt: skip
        self._in_progress = f"the abandoned transfer of {what}"
        loop = asyncio.get_running_loop()

        def ended(_: Future[Any]) -> None:
            loop.call_soon_threadsafe(self._release_if_idle)

        for future in running:
            future.add_done_callback(ended)

    def _release_if_idle(self) -> None:
        if self._in_progress is not None and all(f.done() for f in self._threads):
            logger.info("weights: %s ended; updates are accepted again", self._in_progress)
            self._in_progress = None
