"""An example trainer loop: fetch groups, "train", ack with the step number, report progress.

It shows the delivery contract from the trainer's side: ack after the step consumed the groups,
``Checkpoint(trainer_step)`` whenever the trainer saves its own checkpoint.

Each step is a span, ``rolloutd.trainer.step``, from the global tracer provider (a no-op one
unless the process set one up, as ``rolloutd trainer`` does when traces are exported): the
client's calls inside it carry its trace context, so the service's ``FetchGroups`` span joins
the step's trace and links the generation spans of the groups it leased.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from opentelemetry import trace

from rolloutd.client import Lease, RolloutClient
from rolloutd.v1 import rollout_pb2 as pb


@dataclass(frozen=True)
class TrainerConfig:
    endpoints: list[str]
    groups_per_step: int = 8
    """Groups consumed by one trainer step."""
    steps: int | None = None
    """Stop after this many steps (None: until the service has nothing more to give)."""
    train_s: float = 0.0
    """Simulated time of one optimizer step."""
    checkpoint_every: int = 0
    """Call Checkpoint(step) every this many steps (0: never)."""
    wait_ms: int = 2000
    """How long one fetch waits for groups."""
    idle_exit_s: float = 30.0
    """Stop after this long without any group."""
    report_every_s: float = 1.0
    ready_timeout_s: float = 900.0
    """How long to wait for every endpoint to be ready (a vLLM start takes a minute or more)."""
    unreachable_timeout_s: float = 120.0
    """How long an endpoint may go without answering at all before the trainer gives up on it: a
    service that is starting answers (not ready), one that exited does not. Mid-run, how long
    the trainer waits for a service that restarts (the client's ``outage_s``); the wait is not
    idle time."""
    token: str | None = None
    tls_ca: str | None = None
    """PEM CA bundle that signed the service's certificate; set, the trainer speaks TLS."""
    tls_cert: str | None = None
    """PEM client certificate, for a service that requires one (grpc.tls_client_ca)."""
    tls_key: str | None = None


STEP_SPAN = "rolloutd.trainer.step"
STEP_ATTR = "rolloutd.trainer.step"
"""The step number, on a step that consumed groups."""
GROUPS_ATTR = "rolloutd.trainer.groups"


class ServiceNotReady(RuntimeError):
    """An endpoint did not become ready in time; the message says which and what to look at."""


class RequestFailed(RuntimeError):
    """The service refused or dropped a request the trainer cannot go on without; the message
    names the endpoints, the status and what to do."""


_HINTS = {
    grpc.StatusCode.UNAUTHENTICATED: "set ROLLOUTD_AUTH__TOKEN or pass --token-file, the "
    "service's auth.token",
    grpc.StatusCode.PERMISSION_DENIED: "set ROLLOUTD_AUTH__TOKEN or pass --token-file, the "
    "service's auth.token",
    grpc.StatusCode.INVALID_ARGUMENT: "lower the trainer flag behind the field it names "
    "(max_groups: --groups-per-step), or raise the service's limit",
    grpc.StatusCode.UNAVAILABLE: "is `rolloutd serve` still running? The last line of its log "
    "says why it stopped",
    grpc.StatusCode.DEADLINE_EXCEEDED: "the service is overloaded or stuck; its log says which",
}


def _request_failed(endpoints: list[str], exc: grpc.RpcError) -> RequestFailed:
    code: grpc.StatusCode = exc.code()  # type: ignore[attr-defined]
    hint = _HINTS.get(code, "the service's log says why")
    return RequestFailed(
        f"{','.join(endpoints)} answered {code.name}: {exc.details()}; {hint}"  # type: ignore[attr-defined]
    )


def wait_until_ready(
    client: RolloutClient,
    timeout_s: float,
    out: Callable[[str], object],
    unreachable_timeout_s: float = 120.0,
) -> None:
    """Polls every endpoint's status until all serve, printing what they are doing meanwhile.

    An endpoint that answers but is not ready yet (vLLM loading, a restore) is waited for up to
    ``timeout_s``. One that has not answered once for ``unreachable_timeout_s`` is most likely a
    service that exited: the trainer says so, with a hint, after a third of that time, and gives up
    at the end of it.
    """
    started = time.monotonic()
    deadline = started + timeout_s
    last_answer = dict.fromkeys(client.endpoints, started)
    hinted: set[str] = set()
    last_report = 0.0
    while True:
        states: dict[str, str] = {}
        now = time.monotonic()
        for endpoint in client.endpoints:
            try:
                state = client.status_of(endpoint).state
                states[endpoint] = (
                    pb.ServingState.Name(state).removeprefix("SERVING_STATE_").lower()
                )
                last_answer[endpoint] = now
            except grpc.RpcError as exc:
                states[endpoint] = exc.code().name.lower()  # type: ignore[attr-defined]
        if all(s == "serving" for s in states.values()):
            return
        for endpoint, answered in last_answer.items():
            silent = now - answered
            if silent >= unreachable_timeout_s:
                raise ServiceNotReady(
                    f"{endpoint} has not answered for {silent:.0f} s; start `rolloutd serve` "
                    "there, or read its log for why it stopped"
                )
            if silent >= unreachable_timeout_s / 3 and endpoint not in hinted:
                hinted.add(endpoint)
                out(
                    f"{endpoint} has not answered for {silent:.0f} s: is `rolloutd serve` "
                    "running? If it exited, the last line of its log says why"
                )
        if now > deadline:
            raise ServiceNotReady(
                f"not ready after {timeout_s:.0f} s: "
                + ", ".join(f"{ep} {s}" for ep, s in states.items())
            )
        if now - last_report >= 5.0:
            last_report = now
            out("waiting for the service: " + ", ".join(f"{ep} {s}" for ep, s in states.items()))
        time.sleep(1.0)


def run(cfg: TrainerConfig, out: Callable[[str], object] = print) -> int:
    """Returns the number of steps taken. A request the service refuses (a missing token, a
    batch above its limits) or a service gone for longer than ``unreachable_timeout_s`` raises
    ``RequestFailed`` with one line that says what to do; a restart within it is waited out."""
    with RolloutClient(
        cfg.endpoints,
        outage_s=cfg.unreachable_timeout_s,
        token=cfg.token,
        tls_ca=cfg.tls_ca,
        tls_cert=cfg.tls_cert,
        tls_key=cfg.tls_key,
    ) as client:
        wait_until_ready(client, cfg.ready_timeout_s, out, cfg.unreachable_timeout_s)
        try:
            return _train(cfg, client, out)
        except grpc.RpcError as exc:
            raise _request_failed(cfg.endpoints, exc) from exc


def _train(cfg: TrainerConfig, client: RolloutClient, out: Callable[[str], object]) -> int:
    tracer = trace.get_tracer("rolloutd.trainer")
    step = groups_total = tokens_total = 0
    started = last_report = last_data = time.monotonic()
    while cfg.steps is None or step < cfg.steps:
        with tracer.start_as_current_span(STEP_SPAN) as span:
            batch = _step(cfg, client, step + 1, out)
            span.set_attribute(GROUPS_ATTR, len(batch))
            if batch:
                step += 1
                span.set_attribute(STEP_ATTR, step)
        now = time.monotonic()
        if not batch:
            if client.outage_s is not None:  # the service is restarting: waited for, not idle
                last_data = now
                continue
            if now - last_data > cfg.idle_exit_s:
                out(f"no groups for {cfg.idle_exit_s:.0f}s; stopping")
                break
            continue
        last_data = now
        groups_total += len(batch)
        tokens_total += sum(len(s.token_ids) for g in batch for s in g.samples)  # type: ignore[misc]
        if now - last_report >= cfg.report_every_s:
            last_report = now
            elapsed = now - started
            occupancy = ", ".join(
                f"{ep}: {s.buffer.committed} ready/{s.buffer.generating} generating"
                f" of {s.buffer.capacity}"
                for ep, s in client.status().items()
            )
            out(
                f"step {step:5d}  groups {groups_total:6d}  {groups_total / elapsed:7.1f} groups/s  "
                f"{tokens_total / elapsed:9.0f} tokens/s  buffer [{occupancy}]"
            )
    elapsed = time.monotonic() - started
    out(f"done: {step} steps, {groups_total} groups, {tokens_total} tokens in {elapsed:.1f}s")
    return step


def _step(
    cfg: TrainerConfig, client: RolloutClient, step: int, out: Callable[[str], object]
) -> list[pb.Group]:
    """One step: fetch up to ``groups_per_step`` groups, "train", ack them as ``step`` and
    checkpoint when due; the groups (none: nothing came within ``wait_ms``, no step taken)."""
    batch: list[pb.Group] = []
    leases: list[Lease] = []
    while len(batch) < cfg.groups_per_step:
        lease = client.fetch(
            cfg.groups_per_step - len(batch), cfg.wait_ms, consumer="rolloutd-trainer"
        )
        if lease is None:
            break
        leases.append(lease)
        batch.extend(lease.groups)
    if not batch:
        return batch
    if cfg.train_s:
        time.sleep(cfg.train_s)
    for lease in leases:
        client.ack(lease, step)
    if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
        for ep, r in client.checkpoint(trainer_step=step, tag=f"step-{step}").items():
            if r.outcome != pb.CHECKPOINT_OUTCOME_COMPLETED:  # its acks stay unfinalized
                reason = pb.CheckpointReason.Name(r.reason)
                out(f"checkpoint step {step} on {ep} not completed: {reason} {r.message}")
            elif r.message:  # e.g. a tag that an earlier run of the trainer used already
                out(f"checkpoint step {step} on {ep}: {r.message}")
    return batch
