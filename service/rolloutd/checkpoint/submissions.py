"""Submitted prompts in snapshots: a log of immutable pieces that later snapshots list again.

Every prompt ever accepted by ``SubmitPrompts`` is kept, not only those still waiting for
admission: a resubmission of an id admitted long ago must still be recognised (the same prompt is
a duplicate, another prompt under that id is refused). Rewriting that whole list in every sidecar
would make each checkpoint cost the length of the run, so a snapshot writes only the prompts
accepted since the snapshot it builds on, as a piece of its own, and lists its parent's pieces
unchanged. The sidecar keeps only the count and the admission head.

Layout: ``submissions/<sequence>-<token>.jsonl``, one prompt a line, encoded as the sidecar encodes
prompts (``{id, text, metadata, messages}``), so a piece is readable with any JSON Lines tool. A
manifest lists its pieces oldest first (:class:`SubmissionsEntry`), contiguous from prompt 0, each
with its size and checksum like every other file of a snapshot: a piece that is missing or does
not verify makes the snapshot corrupt, and restore falls back to an older one.

Merging bounds the number of pieces: the new piece absorbs the newest pieces of the parent while
the older one is at most twice the bytes of what has been merged so far. Piece sizes then fall
geometrically from the oldest, so a store holds O(log n) pieces for n prompts and each prompt is
rewritten O(log n) times in all; a checkpoint writes its new prompts plus, now and then, a merge of
recent pieces no larger than about twice those.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from typing import Protocol

import pyarrow as pa

from rolloutd.checkpoint.backends import SUBMISSIONS, Backend, CorruptSnapshot, file_name
from rolloutd.checkpoint.checksums import ChecksumAlgorithm, Hasher, checksum_algorithm
from rolloutd.checkpoint.manifest import FileEntry, SubmissionsEntry
from rolloutd.checkpoint.sidecar import from_json, to_json
from rolloutd.domain.errors import InvariantError
from rolloutd.domain.group import Prompt
from rolloutd.domain.snapshot import ControllerState

_JSON = json.JSONEncoder(separators=(",", ":"), allow_nan=False)
"""One encoder for every line: ``json.dumps`` with options builds a new one per call."""


def encode(prompts: Sequence[Prompt]) -> bytes:
    """JSON Lines, one prompt a line (JSON escapes every newline inside a value)."""
    return "".join(_JSON.encode(to_json(p)) + "\n" for p in prompts).encode()


def decode(data: bytes, piece: SubmissionsEntry) -> list[Prompt]:
    """The prompts of a verified piece; :class:`CorruptSnapshot` if they are not what it lists."""
    path = piece.file.path
    try:
        prompts = [from_json(Prompt, json.loads(line)) for line in data.splitlines()]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CorruptSnapshot(-1, [f"{path}: not a submissions piece: {exc!r}"]) from exc
    if len(prompts) != piece.count:
        problem = f"{path}: {len(prompts)} prompts, manifest says {piece.count}"
        raise CorruptSnapshot(-1, [problem])
    return prompts


def read_verified(backend: Backend, entry: FileEntry) -> bytes:
    """A file's bytes, after checking its size and checksum against ``entry``."""
    try:
        buffer: pa.Buffer = backend.read(entry.path)
    except FileNotFoundError:
        raise CorruptSnapshot(-1, [f"{entry.path}: missing"]) from None
    data = buffer.to_pybytes()
    if len(data) != entry.size:
        raise CorruptSnapshot(-1, [f"{entry.path}: {len(data)} bytes, expected {entry.size}"])
    hasher = Hasher(checksum_algorithm(entry.checksum))
    hasher.update(data)
    if hasher.value != entry.checksum:
        problem = f"{entry.path}: checksum {hasher.value}, manifest says {entry.checksum}"
        raise CorruptSnapshot(-1, [problem])
    return data


def write_piece(backend: Backend, checksum: ChecksumAlgorithm, path: str, data: bytes) -> FileEntry:
    """Writes ``data`` as the piece ``path``: whole and durable on return, listed by no manifest
    yet."""
    hasher = Hasher(checksum)
    hasher.update(data)
    sink = backend.sink(path)
    try:
        sink.write(data)
        sink.commit()
    except BaseException:
        sink.abort()
        raise
    return FileEntry(path, len(data), hasher.value)


def read(backend: Backend, pieces: Sequence[SubmissionsEntry]) -> list[Prompt]:
    """Every prompt the pieces hold, in submission order, each piece verified."""
    prompts: list[Prompt] = []
    for piece in pieces:
        prompts += decode(read_verified(backend, piece.file), piece)
    return prompts


class Piece(Protocol):
    """A file of a log of pieces (submissions here, the lease ledger in ledger.py)."""

    @property
    def file(self) -> FileEntry: ...


def merge_from(parent: Sequence[Piece], new_bytes: int) -> int:
    """Index of the first parent piece that a new piece of ``new_bytes`` absorbs (see the module
    docstring); ``len(parent)`` when it absorbs none."""
    start, merged = len(parent), new_bytes
    while start > 0 and parent[start - 1].file.size <= 2 * merged:
        start -= 1
        merged += parent[start].file.size
    return start


def extend(
    backend: Backend,
    checksum: ChecksumAlgorithm,
    sequence: int,
    parent: Sequence[SubmissionsEntry],
    prompts: Sequence[Prompt],
) -> tuple[SubmissionsEntry, ...]:
    """The pieces of snapshot ``sequence``: ``parent``'s, plus one written for ``prompts`` (the
    prompts accepted since), merged with the newest parent pieces it absorbs. The new file is
    whole and durable on return but listed by no manifest yet; retention collects it if the
    snapshot is never published. Parent pieces being merged are read back verified
    (:class:`CorruptSnapshot` when one does not)."""
    if not prompts:
        return tuple(parent)
    data = encode(prompts)
    start = merge_from(parent, len(data))
    absorbed = parent[start:]
    data = b"".join(read_verified(backend, p.file) for p in absorbed) + data
    entry = write_piece(backend, checksum, f"{SUBMISSIONS}/{file_name(sequence, '.jsonl')}", data)
    first = absorbed[0].first if absorbed else sum(p.count for p in parent)
    count = sum(p.count for p in absorbed) + len(prompts)
    piece = SubmissionsEntry(entry, first, count, sequence)
    return (*parent[:start], piece)


def attach(state: ControllerState, prompts: list[Prompt]) -> ControllerState:
    """``state`` (a decoded sidecar) with the submitted prompts of its snapshot's pieces.

    A sidecar of an earlier version holds its prompts itself and its snapshot has no pieces.
    The sidecar's count and the pieces' are both checksummed, so a mismatch is a bug in the
    writer, not damage, and fails loudly.
    """
    sampler = state.sampler
    if sampler.submitted and not prompts:
        return state
    if len(prompts) != sampler.submitted_len:
        raise InvariantError(
            f"the snapshot's submissions pieces hold {len(prompts)} prompts, its sidecar "
            f"counts {sampler.submitted_len}"
        )
    return replace(state, sampler=replace(sampler, submitted=prompts))
