"""Scoring settings: what is refused at start-up, with the key to fix."""

from __future__ import annotations

import re

import pytest

from rolloutd.entrypoints import EntryPointError
from rolloutd.scoring import FilterConfig, ScoringConfig, build_stage


def test_nothing_configured_is_no_stage():
    assert build_stage(ScoringConfig(), FilterConfig()) is None


@pytest.mark.parametrize(
    ("scoring", "filter", "error", "says"),
    [
        (
            ScoringConfig(),
            FilterConfig(zero_variance=True),
            ValueError,
            "filter.zero_variance needs rewards",
        ),
        (
            ScoringConfig(verifier="builtin:maths"),
            FilterConfig(),
            ValueError,
            "no built-in 'maths'",
        ),
        (
            ScoringConfig(verifier="tests.scoring.nowhere:f"),
            FilterConfig(),
            EntryPointError,
            "scoring.verifier: cannot import 'tests.scoring.nowhere'",
        ),
        (
            ScoringConfig(group_verifier="tests.scoring.verifiers:nothing"),
            FilterConfig(),
            EntryPointError,
            "scoring.group_verifier: 'tests.scoring.verifiers' has no attribute 'nothing'",
        ),
    ],
)
def test_a_wrong_configuration_is_refused_at_start_up_naming_the_key(scoring, filter, error, says):
    with pytest.raises(error, match=re.escape(says)):
        build_stage(scoring, filter)


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        ({"verifier": "builtin:math", "group_verifier": "m:f"}, "not both"),
        ({"group_verifier": "http://judge:8000/"}, "must be a 'package.module:function'"),
        ({"workers": 0}, "scoring.workers must be at least 1"),
        ({"http_retries": -1}, "scoring.http_retries must be at least 0"),
        ({"timeout_s": 0}, "scoring.timeout_s must be positive"),
        ({"http_backoff_s": float("nan")}, "scoring.http_backoff_s"),
    ],
)
def test_scoring_settings_are_checked_when_built(settings, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        ScoringConfig(**settings)


def test_filter_settings_are_checked_when_built():
    with pytest.raises(ValueError, match=r"filter\.zero_variance is off"):
        FilterConfig(min_reward_std=0.1)
    with pytest.raises(ValueError, match=r"filter\.min_reward_std must be >= 0"):
        FilterConfig(True, -0.1)
