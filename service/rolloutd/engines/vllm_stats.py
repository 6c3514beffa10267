"""The engine's counters and its requests' timings, fed by a vLLM stat logger.

vLLM hands every iteration's and scheduler's stats to the ``StatLoggerBase`` objects given to
``AsyncLLM``, in the frontend process; :class:`TallyStatLogger` adds them into a :class:`Tally`
that :meth:`rolloutd.engines.vllm.VLLMEngine.counters` reads, and passes each request's time to
its first token and each finished request on to the tally's :class:`RequestObserver` (the
OpenTelemetry GenAI server metrics), as vLLM's own Prometheus logger records them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from vllm.config import VllmConfig
from vllm.v1.engine import FinishReason
from vllm.v1.metrics.loggers import StatLoggerBase
from vllm.v1.metrics.stats import (
    CachingMetrics,
    FinishedRequestStats,
    IterationStats,
    MultiModalCacheStats,
    SchedulerStats,
)

from rolloutd.domain.engine import EngineCounters, FinishedRequest, RequestObserver

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerSnapshot:
    running: int
    waiting: int
    kv_cache_usage: float


@dataclass
class Tally:
    """Cumulative token counts and the latest scheduler state of each engine core.

    Written only by the stat logger, which vLLM calls from its output handler on the event loop,
    and read by the engine's ``counters`` on the same loop, so no lock is needed.
    """

    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    schedulers: dict[int, SchedulerSnapshot] = field(default_factory=dict)
    prefix_cache: CachingMetrics = field(default_factory=CachingMetrics)
    """The prefix cache's queries and hits over the most recent requests of every core (vLLM's
    own sliding window, as its logging stat logger reports it)."""
    observer: RequestObserver | None = None

    def counters(self) -> EngineCounters:
        snaps = list(self.schedulers.values())
        return EngineCounters(
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            requests_running=sum(s.running for s in snaps),
            requests_waiting=sum(s.waiting for s in snaps),
            kv_cache_usage=sum(s.kv_cache_usage for s in snaps) / len(snaps) if snaps else 0.0,
            preemptions=self.preemptions,
            prefix_cache_hit_ratio=self.prefix_cache.hit_rate,
        )

    def iteration(self, stats: IterationStats) -> None:
        """One iteration's tokens, preemptions, first tokens and finished requests."""
        self.prompt_tokens += stats.num_prompt_tokens
        self.generation_tokens += stats.num_generation_tokens
        self.preemptions += stats.num_preempted_reqs
        observer = self.observer
        if observer is None:
            return
        for seconds in stats.time_to_first_tokens_iter:
            observer.first_token(seconds)
        for finished in stats.finished_requests:
            if finished.finish_reason is not FinishReason.ABORT:
                observer.request_finished(_finished(finished))

    def stat_logger_factory(self) -> Callable[[VllmConfig, int], StatLoggerBase]:
        """What ``AsyncLLM`` takes in ``stat_loggers``: one logger per engine core, all feeding
        this tally."""
        return partial(TallyStatLogger, tally=self)


class TallyStatLogger(StatLoggerBase):
    """Feeds one engine core's iteration and scheduler stats into a shared :class:`Tally`."""

    def __init__(self, vllm_config: VllmConfig, engine_index: int = 0, *, tally: Tally) -> None:
        self._tally = tally
        self._engine_index = engine_index

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        mm_cache_stats: MultiModalCacheStats | None = None,
        engine_idx: int = 0,
    ) -> None:
        if iteration_stats is not None:
            self._tally.iteration(iteration_stats)
        if scheduler_stats is not None:
            self._tally.schedulers[engine_idx] = SchedulerSnapshot(
                running=scheduler_stats.num_running_reqs,
                waiting=scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs,
                kv_cache_usage=scheduler_stats.kv_cache_usage,
            )
            self._tally.prefix_cache.observe(scheduler_stats.prefix_cache_stats)

    def log_engine_initialized(self) -> None:
        logger.debug("vLLM engine core %d reports to rolloutd counters", self._engine_index)


def _finished(stats: FinishedRequestStats) -> FinishedRequest:
    """A finished request's figures; time per output token as the GenAI conventions define it
    (decode time over the tokens after the first), which is vLLM's own."""
    after_first = stats.num_generation_tokens - 1
    return FinishedRequest(
        input_tokens=stats.num_prompt_tokens,
        output_tokens=stats.num_generation_tokens,
        duration_s=stats.e2e_latency,
        time_per_output_token_s=stats.decode_time / after_first if after_first > 0 else None,
    )
