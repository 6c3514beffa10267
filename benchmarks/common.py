"""Helpers shared by the benchmark scripts: arguments, progress, statistics, results, plots.

Every benchmark is a script run as ``python benchmarks/<name>.py [--quick] [--json FILE]`` that
prints progress while it runs and writes its figures as JSON, a Markdown table and (optionally) a
PNG next to the JSON. ``run_all.py`` builds the summary from one convention: the JSON's
``headline`` list, each item made by :func:`headline` (a figure, its target and whether it is met).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, NoReturn

RESULTS = Path(__file__).resolve().parent / "results"
"""Where ``run_all.py`` asks each benchmark to write, and where its summary goes."""


def parse_args(
    description: str,
    argv: Sequence[str] | None = None,
    extra: Callable[[argparse.ArgumentParser], object] | None = None,
) -> argparse.Namespace:
    """The arguments every benchmark takes: ``--quick`` and ``--json FILE``; ``extra`` adds a
    benchmark's own. From here on SIGTERM ends the benchmark as Ctrl-C does (see
    :func:`exit_on_sigterm`)."""
    exit_on_sigterm()
    parser = argparse.ArgumentParser(description=description)
    if extra is not None:
        extra(parser)
    parser.add_argument(
        "--quick", action="store_true", help="a smaller run for development (under a minute)"
    )
    parser.add_argument(
        "--json",
        type=Path,
        default=None,
        help="write the figures here (a .md table and a .png plot go next to it)",
    )
    return parser.parse_args(argv)


def exit_on_sigterm() -> None:
    """SIGTERM (``kill``, ``pkill``, a job's timeout) raises ``SystemExit`` in the main thread, so
    that the ``finally`` blocks that stop a benchmark's services and engines run. Python's default
    is to die at once, which left services running (frozen ones for good) and vLLM engine
    processes behind."""

    def leave(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, leave)


# --- progress ----------------------------------------------------------------------------------

_STARTED = time.monotonic()


def progress(message: str) -> None:
    """One line on stdout, flushed at once, stamped with the seconds since the script started."""
    print(f"[{time.monotonic() - _STARTED:7.1f}s] {message}", flush=True)


# --- statistics --------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation between closest ranks."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def median(values: Sequence[float]) -> float:
    return percentile(values, 50)


def summary(values: Sequence[float], scale: float = 1.0) -> dict[str, float]:
    """p50, p99, mean, min, max (each times ``scale``) and the count of ``values``."""
    return {
        "p50": percentile(values, 50) * scale,
        "p99": percentile(values, 99) * scale,
        "mean": sum(values) / len(values) * scale,
        "min": min(values) * scale,
        "max": max(values) * scale,
        "n": len(values),
    }


def noise(ratios: Sequence[float]) -> dict[str, Any]:
    """How noisy a ratio measured over rounds was: its rounds, their median, lowest and highest,
    and the spread (highest - lowest) relative to the median. A difference from 1 smaller than
    the spread is not a result."""
    mid = median(ratios)
    return {
        "rounds": len(ratios),
        "median": mid,
        "min": min(ratios),
        "max": max(ratios),
        "spread": (max(ratios) - min(ratios)) / mid if mid else float("nan"),
        "each": list(ratios),
    }


def noise_note(ratios: Sequence[float]) -> str:
    """:func:`noise` in words, for a headline's note."""
    n = noise(ratios)
    return (
        f"median of {n['rounds']} rounds, {n['min']:.3f}-{n['max']:.3f} "
        f"(spread {100 * n['spread']:.0f}% of the median)"
    )


# --- machine and conditions ---------------------------------------------------------------------


def machine() -> dict[str, Any]:
    """What the figures depend on besides the code: CPUs, load, memory, Python, kernel."""
    info: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "load_avg_1m_5m_15m": list(os.getloadavg()),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        fields = dict(line.split(":", 1) for line in meminfo.read_text().splitlines())
        for key in ("MemTotal", "MemAvailable"):
            info[f"{key.lower()}_gib"] = int(fields[key].split()[0]) / (1 << 20)
    return info


def revision() -> dict[str, Any]:
    """The commit measured, and files of the service and of the benchmarks that differ from it
    (uncommitted work; results the benchmarks write are not counted)."""
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
        return done.stdout if done.returncode == 0 else ""

    status = git("status", "--porcelain", "--", "service", "benchmarks", ":!benchmarks/results")
    return {
        "commit": git("rev-parse", "--short", "HEAD").strip(),
        "uncommitted": [line[3:] for line in status.splitlines() if line.strip()],
    }


def rss_gib() -> float:
    """Resident memory of this process now (0 where ``/proc`` is missing)."""
    statm = Path("/proc/self/statm")
    if not statm.exists():
        return 0.0
    return int(statm.read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 30)


def peak_rss_gib() -> float:
    """Peak resident memory of this process so far."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)


# --- headline figures ---------------------------------------------------------------------------


def headline(
    name: str, value: float, unit: str, target: str, met: bool | None, note: str = ""
) -> dict[str, Any]:
    """One figure for the summary: ``met`` is None where a figure has no pass/fail target."""
    return {"name": name, "value": value, "unit": unit, "target": target, "met": met, "note": note}


# --- writing results ----------------------------------------------------------------------------


def _finite(value: Any) -> Any:
    """JSON has no NaN or infinity: they become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite(data), indent=2, allow_nan=False) + "\n")
    progress(f"wrote {path}")


