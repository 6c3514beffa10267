"""The vLLM engine on the tiny model, for real: one engine for the module, one more that is killed.

vLLM on CPU starts its engine core with the spawn method, so the engine started in this process
runs in a child process; the SIGKILL test runs its own engine in a separate Python process and
kills that process.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import os
import signal
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import psutil
import pytest
import pytest_asyncio
import torch
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from rolloutd.domain.engine import EngineDeadError, EngineError, GenerationRequest, SamplingParams
from rolloutd.domain.group import Prompt, Sample
from rolloutd.domain.weights import WeightsPhase, WeightsTimeline
from rolloutd.engines.tiny_model import write_random_weights
from rolloutd.engines.vllm_config import VLLMConfig

if TYPE_CHECKING:
    from rolloutd.engines.vllm import VLLMEngine

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module")]

SETTINGS = VLLMConfig(
    dtype="float32", max_model_len=1024, kv_cache_memory_gib=1, enforce_eager=True, max_num_seqs=64
)
TEXT = Prompt("arith", "What is 3 + 4?")
CHAT = Prompt("chat", "", messages=({"role": "user", "content": "What is 2 + 2?"},))
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@dataclass(frozen=True)
class Models:
    base: Path
    second: Path


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Models:
    root = tmp_path_factory.mktemp("vllm-models")
    return Models(base=tiny_model, second=write_random_weights(tiny_model, root / "second", seed=1))


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def engine(models: Models) -> AsyncIterator[VLLMEngine]:
    from rolloutd.engines.vllm import VLLMEngine

    eng = VLLMEngine(SETTINGS, models.base, max_sequences=64)
    await eng.start()
    yield eng
    await eng.stop()


def request(
    rid: str,
    prompt: Prompt = TEXT,
    *,
    seed: int = 0,
    max_tokens: int = 32,
    temperature: float = 1.0,
) -> GenerationRequest:
    return GenerationRequest(
        request_id=rid,
        group_id=0,
        index=seed,
        prompt=prompt,
        seed=seed,
        params=SamplingParams(max_tokens=max_tokens, temperature=temperature),
        trace_headers={"traceparent": TRACEPARENT},
    )


def eos_ids(model_dir: Path) -> set[int]:
    return set(json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"])


def hf_greedy(
    model_dir: Path, prompt_ids: list[int], max_tokens: int
) -> tuple[list[int], list[float]]:
    """Greedy decoding with Hugging Face transformers in float32: token ids and their logprobs."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    stop = eos_ids(model_dir)
    ids, out, logprobs = list(prompt_ids), [], []
    with torch.no_grad():
        for _ in range(max_tokens):
            lp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1], dim=-1)
            token = int(lp.argmax())
            out.append(token)
            logprobs.append(float(lp[token]))
            ids.append(token)
            if token in stop:
                break
    return out, logprobs


