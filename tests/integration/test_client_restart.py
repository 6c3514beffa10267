"""A trainer outlives a restart of the service it trains from: `rolloutd trainer` and the README's
loop, each run as written, while `rolloutd serve` is SIGKILLed and started again on the same
port and state after an outage longer than the client's old retries (about 6 s).

Both finish their steps; nothing acked is delivered again and no step is lost, since leases and
acks are durable and an ack is idempotent; each says once that it waits, and once that the
service answers again.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rolloutd.client import RolloutClient
from tests.integration.proc import ServeProcess
from tests.integration.test_readme_client import client_snippet
from tests.waiting import until

pytestmark = pytest.mark.process

OUTAGE_S = 10.0
"""How long the service stays down: longer than the client's retries before (0.2 s doubling, five
times: about 6 s), shorter than anything a trainer waits before it gives up."""
WAITING = "is unavailable"
BACK = "answers again after"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Service:
    """`rolloutd serve` (synthetic engine) on a fixed port and state directory, restartable."""

    def __init__(self, tmp_path: Path, prompts: int) -> None:
        self.port = free_port()
        self.tmp_path = tmp_path
        self.dataset = tmp_path / "prompts.jsonl"
        self.dataset.write_text(
            "".join(
                json.dumps({"id": f"q{i}", "prompt": f"what is {i}?"}) + "\n"
                for i in range(prompts)
            )
        )
        self.lives: list[ServeProcess] = []

    def start(self) -> ServeProcess:
        p = ServeProcess(
            [
                "--engine",
                "synthetic",
                "--grpc-port",
                str(self.port),
                "--http-port",
                "0",
                "--checkpoint-dir",
                str(self.tmp_path / "ckpt"),
                "--checkpoint-interval",
                "0.5",
                "--dataset",
                str(self.dataset),
                "--epochs",
                "1",
                "--group-size",
                "2",
            ],
            env={"ROLLOUTD_ENGINE__MAX_TOKENS": "16"},
            cwd=self.tmp_path,
            log_path=self.tmp_path / f"serve-{len(self.lives)}.log",
        )
        self.lives.append(p)
        p.wait_listening()
        return p

    def restart_later(self) -> threading.Thread:
        """SIGKILLs the running service, and starts it again after ``OUTAGE_S`` in a thread."""
        self.lives[-1].kill()
        killed = time.monotonic()

        def again() -> None:
            time.sleep(max(OUTAGE_S - (time.monotonic() - killed), 0))  # the outage itself
            self.start()

        thread = threading.Thread(target=again, daemon=True)
        thread.start()
        return thread

    def acked_groups(self) -> int:
        with RolloutClient(f"127.0.0.1:{self.port}", interceptors=[], retries=0) as client:
            return int(client.status_of(client.endpoints[0]).counters.acked_groups)

    def stop(self) -> None:
        for p in self.lives:
            if p.proc.poll() is None:
                p.terminate()


def test_the_example_trainer_rides_out_a_sigkill_and_restart_of_the_service(tmp_path):
    service = Service(tmp_path, prompts=64)
    service.start()
    steps, per_step = 12, 2
    trainer = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rolloutd.cli",
            "trainer",
            "--target",
            f"127.0.0.1:{service.port}",
            "--steps",
            str(steps),
            "--groups-per-step",
            str(per_step),
            "--train-s",
            "0.5",  # most of a step is between its fetch and its ack
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(trainer.stdout.readline, "")))
    reader.start()
    try:
        until("the trainer took a few steps", lambda: service.acked_groups() >= 3 * per_step, 120)
        restarted = service.restart_later()
        assert trainer.wait(timeout=240) == 0, "".join(lines)
        restarted.join(60)
        reader.join(30)
        out = "".join(lines)
        assert f"done: {steps} steps, {steps * per_step} groups" in out, out
        assert out.count(WAITING) == 1 and out.count(BACK) == 1, out
        assert service.acked_groups() == steps * per_step  # every step's groups, each once
    finally:
        trainer.kill()
        service.stop()


def test_the_readme_loop_rides_out_a_sigkill_and_restart_between_a_fetch_and_its_ack(
    tmp_path, monkeypatch, caplog
):
    """The snippet as written; the service is killed at the moment that broke it before: a lease
    fetched, its ack not sent yet. The kill is injected at that point (the ack of step 3); the ack
    itself is the client's own."""
    service = Service(tmp_path, prompts=64)
    service.start()
    ack = RolloutClient.ack
    restarts: list[threading.Thread] = []

    def ack_after_a_kill(self, lease, trainer_step):
        if trainer_step == 3 and not restarts:
            restarts.append(service.restart_later())
        return ack(self, lease, trainer_step)

    monkeypatch.setattr(RolloutClient, "ack", ack_after_a_kill)
    monkeypatch.setenv("ENDPOINTS", f"127.0.0.1:{service.port}")
    out = io.StringIO()
    namespace: dict[str, object] = {"__name__": "__main__"}
    try:
        with contextlib.redirect_stdout(out), caplog.at_level("WARNING", "rolloutd.client"):
            exec(compile(client_snippet(), "README.md", "exec"), namespace)
        restarts[0].join(60)
        printed = out.getvalue()
        assert namespace["step"] == 10
        assert [int(s) for s in re.findall(r"^step (\d+): \d+ groups$", printed, re.M)] == list(
            range(1, 11)
        )
        prompts = re.findall(r"^  prompt (\S+):", printed, re.M)
        assert len(prompts) == len(set(prompts)), "a group was trained on twice"
        assert service.acked_groups() == len(prompts)  # none lost, the killed step's included
        messages = [r.getMessage() for r in caplog.records]
        assert sum(WAITING in m for m in messages) == 1, messages
        assert sum(BACK in m for m in messages) == 1, messages
    finally:
        service.stop()
