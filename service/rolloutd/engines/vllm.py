"""The vLLM engine: vLLM's in-process ``AsyncLLM`` (V1) behind the :class:`GenerationEngine` seam.

What must hold, and how:

- **One engine request per sibling**, each with its own seed, so siblings finish independently and
  a re-run after a restart reproduces a sibling on the same weights.
- **Exact capture.** Token ids come from vLLM's final output; logprobs are requested with
  ``logprobs=0`` (the sampled token only) as flat lists, so a sample holds exactly one logprob
  per generated token without a Python object per token. Prompts are rendered by vLLM's own
  renderer (``messages`` through the tokenizer's chat template), and the prompt token ids the
  engine actually saw are kept.
- **Policy versions come from the engine.** vLLM labels every output token with the weight
  version that produced it; ``update_weights`` sets that label while generation is paused, and a
  sample's ``policy_version`` is read from the labels of its own tokens. A request queued during
  an update therefore carries the new version even if it was submitted before the update began.
- **Streaming and resume.** With a delta sink, requests run with ``RequestOutputKind.DELTA`` and
  tokens and logprobs go to the sink every
  :data:`~rolloutd.engines.vllm_requests.STREAM_TOKENS` tokens. A request with a prefix (a sibling
  resumed after a restart) is a new request whose prompt is the prompt's token ids followed by
  the prefix's, for the remaining ``max_tokens``; the sample joins the prefix and the
  continuation. A stop string that spans the boundary ends the sample where an uninterrupted run
  would (:mod:`rolloutd.engines.stop_boundary`).
- **Counters** are cumulative and come from a ``StatLoggerBase`` given to the engine, which sees
  every iteration's stats in the frontend process (:mod:`rolloutd.engines.vllm_stats`); so do
  each request's time to first token and end (:meth:`VLLMEngine.report_requests`).
- **No orphans.** vLLM 0.32 leaves its engine-core process running when the parent is killed with
  SIGKILL; a small watchdog process (:mod:`rolloutd.engines.reaper`, driven through
  :mod:`rolloutd.engines.reaper_client`) ends it in that case.
- **A dead engine is noticed while idle.** :meth:`VLLMEngine.check_alive` reads vLLM's own
  ``errored`` state (its monitor thread sees the engine-core process die) and whether the
  engine-core processes are still alive, without an engine call.

How a request is put to vLLM (its rendered prompt, sampling parameters and trace headers) is
:mod:`rolloutd.engines.vllm_requests`. Settings (:class:`~rolloutd.engines.vllm_config.VLLMConfig`)
and the KV cache's size (:mod:`rolloutd.engines.vllm_kv_cache`) are kept free of vLLM imports.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import multiprocessing
import os
import time
from array import array
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.exceptions import VLLMClientError
from vllm.inputs import EngineInput
from vllm.outputs import RequestOutput
from vllm.platforms import current_platform
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError as VLLMEngineDeadError
from vllm.v1.engine.exceptions import EngineGenerateError

from rolloutd.domain.engine import (
    DeltaSink,
    EngineCounters,
    EngineDeadError,
    EngineError,
    EngineStartError,
    GenerationRequest,
    RequestObserver,
    RequestRefused,
)
from rolloutd.domain.group import Prompt, Sample
from rolloutd.domain.partial import PartialSibling, TokenDelta
from rolloutd.domain.spec import SpecError, check_prompt_length
from rolloutd.domain.weights import WeightsPhase, WeightsTimeline
from rolloutd.engines.reaper_client import ReaperClient
from rolloutd.engines.stop_boundary import StopBoundary
from rolloutd.engines.vllm_config import VLLMConfig
from rolloutd.engines.vllm_kv_cache import kv_cache_bytes, read_model_config
from rolloutd.engines.vllm_outputs import Collected, to_sample, version_of, weight_labels
from rolloutd.engines.vllm_requests import render, sampling_params, trace_headers
from rolloutd.engines.vllm_start import (
    THREADS_BIND_ENV,
    describe_start_failure,
    export_cpu_threads_bind,
    output_to,
)
from rolloutd.engines.vllm_stats import Tally

logger = logging.getLogger(__name__)

_WATCH_INTERVAL_S = 0.1
"""How often new engine processes are looked for while vLLM starts."""

_PROGRESS_EVERY_S = 15.0
"""How often a start that is still going says so."""

_ENGINE_CORE = "EngineCore"
"""What vLLM names its engine-core processes (``EngineCore``, ``EngineCore_DP<rank>``)."""


class VLLMEngine:
    """Generates with vLLM's ``AsyncLLM`` on a local Hugging Face model directory.

    Construct it cheaply anywhere; :meth:`start` creates the engine (seconds on GPU, 15-60 s on
    CPU) in a worker thread so the event loop keeps serving meanwhile. Must be started, used and
    stopped on one event loop.
    """

    name = "vllm"

    def __init__(
        self, config: VLLMConfig, model_path: str | os.PathLike[str], *, max_sequences: int
    ) -> None:
        """``config``: the ``engine.vllm`` keys. ``max_sequences``: the most siblings the service
        may generate at once, which sizes the KV cache on CPU."""
        self._config = config
        self._model_path = Path(model_path)
        self._max_sequences = max_sequences
        self._kv_cache_bytes: int | None = None
        self._llm: AsyncLLM | None = None
        self._reaper: ReaperClient | None = None
        self._tally = Tally()
        self._version = 0
        self._dead: str | None = None
        self._tasks: dict[str, asyncio.Task[Any]] = {}
        self._weights_lock = asyncio.Lock()
        self._eos: frozenset[int] = frozenset()
        self._cores: list[multiprocessing.process.BaseProcess] = []
        """vLLM's engine-core processes, children of this one."""

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._llm is not None:
            raise RuntimeError("VLLMEngine.start() called twice")
        settings = self._config
        model_config = await asyncio.to_thread(read_model_config, self._model_path)
        self._kv_cache_bytes = kv_cache_bytes(
            settings,
            model_config,
            max_sequences=self._max_sequences,
            on_cpu=current_platform.is_cpu(),
        )
        # At debug level vLLM's own output stays on the terminal, tracebacks included.
        log_path = None if logger.isEnabledFor(logging.DEBUG) else settings.log_path
        logger.info(
            "starting vLLM on %s (a minute or so on CPU)%s",
            self._model_path,
            f"; its output goes to {log_path}" if log_path else "",
        )
        if current_platform.is_cpu():
            bind = export_cpu_threads_bind(settings.cpu_threads_bind)
            if bind is not None:
                logger.info(
                    "vLLM CPU threads: %s=%s (engine.vllm.cpu_threads_bind sets it)",
                    THREADS_BIND_ENV,
                    bind,
                )
        started = time.monotonic()
        reaper = ReaperClient(settings.shutdown_grace_s)
        with output_to(Path(log_path)) if log_path else contextlib.nullcontext():
            build = asyncio.ensure_future(asyncio.to_thread(self._build))
            try:
                await self._await_build(build, reaper, started)
            except asyncio.CancelledError:
                build.add_done_callback(partial(_shutdown_built_engine, reaper=reaper))
                raise
            except Exception as exc:
                await asyncio.to_thread(reaper.reap)
                raise EngineStartError(describe_start_failure(exc, log_path)) from exc
            except BaseException:
                reaper.reap()
                raise
        llm = build.result()
        reaper.watch_new_children()
        self._llm, self._reaper = llm, reaper
        self._cores = [
            p for p in multiprocessing.active_children() if p.name.startswith(_ENGINE_CORE)
        ]
        tasks = await llm.get_supported_tasks()
        if "generate" not in tasks:
            await self.stop()
            raise EngineStartError(
                f"engine.model (--model): {self._model_path} cannot generate text (tasks: {tasks})"
            )
        await llm.update_weight_version(str(self._version))
        self._eos = await asyncio.to_thread(_eos_ids, self._model_path, llm)
        logger.info(
            "vLLM engine started on %s in %.1f s (engine processes %s)",
            self._model_path,
            time.monotonic() - started,
            reaper.watched,
        )

    async def _await_build(
        self, build: asyncio.Future[AsyncLLM], reaper: ReaperClient, started: float
    ) -> None:
        """Waits for vLLM to start, watching every engine process it creates, saying how long it
        has been at it now and then; raises what the start raised."""
        next_progress = started + _PROGRESS_EVERY_S
        while not build.done():
            reaper.watch_new_children()
            await asyncio.wait({build}, timeout=_WATCH_INTERVAL_S)
            if time.monotonic() >= next_progress:
                next_progress += _PROGRESS_EVERY_S
                logger.info("vLLM still starting (%.0f s)", time.monotonic() - started)
        build.result()

    def _build(self) -> AsyncLLM:
        s = self._config
        # vLLM rewinds a seeded request's random generator when the token sampled after a partial
        # prefill chunk is discarded; torch's CPU generators cannot rewind ("CPU Generator does
        # not use offset") and the engine dies. On CPU every prompt is therefore prefilled whole.
        whole_prefill = current_platform.is_cpu()
        args = AsyncEngineArgs(
            model=str(self._model_path),
            dtype=s.dtype,  # type: ignore[arg-type]
            max_model_len=s.max_model_len,
            gpu_memory_utilization=s.gpu_memory_utilization,
            tensor_parallel_size=s.tensor_parallel_size,
            pipeline_parallel_size=s.pipeline_parallel_size,
            enforce_eager=s.enforce_eager,
            max_num_seqs=s.max_num_seqs,
            kv_cache_memory_bytes=self._kv_cache_bytes,
            block_size=s.block_size,
            logprobs_mode=s.logprobs_mode,
            otlp_traces_endpoint=s.otlp_traces_endpoint,
            disable_log_stats=True,
            enable_log_requests=False,
            enable_chunked_prefill=False if whole_prefill else None,
            max_num_batched_tokens=max(s.max_model_len, 8192) if whole_prefill else None,
            worker_extension_cls="rolloutd.engines.vllm_worker.RolloutdWorker",
        )
        return AsyncLLM.from_engine_args(args, stat_loggers=[self._tally.stat_logger_factory()])

    async def stop(self) -> None:
        """Abort what is in flight and shut vLLM down; idempotent."""
        llm, self._llm = self._llm, None
        reaper, self._reaper = self._reaper, None
        if llm is None:
            return
        in_flight = [t for t in self._tasks.values() if t is not asyncio.current_task()]
        for task in in_flight:
            task.cancel()
        # Cancelled requests abort themselves in vLLM, which needs the engine still up.
        await asyncio.gather(*in_flight, return_exceptions=True)
        # Blocks while the engine processes exit (a few seconds); the service is stopping anyway.
        # What vLLM says meanwhile goes where its start-up output went.
        log_path = None if logger.isEnabledFor(logging.DEBUG) else self._config.log_path
        with output_to(Path(log_path), rotate=False) if log_path else contextlib.nullcontext():
            llm.shutdown()
        if reaper is not None:
            reaper.close()
        logger.info("vLLM engine stopped")

    # -- generation ------------------------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        return self._version

    def counters(self) -> EngineCounters:
        return self._tally.counters()

    def report_requests(self, observer: RequestObserver) -> None:
        """``ReportsRequests``: every request's first token and end, from the stat logger."""
        self._tally.observer = observer

    def check_alive(self) -> None:
        """Raises :class:`EngineDeadError` once vLLM reports itself errored or an engine-core
        process exited; a ``waitpid`` per engine core, no engine call."""
        self._live_engine()
        for core in self._cores:
            if not core.is_alive():
                self._dead = (
                    f"the vLLM engine process {core.name} (pid {core.pid}) exited "
                    f"(exit code {core.exitcode})"
                )
                raise EngineDeadError(self._dead)

    async def generate(
        self, request: GenerationRequest, on_delta: DeltaSink | None = None
    ) -> Sample:
        llm = self._live_engine()
        task = asyncio.current_task()
        assert task is not None
        if request.request_id in self._tasks:
            raise EngineError(f"request {request.request_id} is already generating")
        self._tasks[request.request_id] = task
        started = time.time()
        try:
            if request.context is not None:
                (engine_input,) = await llm.renderer.render_cmpl_async(
                    [{"prompt_token_ids": list(request.context)}]
                )
            else:
                engine_input = await render(llm, request.prompt)
            prompt_ids = list(engine_input["prompt_token_ids"])  # type: ignore[typeddict-item]
            self._check_fits(request, len(prompt_ids))
            prefix = request.prefix
            if prefix is None:
                got = await self._run(llm, engine_input, request, on_delta)
            elif (reason := self._prefix_finish(request, prefix)) is not None:
                got = Collected(finish_reason=reason)
            else:
                (continued,) = await llm.renderer.render_cmpl_async(
                    [{"prompt_token_ids": prompt_ids + list(prefix.token_ids())}]
                )
                got = await self._run(llm, continued, request, on_delta)
        finally:
            self._tasks.pop(request.request_id, None)
        got.prompt_token_ids = prompt_ids
        return to_sample(request, got, started, current=self._version, decode=self._decode)

    @property
    def max_model_len(self) -> int:
        return self._config.max_model_len

    async def prompt_tokens(self, prompt: Prompt) -> int:
        """Tokens of ``prompt`` as :meth:`generate` renders it (``PromptMeter``)."""
        engine_input = await render(self._live_engine(), prompt)
        return len(engine_input["prompt_token_ids"])  # type: ignore[typeddict-item]

    def _check_fits(self, request: GenerationRequest, prompt_tokens: int) -> None:
        """vLLM would end a completion at the context's end without a word; refuse instead."""
        try:
            check_prompt_length(request.params.max_tokens, prompt_tokens, self.max_model_len)
        except SpecError as exc:
            raise RequestRefused(f"prompt {request.prompt.prompt_id}: {exc}") from None

    def _prefix_finish(self, request: GenerationRequest, prefix: PartialSibling) -> str | None:
        """The finish reason when the prefix is already a whole completion (the snapshot caught
        a sibling's last token before the sibling was staged); else None."""
        ids = prefix.token_ids()
        if ids and ids[-1] in self._eos:
            return "stop"
        if request.params.stop and any(s in self._decode(ids) for s in request.params.stop):
            return "stop"
        return "length" if len(ids) >= request.params.max_tokens else None

    async def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool,
    ) -> str:
        """``messages`` through the tokenizer's chat template, as text (``ChatRenderer``)."""
        tokenizer = self._live_engine().get_tokenizer()
        return str(
            tokenizer.apply_chat_template(
                [dict(m) for m in messages],
                tools=[dict(t) for t in tools] or None,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
            )
        )

    async def encode(self, text: str) -> array[int]:
        tokenizer = self._live_engine().get_tokenizer()
        return array("i", tokenizer.encode(text, add_special_tokens=False))

    def decode(self, token_ids: array[int]) -> str:
        return self._decode(token_ids)

    def _decode(self, token_ids: array[int]) -> str:
        """The text of ``token_ids`` as vLLM's incremental detokenizer gives it: bytes of a
        character the last tokens leave incomplete are held back, not shown as U+FFFD."""
        tokenizer = self._live_engine().get_tokenizer()
        return str(tokenizer.decode(list(token_ids), skip_special_tokens=True)).rstrip("\ufffd")

    async def abort(self, request_ids: list[str]) -> None:
        """Cancel the named requests; their ``generate`` calls raise ``CancelledError`` and vLLM
        frees their slots. Unknown or finished ids are ignored."""
        for rid in request_ids:
            task = self._tasks.get(rid)
            if task is not None:
                task.cancel()

    async def _run(
        self,
        llm: AsyncLLM,
        engine_input: EngineInput,
        request: GenerationRequest,
        on_delta: DeltaSink | None,
    ) -> Collected:
        p = request.params
        prefix = request.prefix
        boundary = (
            StopBoundary(self._decode, prefix.token_ids(), p.stop)
            if prefix is not None and p.stop
            else None
        )
        params = sampling_params(
            request,
            stream=on_delta is not None or boundary is not None,
            every_token=boundary is not None,
        )
        headers = trace_headers(self._config.otlp_traces_endpoint, request.trace_headers)
        got = Collected()
        final: RequestOutput | None = None
        try:
            async for out in llm.generate(
                engine_input, params, request.request_id, trace_headers=headers
            ):
                final = out
                got.add(request.request_id, out)
                if on_delta is not None and out.outputs[0].token_ids:
                    start = len(got.token_ids) - len(out.outputs[0].token_ids)
                    on_delta(
                        TokenDelta(
                            got.token_ids[start:],
                            got.logprobs[start:],
                            version_of(
                                request.request_id,
                                weight_labels(out.outputs[0]),
                                self._version,
                            ),
                        )
                    )
                if boundary is not None and not out.finished:
                    got.stopped_at = boundary.check(got.token_ids)
                    if got.stopped_at is not None:
                        got.finish_reason = "stop"
                        return got  # leaving the loop aborts the request in vLLM
                    if boundary.passed(got.text):
                        boundary = None
        except VLLMEngineDeadError as exc:
            self._dead = "the vLLM engine core died"
            raise EngineDeadError(f"{self._dead} while generating {request.request_id}") from exc
        except (EngineGenerateError, VLLMClientError) as exc:
            raise EngineError(f"request {request.request_id} failed: {exc!r}") from exc
        if final is None or not final.finished:
            raise EngineError(f"request {request.request_id} ended without a final output")
        if boundary is not None:  # finished within the window: the joined text may stop earlier
            got.stopped_at = boundary.check(got.token_ids)
            if got.stopped_at is not None:
                got.finish_reason = "stop"
        return got

    # -- weights ---------------------------------------------------------------------------------

    async def update_weights(
        self,
        path: str,
        version: int,
        *,
        timeline: WeightsTimeline | None = None,
        only: tuple[str, ...] | None = None,
    ) -> None:
        """Load the safetensors files under ``path`` into the running engine.

        With ``only`` (the tensors a delta changed) the workers read those tensors, completed to
        whole layers, and build those layers' new weights in the engine's format before
        generation pauses (:mod:`rolloutd.engines.vllm_worker`); the pause only copies them into
        place.

        Generation is paused around the load (``vllm.weight_update_mode`` says what happens to
        requests in flight). Once begun, an update runs to the end even if the caller is
        cancelled: stopping half-way would leave generation paused. A failed load may leave the
        weights partly replaced, so the engine is then marked dead and stays paused rather than
        produce samples from mixed weights.
        """
        llm = self._live_engine()
        if not await asyncio.to_thread(_has_safetensors, Path(path)):
            raise EngineError(f"weights path {path}: not a directory with *.safetensors files")
        await asyncio.shield(
            self._swap_weights(llm, path, version, timeline or WeightsTimeline(), only)
        )

    async def _swap_weights(
        self,
        llm: AsyncLLM,
        path: str,
        version: int,
        timeline: WeightsTimeline,
        only: tuple[str, ...] | None,
    ) -> None:
        async with self._weights_lock:
            began = time.monotonic()
            if only:
                try:
                    await llm.collective_rpc(
                        "rolloutd_stage", kwargs={"path": path, "names": list(only)}
                    )
                # Nothing was loaded yet: the request fails, the engine serves on.
                except Exception as exc:
                    raise EngineError(f"preparing the changed layers from {path}: {exc}") from exc
            started = time.monotonic()
            try:
                with timeline.phase(WeightsPhase.PAUSE):
                    await llm.pause_generation(
                        mode=self._config.weight_update_mode, clear_cache=True
                    )
                paused = time.monotonic()
                with timeline.phase(WeightsPhase.LOAD):
                    if only is None:
                        await llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
                    elif only:
                        await llm.collective_rpc("rolloutd_load_staged")
                    await llm.update_weight_version(str(version))
            # vLLM reports a failed engine-core call (a worker's load error) as a bare Exception.
            except Exception as exc:
                self._dead = (
                    f"updating weights to v{version} from {path} failed ({exc}); generation "
                    "stays paused because the weights may be partly replaced"
                )
                raise EngineDeadError(self._dead) from exc
            self._version = version
            with timeline.phase(WeightsPhase.RESUME):
                await llm.resume_generation()
        logger.info(
            "weights v%d loaded from %s: prepared in %.3f s (generation running), drained in "
            "%.3f s, loaded in %.3f s",
            version,
            path,
            started - began,
            paused - started,
            time.monotonic() - paused,
        )

    def _live_engine(self) -> AsyncLLM:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        llm = self._llm
        if llm is None:
            raise EngineDeadError("the vLLM engine is not running")
        if llm.errored:
            self._dead = "the vLLM engine core died"
            raise EngineDeadError(self._dead)
        return llm


def _eos_ids(path: Path, llm: AsyncLLM) -> frozenset[int]:
    """Tokens that end a completion: the tokenizer's end-of-sequence token and those of the
    model's generation config."""
    ids = set()
    eos = llm.get_tokenizer().eos_token_id
    if eos is not None:
        ids.add(int(eos))
    try:
        config = json.loads((path / "generation_config.json").read_text())
    except FileNotFoundError:
        return frozenset(ids)
    found = config.get("eos_token_id")
    ids.update([found] if isinstance(found, int) else found or [])
    return frozenset(ids)


def _has_safetensors(path: Path) -> bool:
    return path.is_dir() and any(path.glob("*.safetensors"))


def _shutdown_built_engine(build: asyncio.Future[AsyncLLM], *, reaper: ReaperClient) -> None:
    """Shut down an engine whose start was cancelled while vLLM was building it."""
    if not build.cancelled() and build.exception() is None:
        build.result().shutdown()
    reaper.close()
