"""One epoch served by a rolloutd that keeps getting killed: start it, train against it, kill it
(at a random instant or at a fault point), restart it with ``--restore latest``, and at the end
check that every prompt was acknowledged exactly once."""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from tests.integration.proc import ServeProcess
from tests.integration.trainer_harness import Trainer

PROMPTS = 36


@dataclass
class Scenario:
    workdir: Path
    checkpoint_dir: str
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment of every service life (e.g. storage options)."""

    @property
    def dataset(self) -> Path:
        path = self.workdir / "prompts.jsonl"
        if not path.exists():
            path.write_text(
                "".join(
                    json.dumps({"id": f"q{i}", "prompt": f"what is {i} + {i}?"}) + "\n"
                    for i in range(PROMPTS)
                )
            )
        return path

    @property
    def log(self) -> str:
        return (self.workdir / "serve.log").read_text()

    def serve(self, fault: str | None = None) -> ServeProcess:
        env = {
            "ROLLOUTD_ENGINE__SYNTHETIC__TOKENS_PER_S": "150",
            "ROLLOUTD_ENGINE__MAX_TOKENS": "48",
            "ROLLOUTD_LIMITS__MAX_IN_FLIGHT": "2",
            "ROLLOUTD_LIMITS__BUFFER_CAPACITY": "8",
            "ROLLOUTD_LIMITS__REWIND_WINDOW": "2",
            "ROLLOUTD_CHECKPOINT__KEEP_LATEST": "2",
            "ROLLOUTD_CHECKPOINT__COMPACT_SEGMENTS": "3",
            # a lease is durable: one granted as the process died, its response lost, holds
            # its groups until it expires
            "ROLLOUTD_LIMITS__LEASE_TIMEOUT_S": "10",
            **self.env,
        }
        if fault:
            env["ROLLOUTD_FAULT"] = fault
        return ServeProcess.synthetic(
            self.checkpoint_dir,
            "--dataset",
            str(self.dataset),
            "--epochs",
            "1",
            "--group-size",
            "2",
            "--checkpoint-interval",
            "0.15",
            "--restore",
            "latest",
            env=env,
            cwd=self.workdir,
            log_path=self.workdir / "serve.log",
        )

    def crash_round(
        self,
        trainer: Trainer,
        rng: random.Random,
        fault: str | None = None,
        *,
        snapshots: Callable[[], int] | None = None,
    ) -> int | None:
        """Trains against one service life; returns its exit status if it died by itself (a fault
        point fired) rather than by the random SIGKILL timer or the end of the round.

        With ``snapshots`` (the store's newest published sequence), the random SIGKILL
        timer starts only once this life has published one: on loaded cores a first snapshot
        can take longer than the timer's window, and the life would then leave nothing new to
        restore."""
        before = snapshots() if snapshots is not None else 0
        p = self.serve(fault)
        try:  # a failed round leaves no service behind
            address = p.wait_listening()
            if fault is None:
                if snapshots is not None:
                    deadline = time.monotonic() + 120.0
                    while snapshots() <= before:
                        assert p.proc.poll() is None, f"the service exited: {p.output}"
                        assert time.monotonic() < deadline, "no snapshot published in 120 s"
                        time.sleep(0.05)
                threading.Timer(rng.uniform(0.2, 1.2), p.kill).start()
            deadline = time.monotonic() + 8.0
            while p.proc.poll() is None and time.monotonic() < deadline:
                try:
                    trainer.run(address, deadline - time.monotonic())
                except grpc.RpcError as exc:
                    if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):  # type: ignore[attr-defined]
                        raise
                    time.sleep(0.05)
            return p.proc.poll()
        finally:
            p.kill()

    def finish(self, trainer: Trainer) -> None:
        """A last, undisturbed life to the end of the epoch; then the contract is checked."""
        p = self.serve()
        address = p.wait_listening()
        try:
            deadline = time.monotonic() + 120
            while len(trainer.acked) < PROMPTS and time.monotonic() < deadline:
                trainer.run(address, 2.0)
            status = trainer.status(address)
        finally:
            p.terminate()
        assert status.dataset_exhausted
        twice = {k: n for k, n in trainer.acked.items() if n != 1}
        assert not twice, f"acknowledged more than once: {twice}"
        assert len(trainer.acked) == PROMPTS, (
            f"never acknowledged: {PROMPTS - len(trainer.acked)} prompts"
        )