async def wait_for(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def check_well_formed(sample: Sample, max_tokens: int, model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert 0 < len(sample.token_ids) <= max_tokens
    assert len(sample.logprobs) == len(sample.token_ids), "exactly one logprob per token"
    assert all(math.isfinite(lp) and lp <= 0.0 for lp in sample.logprobs)
    assert all(0 <= t < len(tokenizer) for t in sample.token_ids)
    assert tokenizer.decode(sample.token_ids, skip_special_tokens=True) == sample.text
    if sample.finish_reason == "length":
        assert len(sample.token_ids) == max_tokens
    else:
        assert sample.finish_reason == "stop"
        assert sample.token_ids[-1] in eos_ids(model_dir)


async def test_samples_decode_with_the_tokenizer(engine: VLLMEngine, models: Models) -> None:
    tokenizer = AutoTokenizer.from_pretrained(models.base)
    samples = await asyncio.gather(
        *(engine.generate(request(f"text-{i}", seed=i, max_tokens=48)) for i in range(4)),
        *(engine.generate(request(f"chat-{i}", CHAT, seed=i, max_tokens=48)) for i in range(2)),
    )
    for sample in samples:
        check_well_formed(sample, 48, models.base)
        assert sample.policy_version == 0
    assert list(samples[0].prompt_token_ids) == tokenizer(TEXT.text).input_ids
    chat_ids = tokenizer.apply_chat_template(
        list(CHAT.messages), add_generation_prompt=True, tokenize=False
    )
    expected = tokenizer(chat_ids, add_special_tokens=False).input_ids
    assert list(samples[4].prompt_token_ids) == expected
    assert [s.index for s in samples] == [0, 1, 2, 3, 0, 1]


async def test_a_sibling_is_reproducible_from_its_seed(engine: VLLMEngine) -> None:
    first = await engine.generate(request("seeded-a", seed=1234, max_tokens=40))
    again = await engine.generate(request("seeded-b", seed=1234, max_tokens=40))
    assert again.token_ids == first.token_ids
    assert again.logprobs.tolist() == pytest.approx(first.logprobs.tolist(), abs=1e-4)


async def test_generation_counter_is_tokens_returned_plus_in_flight(engine: VLLMEngine) -> None:
    await wait_for(lambda: engine.counters().requests_running == 0)
    base = engine.counters()
    max_tokens = 64
    tasks = [
        asyncio.ensure_future(engine.generate(request(f"count-{i}", seed=i, max_tokens=max_tokens)))
        for i in range(8)
    ]
    saw_running = False
    while not all(t.done() for t in tasks):
        counters = engine.counters()
        returned = sum(len(t.result().token_ids) for t in tasks if t.done())
        in_flight = sum(not t.done() for t in tasks)
        generated = counters.generation_tokens - base.generation_tokens
        assert returned <= generated <= returned + in_flight * max_tokens
        if counters.requests_running:
            saw_running = True
            assert counters.kv_cache_usage > 0.0
        await asyncio.sleep(0.01)
    samples = [t.result() for t in tasks]
    final = engine.counters()
    assert final.generation_tokens - base.generation_tokens == sum(
        len(s.token_ids) for s in samples
    )
    assert final.prompt_tokens - base.prompt_tokens == sum(len(s.prompt_token_ids) for s in samples)
    assert saw_running
    assert (final.requests_running, final.requests_waiting) == (0, 0)


async def test_abort_cancels_the_request_and_frees_the_engine(engine: VLLMEngine) -> None:
    task = asyncio.ensure_future(engine.generate(request("long", max_tokens=900)))
    await wait_for(lambda: engine.counters().requests_running == 1)
    await engine.abort(["long", "unknown-id"])
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, timeout=10)
    await wait_for(lambda: engine.counters().requests_running == 0, timeout_s=5)
    settled = engine.counters().generation_tokens
    sample = await engine.generate(request("after-abort", max_tokens=8))
    assert len(sample.token_ids) == 8
    # Had the aborted request gone on, its tokens would have been counted beside these.
    assert engine.counters().generation_tokens == settled + 8, "the aborted request stopped"


async def test_request_errors_are_engine_errors(engine: VLLMEngine, models: Models) -> None:
    too_long = Prompt("long", "What is 3 + 4? " * 1000)
    with pytest.raises(EngineError, match="long"):
        await engine.generate(request("too-long", too_long))
    with pytest.raises(EngineError, match="safetensors"):
        await engine.update_weights(str(models.base / "missing"), 99)
    assert engine.policy_version == 0
    assert len((await engine.generate(request("still-alive", max_tokens=4))).token_ids) == 4


async def test_update_weights_matches_transformers_greedy(
    engine: VLLMEngine, models: Models
) -> None:
    greedy = dict(max_tokens=24, temperature=0.0)
    before = await engine.generate(request("greedy-v0", **greedy))  # type: ignore[arg-type]
    prompt_ids = list(before.prompt_token_ids)
    expected, _ = hf_greedy(models.base, prompt_ids, 24)
    assert list(before.token_ids) == expected
    assert before.policy_version == 0

    # A request in flight when the update starts finishes on the old weights (mode "wait").
    in_flight = asyncio.ensure_future(engine.generate(request("in-flight", max_tokens=120)))
    await wait_for(lambda: engine.counters().requests_running == 1)
    timeline = WeightsTimeline()
    await engine.update_weights(str(models.second), 7, timeline=timeline)
    assert engine.policy_version == 7
    assert in_flight.done() and in_flight.result().policy_version == 0
    phases = timeline.phases
    assert [p.phase for p in phases] == [WeightsPhase.PAUSE, WeightsPhase.LOAD, WeightsPhase.RESUME]
    for before_phase, after_phase in itertools.pairwise(phases):
        assert before_phase.start_ns <= before_phase.end_ns <= after_phase.start_ns

    after = await engine.generate(request("greedy-v7", **greedy))  # type: ignore[arg-type]
    expected, logprobs = hf_greedy(models.second, prompt_ids, 24)
    assert list(after.token_ids) == expected
    assert after.logprobs.tolist() == pytest.approx(logprobs, abs=1e-3)
    assert after.token_ids != before.token_ids
    siblings = await asyncio.gather(
        *(engine.generate(request(f"v7-{i}", seed=i, max_tokens=16)) for i in range(4))
    )
    assert {s.policy_version for s in [after, *siblings]} == {7}


async def test_a_failed_load_marks_the_engine_dead(engine: VLLMEngine, tmp_path: Path) -> None:
    """Runs last but one: the engine stays paused and dead afterwards."""
    save_file({"model.embed_tokens.weight": torch.zeros(3, 5)}, str(tmp_path / "bad.safetensors"))
    with pytest.raises(EngineDeadError, match="partly replaced"):
        await engine.update_weights(str(tmp_path), 8)
    assert engine.policy_version == 7
    with pytest.raises(EngineDeadError):
        await engine.generate(request("after-failed-load"))


async def test_stop_ends_every_engine_process(engine: VLLMEngine) -> None:
    # multiprocessing's resource tracker belongs to this process, not to the engine: it serves
    # every later spawn too and exits with this process.
    children = [
        p
        for p in psutil.Process().children(recursive=True)
        if "multiprocessing.resource_tracker" not in " ".join(p.cmdline())
    ]
    assert any(_name(p) == "VLLM::EngineCore" for p in children)
    await engine.stop()
    assert not await _alive(children, timeout_s=30), "engine processes outlived stop()"
    await engine.stop()  # idempotent


HOLDER = textwrap.dedent(
    """
    import asyncio, sys
    from rolloutd.engines.vllm_config import VLLMConfig
    from rolloutd.domain.group import Prompt
    from rolloutd.domain.engine import GenerationRequest, SamplingParams
    from rolloutd.engines.vllm import VLLMEngine

    def request(i, max_tokens, headers={}):
        return GenerationRequest(f"r{i}", 0, i, Prompt("p", "hi"), seed=i,
                                 params=SamplingParams(max_tokens=max_tokens),
                                 trace_headers=headers)

    async def main():
        model, otlp, traceparent = sys.argv[1:]
        settings = VLLMConfig(dtype="float32", max_model_len=1024, kv_cache_memory_gib=1, enforce_eager=True,
                                shutdown_grace_s=3, otlp_traces_endpoint=otlp)
        engine = VLLMEngine(settings, model, max_sequences=4)
        await engine.start()
        await engine.generate(request(0, 4, {"traceparent": traceparent}))
        tasks = [asyncio.ensure_future(engine.generate(request(i, 900))) for i in (1, 2)]
        while engine.counters().requests_running < 2:
            await asyncio.sleep(0.05)
        print("GENERATING", flush=True)
        await asyncio.gather(*tasks)
        await asyncio.sleep(3600)  # the test kills us long before

    asyncio.run(main())
    """
)


class _Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP trace receiver that keeps (trace id, parent span id, name) of every span."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, str, str]] = []

    async def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: object
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        for resource_spans in request.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    self.spans.append((span.trace_id.hex(), span.parent_span_id.hex(), span.name))
        return trace_service_pb2.ExportTraceServiceResponse()


async def test_sigkill_leaves_no_engine_process_and_vllm_joins_the_trace(
    models: Models, tmp_path: Path
) -> None:
    collector = _Collector()
    server = grpc.aio.server()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    log = tmp_path / "holder.log"
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(
            *(sys.executable, "-c", HOLDER, str(models.base)),
            *(f"http://127.0.0.1:{port}", TRACEPARENT),
            stdout=out,
            stderr=out,
            env={**os.environ, "OTEL_SDK_DISABLED": "false", "OTEL_BSP_SCHEDULE_DELAY": "100"},
        )
    try:
        await wait_for(
            lambda: proc.returncode is not None or b"\nGENERATING\n" in log.read_bytes(),
            timeout_s=240,
        )
        assert proc.returncode is None, log.read_text()[-3000:]
    except BaseException:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        raise
    descendants = psutil.Process(proc.pid).children(recursive=True)
    names = {_name(p) for p in descendants}
    assert {"VLLM::EngineCore", "VLLM::Worker"} <= names, names

    trace_id, parent_id = TRACEPARENT.split("-")[1:3]
    try:
        await wait_for(lambda: any(s[:2] == (trace_id, parent_id) for s in collector.spans), 20)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        await proc.wait()
        await server.stop(grace=None)
    survivors = await _alive(descendants, timeout_s=30)
    assert not survivors, f"left running after SIGKILL: {survivors}\n{log.read_text()[-3000:]}"


def _name(proc: psutil.Process) -> str:
    try:
        return proc.name()
    except psutil.NoSuchProcess:
        return ""


async def _alive(procs: list[psutil.Process], timeout_s: float) -> list[str]:
    """Processes still running after ``timeout_s`` (zombies count as gone: they hold nothing)."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = []
        for p in procs:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(f"{p.pid} {p.name()}")
            except psutil.NoSuchProcess:
                continue
        if not alive or time.monotonic() > deadline:
            return alive
        await asyncio.sleep(0.2)
