"""Weight updates: pushed over gRPC and copied from S3, against a raw local copy of the same files.

For each model size (the tiny model, and a larger random model built the same way) the real
``rolloutd serve`` runs as a subprocess on that model, and this process acts as the trainer:

- ``local_copy_mb_per_s``: ``shutil.copyfile`` of the model's safetensors files into a fresh
  directory beside the service's staging directory (warm page cache): the most a transfer into
  staging could reach here. Neither fsyncs while it transfers: the service writes staged weights
  into the page cache and fsyncs them in its ``verify`` phase, while it hashes them, so a copy
  that paid for durability would measure something the push's transfer does not do;
- ``push_mb_per_s``: ``PushWeights`` from the Python client (``RolloutClient.push_weights``),
  bytes over the service's ``transfer`` phase (header received to last chunk written);
  ``push_vs_local_copy`` is the one over the other (medians), ``push_vs_local_copy_best`` the
  same for the fastest round of each: on a machine shared with other work a 50 ms copy swings
  several-fold with the neighbours' load, so the target counts as met only when both reach it;
- ``push_verified_mb_per_s``: the same bytes over ``transfer`` + ``verify`` (SHA-256 and the
  safetensors headers checked against the served model, the files fsynced);
- ``push_client_cpu_s_per_gb`` and ``push_service_cpu_s_per_gb``: CPU-seconds per GB pushed that
  this process (the trainer: hashing, then streaming) and the service (receiving, writing,
  verifying; the synthetic engine's load is nothing) used over each whole ``push_weights`` call;
- ``grpc_stream_mb_per_s``: the ceiling under a push: a client stream of 1 MiB byte strings over
  loopback into a bare ``grpc.aio`` server in another process that drops them (nothing parsed,
  checked or written), as many bytes as the model; with the CPU-seconds per GB each end used
  (``grpc_stream_*_cpu_s_per_gb``), which show where a push's time goes on a 2-core machine;
- ``s3_mb_per_s``: ``UpdateWeights("s3://...")`` from moto's S3 server on this machine, bytes over
  the ``transfer`` phase (ranged reads in parallel);
- ``update_pause_ms``: generation stopped, from the start of ``pause`` to the end of ``resume``,
  with the engine idle and while a stream of submitted prompts generates (the pause then waits
  for requests in flight to finish, ``vllm.weight_update_mode: wait``);
- the end-to-end update time seen by the trainer, for a push (hashing included) and from S3
  (with a ``SHA256SUMS`` file, so the service verifies checksums on both paths).

The delta run (also in ``--quick``) serves the tiny model in bf16 on vLLM. This process is the
trainer: float32 master weights (Hugging Face ``LlamaForCausalLM``), Adam at lr 1e-6 on a language
modelling loss over random token batches, the bf16 cast of the weights published after each of
``DELTA_STEPS`` steps twice, side by side: first as a delta pushed on the served version
(``RolloutClient.push_delta``), then as full weights (``push_weights``) under the next version.
It reports ``delta_bytes_vs_full`` (median delta size over the safetensors file),
``bit_identical_fraction`` (mean fraction of bf16 elements unchanged by a step),
``delta_pause_ms_p50`` and ``full_pause_ms_p50`` (generation stopped, pause to resume) and their
ratio ``delta_pause_vs_full``, and ``delta_state_matches_full``: after every delta, the weights
the service staged and the engine loaded from hold, tensor by tensor, the SHA-256 of the trainer's
bf16 weights, and a greedy sample (token ids and every logprob) equals the one generated after the
full load of the same weights.

Each figure is the median over the repetitions; one push on a fresh channel comes first and is
reported on its own (the HTTP/2 windows grow during the first transfer).

The service and the client share 2 cores here with vLLM's CPU engine. The transfer path does not
involve the engine, so the transfer rates and ``push_vs_local_copy`` are measured against the
synthetic engine serving the same model (its layout is what pushes are checked against), as
docs/design.md has it for figures of the service's own overhead; the same rates measured beside the
vLLM engine are kept as ``*_beside_engine``. Pauses, loads and end-to-end times come from vLLM.
``--quick`` runs the synthetic engine (no real pause or load) on the tiny model and a ~60 MB one;
its delta run is on vLLM all the same.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import common
import fsspec
import grpc
from moto.server import ThreadedMotoServer

from rolloutd.client import RolloutClient
from rolloutd.engines.tiny_model import TinyModelSpec, build_tiny_model, write_random_weights
from rolloutd.v1 import rollout_pb2 as pb

NAME = "weights"
BUCKET = "rolloutd-bench"
TARGET_PUSH_VS_COPY = 0.5


@dataclass(frozen=True)
class Size:
    name: str
    spec: TinyModelSpec


TINY = Size("tiny", TinyModelSpec())
LARGE = Size(
    "large",
    TinyModelSpec(
        hidden_size=1024, intermediate_size=2816, num_layers=4, num_heads=16, num_kv_heads=16
    ),
)
QUICK_LARGE = Size(
    "medium",
    TinyModelSpec(
        hidden_size=512, intermediate_size=1408, num_layers=4, num_heads=8, num_kv_heads=8
    ),
)


class Service(common.Serve):
    """``rolloutd serve`` on one model, its log in a file."""

    def __init__(
        self,
        model: Path,
        work: Path,
        engine: str,
        s3: dict[str, Any],
        dtype: str = "float32",
        env: dict[str, str] | None = None,
    ) -> None:
        dataset = work / "one-prompt.jsonl"
        dataset.write_text(json.dumps({"id": "warm", "prompt": "What is 1 + 1?"}) + "\n")
        env_vars = {
            "OTEL_SDK_DISABLED": "true",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "ROLLOUTD_ENGINE__VLLM__DTYPE": dtype,
            "ROLLOUTD_ENGINE__VLLM__KV_CACHE_MEMORY_GIB": "1",
            "ROLLOUTD_ENGINE__VLLM__MAX_MODEL_LEN": "512",
            "ROLLOUTD_ENGINE__MAX_TOKENS": "32",
            "ROLLOUTD_WEIGHTS__STAGING_DIR": str(work / "staging"),
            "ROLLOUTD_WEIGHTS__STORAGE_OPTIONS": json.dumps(s3),
            "ROLLOUTD_WEIGHTS__ALLOWED_URLS": json.dumps([f"s3://{BUCKET}/"]),
            "ROLLOUTD_LIMITS__MAX_IN_FLIGHT": "4",
            "ROLLOUTD_LIMITS__BUFFER_CAPACITY": "64",
            **(env or {}),
        }
        args = [
            "--engine", engine, "--model", str(model), "--dataset", str(dataset), "--epochs", "1",
            "--group-size", "4", "--grpc-port", "0", "--http-port", "0",
            "--checkpoint-dir", str(work / "checkpoints"), "--checkpoint-interval", "0",
            "--restore", "none",
        ]  # fmt: skip
        super().__init__(args, env_vars, work, work / f"serve-{engine}-{dtype}.log")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(8 << 20):
            h.update(block)
    return h.hexdigest()


def safetensors_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.glob("*.safetensors"))


def phases(answer: Any) -> str:
    order = ("transfer", "verify", "pause", "load", "resume")
    return ", ".join(
        f"{k} {answer.phase_seconds[k]:.3f} s" for k in order if k in answer.phase_seconds
    )


GRPC_CHUNK = 2**20
"""Bytes per message of the bare gRPC stream: what ``RolloutClient.push_weights`` sends."""


def _sink(ports: Any) -> None:
    """A bare gRPC server that takes client streams of bytes and drops them (in its own process,
    as the service is)."""

    async def drop(requests: Any, context: grpc.aio.ServicerContext) -> bytes:
        received = 0
        async for message in requests:
            received += len(message)
        return str(received).encode()

    async def serve() -> None:
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 * 2**20)])
        handler = grpc.stream_unary_rpc_method_handler(drop)
        server.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler("bench.Sink", {"Push": handler})]
        )
        ports.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def grpc_stream(size_bytes: int, reps: int) -> dict[str, float]:
    """The bare gRPC stream (see the module docstring): medians over ``reps`` streams after one
    on a fresh channel."""
    context = multiprocessing.get_context("spawn")
    ports = context.Queue()
    sink = context.Process(target=_sink, args=(ports,), daemon=True)
    sink.start()
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{ports.get(timeout=120)}")
        push = channel.stream_unary("/bench.Sink/Push")
        messages = [os.urandom(GRPC_CHUNK)] * max(1, size_bytes // GRPC_CHUNK)
        gb = len(messages) * GRPC_CHUNK / 1e9
        push(iter(messages))
        rates, client, server = [], [], []
        for _ in range(reps):
            cpu, sink_cpu = time.process_time(), process_cpu_s(sink.pid)
            started = time.perf_counter()
            push(iter(messages))
            rates.append(gb * 1e3 / (time.perf_counter() - started))
            client.append((time.process_time() - cpu) / gb)
            server.append((process_cpu_s(sink.pid) - sink_cpu) / gb)
        channel.close()
    finally:
        sink.terminate()
        sink.join()
    return {
        "grpc_stream_mb_per_s": common.median(rates),
        "grpc_stream_client_cpu_s_per_gb": common.median(client),
        "grpc_stream_server_cpu_s_per_gb": common.median(server),
    }


def local_copy_s(source: Path, scratch: Path) -> float:
    """One raw copy of the files, their source read once before (as the client's hashing reads
    a push's files before it sends them)."""
    for p in source.glob("*.safetensors"):
        sha256(p)
    target = Path(tempfile.mkdtemp(dir=scratch))
    started = time.perf_counter()
    for p in sorted(source.glob("*.safetensors")):
        shutil.copyfile(p, target / p.name)
    seconds = time.perf_counter() - started
    shutil.rmtree(target)
    return seconds


class Generating:
    """Keeps the engine generating: submits prompts and leases and acks what comes back."""

    def __init__(self, client: RolloutClient) -> None:
        self._client = client
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._n = 0

    def __enter__(self) -> Generating:
        self._thread.start()
        time.sleep(2.0)  # let generation get going
        return self

    def __exit__(self, *exc: object) -> None:
        self._halt.set()
        self._thread.join(60)

    def _run(self) -> None:
        while not self._halt.is_set():
            first = self._n
            prompts = [
                {"prompt_id": f"p{i}", "text": f"What is {i} + 7?"} for i in range(first, first + 8)
            ]
            self._n += len(prompts)
            self._client.submit_prompts(prompts)
            lease = self._client.fetch(max_groups=8, wait_ms=500)
            if lease is not None:
                self._client.ack(lease, trainer_step=0)


def measure(size: Size, root: Path, engine: str, s3: dict[str, Any], reps: int) -> dict[str, Any]:
    work = root / size.name
    work.mkdir()
    common.progress(f"{size.name}: building the model and {reps + 1} more sets of weights")
    base = build_tiny_model(work / "base", seed=0, spec=size.spec, progress=lambda _: None)
    weights = [
        write_random_weights(base, work / f"w{i}", seed=i + 1, progress=lambda _: None)
        for i in range(reps + 1)
    ]
    for w in weights:
        digest = sha256(w / "model.safetensors")
        (w / "SHA256SUMS").write_text(f"{digest}  model.safetensors\n")
    size_bytes = safetensors_bytes(base)
    mb = size_bytes / 1e6
    common.progress(f"{size.name}: {mb:.1f} MB of safetensors")

    fs = fsspec.filesystem("s3", **s3, skip_instance_cache=True)
    urls = []
    for w in weights:
        url = f"s3://{BUCKET}/{uuid.uuid4().hex}"
        for name in ("model.safetensors", "SHA256SUMS"):
            fs.put_file(str(w / name), f"{url}/{name}")
        urls.append(url)

    common.progress(f"{size.name}: a bare gRPC stream of {mb:.1f} MB, {reps + 2} times")
    stream = grpc_stream(size_bytes, reps + 2)
    common.progress(
        f"{size.name}: bare gRPC stream {stream['grpc_stream_mb_per_s']:.0f} MB/s, CPU-s per GB: "
        f"client {stream['grpc_stream_client_cpu_s_per_gb']:.2f}, "
        f"server {stream['grpc_stream_server_cpu_s_per_gb']:.2f}"
    )
    rates = run_service(
        size, base, weights, urls, work, "synthetic", s3, reps, engine == "synthetic"
    )
    updates = (
        rates
        if engine == "synthetic"
        else run_service(size, base, weights, urls, work, engine, s3, reps, True)
    )

    def phase(r: Any, *names: str) -> float:
        return float(sum(r.phase_seconds[n] for n in names))

    def paused_ms(r: Any) -> float:
        return phase(r, "pause", "load", "resume") * 1000

    local = common.median([mb / s for s in rates.copies])
    push_rates = [mb / phase(r, "transfer") for _, r in rates.push]
    push_rate = common.median(push_rates)
    return {
        "size": size.name,
        "bytes": size_bytes,
        "spec": size.spec.__dict__,
        "engine": engine,
        "local_copy_mb_per_s": local,
        "push_mb_per_s": push_rate,
        "push_verified_mb_per_s": common.median(
            [mb / phase(r, "transfer", "verify") for _, r in rates.push]
        ),
        "push_vs_local_copy": push_rate / local,
        "push_best_mb_per_s": max(push_rates),
        "local_copy_best_mb_per_s": max(mb / s for s in rates.copies),
        "push_vs_local_copy_best": max(push_rates) / max(mb / s for s in rates.copies),
        "push_client_cpu_s_per_gb": common.median([c / (mb / 1e3) for c, _ in rates.push_cpu_s]),
        "push_service_cpu_s_per_gb": common.median([s / (mb / 1e3) for _, s in rates.push_cpu_s]),
        **stream,
        "grpc_stream_vs_local_copy": stream["grpc_stream_mb_per_s"] / local,
        "s3_mb_per_s": common.median([mb / phase(r, "transfer") for _, r in rates.fetched]),
        "push_mb_per_s_beside_engine": common.median(
            [mb / phase(r, "transfer") for _, r in updates.push]
        ),
        "s3_mb_per_s_beside_engine": common.median(
            [mb / phase(r, "transfer") for _, r in updates.fetched]
        ),
        "update_pause_ms": common.median([paused_ms(r) for _, r in updates.push + updates.fetched]),
        "update_pause_ms_generating": common.median([paused_ms(r) for r in updates.busy]),
        "push_end_to_end_s": common.median([s for s, _ in updates.push]),
        "push_first_end_to_end_s": updates.first_push_s,
        "s3_end_to_end_s": common.median([s for s, _ in updates.fetched]),
        "push_phases_s": {
            k: common.median([r.phase_seconds[k] for _, r in updates.push])
            for k in updates.push[0][1].phase_seconds
        },
        "s3_phases_s": {
            k: common.median([r.phase_seconds[k] for _, r in updates.fetched])
            for k in updates.fetched[0][1].phase_seconds
        },
        "reps": reps,
    }


@dataclass
class Run:
    """What one service answered: push and S3 updates with the engine idle, pushes while it
    generated, and the raw local copies interleaved with them."""

    first_push_s: float
    copies: list[float]
    push: list[tuple[float, pb.PushWeightsResponse]]
    push_cpu_s: list[tuple[float, float]]
    """CPU-seconds of (this process, the service) over each push in ``push``."""
    fetched: list[tuple[float, pb.UpdateWeightsResponse]]
    busy: list[pb.PushWeightsResponse]


def run_service(
    size: Size,
    base: Path,
    weights: list[Path],
    urls: list[str],
    work: Path,
    engine: str,
    s3: dict[str, Any],
    reps: int,
    generating: bool,
) -> Run:
    service = Service(base, work, engine, s3)
    try:
        service.wait_listening(600.0, poll_s=0.2)
        common.progress(f"{size.name}: {engine} service up at {service.address}")
        client = RolloutClient(service.address, interceptors=(), timeout_s=600)
        version = 1
        started = time.perf_counter()
        client.push_weights(version, weights[-1])
        run = Run(time.perf_counter() - started, [], [], [], [], [])
        common.progress(f"{size.name}: first push on a new channel (not in the medians): "
                        f"{run.first_push_s:.2f} s")  # fmt: skip
        for i in range(reps):
            # A local copy right before each push, so that both see the same machine load.
            run.copies.append(local_copy_s(weights[i], work))
            version += 1
            cpu, service_cpu = time.process_time(), service.cpu_s()
            started = time.perf_counter()
            [answer] = client.push_weights(version, weights[i]).values()
            run.push.append((time.perf_counter() - started, answer))
            run.push_cpu_s.append((time.process_time() - cpu, service.cpu_s() - service_cpu))
            common.progress(
                f"{size.name}: {engine}: push v{version} in {run.push[-1][0]:.2f} s, "
                f"{phases(answer)} (local copy {run.copies[-1]:.3f} s)"
            )
            version += 1
            started = time.perf_counter()
            [answer2] = client.update_weights(version, urls[i]).values()
            run.fetched.append((time.perf_counter() - started, answer2))
            common.progress(
                f"{size.name}: {engine}: s3 v{version} in {run.fetched[-1][0]:.2f} s, "
                f"{phases(answer2)}"
            )
        if generating:
            with Generating(client):
                for i in range(reps):
                    version += 1
                    [answer] = client.push_weights(
                        version, weights[(i + 1) % len(weights)]
                    ).values()
                    run.busy.append(answer)
                    common.progress(
                        f"{size.name}: {engine}: push v{version} while generating, {phases(answer)}"
                    )
        client.close()
    finally:
        service.stop(120.0)
    return run


DELTA_STEPS = 50
DELTA_LR = 1e-6
TARGET_DELTA_BYTES = 0.10
TARGET_PAUSE_RATIO = 1.0


def bf16_model(source: Path, out: Path) -> Path:
    """The tiny model with its weights stored in bf16, as served (configuration and tokenizer
    copied as they are)."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, out, ignore=shutil.ignore_patterns("*.safetensors"))
    for p in source.glob("*.safetensors"):
        tensors = {n: t.to(torch.bfloat16) for n, t in load_file(str(p)).items()}
        save_file(tensors, str(out / p.name), metadata={"format": "pt"})
    return out


def tensor_digests(tensors: dict[str, Any]) -> dict[str, str]:
    """SHA-256 of every tensor's bytes, as a safetensors file holds them."""
    from rolloutd.weights.delta import raw_tensor

    return {n: hashlib.sha256(raw_tensor(t).data).hexdigest() for n, t in tensors.items()}


def staged_digests(directory: Path) -> dict[str, str]:
    from rolloutd.weights.delta import read_safetensors

    return {
        n: hashlib.sha256(t.data).hexdigest()
        for _, _, tensors in read_safetensors(directory)
        for n, t in tensors.items()
    }


def greedy(client: RolloutClient, prompt_id: str) -> tuple[list[int], list[float], int]:
    """A greedy group for one submitted prompt: its first sample's token ids, logprobs and
    policy version."""
    client.submit_prompts([{"prompt_id": prompt_id, "text": "Count: 1 2 3 4 5"}])
    while True:
        lease = client.fetch(max_groups=4, wait_ms=2000)
        if lease is None:
            continue
        client.ack(lease, trainer_step=0)
        for group in lease.groups:
            if group.prompt_id == prompt_id:
                s = group.samples[0]
                return list(s.token_ids), list(s.logprobs), s.policy_version


def delta_run(root: Path, steps: int) -> dict[str, Any]:
    """See the module docstring."""
    import torch
    from transformers import LlamaForCausalLM

    from rolloutd.weights.delta import make_delta

    work = root / "delta"
    work.mkdir()
    common.progress(f"delta: building the tiny model in bf16, then {steps} Adam steps")
    built = build_tiny_model(work / "f32", seed=0, progress=lambda _: None)
    served = bf16_model(built, work / "model")
    torch.manual_seed(0)
    trainer = LlamaForCausalLM.from_pretrained(str(built), torch_dtype=torch.float32)
    names = set(common_names(served))
    optimizer = torch.optim.Adam(trainer.parameters(), lr=DELTA_LR)
    vocab = trainer.config.vocab_size

    def bf16_weights() -> dict[str, Any]:
        return {
            n: p.detach().to(torch.bfloat16).contiguous()
            for n, p in trainer.state_dict().items()
            if n in names
        }

    service = Service(
        served, work, "vllm", {}, dtype="bfloat16", env={"ROLLOUTD_ENGINE__TEMPERATURE": "0"}
    )
    rows: list[dict[str, Any]] = []
    matches = True
    try:
        service.wait_listening(600.0, poll_s=0.2)
        common.progress(f"delta: vLLM (bf16) service up at {service.address}")
        client = RolloutClient(service.address, interceptors=(), timeout_s=600)
        previous, version = bf16_weights(), 0
        for step in range(1, steps + 1):
            batch = torch.randint(0, vocab, (4, 64))
            loss = trainer(input_ids=batch, labels=batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            current = bf16_weights()
            full = work / f"full-{step}"
            full.mkdir()
            save_file_bf16(current, full / "model.safetensors")
            delta_file = work / f"step-{step}.delta"
            stats = make_delta(
                previous, current, delta_file, base_version=version, version=version + 1
            )
            [by_delta] = client.push_delta(version, version + 1, delta_file).values()
            version += 1
            expected = tensor_digests(current)
            staged_ok = staged_digests(work / "staging" / f"v{version}") == expected
            tokens_d, logprobs_d, at_d = greedy(client, f"delta-{step}")
            [by_full] = client.push_weights(version + 1, full).values()
            version += 1
            tokens_f, logprobs_f, at_f = greedy(client, f"full-{step}")
            same = staged_ok and (tokens_d, logprobs_d) == (tokens_f, logprobs_f)
            same = same and (at_d, at_f) == (version - 1, version)
            matches = matches and same
            rows.append(
                {
                    "step": step,
                    "loss": float(loss),
                    "delta_bytes": stats.bytes,
                    "full_bytes": by_full.bytes,
                    "bit_identical_fraction": stats.bit_identical_fraction,
                    "tensors_changed": stats.tensors_changed,
                    "delta_pause_ms": 1000 * paused_s(by_delta),
                    "full_pause_ms": 1000 * paused_s(by_full),
                    "delta_decode_ms": 1000 * by_delta.phase_seconds["decode"],
                    "state_matches_full": same,
                }
            )
            r = rows[-1]
            common.progress(
                f"delta: step {step}/{steps}: delta {r['delta_bytes'] / 1e3:.1f} kB of "
                f"{r['full_bytes'] / 1e6:.2f} MB, {r['bit_identical_fraction']:.4%} bit-identical, "
                f"pause {r['delta_pause_ms']:.1f} ms (full {r['full_pause_ms']:.1f} ms), "
                f"{'matches' if same else 'DIFFERS FROM'} the full load"
            )
            shutil.rmtree(full)
            delta_file.unlink()
            previous = current
        client.close()
    finally:
        service.stop(120.0)
    delta_p50 = common.median([r["delta_pause_ms"] for r in rows])
    full_p50 = common.median([r["full_pause_ms"] for r in rows])
    return {
        "steps": steps,
        "lr": DELTA_LR,
        "dtype": "bfloat16",
        "delta_bytes_vs_full": common.median([r["delta_bytes"] / r["full_bytes"] for r in rows]),
        "bit_identical_fraction": sum(r["bit_identical_fraction"] for r in rows) / len(rows),
        "delta_state_matches_full": matches,
        "delta_pause_ms_p50": delta_p50,
        "full_pause_ms_p50": full_p50,
        "delta_pause_vs_full": delta_p50 / full_p50,
        "delta_decode_ms_p50": common.median([r["delta_decode_ms"] for r in rows]),
        "rows": rows,
    }


def common_names(directory: Path) -> list[str]:
    from rolloutd.weights.delta import read_safetensors

    return [n for _, _, tensors in read_safetensors(directory) for n in tensors]


def save_file_bf16(tensors: dict[str, Any], path: Path) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})


