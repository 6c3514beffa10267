"""What an operator sees of the real vLLM engine: vLLM's own ``vllm:*`` families on rolloutd's
``/metrics``, and vLLM's request spans as children of ``rolloutd.group.generate`` over OTLP."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from rolloutd.telemetry.generation import GENERATE_SPAN, GenAIAttr, GroupAttr
from rolloutd.v1 import rollout_pb2 as pb
from rolloutd.v1 import rollout_pb2_grpc as pb_grpc
from tests.integration.proc import ServeProcess
from tests.telemetry.otlp_receiver import OtlpReceiver, attributes
from tests.waiting import until

pytestmark = [pytest.mark.vllm, pytest.mark.process]

SERVICE = "rolloutd-vllm-observability"
VLLM_REQUEST_SPAN = "llm_request"
VLLM_FAMILIES = {
    # requests
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:request_success",
    "vllm:e2e_request_latency_seconds",
    # tokens
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:time_to_first_token_seconds",
    # KV cache
    "vllm:kv_cache_usage_perc",
}


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    r = OtlpReceiver().start()
    yield r
    r.stop()


def test_vllm_metrics_beside_rolloutd_and_its_request_spans_under_the_group(
    tmp_path, receiver, tiny_model_cache
):
    cache = tiny_model_cache
    data = tmp_path / "prompts.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"What is {i} plus {i}?"}) + "\n" for i in range(4))
    )
    endpoint = receiver.endpoint("grpc")
    args = [
        "--engine", "vllm",
        "--grpc-port", "0",
        "--http-port", "0",
        "--checkpoint-dir", str(tmp_path / "ckpt"),
        "--checkpoint-interval", "0",
        "--dataset", str(data),
        "--epochs", "1",
        "--group-size", "2",
        "--max-tokens", "8",
    ]  # fmt: skip
    p = ServeProcess(
        args,
        env={
            "ROLLOUTD_ENGINE__CACHE_DIR": str(cache),
            "ROLLOUTD_ENGINE__VLLM__OTLP_TRACES_ENDPOINT": endpoint,
            "OTEL_SDK_DISABLED": "false",
            "OTEL_SERVICE_NAME": SERVICE,
            "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
            "OTEL_BSP_SCHEDULE_DELAY": "100",
        },
        cwd=tmp_path,
        log_path=tmp_path / "serve.log",
    )
    try:
        p.wait_listening(timeout=300)
        groups = 0
        with grpc.insecure_channel(p.grpc) as channel:
            stub = pb_grpc.RolloutServiceStub(channel)
            while groups < 4:
                r = stub.FetchGroups(
                    pb.FetchGroupsRequest(max_groups=4, wait_ms=60_000), timeout=120
                )
                groups += len(r.groups)
                stub.AckGroups(pb.AckGroupsRequest(lease_id=r.lease_id, trainer_step=1), timeout=30)
        # the token fates are observed from a status the service refreshes every second
        exposition = until(
            "the acked groups' tokens delivered", lambda: delivered(p.http), every_s=0.5
        )
    finally:
        if p.proc.poll() is None:
            assert p.terminate(timeout=120) == 0, p.output

    families = {f.name: f for f in text_string_to_metric_families(exposition)}
    missing = sorted(VLLM_FAMILIES - set(families))
    assert not missing, missing
    assert any(name.startswith("rolloutd_") for name in families)
    generated = families["vllm:generation_tokens"].samples
    vllm_generated = sum(s.value for s in generated if s.name.endswith("_total"))
    assert vllm_generated > 0
    assert_gen_ai_metrics(families, requests=8, output_tokens=vllm_generated)

    assert receiver.wait_for(
        lambda: any(s.name == VLLM_REQUEST_SPAN for s in all_spans(receiver)), timeout_s=30
    ), "vLLM exported no request span"
    spans = all_spans(receiver)
    generate = {
        (s.trace_id, s.span_id): s for s in receiver.spans(SERVICE) if s.name == GENERATE_SPAN
    }
    assert len(generate) == 4
    for span in generate.values():
        attrs = attributes(span.attributes)
        assert attrs[GroupAttr.SIZE] == 2 and attrs[GenAIAttr.USAGE_OUTPUT_TOKENS] > 0
        assert attrs[GenAIAttr.REQUEST_MODEL]
    requests = [s for s in spans if s.name == VLLM_REQUEST_SPAN]
    children = [s for s in requests if (s.trace_id, s.parent_span_id) in generate]
    assert len(children) == len(requests) == 8, "each sibling's vLLM span is under its group"


def delivered(http: str) -> str | None:
    """The exposition at ``/metrics`` once it counts delivered tokens, else None."""
    with urllib.request.urlopen(f"http://{http}/metrics", timeout=30) as response:
        exposition = response.read().decode()
    families = {f.name: f for f in text_string_to_metric_families(exposition)}
    tokens = families["rolloutd_tokens"].samples if "rolloutd_tokens" in families else []
    fates = {s.labels["fate"]: s.value for s in tokens}
    return exposition if fates.get("delivered", 0) > 0 else None


def sample(families, name: str, suffix: str = "", **labels: str) -> float:
    """The value of one series, by family name, sample suffix and labels (those given)."""
    (value,) = [
        s.value
        for s in families[name].samples
        if s.name == name + suffix and labels.items() <= s.labels.items()
    ]
    return float(value)


def assert_gen_ai_metrics(families, *, requests: int, output_tokens: float) -> None:
    """The engine's own signals from vLLM's stat logger, under the GenAI names, and where the
    generated tokens went."""
    vllm = {"gen_ai_provider_name": "vllm", "gen_ai_operation_name": "text_completion"}
    for name in (
        "gen_ai_server_time_to_first_token_seconds",
        "gen_ai_server_request_duration_seconds",
    ):
        assert sample(families, name, "_count", **vllm) == requests, name
        assert sample(families, name, "_sum", **vllm) > 0, name
    per_token = "gen_ai_server_time_per_output_token_seconds"
    assert 0 < sample(families, per_token, "_count", **vllm) <= requests
    usage = "gen_ai_client_token_usage"
    assert sample(families, usage, "_count", gen_ai_token_type="input", **vllm) == requests
    assert sample(families, usage, "_sum", gen_ai_token_type="input", **vllm) > 0
    assert sample(families, usage, "_sum", gen_ai_token_type="output", **vllm) == output_tokens
    assert sample(families, "rolloutd_engine_preemptions", "_total", engine="vllm") >= 0
    assert 0 <= sample(families, "rolloutd_engine_prefix_cache_hit_ratio", engine="vllm") <= 1
    fates = {s.labels["fate"]: s.value for s in families["rolloutd_tokens"].samples}
    assert fates["delivered"] > 0 and fates["delivered"] + fates["buffered"] == sum(fates.values())


def all_spans(receiver: OtlpReceiver):
    with receiver.received.lock:
        requests = list(receiver.received.traces)
    return [
        span
        for request in requests
        for rs in request.resource_spans
        for ss in rs.scope_spans
        for span in ss.spans
    ]
