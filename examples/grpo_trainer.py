"""The GRPO trainer process of ``examples/grpo.py``: a policy in torch that learns from rolloutd.

One process, one policy (the tiny Llama, float32, CPU). Every step:

1. lease ``groups_per_step`` groups from rolloutd (any endpoint);
2. score every completion with :func:`reward` and normalise the rewards within each group
   (GRPO advantages);
3. recompute the log-probability of every sampled token under the current weights and take one
   optimizer step on a clipped policy-gradient loss whose importance ratio uses the delivered
   logprobs as the behaviour policy; compare the recomputed logprobs with rolloutd's on every sample
   whose generating weights the trainer still holds (logprob parity);
4. ack the leases with the step number, write the new weights as safetensors and push them to every
   endpoint with ``UpdateWeights(version, path)``;
5. every ``checkpoint_every`` steps save the trainer's own checkpoint, then ``Checkpoint(step)``.

Each step appends one fsynced line to ``ledger.jsonl`` in the run directory: which groups it
trained, their policy versions and rewards, the parity figures and the timings. The supervisor in
``examples/grpo.py`` builds its report from that ledger, and the tests check the delivery contract
against it (which groups came back after a rewind, and how often).

Resuming (``--resume``) loads the latest trainer checkpoint S, calls ``Rewind(S)``, pushes the
checkpoint's weights under a new policy version (versions only grow, also across a rewind) and
goes on from step S + 1.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from rolloutd.client import Lease, RolloutClient
from rolloutd.trainer import wait_until_ready
from rolloutd.v1 import rollout_pb2 as pb
from rolloutd.weights.delta import make_delta


def position(group: pb.Group) -> str:
    """Which prompt of which epoch of which source a group answers; rolloutd admits each position
    once an epoch."""
    return f"{group.source_name}/{group.epoch}/{group.prompt_id}"


def temperature_of(group: pb.Group) -> float:
    """The temperature the group was sampled at: its prompt's, its source's or the service's."""
    return group.generation.temperature


def rewards_of(group: pb.Group) -> list[float]:
    """The rewards the service's verifier gave the group's samples (examples/grpo_rewards.py)."""
    if any(s.score_status != pb.SCORE_STATUS_OK for s in group.samples):
        raise RuntimeError(f"group {group.group_id} came without rewards: is scoring configured?")
    return [s.reward for s in group.samples]


def dropped_share(client: RolloutClient) -> float:
    """Of the groups the service finished, the share it dropped (zero reward variance)."""
    statuses = client.status().values()
    dropped = sum(s.counters.dropped_groups for s in statuses)
    committed = sum(s.counters.committed_groups for s in statuses)
    return dropped / (dropped + committed) if dropped + committed else 0.0


@dataclass(frozen=True)
class TrainConfig:
    """Everything the trainer process needs; the supervisor writes it as ``run.json``."""

    model: str
    """Hugging Face directory of the starting policy (the model rolloutd serves at version 0)."""
    steps: int
    """Trainer steps of the whole run (a resumed process continues up to the same number)."""
    groups_per_step: int = 4
    """Groups consumed by one optimizer step."""
    lr: float = 2e-3
    """Adam learning rate."""
    clip_eps: float = 0.2
    """PPO clip range of the importance ratio."""
    temperature: float = 1.0
    """Sampling temperature rolloutd uses; logits are divided by it before the log-softmax, so the
    recomputed logprobs are those of the distribution actually sampled from (rolloutd runs with
    ``engine.vllm.logprobs_mode: processed_logprobs``)."""
    checkpoint_every: int = 5
    """Save the trainer checkpoint and call Checkpoint(step) every this many steps."""
    max_staleness: int = 4
    """rolloutd's ``limits.max_staleness``; a group trained with older samples counts as stale."""
    keep_weights: int = 24
    """Weight directories kept on disk (a restarted rolloutd reloads its snapshot's weights)."""
    threads: int = 1
    """torch CPU threads (vLLM shares the machine)."""
    seed: int = 0
    fetch_timeout_s: float = 600.0
    """A step that cannot gather its groups within this long fails."""
    weights: str = "full"
    """How new weights reach rolloutd: ``full`` (float32 safetensors, loaded from a path) or
    ``delta`` (bf16, what changed since the version served, pushed over gRPC; rolloutd serves
    in bf16 and the model directory holds bf16 weights)."""

    @property
    def served_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.weights == "delta" else torch.float32


