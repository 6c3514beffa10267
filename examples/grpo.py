"""GRPO on the tiny model through rolloutd, with a crash and a resume, on a laptop CPU.

    .venv/bin/python examples/grpo.py --quick        # about 5 minutes on 2 cores
    .venv/bin/python examples/grpo.py                # the full run
    .venv/bin/python examples/grpo.py --target host-a:50051,host-b:50051   # your own rolloutd(s)

By default this script starts its own rolloutd (vLLM on the tiny model, the bundled arithmetic
prompts) as a subprocess and runs the trainer (``grpo_trainer.py``) as a second one. With
``--crash-at STEP`` the trainer, right after acking STEP, SIGKILLs rolloutd's process group and
itself. The script then restarts rolloutd with ``--restore latest`` and the trainer with
``--resume``: the trainer loads its checkpoint S, calls ``Rewind(S)``, pushes its own weights under
a new policy version and goes on.

From the trainer's ledger (one fsynced line per step) it reports, in JSON and as a reward-curve PNG:
the reward at the start and the end, weight updates and their median time, logprob parity between
the trainer and rolloutd, stale groups (trained with samples more than ``limits.max_staleness``
versions old) and duplicate groups (a group whose training the lineage already holds, delivered
again; each group acked after S must come back exactly once). The report goes to the run
directory (``.rolloutd/grpo/report.json`` by default, untracked); ``--json FILE`` puts it
elsewhere, e.g. ``benchmarks/results/grpo-quick.json`` to refresh the figures the repository
keeps. It ends with a rounded summary and one PASS or FAIL line against :data:`EXPECTED`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import yaml

EXAMPLES = Path(__file__).resolve().parent
REPO = EXAMPLES.parent
sys.path.insert(0, str(REPO / "benchmarks"))

from common import conditions, pyplot  # noqa: E402
from grpo_trainer import TrainConfig, read_ledger  # noqa: E402

from rolloutd.engines.tiny_model import ensure_tiny_model  # noqa: E402

LISTENING = re.compile(r"\bgRPC (?P<grpc>[^\s,]+), dashboard")
PROGRESS = re.compile(r" (?:INFO|WARNING|ERROR) rolloutd\.(?:engines\.\w+|server): (?P<text>.*)$")
"""rolloutd's lines worth showing while it starts: its engine's progress and its ready line."""
STARTED = time.monotonic()

EXPECTED: dict[str, tuple[str, Any]] = {
    "reward_rise": (">=", 0.3),
    "logprob_abs_diff_mean": ("<=", 1e-3),
    "stale_groups": ("==", 0),
    "duplicate_groups": ("==", 0),
    "redelivery_missing": ("==", 0),
}
"""What a run must show to PASS (``benchmarks/README.md``, the GRPO example, documents them).
The reward is not held to a value: where it ends depends on the run's timing (which groups a
step gets, from which weights), and quick runs have ended anywhere from about 0.45 to 1.0 from a
start near 0.05. Only its rise is checked, and only in runs of at least :data:`LEARNING_STEPS`
steps (shorter ones check the mechanics alone)."""
LEARNING_STEPS = 60


def say(line: str) -> None:
    print(f"[{time.monotonic() - STARTED:7.1f}s] {line}", flush=True)


# --- rolloutd ----------------------------------------------------------------------------------


def bf16_copy(model: Path, out: Path) -> Path:
    """The tiny model with bf16 weights: what rolloutd serves and deltas apply to."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(model, out, ignore=shutil.ignore_patterns("*.safetensors"))
    for p in model.glob("*.safetensors"):
        tensors = {n: t.to(torch.bfloat16) for n, t in load_file(str(p)).items()}
        save_file(tensors, str(out / p.name), metadata={"format": "pt"})
    return out


def dataset_sources(temperatures: str | None) -> dict[str, Any]:
    """One source per temperature over the bundled prompts; none: the service's own dataset."""
    if not temperatures:
        return {}
    sources = [
        {
            "name": f"t{float(t):g}",
            "path": "bundled:arithmetic",
            "generation": {"temperature": float(t)},
        }
        for t in temperatures.split(",")
    ]
    return {"dataset": {"sources": sources}}


