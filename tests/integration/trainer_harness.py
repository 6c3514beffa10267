"""A trainer that survives service crashes and checks the delivery contract as it goes.

It counts a group as acknowledged only when an ``AckGroups`` call returned OK; an ack whose RPC
died with the service is retried after the restart (OK or already-acked: it was durable;
NOT_FOUND: it was not, and the group will be delivered again).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import grpc

from rolloutd.v1 import rollout_pb2 as pb
from rolloutd.v1 import rollout_pb2_grpc as pb_grpc


class ContractViolation(AssertionError):
    pass


@dataclass
class Trainer:
    step: int = 0
    acked: Counter[str] = field(default_factory=Counter)
    """prompt position key -> times acknowledged."""
    pending: list[tuple[str, list[str], int]] = field(default_factory=list)
    """(lease_id, keys, trainer_step) whose ack RPC failed with the service; retried with the
    same step (the step that consumed the groups)."""
    delivered: int = 0
    checkpoint_every: int = 4
    """Call Checkpoint(trainer_step) every this many steps, as a trainer saving its own state."""

    @staticmethod
    def key(g: pb.Group) -> str:
        return (
            f"{g.epoch}:{g.offset}" if g.source == pb.PROMPT_SOURCE_DATASET else f"s:{g.prompt_id}"
        )

    def _ack(
        self,
        stub: pb_grpc.RolloutServiceStub,
        lease_id: str,
        keys: list[str],
        step: int | None = None,
    ) -> None:
        if step is None:
            self.step += 1
            step = self.step
        try:
            stub.AckGroups(pb.AckGroupsRequest(lease_id=lease_id, trainer_step=step), timeout=10)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:  # type: ignore[attr-defined]
                return  # never durable: the groups come back
            self.pending.append((lease_id, keys, step))
            raise
        self.acked.update(keys)

    def run(self, address: str, seconds: float, through_step: int = 0) -> None:
        """Fetch and ack for up to ``seconds``, and on until step ``through_step`` is acked (what
        a test checks that needs those steps, however slowly the machine runs); returns early
        when the service goes away."""
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.RolloutServiceStub(channel)
            retry, self.pending = self.pending, []
            for lease_id, keys, step in retry:
                self._ack(stub, lease_id, keys, step)
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline or self.step < through_step:
                r = stub.FetchGroups(pb.FetchGroupsRequest(max_groups=3, wait_ms=200), timeout=10)
                if not r.lease_id:
                    continue
                keys = [self.key(g) for g in r.groups]
                self.delivered += len(keys)
                again = [k for k in keys if self.acked[k]]
                if again:
                    raise ContractViolation(f"acknowledged groups delivered again: {again}")
                self._ack(stub, r.lease_id, keys)
                if self.step % self.checkpoint_every == 0:
                    c = stub.Checkpoint(
                        pb.CheckpointRequest(trainer_step=self.step, tag=f"step-{self.step}"),
                        timeout=30,
                    )
                    if c.outcome == pb.CHECKPOINT_OUTCOME_FAILED:
                        raise ContractViolation(
                            f"checkpoint at step {self.step} failed: {c.message}"
                        )

    def status(self, address: str) -> pb.GetStatusResponse:
        with grpc.insecure_channel(address) as channel:
            return pb_grpc.RolloutServiceStub(channel).GetStatus(pb.GetStatusRequest(), timeout=10)
