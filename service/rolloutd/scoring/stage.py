"""The scoring stage: a :class:`FinishingStage` that scores every sibling of a finished group,
records the group's rewards and statistics on it, and drops the groups a filter or a failed
score rules out (docs/design.md, "The pipeline").

A verifier is named in :class:`ScoringConfig` as one of:

- ``"package.module:function"``: a Python entry point, sync or async, called with one
  :class:`ScoringInput` and returning a reward or ``(reward, info)``;
- the same as ``group_verifier``: called once with the list of all siblings' inputs, returning
  one reward (or ``(reward, info)``) per sibling, in order;
- ``"builtin:math"``, ``"builtin:exact"``, ``"builtin:regex"`` (:mod:`rolloutd.scoring.builtins`);
- ``"http://host:port/path"`` or ``https://...``: :mod:`rolloutd.scoring.http`.

Python verifiers, async ones included, run in worker processes (:mod:`rolloutd.scoring.pool`),
never on the service's event loop: a verifier that blocks, burns CPU, hangs or exits takes only
its worker with it. An async verifier runs on an event loop of its worker, one call at a time
per worker, so ``workers`` bounds how many run at once; a verifier that mostly waits on a remote
service is better served over HTTP.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from rolloutd.domain.fate import DropReason
from rolloutd.domain.finishing import FinishingGroup, SampleScore, ScoreStatus, Verdict
from rolloutd.domain.group import Sample
from rolloutd.entrypoints import EntryPointError, load
from rolloutd.scoring.builtins import BUILTINS
from rolloutd.scoring.inputs import ScoringInput, scoring_inputs
from rolloutd.scoring.pool import WorkerPool
from rolloutd.scoring.results import group_scores

log = logging.getLogger(__name__)

_URL = re.compile(r"^https?://", re.IGNORECASE)


class OnFailure(enum.Enum):
    """What becomes of a group with a failed score."""

    DROP = "drop"
    """Dropped, with :attr:`DropReason.SCORING_FAILED`."""
    DELIVER = "deliver"
    """Delivered with its failed scores (no reward, the reason in their info)."""


@dataclass(frozen=True)
class ScoringConfig:
    """What scores a finished group (see the module docstring for the verifier forms)."""

    verifier: str | None = None
    """Scores each sample: an entry point, ``builtin:<name>`` or an HTTP(S) URL."""
    group_verifier: str | None = None
    """Scores a group's samples in one call: an entry point. Excludes ``verifier``."""
    workers: int = 2
    """Worker processes for Python verifiers: how many calls run at once."""
    timeout_s: float = 30.0
    """The longest one call may take (a Python call's worker is then killed; an HTTP request is
    retried)."""
    on_failure: OnFailure = OnFailure.DROP
    """What becomes of a group with a failed score."""
    http_concurrency: int = 16
    """HTTP verifier: the most requests in flight at once."""
    http_retries: int = 3
    """HTTP verifier: retries of a request that timed out, could not connect or got a 5xx."""
    http_backoff_s: float = 0.2
    """HTTP verifier: the wait before the first retry; it doubles for each next one."""

    def __post_init__(self) -> None:
        if self.verifier is not None and self.group_verifier is not None:
            raise ValueError("set scoring.verifier or scoring.group_verifier, not both")
        if self.group_verifier is not None and not _is_entry_point(self.group_verifier):
            raise ValueError(
                f"scoring.group_verifier must be a 'package.module:function' entry point, "
                f"not {self.group_verifier!r}"
            )
        for key, value, least in (
            ("workers", self.workers, 1),
            ("http_concurrency", self.http_concurrency, 1),
            ("http_retries", self.http_retries, 0),
        ):
            if value < least:
                raise ValueError(f"scoring.{key} must be at least {least}, not {value}")
        if not self.timeout_s > 0:
            raise ValueError(f"scoring.timeout_s must be positive, not {self.timeout_s}")
        if not self.http_backoff_s >= 0:
            raise ValueError(f"scoring.http_backoff_s must be >= 0, not {self.http_backoff_s}")


