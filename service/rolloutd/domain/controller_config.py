"""The controller's settings: one frozen value, each field documented, which ``rolloutd.config``
exposes as keys (``limits.*``, ``group_size`` ...) and the rooms read their parts of."""

from __future__ import annotations

from dataclasses import dataclass, field

from rolloutd.domain.concurrency import ConcurrencyConfig
from rolloutd.domain.engine import SamplingParams
from rolloutd.domain.spec import SpecLimits


@dataclass(frozen=True)
class ControllerConfig:
    """The controller's settings; ``config/components.py`` exposes them as keys (``limits.*``,
    ``group_size``) with these defaults and meanings."""

    group_size: int = 4
    """Siblings per prompt (N in GRPO)."""
    max_in_flight: int = 16
    """Most groups generating or finishing at once (with ``concurrency``: the most its adaptive
    limit may reach)."""
    concurrency: ConcurrencyConfig | None = None
    """The adaptive limit on groups in flight (``limits.max_in_flight: auto``,
    domain/concurrency.py); None: ``max_in_flight`` is fixed."""
    buffer_capacity: int = 256
    """Most groups generating, finishing, ready or leased. Acked groups waiting for finalization
    are not counted (else a trainer could stall admission for good); ``rewind_window`` bounds
    them."""
    max_staleness: int = 4
    """Groups more than this many policy versions old are evicted."""
    staleness_gating: bool = True
    """Admit only as many groups as trainers can still consume within ``max_staleness`` policy
    versions, at the pace they were seen to consume per version (until a version change shows
    it: ``max_in_flight`` groups a version), so that eviction is left for what no pace foresees
    (a trainer that stops). Off: admission fills the buffer, and what falls too far behind is
    evicted."""
    lease_timeout_s: float = 300.0
    """An unacknowledged lease expires after this long and its groups become available again.
    Time the service did not run (frozen, a paused VM) does not count."""
    rewind_window: int = 8
    """Acked groups wait at most this many trainer steps for Checkpoint before finalizing."""
    max_fetch_groups: int = 1024
    """Largest max_groups a FetchGroups request may ask for."""
    max_wait_ms: int = 600_000
    """Longest wait_ms a FetchGroups request may ask for."""
    seed: int = 0
    """Root of every group's and sibling's seed."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    """The service's sampling settings: a group's unless its prompt or source sets its own."""
    spec_limits: SpecLimits = field(default_factory=SpecLimits)
    """What a prompt's generation settings may ask for."""
    sibling_retries: int = 2
    """Attempts after a recoverable engine error before the group is dropped."""
    reap_interval_s: float = 1.0
    """How often expired leases are looked for."""
    replica: int = 0
    """This replica's index in the fleet, from 0 (``--replica``; in Kubernetes the pod's
    ordinal). It owns the dataset rows whose index modulo ``fleet.replicas`` is this one, and it
    is the high bits of every group id the replica issues, so ids are unique across the fleet."""
    replicas: int = 1
    """Replicas sharing one dataset (``--replicas``): each prompt is owned by one of them, so the
    fleet delivers each prompt once an epoch. A store restores only under the fleet size (and
    replica index) it was written with."""
    capture_partials: bool = True
    """Stream each sibling's tokens into a staging area that checkpoints capture, so a restart
    continues unfinished siblings from their tokens (``recovery.granularity: token``)."""
    max_metadata_bytes: int = 8 << 20
    """Largest prompt ``metadata``, as JSON in UTF-8, that ``SubmitPrompts`` accepts (it is
    delivered with every group of the prompt, so it must fit a gRPC message twice over)."""
    max_submit_bytes: int = 32 << 20
    """Most bytes of prompts (text, messages and metadata as JSON) one ``SubmitPrompts`` may
    carry; a larger call is refused whole."""
    max_lease_expiries: int = 8
    """A group whose leases expired this many times unacknowledged is dropped
    (``lease_expiries``) instead of being leased again: a group no trainer can take must not
    cycle for good. Counted since the service started."""
    max_version_step: int = 1_000_000
    """How far one ``UpdateWeights`` may move the policy version ahead of the current one: a
    version beyond it is refused, so one wrong value cannot block every later update."""
    max_step_ahead: int = 1_000_000
    """How far the trainer step of one ``AckGroups`` or ``Checkpoint`` may be ahead of the
    highest step the service has seen (acked or finalized): one wrong value would otherwise
    finalize everything before it and refuse every ``Rewind`` below it."""
    durable_turns: bool = True
    """Journal each episode record before it is relied on (``episodes.durable_turns``); off,
    records are kept in memory and snapshots only."""
