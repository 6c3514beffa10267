"""Environments over HTTP, the client (rolloutd.episodes.http) against the server
(rolloutd.episodes.server): ``serve()`` apps on uvicorn in a thread (127.0.0.1, port 0), mounted
under prefixes, and the server's command line in a subprocess that is SIGKILLed mid-episode."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI

from rolloutd.episodes import EnvironmentFailure, EpisodeEnd, EpisodeStart, StepResult
from rolloutd.episodes.http import HttpEnvironment
from rolloutd.episodes.loader import load_environment
from rolloutd.episodes.server import main, serve
from tests.episodes.environments import Counting, Echo, Hangs, Returns

REPO = Path(__file__).resolve().parents[2]
START = EpisodeStart(
    episode_id="g1-s0",
    group_id=1,
    sibling=0,
    prompt_id="p1",
    messages=({"role": "user", "content": "hi"},),
    metadata={"answer": 12345678901234567890, "nested": [1.5, None, "x"]},
    tools=({"type": "function", "function": {"name": "echo", "parameters": {}}},),
)


class Environments:
    """The environments the server serves, one per prefix."""

    def __init__(self) -> None:
        self.echo = Echo(turns=2, greeting="ready")
        self.flaky = Echo(turns=1, fail_first=2)
        self.broken = Echo(turns=1, fail_first=100)
        self.counting = Counting()
        self.hangs = Hangs()
        self.malformed = Returns(result={"done": "yes"})
        self.starts: list[dict[str, Any]] = []


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Environments, str]]:
    envs = Environments()
    app = FastAPI()
    for prefix in ("echo", "flaky", "broken", "counting", "hangs", "malformed"):
        app.mount(f"/{prefix}", serve(getattr(envs, prefix), name=prefix))

    @app.get("/plain/info")
    def plain() -> dict[str, str]:
        return {"hello": "world"}

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    yield envs, f"http://127.0.0.1:{sock.getsockname()[1]}"
    Hangs.release.set()
    server.should_exit = True
    thread.join(10)
    sock.close()
    Hangs.release.clear()


def connect(url: str, **kw: Any) -> HttpEnvironment:
    settings: dict[str, Any] = {"step_timeout_s": 5.0, "retries": 2, **kw}
    port = load_environment(url, {}, **settings)
    assert isinstance(port, HttpEnvironment)
    port._backoff_s = 0.01
    return port


async def test_an_episode_over_http_carries_everything_exactly(served):
    envs, base = served
    port = connect(f"{base}/echo/")
    assert not port.has_state
    assert await port.reset(START) == ({"role": "system", "content": "ready"},)
    assert envs.echo.started == [START]  # metadata's big integer and the tools included
    first = await port.step("g1-s0", 0, "héllo <calc>1+1</calc>")
    assert first == StepResult(
        messages=({"role": "tool", "content": "HÉLLO <CALC>1+1</CALC>", "name": "echo"},)
    )
    last = await port.step("g1-s0", 1, "4", replay=True)
    assert (last.done, last.reward) == (True, 2.0)
    assert envs.echo.steps[-2:] == [
        ("g1-s0", 0, "héllo <calc>1+1</calc>", False),
        ("g1-s0", 1, "4", True),
    ]
    await port.close()


async def test_state_and_restore_over_http_keep_every_byte_and_the_start(served):
    envs, base = served
    port = connect(f"{base}/counting")
    assert port.has_state
    assert await port.reset(START) == ({"role": "user", "content": "tools: 1"},)
    await port.step("g1-s0", 0, "abcd")
    state = await port.state("g1-s0")
    assert state == (4).to_bytes(4, "big") + b"\xff\x00"
    await port.restore(START, state)
    assert envs.counting.restored[-1] == ("g1-s0", state)
    await port.close()


async def test_a_5xx_is_retried_with_the_same_key_and_completion(served):
    envs, base = served
    port = connect(f"{base}/flaky", retries=2)
    result = await port.step("g2-s1", 0, "same words")
    assert result.done
    assert [s for s in envs.flaky.steps if s[0] == "g2-s1"] == [
        ("g2-s1", 0, "same words", False)
    ] * 3
    await port.close()


async def test_a_step_that_keeps_failing_ends_after_its_retries(served):
    envs, base = served
    port = connect(f"{base}/broken", retries=1)
    with pytest.raises(EnvironmentFailure) as failure:
        await port.step("g3-s0", 0, "x")
    assert failure.value.end is EpisodeEnd.STEP_FAILED
    assert "HTTP 500" in failure.value.detail
    assert "raised ConnectionError: sandbox busy (2)" in failure.value.detail
    assert "(2 attempts)" in failure.value.detail
    assert envs.broken.attempts["g3-s0", 0] == 2
    await port.close()


async def test_a_malformed_answer_is_malformed_at_the_client(served):
    _, base = served
    port = connect(f"{base}/malformed", retries=0)
    with pytest.raises(EnvironmentFailure) as failure:
        await port.step("g1-s0", 0, "x")
    assert failure.value.end is EpisodeEnd.MALFORMED
    assert "'done' must be true or false" in failure.value.detail
    await port.close()


async def test_a_4xx_is_not_retried(served):
    envs, base = served
    port = connect(f"{base}/echo", retries=3)
    before = len(envs.echo.steps)
    with pytest.raises(EnvironmentFailure) as failure:
        await port.step("g1-s0", -1, "x")  # the server refuses a negative turn
    assert failure.value.end is EpisodeEnd.STEP_FAILED
    assert "HTTP 422, not retried" in failure.value.detail
    assert len(envs.echo.steps) == before
    with pytest.raises(EnvironmentFailure, match="HTTP 404, not retried"):
        await port.state("g1-s0")  # echo has no state
    await port.close()


async def test_a_step_past_its_timeout_is_not_retried(served):
    envs, base = served
    port = connect(f"{base}/hangs", step_timeout_s=0.3, retries=3)
    with pytest.raises(EnvironmentFailure) as failure:
        await port.step("g4-s0", 0, "x")
    assert failure.value.end is EpisodeEnd.STEP_TIMEOUT
    assert "no answer within 0.3 s" in failure.value.detail
    assert envs.hangs.calls == 1
    await port.close()


def test_an_address_that_is_no_environment_is_a_start_up_error(served):
    _, base = served
    with pytest.raises(
        ValueError, match=r"^episodes\.environment: .*/plain/info answered HTTP 200"
    ):
        load_environment(f"{base}/plain", {}, step_timeout_s=1.0, retries=0)
    with pytest.raises(ValueError, match=r"/nothing/info answered HTTP 404"):
        load_environment(f"{base}/nothing", {}, step_timeout_s=1.0, retries=0)
    with pytest.raises(ValueError, match=r"environment_config: an environment served over HTTP"):
        load_environment(f"{base}/echo", {"turns": 2}, step_timeout_s=1.0, retries=0)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # a port nobody listens on
    closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with pytest.raises(ValueError, match=r"^episodes\.environment: cannot reach .*ConnectError"):
        load_environment(closed, {}, step_timeout_s=1.0, retries=1)
    sock.close()


class ServedProcess:
    """``python -m rolloutd.episodes.server`` in a subprocess, its address read from its first
    line."""

    def __init__(self, spec: str, *args: str) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "service"), str(REPO)])}
        command = [sys.executable, "-m", "rolloutd.episodes.server", spec, "--port", "0", *args]
        self.proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        assert self.proc.stdout is not None
        self.first_line = self.proc.stdout.readline()  # "" once it exits

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


async def test_a_server_that_goes_away_ends_the_episode_as_unreachable():
    served = ServedProcess("tests.episodes.environments:Echo", "--config", '{"turns": 5}')
    try:
        assert served.first_line.startswith("serving tests.episodes.environments:Echo on http://")
        port = connect(served.first_line.split()[-1], retries=2)
        await port.reset(START)
        assert await port.step("g1-s0", 0, "one") == StepResult(
            messages=({"role": "tool", "content": "ONE", "name": "echo"},)
        )
        served.kill()
        with pytest.raises(EnvironmentFailure) as failure:
            await port.step("g1-s0", 1, "two")
        assert failure.value.end is EpisodeEnd.STEP_FAILED
        assert "unreachable (ConnectError" in failure.value.detail
        assert "(3 attempts)" in failure.value.detail
        await port.close()
    finally:
        served.kill()


def test_the_command_line_refuses_a_bad_environment_or_config(capsys):
    for spec, config, message in [
        ("NeedsLimit", "{}", "environment_config: tests.episodes.environments:NeedsLimit refused"),
        ("Echo", "{turns: 2}", "Expecting property name enclosed in double quotes"),
        ("Nothing", "{}", "environment: 'tests.episodes.environments' has no attribute"),
    ]:
        with pytest.raises(SystemExit) as exit:
            main([f"tests.episodes.environments:{spec}", "--config", config])
        assert exit.value.code == 2
        assert message in capsys.readouterr().err
