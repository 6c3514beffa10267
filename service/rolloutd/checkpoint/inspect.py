"""Operator commands: ``rolloutd checkpoints list|show|verify|repair-journal --dir URL
[--storage-option k=v]``.

A snapshot's files are its segments, its sidecar and its submissions and ledger pieces; pieces and
segments are shared by later snapshots. ``list`` reads manifests only and checks file sizes, so the best
it can say is ``unverified`` (sizes match) or ``damaged``; ``verify`` re-reads every file of every
snapshot and compares checksums (a file shared by several snapshots is read once), says ``ok``
or ``corrupt``, reads and checks every record of the journal, and exits 1 when anything fails;
``show latest|SEQ|TAG`` prints a manifest. ``repair-journal`` claims the store (so no service may
be writing it) and moves a damaged journal's damaged part, and everything after it, aside to
``journal-damaged/`` (docs/operations.md, a damaged journal). A store that does not exist (a
mistyped ``--dir``) exits 1; exit status 2 is a usage error.
"""

from __future__ import annotations

import argparse
import enum
import json
import re
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

from rolloutd.checkpoint.backends import CorruptSnapshot
from rolloutd.checkpoint.claim import StoreHeld
from rolloutd.checkpoint.journal import DAMAGED
from rolloutd.checkpoint.manifest import FileEntry, Manifest
from rolloutd.checkpoint.reader import SnapshotNotFound
from rolloutd.checkpoint.store import SnapshotReader, SnapshotStore
from rolloutd.checkpoint.tags import sequence_of
from rolloutd.domain.printable import printable

DEFAULT_DIR = "./.rolloutd/checkpoints"


class Status(enum.Enum):
    OK = "ok"
    """Every checksum verified (``verify`` only)."""
    UNVERIFIED = "unverified"
    """Every file is there with its size; checksums not read (``list``)."""
    DAMAGED = "damaged"
    """A file is missing or has the wrong size (found without reading files)."""
    CORRUPT = "corrupt"
    """A file's checksum differs from the manifest."""
    UNREADABLE = "unreadable"
    """The manifest itself cannot be parsed or fails its own checksum."""


def parse_storage_options(items: Sequence[str]) -> dict[str, Any]:
    """``k=v`` pairs to fsspec options; values are JSON when they parse (``true``, ``3``), else
    strings, and dotted keys nest (``client_kwargs.region_name=eu-west-1``)."""
    options: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--storage-option expects key=value, got {item!r}")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        *parents, leaf = key.split(".")
        target = options
        for parent in parents:
            target = target.setdefault(parent, {})
        target[leaf] = value
    return options


def _human(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _created(created_at: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created_at))


