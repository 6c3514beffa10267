"""The built-in dashboard in a real headless Chromium, against the real synthetic service CLI: on
a fresh start the areas with nothing to show say so, and after checkpoints, a SIGKILL and a
restore every area draws, the trainer's first.

Needs Debian's ``chromium`` (``.ci/run`` installs it where apt can) and the ``playwright`` Python
package (the dev extra); without either the test skips and says which is missing. It saves a
screenshot in its temporary directory; with ``UPDATE_SCREENSHOTS=1`` in the environment it
replaces the one the README shows (``docs/images/dashboard.png``) instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.proc import ServeProcess

pytestmark = pytest.mark.process

REPO = Path(__file__).resolve().parents[2]
README_SCREENSHOT = REPO / "docs" / "images" / "dashboard.png"
AREAS = (
    "trainer",
    "generation",
    "usable-output",
    "efficiency",
    "engine",
    "checkpoint-latency",
    "backpressure",
    "reliability",
    "restore",
    "recovery",
    "snapshot-size",
    "admission",
)
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def chromium() -> str:
    path = os.environ.get("ROLLOUTD_CHROMIUM") or shutil.which("chromium")
    if path is None:
        pytest.skip("Debian's chromium is not installed (apt-get install chromium; .ci/run does)")
    pytest.importorskip("playwright.sync_api", reason="playwright is not installed (dev extra)")
    return path


def get_json(http: str, path: str) -> Any:
    with urllib.request.urlopen(f"http://{http}/{path}", timeout=10) as r:
        return json.load(r)


def wait_for(what: str, check: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.5)


@contextlib.contextmanager
def trainer(grpc_address: str) -> Iterator[None]:
    """The example trainer, so that groups keep being committed, leased and acked."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rolloutd.cli",
            "trainer",
            "--target",
            grpc_address,
            "--groups-per-step",
            "4",
            "--train-s",
            "0.2",
            "--idle-exit-s",
            "600",
            "--checkpoint-every",
            "10",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        yield
    finally:
        proc.kill()
        proc.wait(30)


def serve(ckpt: Path, tmp_path: Path, *args: str) -> ServeProcess:
    p = ServeProcess.synthetic(
        ckpt,
        "--checkpoint-interval",
        "1",
        *args,
        env={
            "OTEL_SDK_DISABLED": "false",  # the dashboard draws the service's own metrics
            "ROLLOUTD_HTTP__DASHBOARD_INTERVAL_S": "1",
            # About 2 s a sibling: slower than the trainer consumes, so the buffer never fills,
            # admission never stops, and every snapshot holds groups still generating; nor
            # does staleness gating stop it once the trainer is gone before the SIGKILL.
            "ROLLOUTD_ENGINE__SYNTHETIC__TOKENS_PER_S": "30",
            "ROLLOUTD_LIMITS__STALENESS_GATING": "false",
        },
        cwd=tmp_path,
        log_path=tmp_path / "serve.log",
    )
    p.wait_listening()
    assert p.http is not None
    return p


def latest(http: str) -> dict[str, float]:
    points = get_json(http, "v1/dashboard/history")["points"]
    return points[-1]["v"] if points else {}


def open_dashboard(pw: Any, executable: str, http: str, errors: list[str]) -> Any:
    browser = pw.chromium.launch(executable_path=executable, args=CHROMIUM_FLAGS)
    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"http://{http}/")
    page.wait_for_function("window.rolloutdDashboard && window.rolloutdDashboard.draws > 0")
    return browser, page


