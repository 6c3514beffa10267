"""Writes the format-2 store that ``test_groups.py`` restores: run it with a rolloutd that writes
format 2 (group metadata as one JSON string per group), e.g. the commit before format 3::

    git archive d2a90a1 service | tar -x -C /tmp/format2
    PYTHONPATH=/tmp/format2/service:. python tests/checkpoint/data/make_format2.py \\
        tests/checkpoint/data/format2

Two snapshots, so the second lists the first's group segment with superseded groups. Groups in
every state a snapshot keeps (committed, acked, generating with a staged sibling), prompts with
metadata and chat messages, and a submitted prompt (no dataset position). ``expected.json`` holds
what the writer's own code said each group and its rows were.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
from array import array
from pathlib import Path

from rolloutd.checkpoint import sidecar
from rolloutd.checkpoint.checkpointer import Checkpointer, CheckpointerConfig
from rolloutd.checkpoint.format import FORMAT_VERSION
from rolloutd.checkpoint.store import SnapshotStore
from rolloutd.domain.controller import Controller, ControllerConfig
from rolloutd.domain.group import Group, GroupMeta, Prompt, Sample
from rolloutd.domain.mutation import MutationKind
from rolloutd.domain.report import Trigger
from rolloutd.domain.sampler import Sampler
from rolloutd.engines.synthetic import SyntheticEngine
from tests.controllers import fetch

FINGERPRINT = {"model": "format2", "group_size": 2}
GROUP_SIZE = 2
PROMPTS = [
    Prompt(f"p{i}", f"question {i}", metadata={"answer": i, "tags": ["a", "b"]} if i % 2 else None)
    for i in range(6)
] + [Prompt("chat", "", messages=({"role": "user", "content": "hi \u00e9"},))]


def sample(index: int, n: int) -> Sample:
    return Sample(
        index=index,
        token_ids=array("i", range(n, 2 * n)),
        logprobs=array("f", [-0.5] * n),
        text=f"text {n} \u4e2d",
        finish_reason="stop",
        policy_version=0,
        prompt_token_ids=array("i", [1, 2, 3]),
        seed=n,
        started_at=1_700_000_000.0 + n,
        finished_at=1_700_000_001.0 + n,
    )


def controller(store: SnapshotStore) -> Controller:
    return Controller(
        ControllerConfig(group_size=GROUP_SIZE, buffer_capacity=64, rewind_window=100),
        SyntheticEngine(),
        Sampler(PROMPTS, seed=0, epochs=1),
        journal=store.journal,
    )


async def admit(ctl: Controller, n: int, position: bool = True) -> list[Group]:
    groups = []
    async with ctl.barrier.mutation(MutationKind.ADMIT):
        for _ in range(n):
            admission = ctl.rooms.sampler.next()
            assert admission is not None
            gid = ctl.rooms.ids.next_local
            ctl.rooms.ids.next_local += 1
            meta = GroupMeta(
                group_id=gid,
                prompt=admission.prompt,
                position=admission.position if position else None,
                group_size=GROUP_SIZE,
                policy_version=0,
                admitted_at=1_700_000_000.0 + gid,
                seed=gid * 31,
            )
            ctl.rooms.buffer.add(Group(meta))
            groups.append(ctl.rooms.buffer.groups[gid])
    return groups


async def stage(ctl: Controller, group: Group, indices: range, commit: bool) -> None:
    async with ctl.barrier.mutation(MutationKind.STAGE_SAMPLE):
        for i in indices:
            ctl.rooms.buffer.stage(group.group_id, sample(i, 4 + 3 * group.group_id + i))
    if commit:
        async with ctl.barrier.mutation(MutationKind.COMMIT_GROUP):
            ctl.rooms.buffer.finish(group.group_id)
            ctl.rooms.buffer.commit(group.group_id, 1_700_000_100.0 + group.group_id)


async def main(out: Path) -> None:
    if FORMAT_VERSION != 2:
        raise SystemExit(f"this rolloutd writes format {FORMAT_VERSION}, not 2")
    shutil.rmtree(out, ignore_errors=True)
    store = SnapshotStore(str(out / "store"))
    ctl = controller(store)
    checkpointer = Checkpointer(ctl, store, store.journal, CheckpointerConfig(), FINGERPRINT)
    groups = await admit(ctl, 4)
    for g in groups[:3]:
        await stage(ctl, g, range(GROUP_SIZE), commit=True)
    await stage(ctl, groups[3], range(1), commit=False)  # one sibling staged, one missing
    assert (await checkpointer.checkpoint(Trigger.ON_DEMAND)).sequence == 1
    lease, _ = await fetch(ctl, 1, 0, "trainer")
    await ctl.ack(lease.lease_id, 5)  # acked, not finalized: supersedes its first row
    more = await admit(ctl, 1) + await admit(ctl, 1, position=False)
    await stage(ctl, more[0], range(GROUP_SIZE), commit=True)
    assert (await checkpointer.checkpoint(Trigger.ON_DEMAND)).sequence == 2
    expected = {
        "fingerprint": FINGERPRINT,
        "groups": {
            str(g.group_id): {
                "meta": json.loads(sidecar.encode_group(g.meta)),
                "rows": {str(i): list(s.token_ids) for i, s in sorted(g.samples.items())},
            }
            for g in ctl.rooms.buffer.groups.values()
        },
        "cursor": [ctl.rooms.sampler.cursor.epoch, ctl.rooms.sampler.cursor.offset],
    }
    (out / "expected.json").write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")
    journal = out / "store" / "journal"
    print(f"wrote {out}: {len(expected['groups'])} groups; journal {sorted(journal.iterdir())}")


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1])))
