"""What every benchmark script shares (``benchmarks/common.py``), where a test can reach it."""

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def test_sigterm_runs_a_benchmarks_cleanup(tmp_path: Path) -> None:
    """A benchmark stopped with SIGTERM stops what it started: its ``finally`` blocks run."""
    cleaned = tmp_path / "cleaned"
    script = textwrap.dedent(
        f"""
        import signal, sys
        sys.path.insert(0, {str(BENCHMARKS)!r})
        import common
        common.parse_args("a benchmark", [])
        try:
            print("running", flush=True)
            signal.pause()  # works until stopped
        finally:
            open({str(cleaned)!r}, "w").write("stopped")
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=os.environ
    )
    assert proc.stdout is not None
    assert proc.stdout.readline() == "running\n"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert cleaned.read_text() == "stopped"