def paused_s(answer: Any) -> float:
    return float(sum(answer.phase_seconds[k] for k in ("pause", "load", "resume")))


def markdown(result: dict[str, Any]) -> str:
    rows = [
        (
            r["size"], r["bytes"] / 1e6, r["local_copy_mb_per_s"], r["push_mb_per_s"],
            r["push_verified_mb_per_s"], r["push_vs_local_copy"], r["push_client_cpu_s_per_gb"],
            r["push_service_cpu_s_per_gb"], r["grpc_stream_mb_per_s"],
            r["grpc_stream_client_cpu_s_per_gb"], r["grpc_stream_server_cpu_s_per_gb"],
            r["s3_mb_per_s"],
            r["update_pause_ms"], r["update_pause_ms_generating"], r["push_end_to_end_s"],
            r["s3_end_to_end_s"],
        )
        for r in result["sizes"]
    ]  # fmt: skip
    table = common.markdown_table(
        ["model", "MB", "local copy MB/s", "push MB/s", "push+verify MB/s", "push / copy",
         "push client CPU-s/GB (with hashing)", "push service CPU-s/GB (with verify)",
         "bare gRPC MB/s", "bare gRPC client CPU-s/GB", "bare gRPC server CPU-s/GB",
         "S3 (moto) MB/s", "pause ms (idle)", "pause ms (generating)", "push end-to-end s",
         "S3 end-to-end s"],
        rows,
    )  # fmt: skip
    engine = result["sizes"][0]["engine"]
    return (
        f"# Weight updates\n\n{'Quick run. ' if result['quick'] else ''}Engine: {engine}. "
        "Transfer rates are bytes over the service's transfer phase; end-to-end is what the "
        "trainer waits for (push: hashing, streaming, verifying, loading).\n\n"
        + common.headline_table(result["headline"])
        + "\n"
        + table
    )


