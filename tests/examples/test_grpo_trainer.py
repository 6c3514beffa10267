"""The GRPO example's trainer math on hand-made samples: alignment, advantages, loss, reward."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from rolloutd.v1 import rollout_pb2 as pb

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from grpo_rewards import answer_shaped
from grpo_trainer import (
    build_batch,
    group_advantages,
    grpo_loss,
    token_logprobs,
)

from rolloutd.scoring import ScoringInput


def reward(text: str) -> float:
    """The example's verifier on a completion, as the service calls it."""
    return answer_shaped(ScoringInput("p", "q", (), None, text, (), "stop", 0))


PAD = 2


def sample(prompt: list[int], tokens: list[int], logprobs: list[float]) -> pb.Sample:
    return pb.Sample(prompt_token_ids=prompt, token_ids=tokens, logprobs=logprobs)


def test_batch_puts_each_delivered_logprob_on_its_own_token() -> None:
    samples = [
        sample([0, 10, 11], [20, 21], [-0.5, -1.5]),
        sample([0, 12], [22, 23, 24], [-1, -2, -3]),
    ]
    batch = build_batch(samples, [1.0, -1.0], PAD, [1.0, 1.0])
    targets = batch.input_ids[:, 1:]
    mask = batch.completion_mask.bool()
    assert targets[0][mask[0]].tolist() == [20, 21]
    assert targets[1][mask[1]].tolist() == [22, 23, 24]
    assert batch.behaviour[0][mask[0]].tolist() == [-0.5, -1.5]
    assert batch.behaviour[1][mask[1]].tolist() == [-1, -2, -3]
    assert batch.attention_mask.sum(1).tolist() == [5, 5]
    assert batch.behaviour[~mask].abs().sum() == 0


def test_batch_refuses_a_sample_whose_logprobs_do_not_match_its_tokens() -> None:
    with pytest.raises(ValueError, match="1 logprobs for 2 tokens"):
        build_batch([sample([0], [5, 6], [-1.0])], [0.0], PAD, [1.0])


class Unigram(torch.nn.Module):
    """Logits that depend only on the position's own input token: easy to check by hand."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(vocab, vocab))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> object:
        return type("Out", (), {"logits": self.table[input_ids]})()


def test_recomputed_logprobs_follow_each_rows_temperature_and_the_targets() -> None:
    model = Unigram(32)
    rows = [sample([0, 3], [4, 5], [0.0, 0.0]), sample([0, 3], [4, 5], [0.0, 0.0])]
    batch = build_batch(rows, [0.0, 0.0], PAD, [2.0, 0.5])
    got = token_logprobs(model, batch)
    for row, temperature in enumerate((2.0, 0.5)):
        expected = [
            torch.log_softmax(model.table[prev] / temperature, -1)[tok].item()
            for prev, tok in [(3, 4), (4, 5)]
        ]
        mask = batch.completion_mask[row].bool()
        assert got[row][mask].tolist() == pytest.approx(expected, abs=1e-6)


def test_advantages_are_normalised_within_the_group() -> None:
    adv = group_advantages([1.0, 0.0, 0.0, 1.0])
    assert adv == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-4)
    assert group_advantages([0.3, 0.3, 0.3]) == [0.0, 0.0, 0.0]


def test_loss_raises_the_better_sample_and_clips_the_ratio() -> None:
    model = Unigram(16)
    samples = [sample([0, 1], [7], [0.0]), sample([0, 1], [8], [0.0])]
    batch = build_batch(samples, [1.0, -1.0], PAD, [1.0, 1.0])
    with torch.no_grad():
        batch.behaviour = token_logprobs(model, batch) * batch.completion_mask
    loss = grpo_loss(token_logprobs(model, batch), batch, clip_eps=0.2)
    loss.backward()
    assert model.table.grad is not None
    # Gradient descent raises the logit of the rewarded token and lowers the other.
    assert model.table.grad[1, 7] < 0 < model.table.grad[1, 8]
    # Far from the behaviour policy the clipped term has no gradient (ratio 1.5 > 1 + eps, A > 0).
    model.zero_grad()
    shifted = build_batch(samples[:1], [1.0], PAD, [1.0])
    shifted.behaviour = (token_logprobs(model, shifted).detach() - 0.405) * shifted.completion_mask
    grpo_loss(token_logprobs(model, shifted), shifted, clip_eps=0.2).backward()
    assert model.table.grad is not None and model.table.grad.abs().sum() == 0


def test_reward_is_the_share_of_short_whole_numbers() -> None:
    assert reward(" 7 12 345 x9") == 0.5
    assert reward("") == 0.0
    assert reward(" 42") == 1.0
