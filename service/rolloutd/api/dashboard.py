"""The built-in dashboard: the admin port's front page, its assets, and the history it draws.

The page (``static/dashboard.html`` with hand-written JavaScript and CSS, shipped in the package)
loads nothing from the network and uses relative URLs only, so it works behind
``kubectl port-forward`` or a path-prefix proxy. It asks ``v1/dashboard/history`` for every
point once, then only for the points newer than the last one it has.
"""

from __future__ import annotations

from importlib import resources
from typing import Annotated, Protocol

from fastapi import APIRouter, HTTPException, Query, Response, status
from fastapi.responses import HTMLResponse
from pydantic import BaseModel, Field

from rolloutd.telemetry.history import COUNTER_KEYS, Point

_STATIC = resources.files("rolloutd.api") / "static"
ASSETS = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
"""The assets the page loads, with their content types; nothing else is served from disk."""


class HistorySource(Protocol):
    run: str
    capacity: int

    def points(self, since: float | None = None) -> list[Point]: ...


class HistoryPoint(BaseModel):
    t: float = Field(description="Wall-clock Unix seconds.")
    run: str = Field(description="The process that took the point; changes at a restart.")
    v: dict[str, float] = Field(
        description="Series key -> value; counters are totals since the history began."
    )


class History(BaseModel):
    run: str = Field(description="The process serving this answer.")
    interval_s: float = Field(description="Seconds between points.")
    capacity: int = Field(description="Most points kept.")
    counters: list[str] = Field(
        description="Key prefixes of counters: a counter left out of a point is zero; a gauge "
        "left out has no value."
    )
    points: list[HistoryPoint]
    scoring: bool = Field(
        False,
        description="Whether a verifier scores the groups (scoring.verifier or "
        "scoring.group_verifier); without one the rewards area has nothing to draw.",
    )


def dashboard_router(
    history: HistorySource, interval_s: float, *, scoring: bool = False
) -> APIRouter:
    """``scoring``: a verifier is configured (the rewards area says so when none is)."""
    router = APIRouter()
    page = (_STATIC / "dashboard.html").read_text()

    @router.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def front_page() -> HTMLResponse:
        return HTMLResponse(page, headers={"Cache-Control": "no-cache"})

    @router.get("/dashboard/{name}", include_in_schema=False)
    async def asset(name: str) -> Response:
        media_type = ASSETS.get(name)
        if media_type is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"no dashboard asset {name!r}")
        return Response(
            (_STATIC / name).read_bytes(),
            media_type=media_type,
            headers={"Cache-Control": "no-cache"},
        )

    @router.get("/v1/dashboard/history")
    def get_history(
        since: Annotated[
            float | None, Query(ge=0, description="Only points newer than this Unix time.")
        ] = None,
    ) -> History:
        """The dashboard's points, oldest first (run off the event loop: up to
        ``http.dashboard_points`` of them)."""
        return History(
            run=history.run,
            interval_s=interval_s,
            capacity=history.capacity,
            counters=sorted(COUNTER_KEYS),
            scoring=scoring,
            points=[
                HistoryPoint(t=p.t, run=p.run, v=dict(p.values)) for p in history.points(since)
            ],
        )

    return router
