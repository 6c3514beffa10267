"""vLLM's families are passed on from the process-wide registry, alone and unchanged."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from rolloutd.telemetry.vllm_metrics import VLLMFamilies


def test_only_vllm_families_are_served_and_only_once_vllm_registered_them():
    source = CollectorRegistry()
    Counter("process_things", "not vLLM's", registry=source).inc()
    served = CollectorRegistry()
    served.register(VLLMFamilies(source))
    assert generate_latest(served) == b""  # vLLM has not started yet

    running = Gauge("vllm:num_requests_running", "running", ["model_name"], registry=source)
    running.labels(model_name="tiny").set(3)
    Counter("vllm:generation_tokens", "tokens", registry=source).inc(17)
    text = generate_latest(served).decode()
    assert 'vllm:num_requests_running{model_name="tiny"} 3.0' in text
    assert "vllm:generation_tokens_total 17.0" in text
    assert "process_things" not in text
