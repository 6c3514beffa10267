"""docs/design.md's tables of layering and of the group life cycle say what the code enforces."""

from __future__ import annotations

import re
from pathlib import Path

from rolloutd.domain.group import TRANSITIONS, GroupState
from tests.test_layering import ALLOWED, ROOMS

DESIGN = Path(__file__).resolve().parents[1] / "docs" / "design.md"


def _table(heading: str) -> list[list[str]]:
    """The rows of the first table under ``## heading``, each cell's code spans."""
    section = DESIGN.read_text().split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    return [[re.findall(r"`([^`]+)`", c) for c in row.strip("|").split("|")] for row in rows[2:]]


def test_the_layering_table_is_the_one_the_layering_test_enforces():
    documented = {unit: set(allowed) for [unit], allowed in _table("Layering")}
    assert documented == ALLOWED


def test_the_life_cycle_table_is_the_one_the_buffer_checks():
    rows = _table("The life of a group")
    documented = {(GroupState(a), GroupState(b)) for [a], [b], _ in rows}
    assert documented == TRANSITIONS


def test_the_rooms_table_is_the_one_the_layering_test_enforces():
    documented = {room: set(uses) for [room], uses, _ in _table("The controller")}
    assert documented == ROOMS
