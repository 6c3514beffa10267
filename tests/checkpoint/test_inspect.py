"""``rolloutd checkpoints list|show|verify`` against a store with good and damaged snapshots."""

from __future__ import annotations

import io
import json

import pytest

from rolloutd.checkpoint.inspect import main, parse_storage_options
from rolloutd.checkpoint.manifest import Manifest
from tests.checkpoint.helpers import Location, make_rows, publish


def _run(location: Location, *argv: str) -> tuple[int, str]:
    options = [f"--storage-option={k}={json.dumps(v)}" for k, v in location.options.items()]
    out = io.StringIO()
    code = main([*argv, "--dir", location.url, *options], out=out)
    return code, out.getvalue()


@pytest.fixture
def snapshots(location: Location) -> list[Manifest]:
    store = location.open()
    first = publish(store, None, make_rows(0, 30), tag="step-10", trainer_step=10)
    second = publish(store, first, make_rows(30, 10), removed=[1, 2])
    return [first, second]


def test_list_shows_each_snapshot(location: Location, snapshots: list[Manifest]):
    code, out = _run(location, "list")
    assert code == 0
    header, newest, oldest = out.splitlines()
    assert header.split() == ["SEQ", "TAG", "STEP", "CREATED", "(UTC)", "ROWS", "BYTES", "STATUS"]
    assert newest.split()[0] == "2" and newest.split()[-1] == "unverified"
    assert "38" in newest.split()  # live rows
    assert oldest.split()[:3] == ["1", "step-10", "10"]

    code, out = _run(location, "list", "--json")
    records = json.loads(out)
    assert [r["sequence"] for r in records] == [2, 1]
    assert records[0]["size_bytes"] == snapshots[1].total_bytes
    assert records[1]["tag"] == "step-10" and records[1]["status"] == "unverified"


def test_list_flags_damage_without_reading_files(location: Location, snapshots: list[Manifest]):
    location.truncate(snapshots[1].segments[1].file.path, 10)
    location.flip_bit("manifests/00000000000000000001.json", 40)
    code, out = _run(location, "list", "--json")
    assert code == 0
    statuses = {r["sequence"]: r["status"] for r in json.loads(out)}
    assert statuses == {2: "damaged", 1: "unreadable"}


def test_show_prints_the_manifest(location: Location, snapshots: list[Manifest]):
    code, out = _run(location, "show", "2")
    assert code == 0
    assert Manifest.from_json(out.encode()) == snapshots[1]
    code, _ = _run(location, "show", "9")
    assert code == 1


def test_verify_checks_every_checksum(location: Location, snapshots: list[Manifest]):
    code, out = _run(location, "verify")
    assert code == 0
    # segment 1 is shared by both snapshots and read once
    assert "2 snapshots, 4 files checked, 0 problems" in out

    damaged = snapshots[1].segments[1].file.path
    location.flip_bit(damaged)
    code, out = _run(location, "verify")
    assert code == 1
    assert f"snapshot 2: {damaged}: checksum" in out
    assert "1 problems" in out
    code, _ = _run(location, "verify", "1")
    assert code == 0


def test_empty_store_and_usage_errors(location: Location, capsys):
    location.open().write_sidecar_json(1, b"{}")  # a store that exists, with no snapshot yet
    code, out = _run(location, "list")
    assert code == 0 and "no snapshots" in out
    with pytest.raises(SystemExit) as caught:
        main(["list", "--storage-option", "novalue"])
    assert caught.value.code == 2
    with pytest.raises(SystemExit):
        main(["frobnicate"])


def test_storage_options_parse_json_values_and_nest():
    assert parse_storage_options(
        ["endpoint_url=http://127.0.0.1:9000", "anon=false", "client_kwargs.region_name=eu"]
    ) == {
        "endpoint_url": "http://127.0.0.1:9000",
        "anon": False,
        "client_kwargs": {"region_name": "eu"},
    }


def test_unreachable_store_is_an_error_not_a_crash(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert main(["list", "--dir", str(tmp_path / "file" / "store")]) == 1
    assert "no snapshot store at" in capsys.readouterr().err


def test_list_never_says_ok_for_what_it_did_not_read(location: Location, snapshots):
    """A flipped bit keeps every size: list cannot see it, so it says unverified, not ok."""
    location.flip_bit(snapshots[1].segments[1].file.path)
    code, out = _run(location, "list")
    assert code == 0
    assert [line.split()[-1] for line in out.splitlines()[1:]] == ["unverified", "unverified"]
    assert " ok" not in out
    code, out = _run(location, "verify")
    assert code == 1 and "corrupt" in out


def test_show_takes_what_restore_takes(location: Location, snapshots: list[Manifest]):
    for spec, expected in (
        ("latest", snapshots[1]),
        ("2", snapshots[1]),
        ("step-10", snapshots[0]),
    ):
        code, out = _run(location, "show", spec)
        assert code == 0, spec
        assert Manifest.from_json(out.encode()) == expected, spec
    code, _ = _run(location, "show", "step-99")
    assert code == 1


def test_show_by_a_reused_tag_says_it_picked_the_newest(location: Location, snapshots, capsys):
    store = location.open()
    third = publish(store, snapshots[1], make_rows(40, 5), tag="step-10", trainer_step=10)
    code, out = _run(location, "show", "step-10")
    assert code == 0 and Manifest.from_json(out.encode()) == third
    note = capsys.readouterr().err
    assert f"names the newest of its snapshots, {third.sequence}" in note
    assert f"older ones with that tag: {snapshots[0].sequence}" in note


def test_a_store_that_does_not_exist_is_an_error(location: Location, capsys):
    for command in ("list", "show", "verify"):
        argv = [command, "latest"] if command == "show" else [command]
        code, _ = _run(location, *argv)
        assert code == 1, command
        assert f"no snapshot store at {location.url}" in capsys.readouterr().err


def test_list_escapes_what_a_client_put_in_a_tag(location: Location):
    """A tag comes from a trainer's Checkpoint call: its ANSI escapes and newlines are shown,
    not obeyed by the operator's terminal."""
    store = location.open()
    publish(store, None, make_rows(0, 3), tag="step-1\x1b[2J\x1b]0;owned\x07\nforged row")
    code, out = _run(location, "list")
    assert code == 0
    _header, row = out.splitlines()
    assert "step-1\\x1b[2J\\x1b]0;owned\\x07\\nforged" in row.split()
    assert out.replace("\n", "").isprintable()
