"""Stop strings across the boundary of a resumed sample (no engine needed: one character a
token)."""

from __future__ import annotations

from array import array

from rolloutd.engines.stop_boundary import StopBoundary, cut_at_stop


def decode(token_ids: array[int]) -> str:
    return "".join(map(chr, token_ids))


def ids(text: str) -> array[int]:
    return array("i", map(ord, text))


def test_a_stop_string_spanning_the_boundary_cuts_the_joined_text():
    boundary = StopBoundary(decode, ids("the answer is 4 EN"), ("END",))
    assert boundary.check(ids("")) is None
    assert boundary.check(ids("D and more")) == "the answer is 4 "


def test_a_stop_string_wholly_in_the_prefix_is_not_the_boundarys():
    boundary = StopBoundary(decode, ids("END then"), ("END",))
    assert boundary.check(ids(" more")) is None


def test_the_check_ends_once_the_continuation_could_hold_a_stop_string_whole():
    boundary = StopBoundary(decode, ids("x"), ("END", "STOP"))
    assert not boundary.passed(["ab", "c"])
    assert boundary.passed(["ab", "cd"])


def test_text_is_cut_before_the_first_stop_string():
    assert cut_at_stop("a STOP b END", ("END", "STOP")) == "a "
    assert cut_at_stop("no stop here", ("END",)) == "no stop here"
