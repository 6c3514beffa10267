"""The admin HTTP app against a hand-written AdminState: in process over the ASGI transport, and on
real uvicorn on port 0."""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import ssl
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from rolloutd.api.admin import AdminServer, AdminTls, SnapshotInfo, create_admin_app
from rolloutd.domain.report import CheckpointPhase, CheckpointReport
from rolloutd.telemetry.catalogue import CATALOGUE
from rolloutd.telemetry.prometheus import prometheus_name
from rolloutd.telemetry.providers import Telemetry, setup_telemetry
from tests.telemetry.reports import (
    CHECKPOINT_STATE,
    ENGINE,
    STATUS,
    checkpoint_report,
    scripted_run,
)
from tests.tls_certs import make_pki

TOKEN = "s3cret"


class FakeState:
    def __init__(self) -> None:
        self.alive = True
        self.ready: tuple[bool, str] = (True, "")
        self.requests: list[tuple[str, int | None]] = []
        self.report = checkpoint_report()

    def live(self) -> bool:
        return self.alive

    def readiness(self) -> tuple[bool, str]:
        return self.ready

    def status(self) -> dict[str, Any]:
        return {"policy_version": 3, "groups": {"committed": 2}, "inflight_samples": 5}

    def checkpoints(self) -> list[SnapshotInfo]:
        return [
            SnapshotInfo(8, "step-40", 40, 1_767_000_060.0, rows=512, size_bytes=4608),
            SnapshotInfo(7, "", None, 1_767_000_000.0, rows=400, size_bytes=4000),
        ]

    async def checkpoint(self, tag: str, trainer_step: int | None) -> CheckpointReport:
        self.requests.append((tag, trainer_step))
        return self.report


@pytest.fixture
def telemetry(monkeypatch: pytest.MonkeyPatch) -> Iterator[Telemetry]:
    for name in list(os.environ):
        if name.startswith("OTEL_"):
            monkeypatch.delenv(name)
    t = setup_telemetry(traces_exporters=(), metrics_exporters=())
    yield t
    t.shutdown()


@pytest.fixture
def state() -> FakeState:
    return FakeState()


@pytest.fixture
async def client(state: FakeState) -> AsyncIterator[httpx.AsyncClient]:
    app = create_admin_app(state, CollectorRegistry(), auth_token=TOKEN)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://admin") as c:
        yield c


async def test_healthz_follows_liveness(client, state):
    assert (await client.get("/healthz")).json() == {"live": True}
    state.alive = False
    response = await client.get("/healthz")
    assert response.status_code == 503
    assert response.json() == {"live": False}


async def test_readyz_flips_with_a_reason(client, state):
    ok = await client.get("/readyz")
    assert (ok.status_code, ok.json()) == (200, {"ready": True, "reason": ""})
    for reason in ("restoring", "checkpoint failed 3 times in a row", "draining"):
        state.ready = (False, reason)
        response = await client.get("/readyz")
        assert (response.status_code, response.json()) == (503, {"ready": False, "reason": reason})
    state.ready = (True, "")
    assert (await client.get("/readyz")).status_code == 200


async def test_metrics_serves_the_catalogue_in_prometheus_naming(telemetry, state):
    observer = telemetry.observer()
    observer.register_sources(lambda: ENGINE, "synthetic", lambda: STATUS, lambda: CHECKPOINT_STATE)
    scripted_run(observer)
    app = create_admin_app(state, telemetry.prometheus_registry)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://a") as c:
        response = await c.get("/metrics")
        openmetrics = await c.get(
            "/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"}
        )
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    names = {line.split("{")[0].split(" ")[0] for line in response.text.splitlines()}
    for instrument in CATALOGUE:
        assert any(n.startswith(prometheus_name(instrument)) for n in names), instrument.name
    assert 'rolloutd_checkpoint_duration_seconds_bucket{le="0.0025"' in response.text
    assert openmetrics.headers["content-type"].startswith("application/openmetrics-text")
    assert openmetrics.text.rstrip().endswith("# EOF")


async def test_status_and_checkpoint_list(client):
    assert (await client.get("/v1/status")).json()["policy_version"] == 3
    listed = (await client.get("/v1/checkpoints")).json()
    assert [s["sequence"] for s in listed] == [8, 7]
    assert listed[0] == {
        "sequence": 8,
        "tag": "step-40",
        "trainer_step": 40,
        "created_unix_s": 1_767_000_060.0,
        "rows": 512,
        "size_bytes": 4608,
    }