# --- the policy --------------------------------------------------------------------------------


@dataclass
class Batch:
    """A step's samples as padded tensors; completion token j of row i sits at ``positions``."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completion_mask: torch.Tensor
    """1 where the target token (``input_ids[:, 1:]``) is a completion token."""
    behaviour: torch.Tensor
    """rolloutd's logprob of each target completion token (0 elsewhere)."""
    advantages: torch.Tensor
    """One per row."""
    temperatures: torch.Tensor
    """The temperature each row was sampled at (one per row)."""


def build_batch(
    samples: Sequence[pb.Sample],
    advantages: Sequence[float],
    pad_id: int,
    temperatures: Sequence[float],
) -> Batch:
    """Rows are prompt ids + completion ids exactly as rolloutd delivered them (no re-tokenizing),
    so a misaligned token or logprob shows up in the parity figures."""
    width = max(len(s.prompt_token_ids) + len(s.token_ids) for s in samples)
    n = len(samples)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    attn = torch.zeros((n, width), dtype=torch.long)
    mask = torch.zeros((n, width - 1))
    behaviour = torch.zeros((n, width - 1))
    for i, s in enumerate(samples):
        if len(s.logprobs) != len(s.token_ids):
            raise ValueError(f"sample has {len(s.logprobs)} logprobs for {len(s.token_ids)} tokens")
        p, c = len(s.prompt_token_ids), len(s.token_ids)
        ids[i, : p + c] = torch.tensor([*s.prompt_token_ids, *s.token_ids])
        attn[i, : p + c] = 1
        # The target at index t is input_ids[t + 1]; completion tokens are targets p-1 .. p+c-2.
        mask[i, p - 1 : p + c - 1] = 1
        behaviour[i, p - 1 : p + c - 1] = torch.tensor(list(s.logprobs))
    return Batch(
        input_ids=ids,
        attention_mask=attn,
        completion_mask=mask,
        behaviour=behaviour,
        advantages=torch.tensor(advantages, dtype=torch.float32),
        temperatures=torch.tensor(temperatures, dtype=torch.float32),
    )


def token_logprobs(model: Any, batch: Batch) -> torch.Tensor:
    """Log-probability of each target token under ``model`` at each row's temperature,
    [rows, width-1]."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logp = torch.log_softmax(logits[:, :-1].float() / batch.temperatures[:, None, None], dim=-1)
    return logp.gather(-1, batch.input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def grpo_loss(logp: torch.Tensor, batch: Batch, clip_eps: float) -> torch.Tensor:
    """Clipped policy gradient; ratio = pi_theta / pi_behaviour per token, where the behaviour
    logprobs are rolloutd's. Token terms are averaged per sample, then over samples (GRPO)."""
    mask = batch.completion_mask
    ratio = torch.exp((logp - batch.behaviour) * mask)
    adv = batch.advantages.unsqueeze(1)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv
    per_token = -torch.minimum(unclipped, clipped) * mask
    per_sample = per_token.sum(1) / mask.sum(1).clamp(min=1)
    return per_sample.mean()


def group_advantages(rewards: Sequence[float]) -> list[float]:
    """(r - mean) / (std + eps) within one group; all-equal rewards give zero advantages."""
    t = torch.tensor(rewards, dtype=torch.float64)
    return ((t - t.mean()) / (t.std(unbiased=False) + 1e-6)).tolist()


# --- files -------------------------------------------------------------------------------------


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish_dir(tmp: Path, final: Path) -> None:
    for f in tmp.iterdir():
        if f.is_file():
            with f.open("rb") as fh:
                os.fsync(fh.fileno())
        else:
            _fsync_dir(f)
    os.replace(tmp, final)
    _fsync_dir(final.parent)