def test_the_dashboard_shows_its_areas_across_a_restore(tmp_path):
    executable = chromium()
    from playwright.sync_api import sync_playwright

    ckpt = tmp_path / "ckpt"
    first = serve(ckpt, tmp_path)
    console_errors: list[str] = []
    try:
        assert first.http is not None and first.grpc is not None
        wait_for(
            "two points", lambda: len(get_json(first.http, "v1/dashboard/history")["points"]) >= 2
        )
        with sync_playwright() as pw:  # a fresh start, no trainer yet
            browser, page = open_dashboard(pw, executable, first.http, console_errors)
            fresh = page.evaluate("window.rolloutdDashboard")["areas"]
            for area in ("trainer", "restore", "recovery"):
                assert fresh[area]["empty"], (area, fresh[area])
                assert page.locator(f"#area-{area} .empty").is_visible(), area
                assert not page.locator(f"#area-{area} canvas").first.is_visible(), area
            assert "started fresh" in page.locator("#area-restore .empty").inner_text()
            assert "episode turns reused vs rerun" in fresh["recovery"]["charts"]
            assert not fresh["generation"]["empty"]
            browser.close()
        with trainer(first.grpc):
            wait_for(
                "two snapshots and a checkpoint on the dashboard",
                lambda: (
                    len(get_json(first.http, "v1/checkpoints")) >= 2
                    and latest(first.http).get("checkpoint_seconds_count/total", 0) >= 2
                ),
            )
    finally:
        first.kill()  # SIGKILL: groups in flight are unfinished in the last snapshot

    second = serve(ckpt, tmp_path, "--restore", "latest")
    try:
        assert second.http is not None and second.grpc is not None
        http = second.http
        with trainer(second.grpc):
            history = get_json(http, "v1/dashboard/history")
            runs = {p["run"] for p in history["points"]}
            assert len(runs) == 2, "the points of the killed run were not kept"
            wait_for(
                "the restore and new checkpoints on the dashboard",
                lambda: (
                    latest(http).get("restore_seconds_count/total", 0) >= 1
                    and latest(http).get("attempts/completed/completed", 0)
                    > history["points"][-1]["v"].get("attempts/completed/completed", 0)
                ),
            )
            assert latest(http).get("recovery_groups/unfinished", 0) > 0

            with sync_playwright() as pw:
                browser, page = open_dashboard(pw, executable, http, console_errors)
                # Backpressure draws only when a mutation waited for a checkpoint's hold, which
                # a run this light may never see; it then says so instead. The page redraws
                # every interval: wait until every other area has points to draw.
                page.wait_for_function(
                    """areas => areas.every(a => a === "backpressure"
                        || window.rolloutdDashboard.areas[a].plotted > 0)""",
                    arg=list(AREAS),
                    timeout=60_000,
                )
                state = page.evaluate("window.rolloutdDashboard")
                empty = [a for a in AREAS if state["areas"][a]["plotted"] == 0]
                assert set(empty) <= {"backpressure"}, f"areas without data: {state['areas']}"
                for area in AREAS:
                    drawn = int(page.get_attribute(f"#area-{area}", "data-points") or 0) > 0
                    said = page.locator(f"#area-{area} .empty").is_visible()
                    assert drawn != said, (area, drawn, said)
                ids = page.eval_on_selector_all("#areas > section", "s => s.map(e => e.id)")
                assert ids[0] == "area-trainer", ids
                assert "live rows" in page.locator(".checkpoints").inner_text()
                assert state["restarts"] >= 1, "no restart marker between the two runs"
                # no verifier: the rewards area says so instead of plotting zeros
                assert state["areas"]["rewards"]["none"] is True
                assert page.locator("#area-rewards .none").is_visible()
                assert not page.locator("#area-rewards .charts").is_visible()
                canvas = "#area-generation canvas"
                # the chart and the time of the draw that made it, read in one go: a redraw
                # between two reads would leave nothing new to wait for
                drawn_at, before = page.eval_on_selector(
                    canvas, "c => [window.rolloutdDashboard.lastT, c.toDataURL()]"
                )
                page.wait_for_function(
                    f"window.rolloutdDashboard.lastT > {drawn_at}", timeout=20_000
                )
                after = page.eval_on_selector(canvas, "c => c.toDataURL()")
                assert after != before, "the generation chart did not change with new points"
                assert page.locator("#checkpoints tr").count() >= 1
                for link in ("metrics", "openapi.json", "v1/checkpoints"):
                    assert page.locator(f'a[href="{link}"]').count() >= 1
                page.reload()
                page.wait_for_function(
                    "window.rolloutdDashboard && window.rolloutdDashboard.draws > 0"
                )
                reloaded = page.evaluate("window.rolloutdDashboard")
                assert reloaded["points"] >= state["points"], "history lost on a reload"
                shot = (
                    README_SCREENSHOT
                    if os.environ.get("UPDATE_SCREENSHOTS") == "1"
                    else tmp_path / "dashboard.png"
                )
                page.screenshot(path=str(shot), full_page=True)
                assert shot.stat().st_size > 10_000
                browser.close()
            assert not console_errors, console_errors
    finally:
        second.terminate()


def test_the_rewards_area_plots_mean_reward_and_dropped_share(tmp_path):
    """A verifier that passes about half the samples, and the zero-variance filter on: the area
    draws the mean reward and the share of finished groups dropped."""
    executable = chromium()
    from playwright.sync_api import sync_playwright

    p = ServeProcess.synthetic(
        tmp_path / "ckpt",
        "--group-size",
        "4",
        "--checkpoint-interval",
        "0",
        env={
            "OTEL_SDK_DISABLED": "false",
            "ROLLOUTD_HTTP__DASHBOARD_INTERVAL_S": "1",
            "ROLLOUTD_ENGINE__SYNTHETIC__TOKENS_PER_S": "200",
            "ROLLOUTD_SCORING__VERIFIER": "tests.scoring.verifiers:first_token_even",
            "ROLLOUTD_SCORING__WORKERS": "1",
            "ROLLOUTD_FILTER__ZERO_VARIANCE": "true",
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        },
        cwd=tmp_path,
        log_path=tmp_path / "serve.log",
    )
    try:
        assert p.wait_listening() and p.http is not None and p.grpc is not None
        http = p.http
        assert get_json(http, "v1/dashboard/history")["scoring"] is True
        with trainer(p.grpc):
            wait_for(
                "rewards, drops and commits over several points",
                lambda: (
                    latest(http).get("reward_count", 0) > 0
                    and latest(http).get("dropped_groups/zero_variance", 0) > 0
                    and len(get_json(http, "v1/dashboard/history")["points"]) >= 6
                ),
            )
            console_errors: list[str] = []
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=executable, args=CHROMIUM_FLAGS)
                page = browser.new_page(viewport={"width": 1280, "height": 1000})
                page.on("pageerror", lambda e: console_errors.append(str(e)))
                page.goto(f"http://{http}/")
                page.wait_for_function(
                    "window.rolloutdDashboard && window.rolloutdDashboard.draws > 0"
                )
                rewards = page.evaluate("window.rolloutdDashboard.areas.rewards")
                assert (
                    rewards["none"] is False
                    and not page.locator("#area-rewards .none").is_visible()
                )
                charts = rewards["charts"]
                assert charts["mean reward"] > 0, charts
                assert charts["dropped share of finished groups (%)"] > 0, charts
                legend = (
                    page.locator("#area-rewards .chart").first.locator(".legend b").inner_text()
                )
                assert 0.0 <= float(legend) <= 1.0, legend  # about one half
                page.locator("#area-rewards").screenshot(path=str(tmp_path / "rewards.png"))
                browser.close()
            assert not console_errors, console_errors
    finally:
        p.terminate()
