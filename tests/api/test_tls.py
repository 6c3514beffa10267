"""TLS between the shipped client (and trainer) and the server, with a CA made in the test:
server authentication from a CA bundle, and mutual TLS when the server sets grpc.tls_client_ca."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import grpc
import pytest

from rolloutd.client import RolloutClient
from tests.integration.proc import ServeProcess
from tests.tls_certs import Pki, make_pki


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def _port(address: str) -> str:
    return f"localhost:{address.rsplit(':', 1)[1]}"


async def _status(endpoint: str, **tls) -> str:
    def call() -> str:
        with RolloutClient(endpoint, retries=0, timeout_s=10, **tls) as client:
            return client.status_of(endpoint).engine

    return await asyncio.to_thread(call)


async def _refused(endpoint: str, **tls) -> None:
    with pytest.raises(grpc.RpcError) as info:
        await _status(endpoint, **tls)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_client_trusts_the_server_through_a_ca_bundle(serve, pki: Pki):
    service, _ = await serve(
        **{"grpc.tls_cert": str(pki.server_cert), "grpc.tls_key": str(pki.server_key)}
    )
    endpoint = _port(service.addresses.grpc)
    assert await _status(endpoint, tls_ca=str(pki.ca)) == "synthetic"
    await _refused(endpoint, tls_ca=str(pki.other_ca))
    await _refused(endpoint)  # plaintext


async def test_server_requires_a_client_certificate_from_its_ca(serve, pki: Pki):
    service, _ = await serve(
        **{
            "grpc.tls_cert": str(pki.server_cert),
            "grpc.tls_key": str(pki.server_key),
            "grpc.tls_client_ca": str(pki.ca),
        }
    )
    endpoint = _port(service.addresses.grpc)
    mutual = {"tls_cert": str(pki.client_cert), "tls_key": str(pki.client_key)}
    assert await _status(endpoint, tls_ca=str(pki.ca), **mutual) == "synthetic"
    await _refused(endpoint, tls_ca=str(pki.ca))


@pytest.mark.process
def test_the_trainer_speaks_mutual_tls(tmp_path, pki: Pki):
    p = ServeProcess.synthetic(
        tmp_path / "ck",
        "--checkpoint-interval",
        "0",
        env={
            "ROLLOUTD_GRPC__TLS_CERT": str(pki.server_cert),
            "ROLLOUTD_GRPC__TLS_KEY": str(pki.server_key),
            "ROLLOUTD_GRPC__TLS_CLIENT_CA": str(pki.ca),
        },
    )
    try:
        endpoint = _port(p.wait_listening())
        trainer = subprocess.run(
            [
                sys.executable, "-m", "rolloutd.cli", "trainer", "--target", endpoint,
                "--steps", "2", "--groups-per-step", "2", "--tls-ca", str(pki.ca),
                "--tls-cert", str(pki.client_cert), "--tls-key", str(pki.client_key),
            ],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    finally:
        assert p.terminate() == 0, p.output
    assert trainer.returncode == 0, trainer.stderr
    assert "done: 2 steps" in trainer.stdout
