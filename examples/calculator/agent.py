"""Episodes of the calculator environment on the tiny model, and one trajectory with its mask.

    make example-agent                                      # from the repository root
    .venv/bin/python examples/calculator/agent.py --groups 2 --plain

It starts ``rolloutd serve`` with ``rolloutd.yaml`` beside this file (vLLM on the tiny model,
``examples/`` on its ``PYTHONPATH`` so that it imports ``calculator.environment``; its own
checkpoint folder and free ports), leases ``--groups`` groups (``group_size`` episodes each),
acks them, and prints

* a line per episode: its id, how it ended (``finish_reason``), its turns, its reward and how
  many of its tokens the model sampled (``loss_mask``) out of how many it holds;
* the trajectory with the most turns, token by token: what the model sampled (mask 1) in green,
  what the environment and the chat template added (mask 0) dimmed, each span under a header
  that says where it starts and what it is. ``--plain`` (or output that is not a terminal)
  brackets runs of tokens instead: ``[[model: ...]]`` and ``{{env: ...}}``;
* checks every delivered sample must pass: one mask value, one logprob per token, logprob 0 on
  every token the model did not sample, spans in order from offset 0, an ``episode:`` finish
  reason, no re-tokenization mismatch. It exits 1 when one fails.

The tiny model is random: it rarely writes a ``<calc>`` call or the right answer. The
configuration makes the calculator ``strict``, so that a turn without a call or an
``<answer>`` tag gets a reminder (a user message, mask 0) and the episode goes on to
``max_turns``: the trajectories show turns and environment spans interleaved, with reward 0.
The point is the mechanics, not the score.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from common import Serve  # noqa: E402

from rolloutd.client import RolloutClient  # noqa: E402
from rolloutd.engines.tiny_model import ensure_tiny_model  # noqa: E402
from rolloutd.v1 import rollout_pb2 as pb  # noqa: E402

GREEN, DIM, BOLD, RESET = "\033[32m", "\033[2m", "\033[1m", "\033[0m"


def service_config(run: Path, model: Path) -> dict[str, Any]:
    """``rolloutd.yaml`` with what this run needs changed: the model, paths, free ports."""
    config: dict[str, Any] = yaml.safe_load((HERE / "rolloutd.yaml").read_text())
    config["engine"]["model"] = str(model)
    config["dataset"]["path"] = str(HERE / "questions.jsonl")
    config["checkpoint"]["dir"] = str(run / "checkpoints")
    config["grpc"] = {"host": "127.0.0.1", "port": 0}
    config["http"] = {"host": "127.0.0.1", "port": 0}
    return config


def fetch(address: str, groups: int, timeout_s: float) -> list[pb.Group]:
    """``groups`` groups, leased and acked."""
    got: list[pb.Group] = []
    deadline = time.monotonic() + timeout_s
    with RolloutClient(address) as client:
        while len(got) < groups:
            if time.monotonic() > deadline:
                raise SystemExit(f"only {len(got)} of {groups} groups within {timeout_s:.0f} s")
            lease = client.fetch(max_groups=groups - len(got), wait_ms=5_000)
            if lease is not None:
                got += lease.groups
                client.ack(lease, trainer_step=1)
    return got


def spans(sample: pb.Sample) -> list[tuple[int, str]]:
    """(offset, kind) of each model turn and environment span, in order: ``turn_starts`` as the
    service sends it (its kind by enum name or text, lower case, without the enum's prefix)."""
    out = []
    for turn in sample.turn_starts:
        offset = int(getattr(turn, "start", getattr(turn, "offset", 0)))
        kind: Any = getattr(turn, "kind", "")
        if isinstance(kind, int):
            enum = turn.DESCRIPTOR.fields_by_name["kind"].enum_type
            kind = enum.values_by_number[kind].name if enum is not None else str(kind)
        out.append((offset, str(kind).lower().rsplit("kind_", 1)[-1]))
    return out


def checks(sample: pb.Sample) -> list[str]:
    """What is wrong with a delivered episode (nothing, if all is well)."""
    n = len(sample.token_ids)
    wrong = []
    if len(sample.loss_mask) != n or len(sample.logprobs) != n:
        wrong.append(f"{n} tokens, {len(sample.loss_mask)} mask values, {len(sample.logprobs)} lp")
    elif any(m == 0 and lp != 0.0 for m, lp in zip(sample.loss_mask, sample.logprobs, strict=True)):
        wrong.append("a token the model did not sample has a logprob")
    offsets = [offset for offset, _ in spans(sample)]
    if not offsets or offsets[0] != 0 or offsets != sorted(set(offsets)) or offsets[-1] >= n:
        wrong.append(f"turn_starts {offsets} do not split {n} tokens in order")
    if not sample.finish_reason.startswith("episode:"):
        wrong.append(f"finish_reason {sample.finish_reason!r} is not an episode's")
    if sample.retokenization_mismatches:
        wrong.append(f"{sample.retokenization_mismatches} tokens differ when re-rendered")
    return wrong


def show_trajectory(group: pb.Group, sample: pb.Sample, decode: Any, plain: bool) -> None:
    bold, reset = ("", "") if plain else (BOLD, RESET)
    print(f"\n{'=' * 100}\nprompt {group.prompt_id}, sibling {sample.index}: {group.prompt_text!r}")
    print(f"finish_reason {sample.finish_reason}, reward {reward(sample)}\n{'=' * 100}")
    bounds = [*spans(sample), (len(sample.token_ids), "")]
    for (start, kind), (end, _) in itertools.pairwise(bounds):
        print(f"\n{bold}--- {kind} span, tokens {start}-{end - 1}{reset}")
        pieces, run, value = [], [], None
        for i in range(start, end):
            mask = sample.loss_mask[i]
            if value is not None and mask != value:
                pieces.append(paint(decode(run), value, plain))
                run = []
            run.append(sample.token_ids[i])
            value = mask
        if run:
            pieces.append(paint(decode(run), value, plain))
        print("".join(pieces))


def paint(text: str, mask: int | None, plain: bool) -> str:
    if plain:
        return f"[[model: {text}]]" if mask else f"{{{{env: {text}}}}}"
    return f"{GREEN}{text}{RESET}" if mask else f"{DIM}{text}{RESET}"


def reward(sample: pb.Sample) -> str:
    return f"{sample.episode_reward:g}" if sample.HasField("episode_reward") else "-"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=2, help="groups to lease (4 episodes each)")
    parser.add_argument("--plain", action="store_true", help="brackets instead of colours")
    parser.add_argument("--run", type=Path, default=None, help="run folder (default: temporary)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait in all")
    args = parser.parse_args(argv)
    plain = args.plain or not sys.stdout.isatty()
    model = ensure_tiny_model(REPO / ".rolloutd" / "cache")
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False)

    with tempfile.TemporaryDirectory(prefix="rolloutd-agent-") as tmp:
        run = args.run or Path(tmp)
        run.mkdir(parents=True, exist_ok=True)
        (run / "rolloutd.yaml").write_text(yaml.safe_dump(service_config(run, model)))
        # examples/ on the path: the service imports the environment (calculator.environment)
        path = [str(REPO / "examples"), *filter(None, [os.environ.get("PYTHONPATH")])]
        env = {"PYTHONPATH": os.pathsep.join(path), "OTEL_SDK_DISABLED": "true"}
        serve = Serve(
            ["--config", str(run / "rolloutd.yaml"), "--restore", "none"], env, REPO,
            run / "serve.log",
        )  # fmt: skip
        try:
            print(f"starting rolloutd (vLLM on the tiny model); its log: {run / 'serve.log'}")
            serve.wait_listening(args.timeout)
            groups = fetch(serve.address, args.groups, args.timeout)
        finally:
            serve.stop(60.0)
    samples = [(g, s) for g in groups for s in g.samples]
    print(f"\n{'episode':<12} {'finish_reason':<26} {'turns':>5} {'reward':>6} model/all tokens")
    for g, s in samples:
        turns = sum(kind == "model" for _, kind in spans(s))
        model_tokens = sum(s.loss_mask)
        print(f"g{g.group_id}-s{s.index:<9} {s.finish_reason:<26} {turns:>5} {reward(s):>6} "
              f"{model_tokens}/{len(s.token_ids)}")  # fmt: skip
    group, longest = max(samples, key=lambda gs: len(spans(gs[1])))
    show_trajectory(group, longest, decode, plain)
    problems = {f"g{g.group_id}-s{s.index}": checks(s) for g, s in samples}
    problems = {k: v for k, v in problems.items() if v}
    print(f"\nchecks: {len(samples) - len(problems)} of {len(samples)} episodes pass")
    if problems:
        print(json.dumps(problems, indent=2))
        raise SystemExit(1)


if __name__ == "__main__":
    main()
