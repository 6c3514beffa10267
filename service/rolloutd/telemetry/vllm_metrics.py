"""vLLM's own ``vllm:*`` metric families, served on rolloutd's ``/metrics`` beside ``rolloutd_*``.

vLLM's V1 frontend always adds its ``PrometheusStatLogger`` next to the stat loggers it is given
(rolloutd gives it one for the engine counters), and that logger registers its families
(``vllm:num_requests_running``, ``vllm:generation_tokens``, ``vllm:kv_cache_usage_perc`` …) in
``prometheus_client``'s process-wide registry. vLLM's published Grafana dashboards query those
names, so this collector hands them on unchanged: nothing is renamed, relabelled or re-aggregated.
It serves nothing until vLLM has registered its families, and nothing else from that registry
(the client library's process and GC collectors stay out of rolloutd's exposition).
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

VLLM_PREFIX = "vllm:"


class VLLMFamilies(Collector):
    """The ``vllm:*`` families of ``source`` (the process-wide registry), read at each scrape."""

    def __init__(self, source: CollectorRegistry = REGISTRY) -> None:
        self._source = source

    def collect(self) -> Iterable[Metric]:
        return [f for f in self._source.collect() if f.name.startswith(VLLM_PREFIX)]

    def describe(self) -> Iterable[Metric]:
        """Nothing to declare up front: the families appear once vLLM has started."""
        return []
