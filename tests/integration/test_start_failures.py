"""Every start-up failure a user can cause ends in one line naming the cause and what to do, and a
non-zero exit; the traceback appears only with ``--log-level debug``."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.integration.proc import ServeProcess

pytestmark = pytest.mark.process


def _rolloutd(
    *args: str, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rolloutd.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env={**os.environ, **(env or {})},
    )


def _serve(tmp_path: Path, *args: str, log_level: str = "INFO") -> subprocess.CompletedProcess:
    return _rolloutd(
        "--log-level", log_level,
        "serve", "--engine", "synthetic", "--grpc-port", "0", "--http-port", "0",
        "--checkpoint-interval", "0", *args,
        cwd=tmp_path,
    )  # fmt: skip


def _assert_one_line(result: subprocess.CompletedProcess, prefix: str, *words: str) -> str:
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "Traceback" not in output, output
    last = result.stderr.rstrip("\n").splitlines()[-1]
    assert last.startswith(prefix), output
    for word in words:
        assert word in last, last
    return last


@pytest.fixture
def listening_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        yield s.getsockname()[1]


def _snapshot_of_group_size_3(tmp_path: Path) -> list[str]:
    p = ServeProcess.synthetic(tmp_path / "ck", "--group-size", "3", cwd=tmp_path)
    p.wait_listening()
    assert p.terminate() == 0, p.output
    return ["--checkpoint-dir", str(tmp_path / "ck"), "--group-size", "4"]


def _file_as_checkpoint_dir(tmp_path: Path) -> list[str]:
    (tmp_path / "not-a-dir").write_text("")
    return ["--checkpoint-dir", str(tmp_path / "not-a-dir")]


CASES: dict[str, tuple[Callable[[Path], list[str]], tuple[str, ...]]] = {
    "unknown-tag": (
        lambda t: ["--checkpoint-dir", str(t / "ck"), "--restore", "step-9"],
        ("step-9", "rolloutd checkpoints list", "--restore"),
    ),
    "restore-refused": (_snapshot_of_group_size_3, ("different configuration", "--restore none")),
    "missing-dataset": (
        lambda t: ["--checkpoint-dir", str(t / "ck"), "--dataset", "nope.jsonl"],
        ("nope.jsonl", "No such file", "--dataset"),
    ),
    "checkpoint-dir-is-a-file": (
        _file_as_checkpoint_dir,
        ("not-a-dir", "checkpoint.dir", "--checkpoint-dir"),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_serve_failure_is_one_line(tmp_path: Path, case: str) -> None:
    prepare, words = CASES[case]
    args = prepare(tmp_path)
    _assert_one_line(_serve(tmp_path, *args), "rolloutd: ", *words)
    debug = _serve(tmp_path, *args, log_level="DEBUG")
    assert debug.returncode != 0 and "Traceback" in debug.stderr


@pytest.mark.parametrize("flag", ["--grpc-port", "--http-port"])
def test_a_port_in_use_is_one_line(tmp_path: Path, listening_port: int, flag: str) -> None:
    result = _serve(tmp_path, "--checkpoint-dir", str(tmp_path / "ck"), flag, str(listening_port))
    _assert_one_line(result, "rolloutd: ", str(listening_port), flag)


def test_trainer_without_its_token_is_one_line(tmp_path: Path) -> None:
    p = ServeProcess.synthetic(
        tmp_path / "ck", "--checkpoint-interval", "0", env={"ROLLOUTD_AUTH__TOKEN": "s3cret"}
    )
    try:
        address = p.wait_listening()
        result = _rolloutd(
            "trainer", "--target", address, "--steps", "1", "--ready-timeout-s", "60", cwd=tmp_path
        )
    finally:
        p.terminate()
    _assert_one_line(result, "rolloutd trainer: ", address, "UNAUTHENTICATED", "--token")


def test_trainer_asking_too_much_is_one_line(tmp_path: Path) -> None:
    p = ServeProcess.synthetic(tmp_path / "ck", "--checkpoint-interval", "0")
    try:
        address = p.wait_listening()
        result = _rolloutd(
            "trainer", "--target", address, "--steps", "1", "--groups-per-step", "100000",
            cwd=tmp_path,
        )  # fmt: skip
    finally:
        p.terminate()
    _assert_one_line(result, "rolloutd trainer: ", "INVALID_ARGUMENT", "max_groups")


def test_log_level_is_taken_after_the_subcommand_too(tmp_path: Path) -> None:
    result = _rolloutd(
        "serve", "--engine", "synthetic", "--dataset", "nope.jsonl", "--log-level", "debug",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 1 and "Traceback" in result.stderr, result.stderr


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_checkpoints_help(tmp_path: Path, flag: str) -> None:
    result = _rolloutd("checkpoints", flag, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "usage: rolloutd checkpoints" in result.stdout
    assert "list" in result.stdout and "verify" in result.stdout


@pytest.mark.parametrize(
    ("key", "value", "words"),
    [
        ("pipeline.finishing_stage", "no_such_module:Stage", ["no_such_module", "PYTHONPATH"]),
        ("pipeline.sibling_runner", "json:NoSuchRunner", ["has no attribute", "NoSuchRunner"]),
        ("scoring.verifier", "no_such_module:reward", ["scoring.verifier", "no_such_module"]),
    ],
)
def test_a_pipeline_entry_point_that_cannot_be_loaded_is_one_line_naming_the_key(
    tmp_path, key, value, words
):
    config = tmp_path / "rolloutd.yaml"
    section, name = key.split(".")
    config.write_text(f"{section}:\n  {name}: {value}\n")
    result = _serve(tmp_path, "--config", str(config))
    assert result.returncode == 2
    _assert_one_line(result, "rolloutd: ", *words)
