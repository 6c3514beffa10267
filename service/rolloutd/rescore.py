"""``rolloutd rescore``: recompute the rewards of every scored group a store holds, from its
Arrow segments, and report where they differ from the recorded ones (exit 1 on any).

A verifier change is checked this way without generating again: point ``--verifier`` at the new
one (or ``--config`` at the service's configuration for the one it ran with). The store is only
read; the newest snapshot that verifies is used.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace
from typing import TextIO

from rolloutd.checkpoint.inspect import parse_storage_options
from rolloutd.checkpoint.store import SnapshotStore
from rolloutd.config import ConfigError, load_config
from rolloutd.domain.finishing import FinishingGroup
from rolloutd.domain.group import GroupMeta, Sample, SampleScore
from rolloutd.scoring import ScoringConfig, build_scorer, scoring_inputs


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rolloutd rescore",
        description="Recompute the rewards of every scored group in a store and report mismatches.",
    )
    parser.add_argument("--dir", required=True, help="snapshot directory or fsspec URL")
    parser.add_argument(
        "--verifier", help="the verifier to score with (entry point, builtin:NAME or URL)"
    )
    parser.add_argument(
        "--config", help="the service's YAML config: its scoring.* keys (unless --verifier)"
    )
    parser.add_argument(
        "--storage-option", action="append", default=[], help="KEY=VALUE passed to fsspec"
    )
    return parser


def _same(a: SampleScore, b: SampleScore) -> bool:
    """Equal rewards (exactly) and status; a failed score matches a failed one whatever its
    reason (a timeout may be a different one each time)."""
    return a.status is b.status and a.reward == b.reward


async def _rescore(
    scoring: ScoringConfig, groups: list[tuple[GroupMeta, list[Sample]]], out: TextIO
) -> int:
    scorer = build_scorer(scoring)
    await scorer.start()
    mismatches = samples = 0
    try:
        for meta, rows in groups:
            assert meta.scores is not None
            view = FinishingGroup(
                meta.group_id, meta.prompt, meta.position, meta.policy_version, rows
            )
            again = await scorer.score(scoring_inputs(view))
            for sample, recorded, now in zip(rows, meta.scores.samples, again, strict=True):
                samples += 1
                if not _same(recorded, now):
                    mismatches += 1
                    out.write(
                        f"group {meta.group_id} (prompt {meta.prompt.prompt_id}) sibling "
                        f"{sample.index}: recorded {recorded.reward} ({recorded.status.value}), "
                        f"now {now.reward} ({now.status.value}{': ' + now.info if now.info else ''})\n"
                    )
    finally:
        await scorer.aclose()
    out.write(
        f"rescored {samples} samples of {len(groups)} groups: "
        f"{mismatches} mismatch{'es' if mismatches != 1 else ''}\n"
    )
    return 1 if mismatches else 0


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    """Run ``rolloutd rescore`` with ``argv`` (the words after ``rescore``)."""
    out = out or sys.stdout
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.verifier is None and args.config is None:
        parser.error("give --verifier, or --config with the service's scoring.* keys")
    try:
        options = parse_storage_options(args.storage_option)
        scoring = load_config(args.config, {}).scoring_config() if args.config else ScoringConfig()
        if args.verifier is not None:
            scoring = replace(scoring, verifier=args.verifier, group_verifier=None)
    except (ValueError, ConfigError) as exc:
        parser.error(str(exc))
    if scoring.verifier is None and scoring.group_verifier is None:
        parser.error(f"{args.config} configures no verifier (scoring.verifier)")
    try:
        snapshot = SnapshotStore(args.dir, options).resolve().snapshot
    except OSError as exc:
        sys.stderr.write(f"rolloutd rescore: {exc}\n")
        return 1
    if snapshot is None:
        sys.stderr.write(f"rolloutd rescore: no snapshot in {args.dir} verifies\n")
        return 1
    rows: dict[int, list[Sample]] = defaultdict(list)
    for _, group_id, sample in snapshot.rows():
        rows[group_id].append(sample)
    scored = [
        (meta, sorted(rows[meta.group_id], key=lambda s: s.index))
        for meta in snapshot.group_metas()
        if meta.scores is not None
    ]
    return asyncio.run(_rescore(scoring, scored, out))
