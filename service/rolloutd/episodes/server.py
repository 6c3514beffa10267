"""Environments over HTTP, the server: :func:`serve` makes a FastAPI app of any
:class:`Environment` object, answering in the wire format that :mod:`rolloutd.episodes.http`
(the client the runner calls) describes; :func:`main` runs one on uvicorn::

    python -m rolloutd.episodes.server package.module:Class --port 8000 [--config '{"k": 1}']
"""

from __future__ import annotations

import argparse
import base64
import binascii
import json
import socket
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from rolloutd.domain.episode import EnvironmentFailure, EpisodeStart
from rolloutd.episodes.loader import LocalEnvironment, build


class StartBody(BaseModel):
    episode_id: str
    group_id: int
    sibling: int
    prompt_id: str
    messages: list[dict[str, Any]]
    metadata: Any = None
    tools: list[dict[str, Any]] = Field(default_factory=list)

    def start(self) -> EpisodeStart:
        return EpisodeStart(
            episode_id=self.episode_id,
            group_id=self.group_id,
            sibling=self.sibling,
            prompt_id=self.prompt_id,
            messages=tuple(self.messages),
            metadata=self.metadata,
            tools=tuple(self.tools),
        )


class StepBody(BaseModel):
    episode_id: str
    turn: int = Field(ge=0)
    completion: str
    replay: bool = False


class StateBody(BaseModel):
    episode_id: str


class RestoreBody(BaseModel):
    start: StartBody
    state: str
    """base64"""


def serve(environment: Any, *, name: str = "") -> FastAPI:
    """A FastAPI app that serves ``environment`` (an :class:`Environment` object) with the wire
    format of :mod:`rolloutd.episodes.http`; run it with uvicorn. Sync methods run in worker
    threads; calls are not bounded in time here (the caller's timeout is)."""
    adapter = LocalEnvironment(environment, timeout_s=None, name=name)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await adapter.close()

    app = FastAPI(title=f"environment {adapter.name}", lifespan=lifespan)

    @app.exception_handler(EnvironmentFailure)
    async def failed(_: Request, exc: EnvironmentFailure) -> JSONResponse:
        return JSONResponse({"error": exc.end.value, "detail": exc.detail}, status_code=500)

    @app.get("/info")
    async def info() -> dict[str, Any]:
        return {"has_state": adapter.has_state, "environment": adapter.name}

    @app.post("/reset")
    async def reset(body: StartBody) -> dict[str, Any]:
        return {"messages": list(await adapter.reset(body.start()))}

    @app.post("/step")
    async def step(body: StepBody) -> dict[str, Any]:
        result = await adapter.step(body.episode_id, body.turn, body.completion, replay=body.replay)
        return {"messages": list(result.messages), "done": result.done, "reward": result.reward}

    @app.post("/state")
    async def state(body: StateBody) -> dict[str, Any]:
        _need_state(adapter)
        return {"state": base64.b64encode(await adapter.state(body.episode_id)).decode()}

    @app.post("/restore")
    async def restore(body: RestoreBody) -> dict[str, Any]:
        _need_state(adapter)
        try:
            state = base64.b64decode(body.state, validate=True)
        except binascii.Error as exc:
            raise HTTPException(422, f"state is not base64: {exc}") from None
        await adapter.restore(body.start.start(), state)
        return {}

    return app


def _need_state(adapter: LocalEnvironment) -> None:
    if not adapter.has_state:
        raise HTTPException(404, f"{adapter.name} has no state() and restore()")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m rolloutd.episodes.server",
        description="Serve an environment class over HTTP for episodes.environment: http://...",
    )
    parser.add_argument("environment", help='the class, as "package.module:Class"')
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0: any free port")
    parser.add_argument(
        "--config", default="{}", help="keyword arguments of the class, as a JSON object"
    )
    args = parser.parse_args(argv)
    try:
        config = json.loads(args.config)
        environment = build(args.environment, config, key="environment")
    except ValueError as exc:  # JSONDecodeError included
        parser.error(str(exc))
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    sock.listen(128)  # connections wait in the backlog until uvicorn accepts them
    port = sock.getsockname()[1]
    app = serve(environment, name=args.environment)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    print(f"serving {args.environment} on http://{args.host}:{port}", flush=True)
    server.run(sockets=[sock])


if __name__ == "__main__":
    main()
