"""The dashboard's routes on a real service: the page, its assets, the history and its filter."""

from __future__ import annotations

import re

import httpx

from rolloutd.api.dashboard import ASSETS
from tests.waiting import eventually


async def test_the_page_loads_only_relative_packaged_assets(serve):
    service, _ = await serve(**{"http.dashboard_interval_s": 0.05})
    base = f"http://{service.addresses.http}"
    async with httpx.AsyncClient(base_url=base) as http:
        page = await http.get("/")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        urls = re.findall(r'(?:src|href)="([^"]+)"', page.text)
        assert not [u for u in urls if u.startswith(("/", "http:", "https:", "//"))], urls
        for name, media_type in ASSETS.items():
            asset = await http.get(f"/dashboard/{name}")
            assert asset.status_code == 200 and asset.headers["content-type"].startswith(media_type)
            assert "http://" not in asset.text and "https://" not in asset.text
        assert (await http.get("/dashboard/../config.py")).status_code == 404
        assert (await http.get("/dashboard/missing.js")).status_code == 404
        for link in ("metrics", "openapi.json", "v1/checkpoints"):
            assert f'href="{link}"' in page.text
            assert (await http.get(f"/{link}")).status_code == 200


async def test_the_history_answers_all_points_then_only_newer_ones(serve):
    service, _ = await serve(**{"http.dashboard_interval_s": 0.05})
    base = f"http://{service.addresses.http}"
    async with httpx.AsyncClient(base_url=base) as http:

        async def history() -> dict | None:
            answer = (await http.get("/v1/dashboard/history")).json()
            return answer if len(answer["points"]) >= 2 else None

        first = await eventually("two sampled points in the history", history)
        assert first["interval_s"] == 0.05 and first["run"] == service.history.run
        assert "committed_tokens" in first["counters"]
        last = first["points"][-1]["t"]
        newer = (await http.get("/v1/dashboard/history", params={"since": last})).json()
        assert all(p["t"] > last for p in newer["points"])
        bad = await http.get("/v1/dashboard/history", params={"since": "yesterday"})
        assert bad.status_code == 422 and "since" in bad.text


async def test_the_history_says_whether_a_verifier_scores_the_groups(serve, tmp_path):
    """The rewards area says "no verifier" rather than plotting zeros."""
    unscored, _ = await serve()
    scored, _ = await serve(
        **{
            "checkpoint.dir": str(tmp_path / "scored"),
            "scoring.verifier": "builtin:exact",
            "scoring.workers": 1,
        }
    )
    for service, expected in ((unscored, False), (scored, True)):
        async with httpx.AsyncClient(base_url=f"http://{service.addresses.http}") as http:
            history = (await http.get("/v1/dashboard/history")).json()
        assert history["scoring"] is expected
