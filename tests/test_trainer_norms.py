"""The trainer's loss aggregation (`algo.loss.norm`) on one rank, against the normalizer written out by hand.

The rows have different numbers of sampled tokens, split over several micro-batches, with a response
budget of several turns: a normalizer that lost its `x agent.max_turns` factor, counted tokens instead of
rows, or was taken per micro-batch instead of over the whole batch gives another loss.
"""

from __future__ import annotations

import random

import pytest
import torch
from trainerlib import one_rank

from molt.spec import RunSpec
from molt.trainer import make_batch
from molt.trajectory import Segment

pytestmark = pytest.mark.timeout(300)
MAX_TOKENS, TURNS = 8, 2


def batch() -> dict[str, torch.Tensor]:
    """5 rows of 3-11 sampled tokens each, one advantage per row (1.5, -0.5, 2.0, -1.0, 0.25)."""
    rng = random.Random(3)
    segs = []
    for i, sampled in enumerate((3, 11, 5, 8, 4)):
        mask = [0, 0] + [1] * sampled
        segs.append(Segment(token_ids=[rng.randrange(320) for _ in mask], loss_mask=mask,
                            logprobs=[-1.0 * m for m in mask], versions=[0 if m else -1 for m in mask],
                            rollout_id=str(i), group_id="g"))
    advantages = (1.5, -0.5, 2.0, -1.0, 0.25)
    return make_batch(segs, advantages=[[a] * len(s.token_ids)
                                        for a, s in zip(advantages, segs, strict=True)])


@pytest.mark.parametrize("norm", ["seq", "seq-mean-token-mean"])
def test_seq_norms_with_several_turns_by_hand(tiny_model_path, norm) -> None:
    spec = RunSpec.model_validate({
        "model": {"path": tiny_model_path},
        "agent": {"max_turns": TURNS},
        "rollout": {"max_tokens": MAX_TOKENS, "temperature": 1.0},
        "algo": {"loss": {"norm": norm}},
        "train": {"prompts_per_step": 1, "micro_batch_size": 2, "lr": 1e-4},
    })
    b = batch()
    # One update per batch: ratio 1, so each sampled token's loss is -A; no correction, KL or entropy.
    per_row = [(-b["advantages"][r] * b["loss_mask"][r]).sum().item() for r in range(5)]
    counts = [int(b["loss_mask"][r].sum()) for r in range(5)]
    if norm == "seq":   # Dr.GRPO: rows x the response budget, max_tokens per turn x max_turns
        expected = sum(per_row) / (5 * MAX_TOKENS * TURNS)
    else:               # the mean over rows of each row's token mean
        expected = sum(s / n for s, n in zip(per_row, counts, strict=True)) / 5
    with one_rank(spec) as rank:
        m = rank.update(b)
    assert m["train/loss"] == pytest.approx(expected, abs=1e-6)