async def test_post_checkpoint_needs_the_token_and_returns_the_outcome(client, state):
    body = {"tag": "step-40", "trainer_step": 40}
    assert (await client.post("/v1/checkpoints", json=body)).status_code == 401
    wrong = {"Authorization": "Bearer nope"}
    assert (await client.post("/v1/checkpoints", json=body, headers=wrong)).status_code == 401
    auth = {"Authorization": f"Bearer {TOKEN}"}
    response = await client.post("/v1/checkpoints", json=body, headers=auth)
    assert response.status_code == 200
    result = response.json()
    assert state.requests == [("step-40", 40)]
    assert (result["outcome"], result["reason"], result["sequence"]) == (
        "completed",
        "completed",
        7,
    )
    assert set(result["phase_seconds"]) == {p.value for p in CheckpointPhase}
    assert result["phase_seconds"]["commit"] == pytest.approx(0.005)
    assert result["error"] is None

    await client.post("/v1/checkpoints", headers=auth)
    assert state.requests[-1] == ("", None)


async def test_a_failed_checkpoint_reports_its_reason_and_error(client, state):
    state.report = checkpoint_report(failing=CheckpointPhase.SIDECAR_WRITE)
    response = await client.post(
        "/v1/checkpoints", json={}, headers={"Authorization": f"Bearer {TOKEN}"}
    )
    result = response.json()
    assert (result["outcome"], result["reason"], result["sequence"]) == ("failed", "io_error", None)
    assert "No space left on device" in result["error"]


async def test_a_failed_checkpoint_does_not_tell_the_client_server_paths(client, state):
    report = checkpoint_report(failing=CheckpointPhase.SIDECAR_WRITE)
    report.error = OSError(errno.ENOSPC, "No space left on device", "/srv/ck/.tmp-9/sidecar")
    state.report = report
    response = await client.post(
        "/v1/checkpoints", json={}, headers={"Authorization": f"Bearer {TOKEN}"}
    )
    result = response.json()
    assert result["error"] == "OSError: No space left on device"
    assert result["message"] == "No space left on device"


async def test_bad_checkpoint_requests_are_refused_with_the_field(client):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    response = await client.post("/v1/checkpoints", json={"trainer_step": -1}, headers=auth)
    assert response.status_code == 422
    assert "trainer_step" in response.text


async def test_openapi_describes_every_route_and_the_checkpoint_result(client):
    spec = (await client.get("/openapi.json")).json()
    assert {"/healthz", "/readyz", "/metrics", "/v1/status", "/v1/checkpoints"} <= set(
        spec["paths"]
    )
    assert {"get", "post"} <= set(spec["paths"]["/v1/checkpoints"])
    schemas = spec["components"]["schemas"]
    assert schemas["Outcome"]["enum"] == ["completed", "skipped", "failed"]
    assert {"outcome", "reason", "sequence", "phase_seconds"} <= set(
        schemas["CheckpointResult"]["properties"]
    )
    assert "SnapshotInfo" in schemas


async def test_admin_server_serves_on_a_free_port_and_stops(state):
    server = AdminServer(create_admin_app(state, CollectorRegistry()), host="127.0.0.1", port=0)
    port = await server.start()
    assert port == server.port > 0
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as c:
        assert (await c.get("/readyz")).json() == {"ready": True, "reason": ""}
    await server.stop()
    await server.stop()
    with pytest.raises(httpx.ConnectError):
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as c:
            await c.get("/healthz")


async def test_a_port_in_use_is_an_error_for_the_caller(state):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = AdminServer(
            create_admin_app(state, CollectorRegistry()),
            host="127.0.0.1",
            port=taken.getsockname()[1],
        )
        with pytest.raises(OSError):
            await server.start()


@pytest.mark.parametrize("body", [{"tag": "5"}, {"tag": "latest"}, {"tag": "x", "trainer_stp": 3}])
async def test_post_checkpoint_refuses_ambiguous_tags_and_unknown_fields(client, state, body):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    response = await client.post("/v1/checkpoints", json=body, headers=auth)
    assert response.status_code == 422, response.text
    assert state.requests == []


