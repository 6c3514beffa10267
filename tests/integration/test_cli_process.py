"""The real CLI in a subprocess: grpcurl through reflection, hostile bytes, SIGTERM shutdown."""

import contextlib
import ipaddress
import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.integration.proc import ServeProcess, foreign_lines

pytestmark = pytest.mark.process

GRPCURL = shutil.which("grpcurl") or str(Path(__file__).parents[2] / ".venv" / "bin" / "grpcurl")


def grpcurl(addr, *args):
    out = subprocess.run(
        [GRPCURL, "-plaintext", *args[:-1], addr, args[-1]] if args else [GRPCURL, addr],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return out


@pytest.fixture
def served(tmp_path):
    p = ServeProcess.synthetic(
        tmp_path / "ckpt",
        "--group-size",
        "3",
        "--checkpoint-interval",
        "0",
        cwd=tmp_path,
    )
    addr = p.wait_listening()
    yield p, addr
    if p.proc.poll() is None:
        p.kill()


def test_grpcurl_lists_services_health_and_fetches_groups(served):
    _p, addr = served
    listed = grpcurl(addr, "list")
    assert listed.returncode == 0, listed.stderr
    services = listed.stdout.split()
    assert "rolloutd.v1.RolloutService" in services and "grpc.health.v1.Health" in services
    health = grpcurl(addr, "grpc.health.v1.Health/Check")
    assert json.loads(health.stdout)["status"] == "SERVING"
    fetched = grpcurl(
        addr, "-d", '{"max_groups": 2, "wait_ms": 5000}', "rolloutd.v1.RolloutService/FetchGroups"
    )
    assert fetched.returncode == 0, fetched.stderr
    body = json.loads(fetched.stdout)
    assert body["lease_id"]
    for group in body["groups"]:
        assert len(group["samples"]) == 3
        assert all(s["token_ids"] for s in group["samples"])
    bad = grpcurl(addr, "-d", '{"max_groups": 0}', "rolloutd.v1.RolloutService/FetchGroups")
    assert "InvalidArgument" in bad.stderr and "max_groups" in bad.stderr


def test_random_bytes_and_http1_change_nothing(served):
    p, addr = served
    # `make run` is `rolloutd serve` with no host: both ports on this machine only
    listening = {
        ipaddress.ip_address(c.laddr.ip)
        for c in psutil.Process(p.proc.pid).net_connections("inet")
        if c.status == psutil.CONN_LISTEN
    }
    assert len(listening) >= 1
    # gRPC's socket may be dual-stack: 127.0.0.1 shows as ::ffff:127.0.0.1
    assert all((getattr(ip, "ipv4_mapped", None) or ip).is_loopback for ip in listening), listening
    host, port = addr.rsplit(":", 1)
    for payload in (
        bytes(range(256)) * 8,
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\xff" * 64,
    ):
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(payload)
            s.settimeout(2)
            with contextlib.suppress(TimeoutError, ConnectionResetError):
                s.recv(4096)
    assert p.proc.poll() is None
    health = grpcurl(addr, "grpc.health.v1.Health/Check")
    assert json.loads(health.stdout)["status"] == "SERVING"
    status = grpcurl(addr, "rolloutd.v1.RolloutService/GetStatus")
    assert json.loads(status.stdout)["state"] == "SERVING_STATE_SERVING"


def test_sigterm_shuts_down_in_order(served, tmp_path):
    p, _addr = served
    assert p.terminate() == 0
    out = p.output
    assert out.index("state: draining") < out.index("stopped in")
    # what the store holds (snapshot, journal, claim) is the service user's alone (umask)
    made = list((tmp_path / "ckpt").rglob("*"))
    assert any(f.is_file() for f in made) and any(f.is_dir() for f in made)
    modes = {f.relative_to(tmp_path): f.stat().st_mode & 0o777 for f in made}
    assert modes == {f: 0o700 if (tmp_path / f).is_dir() else 0o600 for f in modes}


def test_start_restart_and_a_failed_start_print_only_rolloutds_own_lines(tmp_path):
    """At the default log level: no library's start-up or shutdown chatter, no noise at exit."""
    outputs = []
    for _ in range(2):  # a fresh start, then a restore
        p = ServeProcess.synthetic(tmp_path / "ck", "--checkpoint-interval", "0", cwd=tmp_path)
        p.wait_listening()
        assert p.terminate() == 0
        outputs.append(p.output)
    assert "started fresh" in outputs[0] and "restored snapshot 1" in outputs[1]
    failed = subprocess.run(
        [sys.executable, "-m", "rolloutd.cli", "serve", "--engine",
         "synthetic", "--grpc-port", "0", "--http-port", "0", "--checkpoint-dir",
         str(tmp_path / "ck"), "--restore", "step-999"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert failed.returncode == 1 and failed.stdout == ""
    assert failed.stderr.splitlines()[-1].startswith("rolloutd: no snapshot tagged 'step-999'")
    for output in [*outputs, failed.stderr]:
        assert foreign_lines(output) == [], output


@pytest.mark.parametrize(
    ("args", "env", "key"),
    [
        (["--group-size", "0"], {}, "group_size"),
        ([], {"ROLLOUTD_LIMITS__MAX_IN_FLIGHT": "-2"}, "limits.max_in_flight"),
        ([], {"ROLLOUTD_CHECKPOINT__INTERVAL": "5"}, "checkpoint.interval"),
        # a public bind without a token: refused before anything starts
        ([], {"ROLLOUTD_GRPC__HOST": "0.0.0.0"}, "grpc.host"),
    ],
)
def test_bad_configuration_exits_with_a_message_naming_the_key(tmp_path, args, env, key):
    import os
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "rolloutd.cli", "serve", "--engine", "synthetic", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env={**os.environ, **env},
    )
    assert r.returncode == 2
    assert f"config key '{key}'" in r.stderr


def test_the_example_trainer_waits_for_a_service_that_is_not_up_yet(tmp_path):
    import socket
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    trainer = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rolloutd.cli",
            "trainer",
            "--target",
            f"127.0.0.1:{port}",
            "--steps",
            "3",
            "--groups-per-step",
            "2",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert trainer.stdout is not None
    before = []  # until the trainer says it polls a port nobody listens on yet
    while not (before and "waiting for the service" in before[-1]):
        line = trainer.stdout.readline()
        assert line, "the trainer exited before it waited for the service:\n" + "".join(before)
        before.append(line)
    p = ServeProcess.synthetic(tmp_path / "ckpt", "--grpc-port", str(port), cwd=tmp_path)
    try:
        p.wait_listening()
        out, _ = trainer.communicate(timeout=60)
    finally:
        p.terminate()
    out = "".join(before) + out
    assert trainer.returncode == 0, out
    assert "waiting for the service" in out
    assert "done: 3 steps" in out
