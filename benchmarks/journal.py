"""Journal benchmark: durable writes per second with group commit, against this disk and S3 (moto).

Every ack, lease grant and accepted submission is journaled before its RPC returns. Writers that
arrive while a sync runs share the next one (group commit), so throughput should grow with the
number of concurrent writers while syncs (local ``fdatasync``) or puts (S3 objects) per record
fall. For 1, 4, 16 and 64 writers on one event loop (as the service's RPCs are), each queueing
records the size of an ack of 4 groups with ``Journal.enqueue`` on a real ``SnapshotStore``'s
journal and waiting until each is durable, this measures records per second, syncs per record
and the latency of one write (p50, p99). One writer is the baseline: one sync per record.

S3 is moto's server on this machine (HTTP on loopback): its figures show the batching (puts per
record), not the latency of a real object store.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import common
import fsspec
from moto.server import ThreadedMotoServer

from rolloutd.checkpoint.store import SnapshotStore

BUCKET = "rolloutd-bench-journal"
RECORD = {
    "kind": "ack",
    "lease_id": uuid.uuid4().hex,
    "group_ids": [1, 2, 3, 4],
    "trainer_step": 7,
    "acked_at": 1.7e9,
    "groups": [
        {"group_id": g, "prompt": {"id": f"p{g}", "text": "what is 2 + 2?" * 4}, "position": [0, g]}
        for g in range(4)
    ],
}


def measure(store: SnapshotStore, writers: int, records: int) -> dict[str, Any]:
    """``records`` writes split over ``writers`` tasks on one event loop that start together."""
    return asyncio.run(_measure(store, writers, records))


async def _measure(store: SnapshotStore, writers: int, records: int) -> dict[str, Any]:
    journal = store.journal
    per_writer = max(records // writers, 1)
    latencies: list[float] = []
    start = asyncio.Barrier(writers + 1)

    async def write() -> None:
        await start.wait()
        for _ in range(per_writer):
            t = time.perf_counter()
            await journal.enqueue(RECORD)
            latencies.append(time.perf_counter() - t)

    tasks = [asyncio.create_task(write()) for _ in range(writers)]
    syncs_before = journal.syncs
    await start.wait()
    began = time.perf_counter()
    await asyncio.gather(*tasks)
    seconds = time.perf_counter() - began
    written = per_writer * writers
    syncs = journal.syncs - syncs_before
    return {
        "writers": writers,
        "records": written,
        "seconds": seconds,
        "records_per_s": written / seconds,
        "syncs": syncs,
        "syncs_per_record": syncs / written,
        "latency_ms": common.summary(latencies, 1e3),
    }


def run(where: str, open_store, writer_counts: list[int], records: int) -> list[dict[str, Any]]:
    rows = []
    for writers in writer_counts:
        store = open_store()
        row = {"store": where, **measure(store, writers, records)}
        common.progress(
            f"{where}: {writers:3d} writers: {row['records_per_s']:8.0f} records/s, "
            f"{row['syncs_per_record']:.3f} syncs/record, p99 {row['latency_ms']['p99']:.1f} ms"
        )
        rows.append(row)
    return rows


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    plt = common.pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for where in sorted({r["store"] for r in rows}):
        mine = [r for r in rows if r["store"] == where]
        xs = [r["writers"] for r in mine]
        left.plot(xs, [r["records_per_s"] for r in mine], marker="o", label=where)
        right.plot(xs, [r["syncs_per_record"] for r in mine], marker="o", label=where)
    for ax, title in ((left, "durable records / s"), (right, "syncs (puts) per record")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent writers")
        ax.set_title(title)
        ax.legend()
    left.set_yscale("log")
    common.save_figure(fig, path)


def main() -> None:
    args = common.parse_args(__doc__.splitlines()[0])
    started = time.time()
    writer_counts = [1, 4, 16] if args.quick else [1, 4, 16, 64]
    records = 400 if args.quick else 2000
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's request log
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    s3 = {"endpoint_url": f"http://{host}:{port}", "key": "bench", "secret": "bench"}
    fsspec.filesystem("s3", **s3, skip_instance_cache=True).mkdir(BUCKET)
    try:
        with tempfile.TemporaryDirectory(prefix="rolloutd-journal-") as tmp:
            rows = run(
                "local",
                lambda: SnapshotStore(str(Path(tmp) / uuid.uuid4().hex)),
                writer_counts,
                records,
            )
        rows += run(
            "s3 (moto)",
            lambda: SnapshotStore(f"s3://{BUCKET}/{uuid.uuid4().hex}", s3),
            writer_counts,
            records // 4,
        )
    finally:
        server.stop()
    local = {r["writers"]: r for r in rows if r["store"] == "local"}
    most = max(local)
    gain = local[most]["records_per_s"] / local[1]["records_per_s"]
    headline = [
        common.headline(
            f"local records/s, {most} writers vs 1 (group commit)", gain, "x", "> 1", gain > 1
        ),
        common.headline(
            f"local syncs per record, {most} writers", local[most]["syncs_per_record"], "", "< 1",
            local[most]["syncs_per_record"] < 1,
        ),
    ]  # fmt: skip
    result = {
        "quick": args.quick,
        "machine": common.machine(),
        "revision": common.revision(),
        "started_at": started,
        "record_bytes": len(str(RECORD)),
        "rows": rows,
        "headline": headline,
    }
    table = common.markdown_table(
        ["store", "writers", "records/s", "syncs/record", "p50 ms", "p99 ms"],
        [
            (
                r["store"],
                r["writers"],
                r["records_per_s"],
                r["syncs_per_record"],
                r["latency_ms"]["p50"],
                r["latency_ms"]["p99"],
            )
            for r in rows
        ],
    )
    text = (
        f"# Journal writes\n\n{'Quick run. ' if args.quick else ''}Durable journal records (an "
        "ack of 4 groups each) written by concurrent writers on one event loop to a real store; group commit "
        "shares one sync among the writers waiting for it. S3 is moto on loopback.\n\n"
        + common.headline_table(headline)
        + "\n"
        + table
    )
    common.publish(result, args.json, "journal", text, lambda _, png: plot(rows, png))


if __name__ == "__main__":
    main()
