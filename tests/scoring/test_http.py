"""The HTTP verifier against a real FastAPI app on uvicorn (127.0.0.1, port 0, in a thread):
a good answer, a slow server, one that fails twice then answers, one that refuses, one that
is down."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from rolloutd.scoring import ScoreFailure, ScoreStatus, ScoringInput, failure_kind
from rolloutd.scoring.http import HttpVerifier

SLOW_TIMEOUT_S = 0.3


class RewardServer:
    """A reward server whose routes misbehave on purpose; it counts the requests each prompt
    id made to each route."""

    def __init__(self) -> None:
        self.seen: Counter[tuple[str, str]] = Counter()
        self.bodies: list[dict[str, Any]] = []
        self.in_flight = self.most_in_flight = 0
        self.release = threading.Event()
        self.app = FastAPI()
        self.app.post("/score")(self.score)
        self.app.post("/slow")(self.slow)
        self.app.post("/flaky")(self.flaky)
        self.app.post("/refuse")(self.refuse)
        self.app.post("/garbage")(self.garbage)
        self.app.post("/busy")(self.busy)

    async def _body(self, request: Request) -> dict[str, Any]:
        body: dict[str, Any] = await request.json()
        self.seen[request.url.path, body["prompt_id"]] += 1
        self.bodies.append(body)
        return body

    async def score(self, request: Request) -> dict[str, Any]:
        body = await self._body(request)
        return {"reward": len(body["completion"]), "info": {"index": body["index"]}}

    async def slow(self, request: Request) -> dict[str, Any]:
        await self._body(request)
        await asyncio.to_thread(self.release.wait)  # until the test is over
        return {"reward": 1.0}

    async def flaky(self, request: Request) -> Response:
        body = await self._body(request)
        if self.seen["/flaky", body["prompt_id"]] <= 2:
            return PlainTextResponse("overloaded", status_code=500)
        return JSONResponse({"reward": 0.25})

    async def refuse(self, request: Request) -> Response:
        await self._body(request)
        return PlainTextResponse("no completion given", status_code=422)

    async def garbage(self, request: Request) -> Response:
        await self._body(request)
        return PlainTextResponse("reward: high")

    async def busy(self, request: Request) -> dict[str, Any]:
        await self._body(request)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        await asyncio.sleep(0.05)
        self.in_flight -= 1
        return {"reward": 1.0}


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[RewardServer, str]]:
    reward_server = RewardServer()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(reward_server.app, log_config=None, access_log=False, lifespan="off")
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    yield reward_server, f"http://127.0.0.1:{sock.getsockname()[1]}"
    reward_server.release.set()
    uv.should_exit = True
    thread.join(10)
    sock.close()


def sample(prompt_id: str, completion: str = "four", index: int = 0) -> ScoringInput:
    return ScoringInput(
        prompt_id,
        "q",
        ({"role": "user", "content": "q"},),
        {"answer": [1, {"a": None}]},
        completion,
        (1, 2),
        "length",
        index,
    )


def verifier(url: str, **kw: Any) -> HttpVerifier:
    settings: dict[str, Any] = {
        "timeout_s": 5.0,
        "concurrency": 4,
        "retries": 2,
        "backoff_s": 0.01,
    }
    return HttpVerifier(url, **(settings | kw))


async def test_each_sample_is_one_post_of_json_answered_with_a_reward(server):
    reward_server, base = server
    http = verifier(f"{base}/score")
    try:
        scores = await http.score([sample("ok", "four", 0), sample("ok", "sixteen", 1)])
    finally:
        await http.aclose()
    assert [(s.reward, json.loads(s.info)) for s in scores] == [
        (4.0, {"index": 0}),
        (7.0, {"index": 1}),
    ]
    [first] = [b for b in reward_server.bodies if b["prompt_id"] == "ok" and b["index"] == 0]
    assert first == {
        "prompt_id": "ok",
        "prompt": "q",
        "messages": [{"role": "user", "content": "q"}],
        "metadata": {"answer": [1, {"a": None}]},
        "completion": "four",
        "token_ids": [1, 2],
        "finish_reason": "length",
        "index": 0,
    }


async def test_a_slow_server_fails_the_score_after_every_retry_timed_out(server):
    reward_server, base = server
    http = verifier(f"{base}/slow", timeout_s=SLOW_TIMEOUT_S, retries=2)
    try:
        [score] = await http.score([sample("slow")])
    finally:
        await http.aclose()
    assert failure_kind(score) is ScoreFailure.TIMEOUT
    assert f"no answer within {SLOW_TIMEOUT_S:g} s (3 attempts)" in score.info
    assert reward_server.seen["/slow", "slow"] == 3


async def test_a_server_that_fails_twice_then_answers_gives_the_reward(server):
    reward_server, base = server
    http = verifier(f"{base}/flaky", retries=3)
    try:
        [score] = await http.score([sample("flaky")])
    finally:
        await http.aclose()
    assert (score.status, score.reward) == (ScoreStatus.OK, 0.25)
    assert reward_server.seen["/flaky", "flaky"] == 3


async def test_a_server_that_keeps_failing_fails_the_score_with_its_status(server):
    _, base = server
    http = verifier(f"{base}/flaky", retries=1)
    try:
        [score] = await http.score([sample("flaky-twice")])
    finally:
        await http.aclose()
    assert failure_kind(score) is ScoreFailure.HTTP_STATUS
    assert "HTTP 500 (2 attempts)" in score.info


async def test_a_refusal_is_not_retried(server):
    reward_server, base = server
    http = verifier(f"{base}/refuse", retries=3)
    try:
        [score] = await http.score([sample("refused")])
    finally:
        await http.aclose()
    assert failure_kind(score) is ScoreFailure.HTTP_STATUS
    assert "HTTP 422, not retried: no completion given" in score.info
    assert reward_server.seen["/refuse", "refused"] == 1


async def test_an_answer_without_a_reward_is_a_bad_result(server):
    _, base = server
    http = verifier(f"{base}/garbage")
    try:
        [score] = await http.score([sample("garbage")])
    finally:
        await http.aclose()
    assert failure_kind(score) is ScoreFailure.BAD_RESULT
    assert "answered 'reward: high'" in score.info


async def test_a_server_that_is_down_fails_the_score_after_the_retries():
    with socket.socket() as closed:  # bound, never listening: connections are refused
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}/score"
        http = verifier(url, retries=2)
        try:
            [score] = await http.score([sample("down")])
        finally:
            await http.aclose()
    assert failure_kind(score) is ScoreFailure.UNREACHABLE
    assert score.info.startswith(f"unreachable: {url}: ConnectError: ")
    assert score.info.endswith("(3 attempts)")


async def test_requests_in_flight_stay_within_the_concurrency_limit(server):
    reward_server, base = server
    http = verifier(f"{base}/busy", concurrency=2)
    try:
        scores = await http.score([sample("busy", index=i) for i in range(6)])
    finally:
        await http.aclose()
    assert [s.reward for s in scores] == [1.0] * 6
    assert reward_server.seen["/busy", "busy"] == 6
    assert reward_server.most_in_flight <= 2
