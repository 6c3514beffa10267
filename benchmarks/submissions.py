"""Submissions benchmark: bytes a checkpoint writes for submitted prompts, against the history.

Every prompt ever accepted by ``SubmitPrompts`` is kept for idempotency by prompt id. A snapshot
writes only the prompts accepted since its parent, as a submissions piece that later snapshots list
again (``checkpoint/submissions.py``). For histories of 1,000, 10,000 and 100,000 submitted prompts
(100,000 omitted with ``--quick``), this checkpoints once, then checkpoints 20 times after 10 new
prompts each, on a real local ``SnapshotStore``, and reports the bytes each of those checkpoints
wrote (submissions pieces, sidecar, total, as the manifests list them), its wall time, the pieces
the newest manifest lists, and how long a restore of the newest snapshot takes. Before pieces, the
sidecar held the whole history: every checkpoint wrote it all again.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

import common

from rolloutd.checkpoint.checkpointer import Checkpointer, CheckpointerConfig
from rolloutd.checkpoint.restore import Granularity, restore
from rolloutd.checkpoint.store import SnapshotStore
from rolloutd.domain.controller import Controller, ControllerConfig
from rolloutd.domain.group import Prompt
from rolloutd.domain.report import SizePart, Trigger
from rolloutd.domain.sampler import Admission, Sampler
from rolloutd.engines.synthetic import SyntheticEngine

ROUNDS = 20
NEW_PER_ROUND = 10


def prompt(i: int) -> Prompt:
    """About 200 bytes as a line, like a short math problem with its answer as metadata."""
    text = f"Solve the following problem step by step and give the final answer: item {i}. " * 2
    return Prompt(f"s{i}", text, metadata={"answer": i})


def node(root: str) -> tuple[Controller, Checkpointer]:
    """A controller that is never started (nothing is admitted) and its checkpointer."""
    store = SnapshotStore(root)
    controller = Controller(
        ControllerConfig(group_size=2, max_in_flight=2, buffer_capacity=4),
        SyntheticEngine(),
        Sampler([Prompt("d", "x")], seed=1, epochs=1, max_pending=10_000_000),
        journal=store.journal,
    )
    return controller, Checkpointer(controller, store, store.journal, CheckpointerConfig(), {})


async def submit(controller: Controller, start: int, stop: int) -> None:
    for s in range(start, stop, 10_000):
        batch = [Admission(prompt(i), None) for i in range(s, min(stop, s + 10_000))]
        await controller.submit(batch)


async def measure(history: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="rolloutd-submissions-") as tmp:
        root = str(Path(tmp) / "store")
        controller, checkpointer = node(root)
        await submit(controller, 0, history)
        first = await checkpointer.checkpoint(Trigger.ON_DEMAND)
        written: dict[str, list[float]] = {"submissions": [], "sidecar": [], "total": [], "ms": []}
        for k in range(ROUNDS):
            start = history + k * NEW_PER_ROUND
            await submit(controller, start, start + NEW_PER_ROUND)
            report = await checkpointer.checkpoint(Trigger.ON_DEMAND)
            written["submissions"].append(report.size_bytes[SizePart.SUBMISSIONS])
            written["sidecar"].append(report.size_bytes[SizePart.SIDECAR])
            written["total"].append(report.size_bytes[SizePart.TOTAL])
            written["ms"].append(report.seconds * 1e3)
        store = SnapshotStore(root)
        pieces = len(store.load(store.sequences()[0]).submissions)
        fresh, fresh_checkpointer = node(root)
        began = time.perf_counter()
        await restore(fresh, store, fresh_checkpointer, "latest", {}, Granularity.SIBLING)
        restore_s = time.perf_counter() - began
        assert fresh.sampler.pending == history + ROUNDS * NEW_PER_ROUND
    return {
        "history": history,
        "first_bytes": first.size_bytes[SizePart.TOTAL],
        "submissions_bytes": common.summary(written["submissions"]),
        "sidecar_bytes": common.summary(written["sidecar"]),
        "total_bytes": common.summary(written["total"]),
        "checkpoint_ms": common.summary(written["ms"]),
        "pieces": pieces,
        "restore_s": restore_s,
    }


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r["history"] for r in rows]
    ax.plot(xs, [r["first_bytes"] for r in rows], marker="o", label="whole history (first)")
    ax.plot(xs, [r["total_bytes"]["p50"] for r in rows], marker="o", label="after 10 new, median")
    ax.plot(xs, [r["total_bytes"]["max"] for r in rows], marker="o", label="after 10 new, max")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("prompts submitted before")
    ax.set_ylabel("bytes written by one checkpoint")
    ax.legend()
    common.save_figure(fig, path)


def main() -> None:
    args = common.parse_args(__doc__.splitlines()[0])
    started = time.time()
    histories = [1_000, 10_000] if args.quick else [1_000, 10_000, 100_000]
    rows = []
    for history in histories:
        row = asyncio.run(measure(history))
        common.progress(
            f"{history:7d} submitted: then 10 new write {row['total_bytes']['p50']:.0f} B median, "
            f"{row['total_bytes']['max']:.0f} B max ({row['first_bytes']} B for all), "
            f"{row['pieces']} pieces, restore {row['restore_s']:.2f} s"
        )
        rows.append(row)
    largest = rows[-1]
    ratio = largest["total_bytes"]["p50"] / largest["first_bytes"]
    headline = [
        common.headline(
            f"bytes of a checkpoint after {NEW_PER_ROUND} new prompts, over {largest['history']} "
            "submitted before (median, fraction of the whole history)",
            ratio, "", "< 0.01", ratio < 0.01,
        ),
    ]  # fmt: skip
    result = {
        "quick": args.quick,
        "machine": common.machine(),
        "revision": common.revision(),
        "started_at": started,
        "rows": rows,
        "headline": headline,
    }
    table = common.markdown_table(
        [
            "submitted before",
            "all (first) B",
            "next: total p50 B",
            "total max B",
            "submissions p50 B",
            "sidecar p50 B",
            "checkpoint p50 ms",
            "pieces",
            "restore s",
        ],
        [
            (
                r["history"],
                r["first_bytes"],
                r["total_bytes"]["p50"],
                r["total_bytes"]["max"],
                r["submissions_bytes"]["p50"],
                r["sidecar_bytes"]["p50"],
                r["checkpoint_ms"]["p50"],
                r["pieces"],
                r["restore_s"],
            )
            for r in rows
        ],
    )
    text = (
        f"# Submitted prompts in checkpoints\n\n{'Quick run. ' if args.quick else ''}A history "
        f"of submitted prompts is checkpointed once, then {ROUNDS} checkpoints follow "
        f"{NEW_PER_ROUND} new prompts each (local store). Bytes are those each checkpoint wrote "
        "(new files its manifest lists); max includes the occasional merge of recent pieces.\n\n"
        + common.headline_table(headline)
        + "\n"
        + table
    )
    common.publish(result, args.json, "submissions", text, lambda _, png: plot(rows, png))


if __name__ == "__main__":
    main()