def plot(result: dict[str, Any], path: Path) -> None:
    plt = common.pyplot()
    sizes = result["sizes"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    labels = [f"{r['size']}\n{r['bytes'] / 1e6:.0f} MB" for r in sizes]
    width = 0.2
    for i, (key, label) in enumerate(
        [("local_copy_mb_per_s", "local copy"), ("grpc_stream_mb_per_s", "bare gRPC stream"),
         ("push_mb_per_s", "push (gRPC)"), ("s3_mb_per_s", "S3 (moto)")]
    ):  # fmt: skip
        xs = [x + (i - 1.5) * width for x in range(len(sizes))]
        left.bar(xs, [r[key] for r in sizes], width, label=label)
    left.set_xticks(range(len(sizes)), labels)
    left.set_ylabel("MB/s")
    left.set_title("transfer rate")
    left.legend()
    phases = ["transfer", "verify", "pause", "load", "resume"]
    for j, source in enumerate(("push", "s3")):
        bottoms = [0.0] * len(sizes)
        for k, name in enumerate(phases):
            values = [r[f"{source}_phases_s"].get(name, 0.0) for r in sizes]
            xs = [x + (j - 0.5) * 0.4 for x in range(len(sizes))]
            label = name if j == 0 else None
            right.bar(xs, values, 0.38, bottom=bottoms, color=f"C{k}", label=label)
            bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    right.set_xticks(range(len(sizes)), [f"{lab}\npush | S3" for lab in labels])
    right.set_ylabel("seconds")
    right.set_title("update phases (median)")
    right.legend()
    common.save_figure(fig, path)


def main() -> None:
    args = common.parse_args(__doc__.splitlines()[0])
    started = time.time()
    engine = "synthetic" if args.quick else "vllm"
    sizes = [TINY, QUICK_LARGE] if args.quick else [TINY, LARGE]
    reps = 2 if args.quick else 5
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's request log
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    s3 = {"endpoint_url": f"http://{host}:{port}", "key": "bench", "secret": "bench"}
    fsspec.filesystem("s3", **s3, skip_instance_cache=True).mkdir(BUCKET)
    try:
        with tempfile.TemporaryDirectory(prefix="rolloutd-weights-") as tmp:
            delta = delta_run(Path(tmp), DELTA_STEPS)
            rows = [measure(size, Path(tmp), engine, s3, reps) for size in sizes]
    finally:
        server.stop()
    large = rows[-1]
    headline = [
        common.headline(
            f"push / local copy MB/s, {large['bytes'] / 1e6:.0f} MB model",
            large["push_vs_local_copy"], "", f">= {TARGET_PUSH_VS_COPY}",
            min(large["push_vs_local_copy"], large["push_vs_local_copy_best"])
            >= TARGET_PUSH_VS_COPY,
            f"medians {large['push_mb_per_s']:.0f} / {large['local_copy_mb_per_s']:.0f} MB/s; "
            f"fastest rounds {large['push_best_mb_per_s']:.0f} / "
            f"{large['local_copy_best_mb_per_s']:.0f} MB/s = "
            f"{large['push_vs_local_copy_best']:.2f}; CPU-s per GB over a whole push: client "
            f"{large['push_client_cpu_s_per_gb']:.2f} (with its hashing), service "
            f"{large['push_service_cpu_s_per_gb']:.2f} (with verifying)",
        ),
        common.headline(
            f"bare gRPC stream / local copy MB/s, {large['bytes'] / 1e6:.0f} MB",
            large["grpc_stream_vs_local_copy"], "", "", None,
            f"{large['grpc_stream_mb_per_s']:.0f} MB/s; CPU-s per GB: client "
            f"{large['grpc_stream_client_cpu_s_per_gb']:.2f}, server "
            f"{large['grpc_stream_server_cpu_s_per_gb']:.2f}",
        ),
        common.headline(f"S3 (moto) transfer, {large['bytes'] / 1e6:.0f} MB model",
                        large["s3_mb_per_s"], "MB/s", "", None),
        common.headline(
            f"generation paused per update, {large['bytes'] / 1e6:.0f} MB model "
            f"({large['engine']})",
            large["update_pause_ms"], "ms", "", None,
            f"{large['update_pause_ms_generating']:.0f} ms while generating",
        ),
        common.headline(
            f"push end-to-end, {large['bytes'] / 1e6:.0f} MB model", large["push_end_to_end_s"],
            "s", "", None, f"S3: {large['s3_end_to_end_s']:.2f} s",
        ),
        common.headline(
            f"delta / full bytes, tiny model in bf16, Adam lr {DELTA_LR:g}",
            delta["delta_bytes_vs_full"], "", f"<= {TARGET_DELTA_BYTES}",
            delta["delta_bytes_vs_full"] <= TARGET_DELTA_BYTES,
            f"{delta['bit_identical_fraction']:.4%} of bf16 elements bit-identical per step",
        ),
        common.headline(
            "engine pause, delta / full (same weights, side by side)",
            delta["delta_pause_vs_full"], "", f"<= {TARGET_PAUSE_RATIO}",
            delta["delta_pause_vs_full"] <= TARGET_PAUSE_RATIO,
            f"p50 {delta['delta_pause_ms_p50']:.1f} / {delta['full_pause_ms_p50']:.1f} ms; "
            f"state matches a full load after all {delta['steps']} deltas: "
            f"{delta['delta_state_matches_full']}",
        ),
    ]  # fmt: skip
    result = {
        "benchmark": NAME,
        "quick": args.quick,
        "headline": headline,
        **{k: v for k, v in delta.items() if k.startswith(("delta_", "full_", "bit_"))},
        "delta": delta,
        "sizes": rows,
        "conditions": common.conditions(started),
    }
    common.publish(result, args.json, NAME, markdown(result), plot)


if __name__ == "__main__":
    main()