@pytest.mark.parametrize(("spec", "sequence"), [("8", 8), ("7", 7), ("step-40", 8), ("latest", 8)])
async def test_get_one_checkpoint_by_sequence_tag_or_latest(client, spec, sequence):
    response = await client.get(f"/v1/checkpoints/{spec}")
    assert response.status_code == 200
    assert response.json()["sequence"] == sequence


@pytest.mark.parametrize("spec", ["9", "step-41"])
async def test_an_unknown_checkpoint_is_404_naming_it(client, spec):
    response = await client.get(f"/v1/checkpoints/{spec}")
    assert response.status_code == 404
    assert spec in response.json()["detail"]


async def test_no_page_loads_assets_from_a_cdn(client):
    """Swagger UI at /docs came from a CDN and did not render offline: the app serves the
    OpenAPI document itself, and no HTML that reaches out."""
    assert (await client.get("/docs")).status_code == 404
    assert (await client.get("/redoc")).status_code == 404
    spec = (await client.get("/openapi.json")).json()
    assert "/v1/checkpoints/{snapshot}" in spec["paths"]


async def test_every_route_that_changes_state_needs_the_token(client):
    """Reads are open; anything else takes the bearer token, whatever route is added later."""
    app = client._transport.app
    changing = [
        (method, route.path)
        for route in app.routes
        for method in getattr(route, "methods", ()) or ()
        if method not in ("GET", "HEAD")
    ]
    assert ("POST", "/v1/checkpoints") in changing
    for method, path in changing:
        response = await client.request(method, path, json={})
        assert response.status_code == 401, (method, path)


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])
async def test_the_scheme_is_case_insensitive(client, state, scheme):
    headers = {"Authorization": f"{scheme} {TOKEN}"}
    assert (await client.post("/v1/checkpoints", json={}, headers=headers)).status_code == 200


@pytest.mark.parametrize(
    "authorization", [b"Bearer \xc3\xa9t\xc3\xa9", b"\xe9\xe9 s3cret", b"Bearer s3cret\xff"]
)
async def test_a_non_ascii_authorization_header_is_401(client, state, authorization):
    response = await client.post(
        "/v1/checkpoints", json={}, headers={"Authorization": authorization}
    )
    assert response.status_code == 401
    assert state.requests == []


@pytest.mark.parametrize("spec", ["²", "①", "\u0663", "\uff18"])
async def test_digits_that_are_not_ascii_name_no_snapshot(client, spec):
    response = await client.get(f"/v1/checkpoints/{spec}")
    assert response.status_code == 404
    assert spec in response.json()["detail"]


async def test_a_connection_that_never_finishes_its_request_head_is_closed(state):
    """Slowloris: a byte now and then kept a half-sent request open for good."""
    server = AdminServer(
        create_admin_app(state, CollectorRegistry()),
        host="127.0.0.1",
        port=0,
        header_timeout_s=0.5,
    )
    port = await server.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: a\r\n")
        await writer.drain()
        # closed by the server, with nothing sent: no response to a request never finished
        assert await asyncio.wait_for(reader.read(), timeout=30) == b""
        writer.close()
        # a whole request on a connection of its own is served as ever
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as c:
            assert (await c.get("/healthz")).status_code == 200
    finally:
        await server.stop()


async def test_the_admin_port_serves_tls_and_can_require_a_client_certificate(state, tmp_path):
    pki = make_pki(tmp_path)
    server = AdminServer(
        create_admin_app(state, CollectorRegistry()),
        host="127.0.0.1",
        port=0,
        tls=AdminTls(str(pki.server_cert), str(pki.server_key), client_ca=str(pki.ca)),
    )
    port = await server.start()
    try:
        trusted = ssl.create_default_context(cafile=str(pki.ca))
        mutual = ssl.create_default_context(cafile=str(pki.ca))
        mutual.load_cert_chain(str(pki.client_cert), str(pki.client_key))
        async with httpx.AsyncClient(base_url=f"https://localhost:{port}", verify=mutual) as c:
            assert (await c.get("/healthz")).json() == {"live": True}
        for refused in (
            httpx.AsyncClient(base_url=f"https://localhost:{port}", verify=trusted),  # no cert
            httpx.AsyncClient(base_url=f"http://localhost:{port}"),  # plaintext
        ):
            async with refused as c:
                with pytest.raises(httpx.TransportError):
                    await c.get("/healthz")
    finally:
        await server.stop()
