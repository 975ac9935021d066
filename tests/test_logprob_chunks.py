"""The chunked logprob pass (`train.logprob_chunk_tokens`) gives today's numbers: values and gradients equal
the whole-logits computation to fp32 precision, with several chunks and a partial last one."""

from __future__ import annotations

import pytest
import torch
from trainerlib import one_rank

from molt.spec import RunSpec
from molt.trainer.model import chunked_token_logprobs, token_logprobs

pytestmark = pytest.mark.timeout(300)


def test_chunked_equals_whole_logits_values_and_gradients() -> None:
    """12 selected positions in chunks of 5 (5 + 5 + 2), per-token temperature, top-p and top-k (the
    truncation active on some), entropy; unselected positions (prompt, padding) are 0 in both."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 9, 16, generator=gen).requires_grad_()
    head = torch.nn.Linear(16, 50, bias=False)
    with torch.no_grad():
        head.weight.copy_(0.3 * torch.randn(50, 16, generator=gen))   # logits of a few units, as a model's
    ids = torch.randint(0, 50, (2, 9), generator=gen)
    select = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1, 1, 0, 0]])
    assert int(select[:, 1:].sum()) == 12
    temp = 0.5 + torch.rand(2, 9, generator=gen)
    top_p = torch.where(torch.rand(2, 9, generator=gen) < 0.5, 0.7, 1.0)
    top_k = torch.where(torch.rand(2, 9, generator=gen) < 0.5, 5, -1)
    weights = torch.randn(2, 2, 9, generator=gen)   # a loss that mixes logprobs and entropies

    def run(chunk: int | None, calls: int = 0) -> tuple[torch.Tensor, ...]:
        hidden.grad, head.weight.grad = None, None
        if chunk is None:
            logp, ent = token_logprobs(head(hidden), ids, select, temp, top_p, top_k, entropy=True)
        else:
            logp, ent = chunked_token_logprobs(hidden, head, ids, select, temp, top_p, top_k, True, chunk,
                                               calls)
        ((weights[0] * logp).sum() + (weights[1] * ent).sum()).backward()
        return logp.detach(), ent.detach(), hidden.grad.clone(), head.weight.grad.clone()

    calls = []   # spare chunks (as if another rank needed 6): the same numbers, 6 head calls each way
    hook = head.register_forward_hook(lambda *_: calls.append(1))
    whole, chunked, padded = run(None), run(5), run(5, calls=6)
    hook.remove()
    assert len(calls) == 1 + 2 * 3 + 2 * 6   # each chunk: forward, and its recomputation in the backward
    for a, b, c in zip(whole, chunked, padded, strict=True):
        assert (a - b).abs().max().item() <= 1e-6 and (b - c).abs().max().item() == 0
    assert whole[0][select == 0].abs().max() == 0 and chunked[0][select == 0].abs().max() == 0
    assert whole[2].abs().max() > 0 and whole[3].abs().max() > 0
    # no grad: the same values without the checkpointing
    with torch.no_grad():
        logp, _ = chunked_token_logprobs(hidden, head, ids, select, temp, top_p, top_k, False, 3)
    assert (logp - whole[0]).abs().max().item() <= 1e-6


def test_a_rank_with_small_chunks_trains_like_whole_chunks(tiny_model_path) -> None:
    """One rank, chunks of 5 sampled positions (the last one partial) against chunks larger than the batch:
    the logprobs (on sampled tokens), the update's loss, entropy and gradient norm agree to 1e-6, and so
    do the gradients the optimizer gets, to 1e-6 of the largest. What chunking can change is compared
    before AdamW: its first step is lr * g / (|g| + eps), so a rounding difference in a near-zero gradient
    (the host's kernels: ~1e-5 in the weights with AVX2) becomes an lr-sized step."""
    from test_trainer import batch_of, max_diff

    out = []
    for chunk in (5, 10_000):
        spec = RunSpec.model_validate({
            "model": {"path": tiny_model_path}, "rollout": {"temperature": 0.7, "top_k": 20},
            "algo": {"loss": {"entropy_coef": 0.01}},
            "train": {"prompts_per_step": 1, "micro_batch_size": 3, "lr": 1e-3,
                      "logprob_chunk_tokens": chunk}})
        b = batch_of(3)
        with one_rank(spec) as rank:
            grads = {}   # what the optimizer steps on (clipped)
            rank.optimizer.register_step_pre_hook(lambda *_, rank=rank, grads=grads: grads.update(
                {k: p.grad.detach().clone() for k, p in rank.model.named_parameters()}))
            logp = rank.forward(b)
            metrics = rank.update(b)
            out.append((logp, metrics, grads))
    (logp5, m5, g5), (logp_all, m_all, g_all) = out
    sampled = b["loss_mask"] > 0
    assert int(sampled.sum()) % 5 and int(sampled.sum()) > 10   # several chunks, a partial last one
    assert (logp5 - logp_all)[sampled].abs().max().item() <= 1e-6
    assert (logp5[~sampled] == 0).all()      # prompt tokens are not scored
    assert m5["train/loss"] == pytest.approx(m_all["train/loss"], abs=1e-6)
    assert m5["train/grad_norm"] == pytest.approx(m_all["train/grad_norm"], abs=1e-6)
    assert m5["train/entropy"] == pytest.approx(m_all["train/entropy"], abs=1e-6)
    largest = max(float(g.abs().max()) for g in g_all.values())
    assert len(g_all) > 10 and max_diff(g5, g_all) <= 1e-6 * largest


@pytest.mark.timeout(240)
def test_two_ranks_with_different_chunk_counts_match_whole_logits(ray_session, tiny_model_path) -> None:
    """Two FSDP2 ranks (gloo) in chunks of 4 sampled positions, whose micro-batches need different numbers
    of chunks (and the packed rank an inert micro-batch with none): logprobs, loss and gradient norm of two
    steps equal one process scoring the whole padded batch with whole logits (`reference_run`) to 1e-6,
    and nothing hangs. Each call of the sharded head is a collective: a rank that made fewer calls than the
    other, forward or backward (recomputation), would wait on it until parallel.collective_timeout_s (a
    minute here, `make_spec`) fails the step."""
    from test_packing import BUDGET
    from test_trainer import batch_of, make_spec, reference_run

    from molt.trainer import TrainerRanks
    from molt.trainer.packing import token_budget_groups

    batches = [batch_of(s) for s in (0, 1)]
    chunks = []   # per rank (rows 0-3, 4-7), the chunks of 4 each packed micro-batch's sampled tokens need
    for rows in (slice(0, 4), slice(4, 8)):
        mask, lengths = batches[0]["loss_mask"][rows], batches[0]["attention_mask"][rows].sum(-1).tolist()
        chunks.append([-(-int(mask[g].sum()) // 4) for g in token_budget_groups(lengths, BUDGET)])
    assert len(chunks[0]) != len(chunks[1]) and max(max(c) for c in chunks) >= 3, chunks
    spec = make_spec(tiny_model_path, 2, lr=1e-4, micro_batch_tokens=BUDGET, logprob_chunk_tokens=4)
    group = TrainerRanks(spec)
    try:
        logp = group.logprobs(batches[0])
        metrics = [group.update(b) for b in batches]
    finally:
        group.shutdown()
    padded, _ = reference_run(tiny_model_path, batches, spec)
    assert float((logp - padded[0][1])[batches[0]["loss_mask"] > 0].abs().max()) <= 1e-6
    for m, (loss, _, grad_norm) in zip(metrics, padded, strict=True):
        assert abs(m["train/loss"] - loss) <= 1e-6
        assert m["train/grad_norm"] == pytest.approx(grad_norm, rel=1e-6)
