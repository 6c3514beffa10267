"""How journal records are laid out in a file or object, and how damage among them is found.

A record is one line: ``~``, its payload's length and CRC-32 as 8 hex digits each, each
followed by a space, then the payload (the JSON ``{"position": P, "record": {...}}``) and a
newline::

    ~0000002f 1c291ca3 {"position":1,"record":{"kind":"ids","through":1024}}

The length tells a record cut short from a whole one, the checksum a changed byte. Journals
written before records were framed hold the bare JSON line; a line that starts with ``{`` is
read as one, so they are still read (without those checks).

:func:`scan` reads a file's bytes front to back and sorts what it finds: whole records, damage
followed by whole records (*middle* damage: records that were acknowledged may be garbled or
lost), and damage that nothing whole follows (a *tail*: on a local disk, an append that never
returned, which no client was told about, unless the journal's acknowledged mark says otherwise).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

FRAME = b"~"
_HEADER = len(b"~00000000 00000000 ")


@dataclass(frozen=True)
class JournalEntry:
    """One durable record at its journal position (positions increase by one per record)."""

    position: int
    record: dict[str, Any]


@dataclass(frozen=True)
class Damage:
    """Bytes of a journal file that hold no whole record."""

    offset: int
    size: int
    reason: str
    after: int | None
    """Position of the last whole record before it (None: none in this file)."""
    before: int | None
    """Position of the first whole record after it (None: nothing whole follows, a tail)."""

    def describe(self, where: str) -> str:
        return f"{where}: {self.size} bytes at offset {self.offset} hold no whole record ({self.reason})"


@dataclass
class Scan:
    """What one file holds."""

    entries: list[JournalEntry] = field(default_factory=list)
    middle: list[Damage] = field(default_factory=list)
    tail: Damage | None = None


def encode(position: int, record: Mapping[str, Any]) -> bytes:
    payload = json.dumps({"position": position, "record": record}, separators=(",", ":")).encode()
    return b"~%08x %08x " % (len(payload), zlib.crc32(payload)) + payload + b"\n"


def _entry(payload: bytes) -> JournalEntry:
    value = json.loads(payload)
    return JournalEntry(int(value["position"]), value["record"])


def _line_end(data: bytes, offset: int) -> int:
    newline = data.find(b"\n", offset)
    return len(data) if newline < 0 else newline + 1


def _next(data: bytes, offset: int) -> tuple[JournalEntry | None, int, str]:
    """The record at ``offset``, where the next one starts, and what is wrong when it is none."""
    if data[offset : offset + 1] != FRAME:  # a record from before framing: a JSON line
        end = _line_end(data, offset)
        try:
            return _entry(data[offset:end]), end, ""
        except (ValueError, KeyError, TypeError) as exc:
            cut = "" if data[end - 1 : end] == b"\n" else ", cut short"
            return None, end, f"not a record{cut}: {exc}"
    header = data[offset + 1 : offset + _HEADER]
    try:
        if header[8:9] != b" " or header[17:18] != b" ":
            raise ValueError(header)
        length, checksum = int(header[:8], 16), int(header[9:17], 16)
    except ValueError:
        return None, _line_end(data, offset), "an unreadable record header"
    start = offset + _HEADER
    end = start + length
    if end >= len(data):
        present = len(data) - start
        return None, _line_end(data, offset), f"cut short: {present} of {length} bytes"
    if data[end : end + 1] != b"\n":
        return None, _line_end(data, offset), "a record whose length is wrong"
    payload = data[start:end]
    actual = zlib.crc32(payload)
    if actual != checksum:
        return None, end + 1, f"checksum {actual:08x}, the record says {checksum:08x}"
    try:
        return _entry(payload), end + 1, ""
    except (ValueError, KeyError, TypeError) as exc:
        return None, end + 1, f"not a record: {exc}"


def scan(data: bytes) -> Scan:
    """The whole records of ``data`` and its damage, in order (see the module docstring)."""
    found = Scan()
    offset = 0
    damaged: tuple[int, str] | None = None  # where the damage being read started, and why
    while offset < len(data):
        if data[offset : offset + 1] == b"\n":  # an empty line: nothing
            offset += 1
            continue
        entry, offset_next, reason = _next(data, offset)
        if entry is None:
            damaged = damaged or (offset, reason)
        else:
            if damaged is not None:
                found.middle.append(_damage(found, damaged, offset, entry.position))
                damaged = None
            found.entries.append(entry)
        offset = offset_next
    if damaged is not None:
        found.tail = _damage(found, damaged, len(data), None)
    return found


def _damage(found: Scan, damaged: tuple[int, str], end: int, before: int | None) -> Damage:
    start, reason = damaged
    after = found.entries[-1].position if found.entries else None
    return Damage(start, end - start, reason, after, before)
