"""Sequence packing: token-budget micro-batches, packed into padding-free rows, score and train exactly like
padded row micro-batches (real FSDP2 ranks, in Ray actors or one in this process, fp32)."""

from __future__ import annotations

import pytest
from test_trainer import batch_of, make_spec, reference_run
from trainerlib import one_rank

from molt.spec import RunSpec
from molt.trainer import TrainerRanks
from molt.trainer.packing import token_budget_groups

pytestmark = pytest.mark.timeout(300)
BUDGET = 40  # tokens per packed micro-batch: rows of 7-22 tokens give 1-3 rows each


def test_token_budget_groups() -> None:
    assert token_budget_groups([3, 4, 2, 9, 1], 7) == [range(0, 2), range(2, 3), range(3, 4), range(4, 5)]
    assert token_budget_groups([12], 7) == [range(0, 1)]   # a row over the budget goes alone
    assert token_budget_groups([], 7) == []
    with pytest.raises(ValueError, match="needs parallel.device=cpu"):
        RunSpec.model_validate({"parallel": {"device": "cuda"}, "model": {"dtype": "bfloat16"},
                                "train": {"micro_batch_tokens": 512}})


def test_packed_equals_padded(ray_session, tiny_model_path) -> None:
    """Two FSDP2 ranks with packed token-budget micro-batches (the ranks need different numbers of them)
    against one process scoring the whole padded batch in one forward (`reference_run`): logprobs, loss
    and gradient norm of two steps agree to 1e-6 (max). Positions that did not restart per sequence, or
    attention across packed sequences, move logprobs by ~1 (seen: 6.1)."""
    batches = [batch_of(s) for s in (0, 1)]
    lengths = batches[0]["attention_mask"].sum(-1).tolist()
    assert len(token_budget_groups(lengths[:4], BUDGET)) != len(token_budget_groups(lengths[4:], BUDGET))
    spec = make_spec(tiny_model_path, 2, lr=1e-4, micro_batch_tokens=BUDGET)
    group = TrainerRanks(spec)
    logp = group.logprobs(batches[0])
    metrics = [group.update(b) for b in batches]
    group.shutdown()
    padded, _ = reference_run(tiny_model_path, batches, spec)
    assert float((logp - padded[0][1])[batches[0]["loss_mask"] > 0].abs().max()) < 1e-6
    for m, (loss, _, grad_norm) in zip(metrics, padded, strict=True):
        assert abs(m["train/loss"] - loss) < 1e-6
        assert m["train/grad_norm"] == pytest.approx(grad_norm, rel=1e-6)


def test_packed_critic_values_and_entropy_equal_padded(tiny_model_path) -> None:
    """One rank in this process, packed token-budget micro-batches against padded row micro-batches on
    the same ragged batch: the critic's values and the policy's per-token entropy agree to 1e-6 (max)."""
    import torch

    def per_token(role: str, budget: int | None) -> torch.Tensor:
        with one_rank(make_spec(tiny_model_path, micro_batch_tokens=budget), role) as worker:
            if role == "critic":
                return worker.forward(batch)
            out, start = torch.zeros(batch["input_ids"].shape), 0
            for mb in worker._micro_batches(batch):
                rows, length = mb["input_ids"].shape
                out[start:start + rows, :length] = worker._forward(mb, entropy=True)[1]
                start += rows
            return out

    batch = batch_of(3)
    for role in ("critic", "policy"):
        padded, packed = per_token(role, None), per_token(role, BUDGET)
        assert float(padded.abs().max()) > 0.1 and float((packed - padded).abs().max()) < 1e-6, role
