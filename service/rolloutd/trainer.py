"""An example trainer loop: fetch groups, "train", ack with the step number, report progress.

It shows the delivery contract from the trainer's side: ack after the step consumed the groups,
``Checkpoint(trainer_step)`` whenever the trainer saves its own checkpoint.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

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
    token: str | None = None


def run(cfg: TrainerConfig, out=print) -> int:  # type: ignore[no-untyped-def]
    """Returns the number of steps taken."""
    step = groups_total = tokens_total = 0
    started = last_report = last_data = time.monotonic()
    with RolloutClient(cfg.endpoints, token=cfg.token) as client:
        while cfg.steps is None or step < cfg.steps:
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
            now = time.monotonic()
            if not batch:
                if now - last_data > cfg.idle_exit_s:
                    out(f"no groups for {cfg.idle_exit_s:.0f}s; stopping")
                    break
                continue
            last_data = now
            if cfg.train_s:
                time.sleep(cfg.train_s)
            step += 1
            for lease in leases:
                client.ack(lease, step)
            groups_total += len(batch)
            tokens_total += sum(len(s.token_ids) for g in batch for s in g.samples)  # type: ignore[misc]
            if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                client.checkpoint(trainer_step=step, tag=f"step-{step}")
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