def service_config(run: Path, model: Path, args: argparse.Namespace) -> dict[str, Any]:
    """rolloutd's configuration for this run (written as ``rolloutd.yaml``)."""
    return {
        "engine": {
            "kind": "vllm",
            "model": str(model),
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "vllm": {
                # bf16 where the trainer sends deltas: most bf16 weights stay bit-identical
                # from one step to the next, which is what makes a delta small.
                "dtype": "bfloat16" if args.weights == "delta" else "float32",
                "max_model_len": 512,
                "kv_cache_memory_gib": 1,
                "max_num_seqs": 64,
                # The logprob of the distribution sampled from (after temperature): the behaviour
                # policy of the importance ratio, and what the trainer recomputes.
                "logprobs_mode": "processed_logprobs",
            },
        },
        **dataset_sources(args.temperatures),
        "group_size": args.group_size,
        "limits": {
            "max_in_flight": args.groups_per_step,
            "buffer_capacity": 2 * args.groups_per_step,
            "max_staleness": args.max_staleness,
            "lease_timeout_s": 120,
            "rewind_window": 4 * args.checkpoint_every,
        },
        # the reward is scored in the service (examples/grpo_rewards.py), and groups whose
        # rewards are all equal (no GRPO signal) are dropped before the trainer sees them
        "scoring": {"verifier": "grpo_rewards:answer_shaped", "workers": 1},
        "filter": {"zero_variance": True},
        "checkpoint": {"dir": str(run / "checkpoints"), "interval_s": 5.0},
        "grpc": {"host": "127.0.0.1", "port": 0},
        "http": {"enabled": False},
    }