@dataclass(frozen=True)
class FilterConfig:
    """Which scored groups are dropped before they become training-ready."""

    zero_variance: bool = False
    """Drop groups whose rewards' standard deviation is at most ``min_reward_std`` (DAPO's
    dynamic sampling: such a group carries no GRPO signal)."""
    min_reward_std: float = 0.0
    """With ``zero_variance``: the standard deviation at or below which a group is dropped; 0
    drops only groups of equal rewards; set it above 0 for continuous rewards."""

    def __post_init__(self) -> None:
        if not self.min_reward_std >= 0:
            raise ValueError(f"filter.min_reward_std must be >= 0, not {self.min_reward_std}")
        if self.min_reward_std > 0 and not self.zero_variance:
            raise ValueError("filter.min_reward_std is set but filter.zero_variance is off")


def _is_entry_point(spec: str) -> bool:
    return not _URL.match(spec) and not spec.startswith("builtin:")


class Scorer(Protocol):
    """Scores a group's samples: one score per input, in order; a verifier's failure is a
    FAILED score, never an exception."""

    async def start(self) -> None:
        """Gets ready to score (starts workers); optional, ``score`` does it when needed."""

    async def score(self, inputs: Sequence[ScoringInput]) -> list[SampleScore]: ...

    async def aclose(self) -> None: ...


class PoolScorer:
    """A Python verifier in worker processes: once per sample, or once per group."""

    def __init__(self, pool: WorkerPool, spec: str, *, group: bool = False) -> None:
        self.pool = pool
        self.spec = spec
        self.group = group

    async def start(self) -> None:
        await self.pool.start()

    async def score(self, inputs: Sequence[ScoringInput]) -> list[SampleScore]:
        if self.group:
            return await self.pool.call(self.spec, inputs, group=True)
        each = await asyncio.gather(*(self.pool.call(self.spec, [x]) for x in inputs))
        return [score for [score] in each]

    async def aclose(self) -> None:
        await self.pool.aclose()


def build_scorer(config: ScoringConfig) -> Scorer:
    """The scorer ``config`` names; an entry point is imported here once, so a wrong one is a
    start-up error naming its key, not a failed score per sample."""
    key, spec = (
        ("scoring.verifier", config.verifier)
        if config.verifier is not None
        else ("scoring.group_verifier", config.group_verifier)
    )
    if spec is None:
        raise ValueError("no verifier: set scoring.verifier or scoring.group_verifier")
    if _URL.match(spec):
        from rolloutd.scoring.http import HttpVerifier  # httpx: only when a URL is configured

        return HttpVerifier(
            spec,
            timeout_s=config.timeout_s,
            concurrency=config.http_concurrency,
            retries=config.http_retries,
            backoff_s=config.http_backoff_s,
        )
    if spec.startswith("builtin:"):
        name = spec.removeprefix("builtin:")
        if name not in BUILTINS:
            raise ValueError(f"{key}: no built-in {name!r}; there are {sorted(BUILTINS)}")
        spec = BUILTINS[name]
    try:
        load(spec)
    except EntryPointError as exc:
        raise EntryPointError(f"{key}: {exc}") from exc
    pool = WorkerPool(config.workers, config.timeout_s)
    return PoolScorer(pool, spec, group=config.group_verifier is not None)