def _table(rows: list[list[str]], out: TextIO) -> None:
    """Aligned columns; what a client named (a tag) is escaped, so that it cannot break a row
    or send a terminal its escape sequences."""
    rows = [[printable(cell) for cell in row] for row in rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        cells = (cell.ljust(width) for cell, width in zip(row, widths, strict=True))
        out.write("  ".join(cells).rstrip() + "\n")


def _row(sequence: int, manifest: Manifest | None, status: Status) -> list[str]:
    if manifest is None:
        return [str(sequence), "", "", "", "", "", status.value]
    step = "" if manifest.trainer_step is None else str(manifest.trainer_step)
    return [
        str(sequence),
        manifest.tag,
        step,
        _created(manifest.created_at),
        str(manifest.live_rows),
        _human(manifest.total_bytes),
        status.value,
    ]


_HEADER = ["SEQ", "TAG", "STEP", "CREATED (UTC)", "ROWS", "BYTES", "STATUS"]


def _list(store: SnapshotReader, args: argparse.Namespace, out: TextIO) -> int:
    rows = [_HEADER]
    records = []
    for sequence in store.sequences():
        try:
            manifest: Manifest | None = store.load(sequence)
        except CorruptSnapshot as exc:
            manifest, problems = None, exc.problems
            status = Status.UNREADABLE
        else:
            assert manifest is not None
            problems = store.check_sizes(manifest)
            status = Status.DAMAGED if problems else Status.UNVERIFIED
        rows.append(_row(sequence, manifest, status))
        records.append(
            {
                "sequence": sequence,
                "tag": manifest.tag if manifest else None,
                "trainer_step": manifest.trainer_step if manifest else None,
                # The field names of the admin API's /v1/checkpoints.
                "created_unix_s": manifest.created_at if manifest else None,
                "rows": manifest.live_rows if manifest else None,
                "size_bytes": manifest.total_bytes if manifest else None,
                "status": status.value,
                "problems": problems,
            }
        )
    if args.json:
        json.dump(records, out, indent=1)
        out.write("\n")
    elif len(rows) == 1:
        out.write(f"no snapshots in {store.url}\n")
    else:
        _table(rows, out)
    return 0


def _show(store: SnapshotReader, args: argparse.Namespace, out: TextIO) -> int:
    try:
        manifest = store.load(sequence_of(store, args.snapshot))
    except (SnapshotNotFound, CorruptSnapshot) as exc:
        sys.stderr.write(f"{exc}\n")
        return 1
    if manifest.tag == args.snapshot:
        older = [m.sequence for m in store.list() if m.tag == manifest.tag][1:]
        if older:
            sys.stderr.write(
                f"tag {manifest.tag!r} names the newest of its snapshots, {manifest.sequence}; "
                f"older ones with that tag: {', '.join(map(str, older))} (show them by sequence)\n"
            )
    pretty = json.dumps(manifest.to_dict(), indent=1)
    out.write(re.sub(r"\[\s+(-?\d+),\s+(-?\d+)\s+\]", r"[\1, \2]", pretty))  # one range a line
    out.write("\n")
    return 0


def _verify(store: SnapshotReader, args: argparse.Namespace, out: TextIO) -> int:
    checked: dict[FileEntry, list[str]] = {}
    rows = [_HEADER]
    failures: list[str] = []
    sequences = args.sequences or store.sequences()
    for sequence in sequences:
        try:
            manifest = store.load(sequence)
        except (SnapshotNotFound, CorruptSnapshot) as exc:
            rows.append(_row(sequence, None, Status.UNREADABLE))
            failures.append(f"snapshot {sequence}: {exc}")
            continue
        problems = []
        for entry in manifest.files():
            if entry not in checked:
                checked[entry] = store.verify_file(entry)
            problems += checked[entry]
        rows.append(_row(sequence, manifest, Status.CORRUPT if problems else Status.OK))
        failures += [f"snapshot {sequence}: {problem}" for problem in problems]
    if len(rows) > 1:
        _table(rows, out)
    journal = store.journal.check()
    failures += [f"journal: {problem}" for problem in journal.problems]
    out.write(f"{len(sequences)} snapshots, {len(checked)} files checked, ")
    out.write(f"{len(failures)} problems\n")
    held = "" if journal.first is None else f", positions {journal.first} to {journal.last}"
    out.write(f"journal: {journal.records} records in {journal.files} files{held}\n")
    for failure in failures:
        out.write(f"  {failure}\n")
    for tail in journal.tails:
        out.write(f"  journal: {tail}: a torn tail (an append that never returned), ignored\n")
    return 1 if failures else 0


def _repair_journal(store: SnapshotStore, args: argparse.Namespace, out: TextIO) -> int:
    try:
        store.claim.acquire()
    except StoreHeld as exc:
        sys.stderr.write(f"rolloutd checkpoints: {exc}\n")
        return 1
    try:
        repaired = store.journal.repair()
    finally:
        store.claim.release()
    if repaired is None:
        out.write(f"the journal of {store.url} holds no damage before its tail: nothing to do\n")
        return 0
    moved, kept, cut = repaired
    out.write(f"moved aside to {DAMAGED}/: {', '.join(moved)}\n")
    out.write(
        f"the journal now ends at position {kept}; {cut} whole records after the damage were "
        f"set aside with it (kept in {DAMAGED}/, never read): what they told clients is undone\n"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rolloutd checkpoints", description=__doc__)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--dir", default=DEFAULT_DIR, help="snapshot store: directory or URL")
    common.add_argument(
        "--storage-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="fsspec option, repeatable (endpoint_url=..., key=..., secret=...)",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    listing = commands.add_parser("list", parents=[common], help="snapshots, newest first")
    listing.add_argument("--json", action="store_true", help="print JSON instead of a table")
    listing.set_defaults(func=_list)
    show = commands.add_parser("show", parents=[common], help="print one manifest")
    show.add_argument("snapshot", help="latest, a sequence number or a tag (as --restore)")
    show.set_defaults(func=_show)
    verify = commands.add_parser("verify", parents=[common], help="re-check every checksum")
    verify.add_argument("sequences", type=int, nargs="*", help="only these (default: all)")
    verify.set_defaults(func=_verify)
    repair = commands.add_parser(
        "repair-journal",
        parents=[common],
        help="move a damaged journal's damaged part aside, so the service can start",
    )
    repair.set_defaults(func=_repair_journal)
    return parser


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    """Run ``rolloutd checkpoints`` with ``argv`` (the words after ``checkpoints``)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        options = parse_storage_options(args.storage_option)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        if not _exists(args.dir, options):
            sys.stderr.write(
                f"rolloutd checkpoints: no snapshot store at {args.dir} (nothing there); "
                "check --dir, the checkpoint.dir of the service\n"
            )
            return 1
        store = SnapshotStore(args.dir, options)
        status: int = args.func(store, args, out or sys.stdout)
    except OSError as exc:
        sys.stderr.write(f"rolloutd checkpoints: {exc}\n")
        return 1
    return status


def _exists(url: str, options: dict[str, Any]) -> bool:
    """A store exists once its directory does, or (object stores) once its prefix holds a file."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(url, **options)
    return bool(fs.exists(path))