def write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    progress(f"wrote {path}")


def fmt(value: Any, digits: int = 3) -> str:
    """A number for a table: ``digits`` significant digits, thousands separated; text as is."""
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if not math.isfinite(value):
        return "-"
    if value != 0 and abs(value) < 10 ** (digits - 1):
        return f"{value:#.{digits}g}".rstrip(".")  # keeps trailing zeros: 2.00, not 2
    return f"{value:,.0f}"


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = [
        "| " + " | ".join(headers) + " |",
        "|" + "|".join("---" for _ in headers) + "|",
    ]
    lines += ["| " + " | ".join(fmt(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def headline_table(items: Sequence[dict[str, Any]]) -> str:
    mark = {True: "met", False: "**missed**", None: "-"}
    return markdown_table(
        ["figure", "value", "target", "result", "note"],
        [
            (
                i["name"],
                f"{fmt(i['value'])} {i['unit']}".strip(),
                i["target"],
                mark[i["met"]],
                i["note"],
            )
            for i in items
        ],
    )


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (no display needed), imported only when plotting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path) -> None:
    """Lays out ``fig``, writes it as the PNG ``path`` and closes it."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    progress(f"wrote {path}")


def result_paths(json_path: Path | None, name: str) -> tuple[Path, Path, Path]:
    """(json, md, png) paths: next to ``--json`` when given, else in ``benchmarks/results``."""
    base = json_path if json_path is not None else RESULTS / f"{name}.json"
    return base, base.with_suffix(".md"), base.with_suffix(".png")


def conditions(started: float, **extra: Any) -> dict[str, Any]:
    """What a result was measured on and when: machine, load, revision, start and duration."""
    return {
        **machine(),
        **revision(),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "duration_s": time.time() - started,
        **extra,
    }


def publish(
    result: dict[str, Any],
    json_path: Path | None,
    name: str,
    markdown: str,
    plot: Callable[[dict[str, Any], Path], None] | None = None,
) -> None:
    """Writes a benchmark's JSON, Markdown and (given ``plot``) PNG, then prints its headline."""
    json_out, md_out, png_out = result_paths(json_path, name)
    write_json(json_out, result)
    write_text(md_out, markdown)
    if plot is not None:
        plot(result, png_out)
    for item in result["headline"]:
        progress(f"{item['name']}: {fmt(item['value'])} {item['unit']} (target {item['target']})")


def fail(message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(1)


LISTENING = re.compile(r"\bgRPC \S+:(?P<grpc>\d+), dashboard http://\S+:(?P<http>\d+)/")
"""The ``ready`` line ``rolloutd serve`` logs once it serves, with the ports it bound."""
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class Serve:
    """``rolloutd serve`` (the real CLI) in a subprocess and session of its own: its output goes
    to ``log_path``, and its addresses are read from its ``ready`` line (ports 0 in ``args``
    let it bind free ones). ``env`` is added to this process's environment."""

    def __init__(self, args: Sequence[str], env: dict[str, str], cwd: Path, log_path: Path) -> None:
        self.log_path = log_path
        self._log = log_path.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rolloutd.cli", "serve", *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
            cwd=cwd,
            start_new_session=True,
        )
        self.address = self.http = ""
        """``host:port`` of the gRPC and HTTP listeners, once :meth:`wait_listening` returns."""

    def wait_listening(self, timeout_s: float, poll_s: float = 0.05) -> None:
        """Until the service logs that it listens; exits the benchmark with the log's tail when
        the process ends or ``timeout_s`` passes first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if (m := LISTENING.search(self.log_path.read_text())) is not None:
                self.address, self.http = f"127.0.0.1:{m['grpc']}", f"127.0.0.1:{m['http']}"
                return
            if self.proc.poll() is not None:
                break
            time.sleep(poll_s)
        fail(f"rolloutd did not start:\n{self.log_path.read_text()[-4000:]}")

    def cpu_s(self) -> float:
        """User plus system CPU time of the service process so far."""
        stat = Path(f"/proc/{self.proc.pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2 :].split()
        return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS

    def kill(self) -> None:
        """SIGKILL the service's whole session (its engine processes too)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._log.close()

    def stop(self, timeout_s: float) -> int:
        """SIGTERM (a graceful drain), then :meth:`kill` if it has not exited in ``timeout_s``;
        the exit code."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        finally:
            if self.proc.poll() is None:
                self.kill()
            self._log.close()