class Rolloutd:
    """``rolloutd serve`` in its own process group, its log copied to a file."""

    def __init__(self, config: Path, restore: str, log: Path) -> None:
        # examples/ on the path: the service imports the verifier (grpo_rewards) from there
        path = os.pathsep.join(
            p for p in (str(REPO / "examples"), os.environ.get("PYTHONPATH")) if p
        )
        env = {
            "PYTHONUNBUFFERED": "1",
            "OTEL_SDK_DISABLED": "true",
            **os.environ,
            "PYTHONPATH": path,
        }
        cmd = [sys.executable, "-m", "rolloutd.cli", "serve", "--config", str(config)]
        self.proc = subprocess.Popen(
            [*cmd, "--restore", restore],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )
        self.target: str | None = None
        self._ready = threading.Event()
        self._log = log
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        with self._log.open("a") as log:
            for line in self.proc.stdout:
                log.write(line)
                log.flush()
                if self.target is None and (progress := PROGRESS.search(line)):
                    say(f"rolloutd: {progress['text']}")  # vLLM takes a minute or so to start
                m = LISTENING.search(line)
                if m and self.target is None:
                    self.target = "127.0.0.1:" + m["grpc"].rsplit(":", 1)[1]
                    self._ready.set()

    def wait_listening(self, timeout_s: float = 600) -> str:
        deadline = time.monotonic() + timeout_s
        while not self._ready.wait(0.5):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"rolloutd did not start (exit {self.proc.poll()}); see {self._log}"
                )
        assert self.target is not None
        return self.target

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def run_trainer(run: Path, target: str, life: int, crash_at: int | None, pgid: int | None) -> int:
    cmd = [sys.executable, str(EXAMPLES / "grpo_trainer.py"), str(run), "--target", target]
    cmd += ["--life", str(life)]
    if life:
        cmd.append("--resume")
    if crash_at is not None:
        cmd += ["--crash-at", str(crash_at)]
    if pgid is not None:
        cmd += ["--kill-pgid", str(pgid)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    with (run / f"trainer-{life}.log").open("w") as log:
        for line in proc.stdout:
            log.write(line)
            if line.startswith("[trainer]"):
                say(line.rstrip())
    return proc.wait()


# --- the report --------------------------------------------------------------------------------


def lineage(ledger: list[dict[str, Any]], events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The steps behind the final weights: each resume cuts the previous life at its checkpoint."""
    steps: list[dict[str, Any]] = []
    for life in sorted({r["life"] for r in ledger}):
        resumed = [e for e in events if e["event"] == "resumed" and e["life"] == life]
        if resumed:
            steps = [r for r in steps if r["step"] <= resumed[0]["from_step"]]
        steps += [r for r in ledger if r["life"] == life]
    return steps


def duplicates(ledger: list[dict[str, Any]], events: list[dict[str, Any]]) -> int:
    """Groups delivered although the lineage receiving them already trained on them: the same
    group id, or the same prompt position (a group re-generated for a trained prompt)."""
    count = 0
    for life in sorted({r["life"] for r in ledger}):
        resumed = [e for e in events if e["event"] == "resumed" and e["life"] == life]
        earlier = lineage([r for r in ledger if r["life"] < life], events)
        held = [r for r in earlier if resumed and r["step"] <= resumed[0]["from_step"]]
        ids = {g for r in held for g in r["group_ids"]}
        positions = {p for r in held for p in r["positions"]}
        for r in (r for r in ledger if r["life"] == life):
            for g, p in zip(r["group_ids"], r["positions"], strict=True):
                count += g in ids or p in positions
                ids.add(g)
                positions.add(p)
    return count


def by_temperature(ledger: list[dict[str, Any]]) -> dict[str, float]:
    """Mean |trainer logprob - rolloutd logprob| over the tokens sampled at each temperature."""
    sums: dict[str, list[float]] = {}
    for r in ledger:
        for t, (n, total) in r["parity_by_temperature"].items():
            acc = sums.setdefault(t, [0, 0.0])
            acc[0] += n
            acc[1] += total
    return {t: total / n for t, (n, total) in sorted(sums.items()) if n}


def report(run: Path, args: argparse.Namespace, started: float) -> dict[str, Any]:
    ledger = read_ledger(run / "ledger.jsonl")
    events = read_ledger(run / "events.jsonl")
    steps = lineage(ledger, events)
    rewards = [r["reward"] for r in steps]
    updates = [r["weight_update_ms"] for r in ledger] + [e["weight_update_ms"] for e in events]
    parity_tokens = sum(r["parity_tokens"] for r in ledger)
    resumes = [e for e in events if e["event"] == "resumed"]
    expected = {p for e in resumes for p in e["acked_after_checkpoint"]}
    lost_ids = {
        p: g
        for r in ledger
        if resumes and r["life"] == 0 and r["step"] > resumes[0]["from_step"]
        for g, p in zip(r["group_ids"], r["positions"], strict=True)
    }
    again = [
        (g, p)
        for r in ledger
        if r["life"] > 0
        for g, p in zip(r["group_ids"], r["positions"], strict=True)
        if p in expected
    ]
    redelivered = {p for _, p in again}
    return {
        "reward_first": statistics.fmean(rewards[:3]),
        "reward_last": statistics.fmean(rewards[-3:]),
        "steps": len(steps),
        "steps_executed": len(ledger),
        "weight_updates": len(updates),
        "weight_update_ms_p50": statistics.median(updates),
        "logprob_abs_diff_mean": sum(r["parity_sum"] for r in ledger) / parity_tokens
        if parity_tokens
        else None,
        "logprob_abs_diff_max": max(r["parity_max"] for r in ledger),
        "logprob_tokens_compared": parity_tokens,
        "logprob_abs_diff_mean_by_temperature": by_temperature(ledger),
        "stale_groups": sum(r["stale_groups"] for r in ledger),
        "staleness_max": max(r["staleness_max"] for r in ledger),
        "duplicate_groups": duplicates(ledger, events),
        "resumed": bool(resumes),
        "resumed_from_step": resumes[0]["from_step"] if resumes else None,
        "rewind_readmitted": sum(e["rewind_readmitted"] for e in resumes),
        "evicted_at_resume": sum(e["evicted_at_resume"] for e in resumes),
        "acked_after_checkpoint": len(expected),
        "redelivered_after_rewind": len(again),
        "redelivered_same_group": sum(lost_ids.get(p) == g for g, p in again),
        "redelivered_regenerated": sum(lost_ids.get(p) != g for g, p in again),
        "redelivery_missing": len(expected - redelivered),
        "policy_versions": [steps[0]["version"], steps[-1]["new_version"]],
        "tokens_trained": sum(r["tokens"] for r in ledger),
        "reward_curve": [[r["step"], r["life"], r["reward"]] for r in ledger],
        "completions": {
            "first_step": steps[0]["completion"],
            "last_step": steps[-1]["completion"],
        },
        "reward": {
            "what": "share of completion words that are 1-2 digit whole numbers",
            "range": [0, 1],
        },
        "config": {
            "quick": args.quick,
            "crash_at": args.crash_at,
            "temperature": args.temperature,
            "temperatures": args.temperatures,
            "group_size": args.group_size,
            "groups_per_step": args.groups_per_step,
            "max_tokens": args.max_tokens,
            "max_staleness": args.max_staleness,
            "checkpoint_every": args.checkpoint_every,
            "lr": args.lr,
        },
        "conditions": conditions(started),
    }


def plot(result: dict[str, Any], out: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    curve = result["reward_curve"]
    cut = result["resumed_from_step"]
    for life in sorted({c[1] for c in curve}):
        pts = [(s, r) for s, lf, r in curve if lf == life]
        kept = [p for p in pts if cut is None or life > 0 or p[0] <= cut]
        lost = [p for p in pts if cut is not None and life == 0 and p[0] >= cut]
        label = "trained (final lineage)" if life == 0 else None
        ax.plot(*zip(*kept, strict=True), color="tab:blue", marker=".", label=label)
        if lost:
            ax.plot(
                *zip(*lost, strict=True),
                color="tab:gray",
                ls="--",
                marker=".",
                label="lost with the crash, redone after Rewind",
            )
    if cut is not None:
        ax.axvline(cut, color="tab:red", lw=0.8, label=f"resumed from checkpoint {cut}")
    ax.set_xlabel("trainer step")
    ax.set_ylabel("mean reward")
    ax.set_ylim(0, 1)
    ax.set_title(
        f"GRPO through rolloutd, tiny model on CPU: reward {result['reward_first']:.2f}"
        f" -> {result['reward_last']:.2f}",
        fontsize=10,
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    say(f"wrote {out}")


# --- main --------------------------------------------------------------------------------------


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a short run (about 5 minutes here)")
    p.add_argument(
        "--json",
        type=Path,
        help="report file, the PNG next to it (default: report.json in the run directory)",
    )
    p.add_argument("--target", help="use these rolloutd endpoints instead of starting one")
    p.add_argument("--run-dir", type=Path, default=REPO / ".rolloutd" / "grpo")
    p.add_argument("--steps", type=int, help="trainer steps (quick 60, full 150)")
    p.add_argument(
        "--crash-at", type=int, help="SIGKILL both after this step (quick 33, full 77; 0: none)"
    )
    p.add_argument("--checkpoint-every", type=int, help="trainer checkpoints (quick 5, full 10)")
    p.add_argument("--groups-per-step", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8, help="completions per prompt")
    p.add_argument("--max-tokens", type=int, default=16, help="longest completion")
    p.add_argument("--max-staleness", type=int, default=4, help="rolloutd limits.max_staleness")
    p.add_argument("--temperature", type=float, default=2.0, help="sampling temperature")
    p.add_argument(
        "--temperatures",
        help="comma-separated temperatures, e.g. 0.5,2.0: the bundled prompts become one dataset "
        "source per temperature, drawn from equally (each group sampled at its source's)",
    )
    p.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate")
    p.add_argument(
        "--weights",
        choices=("full", "delta"),
        default="full",
        help="full: float32 weights loaded from a path after each step; delta: served in bf16, "
        "and only what changed is pushed (docs/operations.md, 'Deltas')",
    )
    args = p.parse_args(argv)
    quick = {"steps": 60, "crash_at": 33, "checkpoint_every": 5}
    full = {"steps": 150, "crash_at": 77, "checkpoint_every": 10}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.target and args.crash_at:
        print("crash and resume need the example's own rolloutd; running without", flush=True)
    if args.crash_at == 0 or args.target:
        args.crash_at = None
    if args.crash_at is not None and not args.crash_at < args.steps:
        p.error("--crash-at must be below --steps")
    if args.json is None:
        args.json = args.run_dir / "report.json"
    return args


def supervise(run: Path, model: Path, args: argparse.Namespace) -> None:
    """rolloutd and the trainer, each in its own process; after the planned crash, both again."""
    config = run / "rolloutd.yaml"
    config.write_text(yaml.safe_dump(service_config(run, model, args)))
    life = 0
    while True:
        service = Rolloutd(config, "none" if life == 0 else "latest", run / f"rolloutd-{life}.log")
        crash = args.crash_at if life == 0 else None
        try:
            target = service.wait_listening()
            say(f"rolloutd (pid {service.proc.pid}) listening on {target}")
            if crash is not None:
                say(
                    f"after step {crash} the trainer will SIGKILL rolloutd and itself: a "
                    "deliberate crash, to show the resume"
                )
            rc = run_trainer(run, target, life, crash, service.proc.pid)
        except BaseException:
            service.stop()
            raise
        if rc == -signal.SIGKILL and crash is not None:
            service.proc.wait(60)
            say(
                "the deliberate crash happened: trainer and rolloutd were SIGKILLed (rolloutd "
                f"exit {service.proc.returncode}); restarting rolloutd with --restore latest and "
                "resuming the trainer from its last checkpoint"
            )
            life += 1
            continue
        service.stop()
        if rc:
            raise SystemExit(f"trainer failed (exit {rc}); see {run}/trainer-{life}.log")
        return


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    started = time.time()
    run = args.run_dir.resolve()
    if run.exists() and any(run.iterdir()):
        if not (run / "run.json").exists():
            raise SystemExit(
                f"{run} is not empty and holds no earlier run; choose another --run-dir"
            )
        shutil.rmtree(run)
    run.mkdir(parents=True, exist_ok=True)
    model = ensure_tiny_model(REPO / ".rolloutd" / "cache", progress=say)
    if args.weights == "delta":
        model = bf16_copy(model, run / "model-bf16")
    cfg = TrainConfig(
        weights=args.weights,
        model=str(model),
        steps=args.steps,
        groups_per_step=args.groups_per_step,
        lr=args.lr,
        temperature=args.temperature,
        checkpoint_every=args.checkpoint_every,
        max_staleness=args.max_staleness,
    )
    (run / "run.json").write_text(json.dumps(asdict(cfg), indent=2))
    say(f"run directory {run}; {args.steps} steps, crash after step {args.crash_at}")
    if args.target:
        rc = run_trainer(run, args.target, 0, None, None)
        if rc:
            raise SystemExit(f"trainer failed (exit {rc}); see {run}/trainer-0.log")
    else:
        supervise(run, model, args)
    result = report(run, args, started)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    say(f"wrote {args.json}")
    plot(result, args.json.with_suffix(".png"))
    for line in summary(result):
        say(line)
    failed = verdict(result)
    print("PASS" if not failed else f"FAIL: {'; '.join(failed)}", flush=True)
    return 1 if failed else 0


def summary(result: dict[str, Any]) -> list[str]:
    """The report's headline figures, rounded."""
    parity = result["logprob_abs_diff_mean"]
    resumed = (
        f"resumed from step {result['resumed_from_step']}: {result['acked_after_checkpoint']} "
        f"groups acked after it, {result['redelivered_after_rewind']} delivered again"
        if result["resumed"]
        else "no crash"
    )
    judged = (
        "" if result["steps"] >= LEARNING_STEPS else f", not judged under {LEARNING_STEPS} steps"
    )
    return [
        f"reward {result['reward_first']:.2f} -> {result['reward_last']:.2f} "
        f"(mean of the first / last 3 steps; rise {reward_rise(result):+.2f}{judged})",
        f"steps {result['steps']} ({result['steps_executed']} executed); "
        f"{result['weight_updates']} weight updates, median {result['weight_update_ms_p50']:.0f} ms",
        "logprob difference trainer / rolloutd: mean "
        + ("n/a" if parity is None else f"{parity:.1e}")
        + f", max {result['logprob_abs_diff_max']:.1e} "
        f"over {result['logprob_tokens_compared']:,} tokens",
        f"stale groups {result['stale_groups']}, duplicate groups {result['duplicate_groups']}, "
        f"missing after Rewind {result['redelivery_missing']}; {resumed}",
    ]


def reward_rise(result: dict[str, Any]) -> float:
    return float(result["reward_last"] - result["reward_first"])


def verdict(result: dict[str, Any]) -> list[str]:
    """What missed :data:`EXPECTED`; empty when the run passes."""
    values = {**result, "reward_rise": reward_rise(result)}
    checks = {">=": lambda v, x: v >= x, "<=": lambda v, x: v <= x, "==": lambda v, x: v == x}
    missed = []
    for key, (op, bound) in EXPECTED.items():
        if key == "reward_rise" and result["steps"] < LEARNING_STEPS:
            continue
        value = values[key]
        if value is None or not checks[op](value, bound):
            missed.append(
                f"{key} {value if value is None else round(value, 4)} (expected {op} {bound})"
            )
    return missed


if __name__ == "__main__":
    sys.exit(main())
