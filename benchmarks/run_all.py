"""Run every benchmark present, streaming its progress, then summarize their headline figures.

``make bench`` runs this; ``make bench-quick`` passes ``--quick`` on to each benchmark. Each
``benchmarks/<name>.py`` runs as a subprocess with ``--json <results>/<name>.json``; afterwards
``summary.md`` and ``summary.json`` in the same folder list every headline figure with its target.
A benchmark that fails is reported as such (and this script exits non-zero), never summarized
from an older result file.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import common

HERE = Path(__file__).resolve().parent
KNOWN = (
    "checkpoint",
    "control_plane",
    "telemetry_overhead",
    "throughput",
    "weights",
    "recovery",
    "scoring",
    "episodes",
    "admission",
)
"""Run first, in this order; any other benchmark script found runs after them."""
NOT_BENCHMARKS = {"common", "run_all"}


def discover() -> list[str]:
    found = {p.stem for p in HERE.glob("*.py") if p.stem not in NOT_BENCHMARKS}
    found = {name for name in found if not name.startswith("_")}
    return [n for n in KNOWN if n in found] + sorted(found - set(KNOWN))


def run_one(name: str, results: Path, quick: bool) -> dict[str, Any]:
    """Runs ``benchmarks/<name>.py``, prefixing each line it prints with its name."""
    json_path = results / f"{name}.json"
    command = [sys.executable, "-u", str(HERE / f"{name}.py"), "--json", str(json_path)]
    if quick:
        command.append("--quick")
    common.progress(f"{name}: {' '.join(command[2:])}")
    started = time.time()
    with subprocess.Popen(
        command,
        cwd=HERE.parent,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            print(f"  {name} | {line.rstrip()}", flush=True)
    seconds = time.time() - started
    outcome: dict[str, Any] = {"name": name, "rc": proc.returncode, "seconds": seconds}
    fresh = json_path.exists() and json_path.stat().st_mtime >= started
    if proc.returncode != 0 or not fresh:
        outcome["status"] = "failed" if proc.returncode != 0 else "no results"
        common.progress(f"{name}: {outcome['status']} (exit code {proc.returncode})")
        return outcome
    data = json.loads(json_path.read_text())
    outcome |= {
        "status": "ok",
        "json": json_path.name,
        "quick": data.get("quick", quick),
        "headline": data.get("headline", []),
    }
    for extra in (".md", ".png"):
        if json_path.with_suffix(extra).exists():
            outcome[extra[1:]] = json_path.with_suffix(extra).name
    common.progress(f"{name}: done in {seconds:.0f} s")
    return outcome


def summary_markdown(
    quick: bool, outcomes: list[dict[str, Any]], conditions: dict[str, Any]
) -> str:
    load = conditions["load_avg_1m_5m_15m"]
    kind = (
        "Quick runs (`make bench-quick`): smaller workloads, see each result for what changes."
        if quick
        else "Full runs (`make bench`)."
    )
    lines = [
        "# Benchmark summary\n",
        f"{kind} Commit {conditions['commit'] or '?'}"
        + (
            f" with uncommitted changes to {', '.join(conditions['uncommitted'])}"
            if conditions["uncommitted"]
            else ""
        )
        + f"; {conditions['cpus']} CPUs shared with other work (load average "
        f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} at the end); {conditions['finished_at']}. "
        "Ratios compare figures measured side by side in the same run.\n",
    ]
    items = []
    for o in outcomes:
        for item in o.get("headline", []):
            items.append({**item, "name": f"{o['name']}: {item['name']}"})
    if items:
        lines.append(common.headline_table(items))
    lines.append("\n| benchmark | status | seconds | details |\n|---|---|---|---|")
    for o in outcomes:
        details = ", ".join(f"[{o[k]}]({o[k]})" for k in ("md", "png", "json") if k in o)
        lines.append(f"| {o['name']} | {o['status']} | {o['seconds']:.0f} | {details} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="pass --quick to every benchmark")
    parser.add_argument(
        "--only", action="append", default=None, metavar="NAME", help="run only these (repeatable)"
    )
    parser.add_argument("--results", type=Path, default=common.RESULTS, help="output folder")
    args = parser.parse_args()

    names = discover()
    if args.only:
        unknown = sorted(set(args.only) - set(names))
        if unknown:
            common.fail(f"no benchmark named {', '.join(unknown)}; found {', '.join(names)}")
        names = [n for n in names if n in args.only]
    common.progress(f"benchmarks: {', '.join(names)}{' (quick)' if args.quick else ''}")
    args.results.mkdir(parents=True, exist_ok=True)
    outcomes = [run_one(name, args.results, args.quick) for name in names]

    conditions = {
        **common.machine(),
        **common.revision(),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    summary = {"quick": args.quick, "conditions": conditions, "benchmarks": outcomes}
    common.write_json(args.results / "summary.json", summary)
    text = summary_markdown(args.quick, outcomes, conditions)
    common.write_text(args.results / "summary.md", text)
    print()
    print(text)
    if any(o["status"] != "ok" for o in outcomes):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
