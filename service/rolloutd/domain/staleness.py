"""Staleness gating: admit only the groups a trainer can still consume in time.

A group admitted at policy version ``v`` is evicted once the served version passes
``v + max_staleness``, and its tokens are wasted. Eviction is the safety net; the gate avoids it
by asking, before each admission, how many more groups the trainer will consume before a group
admitted now would become too stale, and admitting no more than that.

The trainer's consumption is measured in groups leased per policy version (a lease is when a
group reaches a trainer, and staleness is judged there), smoothed over versions. A group admitted
now waits behind every group already generating, finishing or ready (``outstanding``), so it is
consumed in time when::

    outstanding < (rest of the current version) + per_version * max_staleness

where the rest of the current version is ``per_version`` minus what was consumed since the
version began, or what trainers are waiting for right now when that is more: a trainer that asks
for groups and finds none shows that it consumes more than the estimate, and is never left
waiting on an estimate (each waiting fetch counts for up to one version's consumption, and at
least one group).

Before the first version change after a group reached a trainer there is nothing measured, and
the estimate is ``prior_per_version`` (or what trainers consumed so far, when that is more): the
controller passes ``limits.max_in_flight``, so until a trainer has shown its pace the window
holds ``limits.max_in_flight x (max_staleness + 1)`` groups. A trainer that consumes fewer a
version than that finds the surplus of the first versions evicted, once.

Pure arithmetic on counts. The policy room (:mod:`rolloutd.domain.policy`) holds it: admission
asks it before each admission, leasing tells it what was leased and what fetches wait for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MIN_PER_VERSION = 1.0
"""The least consumption per version the gate assumes once it has measured: a trainer that
consumed nothing for a while (it trained on other data) and then polls without waiting still
gets groups."""


@dataclass(frozen=True)
class GateState:
    """What a snapshot keeps of the gate: the trainer's pace, so a restart does not start from
    the prior again."""

    per_version: float | None = None
    """Groups consumed per policy version, smoothed; None before the first version change."""


class StalenessGate:
    """Counts consumption per policy version and says how many more groups may be admitted; see
    the module docstring."""

    def __init__(
        self,
        max_staleness: int,
        prior_per_version: float,
        *,
        version: int = 0,
        smoothing: float = 0.5,
    ) -> None:
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        self.max_staleness = max_staleness
        self.prior_per_version = prior_per_version
        self.smoothing = smoothing
        """Weight of the newest version's consumption in the estimate."""
        self.per_version: float | None = None
        self.version = version
        """The policy version whose consumption is being counted."""
        self.consumed = 0
        """Groups leased since :attr:`version` began."""
        self._waiting: dict[int, int] = {}
        """``max_groups`` of the fetches waiting right now -> how many ask for it."""

    @property
    def estimate(self) -> float:
        """Groups a trainer consumes per version: measured; before any measure, the prior or
        what trainers consumed at this version so far, whichever is more (a trainer that never
        changes the version is never held back by the prior)."""
        if self.per_version is None:
            return max(self.prior_per_version, float(self.consumed))
        return max(self.per_version, MIN_PER_VERSION)

    def wait_started(self, max_groups: int) -> None:
        """A fetch for up to ``max_groups`` found nothing ready and waits."""
        self._waiting[max_groups] = self._waiting.get(max_groups, 0) + 1

    def wait_ended(self, max_groups: int) -> None:
        left = self._waiting[max_groups] - 1
        if left:
            self._waiting[max_groups] = left
        else:
            del self._waiting[max_groups]

    def waiting(self) -> int:
        """What the waiting fetches ask for, each at most one version's consumption (a fetch
        takes whatever is ready, so its ``max_groups`` is an upper bound, not a demand) and at
        least one group (so a trainer is never left waiting on an estimate)."""
        each = max(1, math.ceil(self.estimate))
        return sum(min(ask, each) * n for ask, n in self._waiting.items())

    def leased(self, groups: int) -> None:
        """``groups`` reached a trainer at the current version."""
        self.consumed += groups

    def version_changed(self, version: int) -> None:
        """The served policy version is now ``version``: what was consumed since the last change,
        per version it moved (an update may skip versions), joins the estimate."""
        steps = version - self.version
        if steps <= 0 or (self.per_version is None and not self.consumed):
            # nothing to learn from versions before the first group reached a trainer (a
            # trainer loads its first weights before it fetches)
            self.version, self.consumed = version, 0
            return
        observed = self.consumed / steps
        if self.per_version is None:
            self.per_version = observed
        else:
            self.per_version += self.smoothing * (observed - self.per_version)
        self.version, self.consumed = version, 0

    def room(self, outstanding: int) -> int:
        """How many more groups may be admitted now, behind ``outstanding`` ones (generating,
        finishing or ready), to be consumed within ``max_staleness`` versions; never negative."""
        per_version = self.estimate
        now = max(per_version - self.consumed, float(self.waiting()))
        window = now + per_version * self.max_staleness
        return max(0, math.floor(window - outstanding + 1e-9))

    def state(self) -> GateState:
        return GateState(self.per_version)

    def restore(self, state: GateState, version: int) -> None:
        """Continues from a snapshot's estimate, counting from ``version`` (the restored one)."""
        self.per_version = state.per_version
        self.version, self.consumed = version, 0