def served_weights(model: Any, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The parameters as rolloutd serves them (the trainer keeps float32 masters)."""
    return {n: p.detach().to(dtype).contiguous() for n, p in model.named_parameters()}


def write_weights(model: Any, out: Path, dtype: torch.dtype = torch.float32) -> None:
    """``out/model.safetensors`` with the parameter names and dtypes of the served model."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = served_weights(model, dtype)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    _publish_dir(tmp, out)


def check_weight_names(model: Any, model_dir: Path, dtype: str = "F32") -> None:
    """The pushed tensors must be exactly the served model's (vLLM's ``reload_weights`` maps them
    by name and would silently keep an old tensor it is not given)."""
    served: dict[str, tuple[str, tuple[int, ...]]] = {}
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            t = f.get_slice(name)
            served[name] = (t.get_dtype(), tuple(t.get_shape()))
    ours = {n: (dtype, tuple(p.shape)) for n, p in model.named_parameters()}
    if served != ours:
        raise RuntimeError(
            f"trainer parameters differ from {model_dir}: "
            f"{sorted(set(served.items()) ^ set(ours.items()))[:6]}"
        )


def append_line(path: Path, record: dict[str, Any]) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_ledger(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@dataclass
class TrainerState:
    """What the trainer checkpoint holds besides the weights and the optimizer."""

    step: int = 0
    version: int = 0
    """Policy version of the current weights (as rolloutd labels the samples they generate)."""
    trained: list[int] = field(default_factory=list)
    """Group ids whose training these weights hold."""
    positions: list[str] = field(default_factory=list)
    """Their prompt positions (:func:`position`): a group re-generated for a position already
    trained is a duplicate too, whatever its id."""


def save_checkpoint(run: Path, model: Any, optimizer: Any, state: TrainerState) -> Path:
    final = run / "trainer" / f"step-{state.step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_weights(model, tmp / "weights")
    torch.save(
        {"optimizer": optimizer.state_dict(), "rng": torch.get_rng_state()}, tmp / "optim.pt"
    )
    (tmp / "state.json").write_text(json.dumps(asdict(state)))
    _publish_dir(tmp, final)
    return final


def latest_checkpoint(run: Path) -> Path | None:
    found = sorted((run / "trainer").glob("step-[0-9]*[0-9]"))
    return found[-1] if found else None


# --- the loop ----------------------------------------------------------------------------------


class Trainer:
    """One trainer process (a *life*); a resumed process is the next life on the same run dir."""

    def __init__(self, run: Path, cfg: TrainConfig, client: RolloutClient, life: int) -> None:
        self.run, self.cfg, self.client, self.life = run, cfg, client, life
        torch.manual_seed(cfg.seed)
        torch.set_num_threads(cfg.threads)
        self.model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32)
        self.model.train()
        check_weight_names(self.model, Path(cfg.model), "BF16" if cfg.weights == "delta" else "F32")
        self.pushed: tuple[int, dict[str, torch.Tensor]] | None = None
        """The version last loaded on every endpoint and its served weights: a delta's base."""
        self.pad_id = int(self.model.config.pad_token_id)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=cfg.lr)
        self.state = TrainerState()
        self.ledger = run / "ledger.jsonl"
        self.expected_redelivery: set[str] = set()
        """Positions of the groups the previous life acked after the restored checkpoint: each
        comes back once, as the same group or (if its samples were never durable) re-generated."""
        self.started = time.monotonic()
        self.tokens = 0
        self.history: dict[int, dict[str, torch.Tensor]] = {}
        self.parity_by_temperature: dict[float, tuple[int, float]] = {}
        """The last step's parity by sampling temperature: (tokens, sum of differences)."""
        """Copies of the weights of recent versions, to recompute the logprobs of samples they
        generated (most samples are a version or two behind the trainer)."""
        self.shadow = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32).eval()

    def start(self, out: Any) -> None:
        """A fresh run on a service that already moved past version 0 (someone else's weights)
        first pushes its own weights, so every sample it trains on comes from its lineage."""
        current = max(s.policy_version for s in self.client.status().values())
        if current != 0:
            self.state.version = current + 1
            ms, _ = self.push_weights()
            out(
                f"rolloutd serves v{current}; own weights pushed as v{self.state.version} ({ms:.0f} ms)"
            )

    def resume(self, out: Any) -> None:
        ckpt = latest_checkpoint(self.run)
        step = 0
        if ckpt is not None:
            weights = ckpt / "weights" / "model.safetensors"
            self.model.load_state_dict(load_file(str(weights)))
            extra = torch.load(ckpt / "optim.pt", weights_only=False)
            self.optimizer.load_state_dict(extra["optimizer"])
            torch.set_rng_state(extra["rng"])
            self.state = TrainerState(**json.loads((ckpt / "state.json").read_text()))
            step = self.state.step
        lost = [
            r for r in read_ledger(self.ledger) if r["life"] == self.life - 1 and r["step"] > step
        ]
        self.expected_redelivery = {p for r in lost for p in r["positions"]}
        rewound = self.client.rewind(step)
        redelivered = sum(r.redelivered_groups for r in rewound.values())
        readmitted = sum(r.readmitted_prompts for r in rewound.values())
        current = max(s.policy_version for s in self.client.status().values())
        self.state.version = max(self.state.version, current) + 1
        ms, evicted = self.push_weights()
        out(
            f"resumed from trainer checkpoint step {step}: Rewind({step}) made {redelivered} groups "
            f"available again ({readmitted} prompts re-admitted), {len(self.expected_redelivery)} "
            f"were acked after step {step}; own weights pushed as v{self.state.version} in {ms:.0f} ms "
            f"({evicted} groups now too stale evicted)"
        )
        append_line(
            self.run / "events.jsonl",
            {
                "event": "resumed",
                "life": self.life,
                "from_step": step,
                "rewind_redelivered": redelivered,
                "rewind_readmitted": readmitted,
                "acked_after_checkpoint": sorted(self.expected_redelivery),
                "version": self.state.version,
                "weight_update_ms": ms,
                "evicted_at_resume": evicted,
            },
        )

    def push_weights(self) -> tuple[float, int]:
        """Writes the current weights and loads them on every endpoint; returns the milliseconds
        it took and the groups rolloutd evicted as now too stale (their prompts are re-admitted)."""
        started = time.perf_counter()
        if self.cfg.weights == "delta" and self.pushed is not None:
            responses = self.push_delta(*self.pushed)
            if responses is not None:
                ms = (time.perf_counter() - started) * 1000
                return ms, sum(r.evicted_groups for r in responses.values())
        # A resumed trainer may reuse a version number that the crashed one had pushed.
        out = self.run / "weights" / f"v{self.state.version:06d}-life{self.life}"
        write_weights(self.model, out, self.cfg.served_dtype)
        responses = self.client.update_weights(self.state.version, str(out.resolve()))
        if self.cfg.weights == "delta":
            self.pushed = (self.state.version, served_weights(self.model, torch.bfloat16))
        ms = (time.perf_counter() - started) * 1000
        kept = sorted((self.run / "weights").glob("v[0-9]*-life[0-9]*"))
        for old in kept[: -self.cfg.keep_weights]:
            shutil.rmtree(old)
        return ms, sum(r.evicted_groups for r in responses.values())

    def push_delta(self, base: int, served: dict[str, torch.Tensor]) -> dict[str, Any] | None:
        """Pushes what changed since ``base`` to every endpoint; None when an endpoint serves
        another version (restarted from an older snapshot), and full weights must go instead."""
        current = served_weights(self.model, torch.bfloat16)
        path = self.run / "weights" / f"v{self.state.version:06d}.delta"
        path.parent.mkdir(parents=True, exist_ok=True)
        stats = make_delta(served, current, path, base_version=base, version=self.state.version)
        try:
            responses = self.client.push_delta(base, self.state.version, path)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            print(f"delta refused ({exc.details()}); pushing full weights", flush=True)
            return None
        finally:
            path.unlink()
        print(
            f"v{self.state.version}: delta of {stats.bytes / 1e3:.1f} kB, "
            f"{stats.density:.3%} of the elements changed",
            flush=True,
        )
        self.pushed = (self.state.version, current)
        return responses

    def fetch(self) -> tuple[list[pb.Group], list[Lease]]:
        groups: list[pb.Group] = []
        leases: list[Lease] = []
        deadline = time.monotonic() + self.cfg.fetch_timeout_s
        while len(groups) < self.cfg.groups_per_step:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(groups)} groups after {self.cfg.fetch_timeout_s:.0f}s")
            lease = self.client.fetch(
                self.cfg.groups_per_step - len(groups), wait_ms=2000, consumer="grpo-example"
            )
            if lease is not None:
                leases.append(lease)
                groups.extend(lease.groups)
        return groups, leases

    def parity(
        self, samples: Sequence[pb.Sample], batch: Batch, logp: torch.Tensor, version: int
    ) -> dict[int, tuple[int, float, float]]:
        """|trainer logprob - rolloutd logprob| of every sampled token whose generating weights
        the trainer still holds: (tokens, sum, max) by policy version. ``logp`` is the training
        forward pass (the current version); older versions are recomputed from kept copies.
        Samples of a version lost with a crash are skipped: no weights of theirs exist any more."""
        by_version: dict[int, list[int]] = {}
        for i, s in enumerate(samples):
            by_version.setdefault(s.policy_version, []).append(i)
        result: dict[int, tuple[int, float, float]] = {}
        by_temperature = self.parity_by_temperature = {}
        for v, rows in sorted(by_version.items()):
            if v == version:
                ours = logp[rows]
            elif v in self.history:
                self.shadow.load_state_dict(self.history[v])
                sub = Batch(
                    batch.input_ids[rows],
                    batch.attention_mask[rows],
                    batch.completion_mask[rows],
                    batch.behaviour[rows],
                    batch.advantages[rows],
                    batch.temperatures[rows],
                )
                with torch.no_grad():
                    ours = token_logprobs(self.shadow, sub)
            else:
                continue
            mask = batch.completion_mask[rows].bool()
            diff = (ours - batch.behaviour[rows]).abs()
            result[v] = (int(mask.sum()), float(diff[mask].sum()), float(diff[mask].max()))
            for t in batch.temperatures[rows].unique().tolist():
                at = mask & (batch.temperatures[rows] == t)[:, None]
                n, total = by_temperature.get(t, (0, 0.0))
                by_temperature[t] = (n + int(at.sum()), total + float(diff[at].sum()))
        for old in [v for v in self.history if v < version - self.cfg.max_staleness]:
            del self.history[old]
        return result

    def step(self, crash_at: int | None, kill_pgid: int | None, out: Any) -> None:
        t0 = time.perf_counter()
        groups, leases = self.fetch()
        t_fetch = time.perf_counter() - t0
        step = self.state.step + 1
        version = self.state.version
        samples: list[pb.Sample] = []
        advantages: list[float] = []
        temperatures: list[float] = []
        rewards: list[float] = []
        staleness: list[int] = []
        duplicates = 0
        trained, positions = set(self.state.trained), set(self.state.positions)
        for g in groups:
            if g.group_id in trained or position(g) in positions:
                duplicates += 1
            trained.add(g.group_id)
            positions.add(position(g))
            r = rewards_of(g)
            rewards.extend(r)
            advantages.extend(group_advantages(r))
            samples.extend(g.samples)
            temperatures.extend([temperature_of(g)] * len(g.samples))
            staleness.append(version - min(s.policy_version for s in g.samples))
        if version not in self.history:
            self.history[version] = {
                k: v.detach().clone() for k, v in self.model.state_dict().items()
            }
        batch = build_batch(samples, advantages, self.pad_id, temperatures)
        logp = token_logprobs(self.model, batch)
        loss = grpo_loss(logp, batch, self.cfg.clip_eps)
        self.optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        parity = self.parity(samples, batch, logp.detach(), version)
        parity_n = sum(n for n, _, _ in parity.values())
        t_train = time.perf_counter() - t0 - t_fetch

        for lease in leases:
            self.client.ack(lease, step)
        self.state = TrainerState(step, version + 1, sorted(trained), sorted(positions))
        update_ms, _ = self.push_weights()
        tokens = sum(len(s.token_ids) for s in samples)
        self.tokens += tokens
        record = {
            "life": self.life,
            "step": step,
            "version": version,
            "new_version": self.state.version,
            "group_ids": [g.group_id for g in groups],
            "positions": [position(g) for g in groups],
            "sample_versions": [[s.policy_version for s in g.samples] for g in groups],
            "reward": sum(rewards) / len(rewards),
            "dropped_share": dropped_share(self.client),
            "staleness_max": max(staleness),
            "staleness_mean": sum(staleness) / len(staleness),
            "stale_groups": sum(s > self.cfg.max_staleness for s in staleness),
            "duplicate_groups": duplicates,
            "redelivered": sorted(
                p for p in map(position, groups) if p in self.expected_redelivery
            ),
            "completion": samples[0].text,
            "loss": float(loss.detach()),
            "tokens": tokens,
            "parity_tokens": parity_n,
            "parity_sum": sum(total for _, total, _ in parity.values()),
            "parity_max": max((mx for _, _, mx in parity.values()), default=0.0),
            "parity_by_lag": {
                str(version - v): [n, total, mx] for v, (n, total, mx) in parity.items()
            },
            "parity_by_temperature": {
                f"{t:g}": [n, total] for t, (n, total) in self.parity_by_temperature.items()
            },
            "fetch_s": t_fetch,
            "train_s": t_train,
            "weight_update_ms": update_ms,
            "time": time.time(),
        }
        append_line(self.ledger, record)
        elapsed = time.monotonic() - self.started
        parity_sum = sum(total for _, total, _ in parity.values())
        mean_diff = f"{parity_sum / parity_n:.1e}" if parity_n else "   -   "
        out(
            f"step {step:4d}  reward {record['reward']:.3f}  dropped {record['dropped_share']:4.0%}"
            f"  policy v{version}->v{self.state.version}"
            f"  staleness max {record['staleness_max']} mean {record['staleness_mean']:.1f}"
            f"  {self.tokens / elapsed:6.0f} tok/s  update {update_ms:5.0f} ms"
            f"  |dlogp| {mean_diff}  fetch {t_fetch:4.1f}s train {t_train:4.1f}s"
        )
        if self.cfg.checkpoint_every and step % self.cfg.checkpoint_every == 0:
            save_checkpoint(self.run, self.model, self.optimizer, self.state)
            responses = self.client.checkpoint(trainer_step=step, tag=f"grpo-step-{step}")
            outcomes = {pb.CheckpointOutcome.Name(r.outcome) for r in responses.values()}
            out(f"step {step:4d}  trainer checkpoint saved; Checkpoint({step}): {sorted(outcomes)}")
        if crash_at is not None and step == crash_at:
            out(f"step {step:4d}  crash: SIGKILL rolloutd (process group {kill_pgid}) and trainer")
            if kill_pgid is not None:
                os.killpg(kill_pgid, signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("run", type=Path, help="run directory holding run.json")
    parser.add_argument("--target", required=True, help="comma-separated rolloutd endpoints")
    parser.add_argument("--life", type=int, default=0, help="0 for the first process, then 1, ...")
    parser.add_argument("--resume", action="store_true", help="resume from the latest checkpoint")
    parser.add_argument("--crash-at", type=int, help="SIGKILL after this step")
    parser.add_argument("--kill-pgid", type=int, help="process group SIGKILLed with the crash")
    args = parser.parse_args(argv)

    def out(line: str) -> None:
        print(f"[trainer] {line}", flush=True)

    raw = json.loads((args.run / "run.json").read_text())
    cfg = TrainConfig(**raw)
    with RolloutClient(args.target.split(","), timeout_s=120) as client:
        wait_until_ready(client, 900, out)
        trainer = Trainer(args.run, cfg, client, args.life)
        if args.resume:
            trainer.resume(out)
        else:
            trainer.start(out)
        while trainer.state.step < cfg.steps:
            trainer.step(args.crash_at, args.kill_pgid, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
