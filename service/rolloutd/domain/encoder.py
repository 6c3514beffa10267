"""The group encoder: how a fetch makes sure a group can be delivered before leasing it, and the
bounds on what a prompt's metadata may be (docs/design.md, "The delivery contract").

A trainer receives a group encoded (the API's protobuf message): a group that cannot be encoded,
or that no trainer could decode, must be found before its lease is granted, or it would be
leased, fail, expire and come back for good. The API implements :class:`GroupEncoder`; the
domain only asks it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Generic, Protocol, TypeVar

from rolloutd.domain.group import Group

MAX_METADATA_DEPTH = 32
"""Deepest nesting of objects and arrays a prompt's metadata may have: a group's metadata is
also sent as a ``google.protobuf.Struct``, three message levels per object, and protobuf's
parsers refuse a message nested deeper than 100 levels (the group and its response are two)."""

E = TypeVar("E")
E_co = TypeVar("E_co", covariant=True)


class Undeliverable(Exception):
    """A group that cannot be delivered; the message says why."""


class GroupEncoder(Protocol, Generic[E_co]):
    """Encodes a group the way a fetch delivers it, before its lease is granted, so a group
    that cannot be delivered is dropped instead of leased (and expiring) again and again."""

    @property
    def max_bytes(self) -> float:
        """Most encoded bytes of groups one fetch may return."""
        ...

    def encode(self, group: Group) -> tuple[E_co, int]:
        """The encoded group and its size in bytes; raises :class:`Undeliverable`."""
        ...


class _AsIs:
    """Delivers groups as they are (a caller in the same process)."""

    max_bytes = math.inf

    def encode(self, group: Group) -> tuple[Group, int]:
        return group, 0


def metadata_too_deep(metadata: object) -> bool:
    """Nested deeper than :data:`MAX_METADATA_DEPTH` objects and arrays. Walks level by level,
    never recursing: metadata too deep for Python's recursion is found too."""
    level: list[object] = [metadata]
    depth = 0
    while True:
        containers = [v for v in level if isinstance(v, dict | list)]
        if not containers:
            return False
        depth += 1
        if depth > MAX_METADATA_DEPTH:
            return True
        level = [c for v in containers for c in (v.values() if isinstance(v, dict) else v)]


def metadata_problem(metadata: object, max_bytes: float) -> str | None:
    """Why a prompt's metadata cannot be delivered (too deep, or larger than ``max_bytes`` as
    JSON in UTF-8), or None."""
    if metadata_too_deep(metadata):
        return f"nested deeper than {MAX_METADATA_DEPTH} levels of objects and arrays"
    size = len(json.dumps(metadata, ensure_ascii=False).encode())
    if size > max_bytes:
        return f"{size} bytes as JSON, more than limits.max_metadata_bytes={max_bytes}"
    return None


def tools_problem(tools: object, max_bytes: float) -> str | None:
    """Why a prompt's ``tools`` cannot be passed to the chat template (not a list of JSON
    objects, nested too deep, or larger than ``max_bytes`` as JSON), or None."""
    if not isinstance(tools, list | tuple):
        return f"must be a list of JSON objects (tool schemas), not {type(tools).__name__}"
    for j, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            return f"item {j} must be a JSON object (a tool schema), not {type(tool).__name__}"
    return metadata_problem([dict(t) for t in tools], max_bytes)


AS_IS: GroupEncoder[Group] = _AsIs()
"""Groups as they are, for a caller in the same process."""