class ScoringStage:
    """Scores each finished group, then commits it with its scores or drops it with a
    :class:`DropReason` (see the module docstring). Failed scores are decided first, then the
    filter. A dropped group's verdict carries its scores too, for whoever counts them."""

    def __init__(
        self,
        scorer: Scorer | None,
        *,
        on_failure: OnFailure = OnFailure.DROP,
        filter: FilterConfig | None = None,
        by_source: Mapping[str, Scorer] | None = None,
    ) -> None:
        """``scorer`` scores every group but those of a source in ``by_source``; a group with
        neither is committed unscored, unless its samples are episodes: their environment's
        rewards are then their scores (:func:`episode_scores`)."""
        self.scorer = scorer
        self.by_source = dict(by_source or {})
        self.on_failure = on_failure
        self.filter = filter or FilterConfig()

    @property
    def _scorers(self) -> list[Scorer]:
        return [*([self.scorer] if self.scorer else []), *self.by_source.values()]

    async def start(self) -> None:
        """Starts the scorers' workers now rather than on the first group, so that workers
        that cannot start fail the service's start-up instead of every group's scores."""
        for scorer in self._scorers:
            await scorer.start()

    async def finish(self, group: FinishingGroup) -> Verdict:
        scorer = self.by_source.get(group.source, self.scorer)
        episodes = [s.episode_end for s in group.samples]
        if scorer is None and not any(episodes):
            return Verdict()
        if scorer is None:
            given = [episode_score(s) for s in group.samples]
            if all(s is None for s in given):
                return Verdict()
            scores = group_scores(
                [s or SampleScore(None, ScoreStatus.FAILED, "no reward") for s in given]
            )
        else:
            scored = await scorer.score(scoring_inputs(group))
            # a verifier scores the conversation; an episode its environment failed has none
            scores = group_scores(
                [
                    SampleScore(None, ScoreStatus.FAILED, f"episode ended: {end.value}")
                    if end is not None and end.failed
                    else score
                    for score, end in zip(scored, episodes, strict=True)
                ]
            )
        failures = [s for s in scores.samples if s.status is ScoreStatus.FAILED]
        if failures:
            log.warning(
                "group %d: %d of %d scores failed, first: %s",
                group.group_id,
                len(failures),
                len(scores.samples),
                failures[0].info,
            )
            if self.on_failure is OnFailure.DROP:
                detail = f"{len(failures)} of {len(scores.samples)} scores failed"
                return Verdict(DropReason.SCORING_FAILED, detail, scores)
        if self.filter.zero_variance and scores.std <= self.filter.min_reward_std:
            detail = f"reward std {scores.std:.4g} <= {self.filter.min_reward_std}"
            return Verdict(DropReason.ZERO_VARIANCE, detail, scores)
        return Verdict(scores=scores)

    async def aclose(self) -> None:
        """Stops the scorers' workers (or closes their HTTP clients)."""
        for scorer in self._scorers:
            await scorer.aclose()


def episode_score(sample: Sample) -> SampleScore | None:
    """An episode's score from its environment: its reward, FAILED when the environment failed
    (the reason in ``info``); None when it gave no reward (or the sample is no episode)."""
    end = sample.episode_end
    if end is not None and end.failed:
        return SampleScore(None, ScoreStatus.FAILED, f"episode ended: {end.value}")
    if sample.episode_reward is None:
        return None
    return SampleScore(sample.episode_reward)


def build_stage(
    scoring: ScoringConfig,
    filter: FilterConfig,
    source_verifiers: Mapping[str, str] | None = None,
    *,
    episodes: bool = False,
) -> ScoringStage | None:
    """The stage ``scoring`` and ``filter`` configure, with a verifier of its own for each
    source in ``source_verifiers`` (``dataset.sources[].verifier``); None when nothing asks for
    anything (no verifier, no filter). A filter without a verifier has no rewards to filter on:
    an error."""
    by_source = {
        name: build_scorer(replace(scoring, verifier=spec, group_verifier=None))
        for name, spec in (source_verifiers or {}).items()
    }
    if scoring.verifier is None and scoring.group_verifier is None:
        if by_source:
            return ScoringStage(
                None, on_failure=scoring.on_failure, filter=filter, by_source=by_source
            )
        if episodes:  # environments' rewards
            return ScoringStage(None, on_failure=scoring.on_failure, filter=filter)
        if filter.zero_variance:
            raise ValueError(
                "filter.zero_variance needs rewards: set scoring.verifier or scoring.group_verifier"
            )
        return None
    return ScoringStage(
        build_scorer(scoring), on_failure=scoring.on_failure, filter=filter, by_source=by_source
    )
