"""Context parallel (`parallel.cp_size`): ranks that split each micro-batch's positions (real gloo groups
of forked trainer ranks) give the per-token logprobs, losses, metrics and gradients of one cp=1 rank on the
same batch, within 1e-5 (max)."""

from __future__ import annotations

import random

import pytest
import torch
from torch.distributed.tensor import DTensor
from trainerlib import forked_ranks, one_rank

from molt.spec import RunSpec
from molt.trainer import make_batch
from molt.trainer.context_parallel import zigzag
from molt.trainer.ranks import row_shards
from molt.trajectory import Segment

pytestmark = pytest.mark.timeout(300)
TOLERANCE = 1e-5
COMPARED = ("train/loss", "train/grad_norm", "train/entropy", "train/kl", "train/is_weight_mean",
            "mismatch/mean_abs", "mismatch/max_abs", "train/tokens")


def rollouts(seed: int, rows: int = 7, moe_layers: int = 0) -> dict[str, torch.Tensor]:
    """Rows of unequal lengths, odd ones among them (so micro-batches are padded up for the split), each a
    multi-turn rollout: a prompt, a sampled turn, a tool output the loss masks out, a second sampled turn
    drawn with other sampling parameters; per-token advantages, reference logprobs and (MoE) random routes."""
    rng = random.Random(seed)
    segs, adv, ref = [], [], []
    for i in range(rows):
        prompt, turn, tool, turn2 = (rng.randint(*bounds) for bounds in ((2, 6), (3, 9), (2, 6), (3, 12)))
        n = prompt + turn + tool + turn2
        mask = [0] * prompt + [1] * turn + [0] * tool + [1] * turn2
        routes = None
        if moe_layers:   # 2 distinct experts of 4 per token and layer, not what the router would pick
            routes = torch.rand(n, moe_layers, 4, generator=torch.Generator().manual_seed(seed * 100 + i))
            routes = routes.argsort(-1)[..., :2].numpy()
        segs.append(Segment(token_ids=[rng.randrange(320) for _ in range(n)], loss_mask=mask,
                            logprobs=[-rng.uniform(0.5, 4) * m for m in mask],
                            versions=[0 if m else -1 for m in mask], rollout_id=str(i), group_id="g",
                            routed_experts=routes,
                            sampling=[[prompt, 0.7, 0.9, -1], [prompt + turn + tool, 1.0, 1.0, 20]]))
        adv.append([rng.gauss(0, 1)] * n)
        ref.append([-rng.uniform(0.5, 4) for _ in range(n)])
    return make_batch(segs, advantages=adv, ref_logp=ref)


def cp_spec(path: str, cp: int = 1, dp: int = 1, **train) -> RunSpec:
    """Rules that reduce over a whole row (seq-mean-token-mean, the geometric-mean correction), the entropy
    bonus and a KL loss on the reference logprobs: each sees the gathered micro-batch."""
    return RunSpec.model_validate({
        "model": {"path": path, "reference": "policy"},
        "parallel": {"dp_size": dp, "cp_size": cp, "cpu_threads": 1},
        "rollout": {"samples_per_prompt": 8, "max_tokens": 8, "temperature": 0.7},
        "algo": {"loss": {"norm": "seq-mean-token-mean", "entropy_coef": 0.01}, "kl": {"coef": 0.01},
                 "correction": {"level": "geo", "mode": "mask", "low": 0.2, "high": 5.0}},
        "train": {"prompts_per_step": 1, "micro_batch_size": 3, "logprob_chunk_tokens": 4, **train},
    })


def step(worker, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float], dict]:
    """The rank's logprobs of its rows of `batch`, then one update: its metrics and the gradient each
    parameter had when the optimizer would have stepped (after clipping; the step itself is skipped)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX

    shard = row_shards(batch, worker.spec.parallel)[worker.rank]
    grads = {}

    def capture() -> None:   # names without activation checkpointing's wrapper
        for name, p in worker.model.named_parameters():
            if p.grad is not None:
                grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                grads[name.replace(_CHECKPOINT_PREFIX, "")] = grad.clone()
    worker.optimizer.step = capture
    logp = worker.forward(shard)
    return logp, worker.update(shard), grads


def assert_like(cp_runs: list, reference: tuple, batch: dict[str, torch.Tensor], dp: int = 1,
                compared: tuple[str, ...] = COMPARED) -> None:
    """Every rank's metrics and gradients are the reference's, and its data shard's scores (logprobs or
    values) of the sampled tokens."""
    ref_scores, ref_metrics, ref_grads = reference
    rows = -(-batch["input_ids"].shape[0] // dp)
    for rank, (scores, metrics, grads) in enumerate(cp_runs):
        first = rank // (len(cp_runs) // dp) * rows
        sampled = batch["loss_mask"][first:first + rows] > 0
        gap = (scores[:len(sampled)] - ref_scores[first:first + rows])[sampled]
        assert float(gap.abs().max()) <= TOLERANCE, rank
        for key in compared:
            assert metrics[key] == pytest.approx(ref_metrics[key], abs=TOLERANCE), (rank, key)
        assert grads.keys() == ref_grads.keys()
        assert max(float((grads[k] - ref_grads[k]).abs().max()) for k in grads) <= TOLERANCE, rank


def test_the_layout_is_zigzag_and_balances_causal_attention() -> None:
    """Rank r holds chunks r and 2cp-1-r, as AutoModel's round-robin layout (torch's context parallel);
    each rank's causal attention work (the keys its queries see) is the same."""
    from nemo_automodel.components.distributed.context_parallel.sharder import round_robin_local_indices

    class Mesh:   # the two calls the layout makes of a cp mesh, outside a process group
        def __init__(self, size: int, rank: int) -> None:
            self.size, self.get_local_rank = (lambda: size), (lambda: rank)

    for size in (2, 4):
        held = [zigzag(8 * size, size, r) for r in range(size)]
        assert sorted(torch.cat(held).tolist()) == list(range(8 * size))
        for r, h in enumerate(held):
            assert torch.equal(h, round_robin_local_indices(Mesh(size, r), 8 * size))
        assert len({int((h + 1).sum()) for h in held}) == 1


def test_two_cp_ranks_give_one_ranks_numbers(tiny_model_path) -> None:
    """cp=2 against cp=1 on 7 multi-turn rollouts (tool tokens masked, two sampling settings per row) in
    3 micro-batches of odd lengths, logprobs in chunks of 4 positions: logprobs, loss, entropy, KL,
    importance weights, gap metrics and every gradient within 1e-5."""
    batch = rollouts(0)
    with one_rank(cp_spec(tiny_model_path)) as rank:
        reference = step(rank, batch)
    runs = forked_ranks(cp_spec(tiny_model_path, cp=2), lambda w: step(w, batch))
    assert_like(runs, reference, batch)


def test_data_and_context_parallel_with_packing(tiny_model_path) -> None:
    """4 ranks, dp=2 x cp=2, packed micro-batches (rows cut at no sequence bound: the packed row is split
    anywhere, each sequence attends only to itself), activation checkpointing: one cp=1 rank's numbers."""
    batch = rollouts(1, rows=8)
    train = {"micro_batch_tokens": 60}
    with one_rank(cp_spec(tiny_model_path, **train)) as rank:
        reference = step(rank, batch)
    spec = cp_spec(tiny_model_path, cp=2, dp=2, **train)
    spec.parallel.activation_checkpointing = True
    runs = forked_ranks(spec, lambda w: step(w, batch))
    assert_like(runs, reference, batch, dp=2)


def test_tensor_and_context_parallel(tiny_model_path) -> None:
    """4 ranks, tp=2 x cp=2: each tensor-parallel rank's 2 heads (1 key/value head, repeated for the split)
    over its 2 cp ranks, whole logits (tensor parallel does not chunk): one cp=1 rank's numbers."""
    batch = rollouts(3)
    with one_rank(cp_spec(tiny_model_path)) as rank:
        reference = step(rank, batch)
    spec = cp_spec(tiny_model_path, cp=2)
    spec.parallel.tp_size = 2
    assert_like(forked_ranks(spec, lambda w: step(w, batch)), reference, batch)


def test_forked_ranks_leave_the_garbage_they_inherit_alone(tiny_model_path) -> None:
    """An earlier rank of this process left as garbage, as between two full collections of the suite: its
    process group's destructor waits for the group's threads, which a fork does not copy. A forked rank's
    full collection must leave it alone (trainerlib.forked_ranks freezes it at the fork): the collection
    hung there and the ranks never answered, the critic's below at each full suite."""
    import gc

    def earlier_rank() -> None:
        with one_rank(cp_spec(tiny_model_path)) as rank:
            assert rank.model is not None
    enabled = gc.isenabled()
    gc.disable()   # keep the garbage until the fork
    try:
        earlier_rank()
        assert len(forked_ranks(cp_spec(tiny_model_path), lambda w: gc.collect(), timeout_s=60)) == 1
    finally:
        if enabled:
            gc.enable()


def test_critic_values_under_context_parallel(tiny_model_path) -> None:
    """The critic's values (its value head on whole hidden states, each position scoring the token after
    it) and its update at cp=2: cp=1's. Its value head has no dropout, so train and eval forwards agree."""
    batch = rollouts(4)
    batch["returns"] = torch.randn(batch["input_ids"].shape, generator=torch.Generator().manual_seed(4))
    batch["old_values"] = torch.zeros_like(batch["returns"])

    def critic(cp: int) -> RunSpec:
        return RunSpec.model_validate({
            "model": {"path": tiny_model_path, "critic": True}, "algo": {"estimator": "gae"},
            "parallel": {"cp_size": cp, "cpu_threads": 1}, "rollout": {"samples_per_prompt": 8},
            "train": {"prompts_per_step": 1, "micro_batch_size": 3}})

    def critic_step(worker) -> tuple:
        assert all(m.p == 0 for m in worker.model.modules() if isinstance(m, torch.nn.Dropout))
        return step(worker, batch)
    with one_rank(critic(1), role="critic") as rank:
        reference = critic_step(rank)
    runs = forked_ranks(critic(2), critic_step, role="critic")
    assert_like(runs, reference, batch, compared=("critic/loss", "critic/grad_norm", "critic/value_error"))


def test_moe_routes_are_split_with_their_tokens(tiny_model_path) -> None:
    """The tiny MoE model replaying random routes (not the router's picks) at cp=2: cp=1's numbers."""
    from molt.inputs.tiny import tiny_model_path as build

    path = str(build(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64))
    batch = rollouts(2, moe_layers=2)
    specs = [cp_spec(path, cp=cp) for cp in (1, 2)]
    for spec in specs:
        spec.model.router_replay = True
    with one_rank(specs[0]) as rank:
        reference = step(rank, batch)
    assert_like(forked_ranks(specs[1], lambda w: step(w, batch)), reference, batch)


def test_the_memory_plan_and_the_dry_run_split_a_micro_batch_over_cp_ranks() -> None:
    """A cp rank's activations and logits are its share of the micro-batch's: half at cp=2 (8192 tokens a
    micro-batch, 4096 on each rank); its weights, gradients and optimizer state are sharded over dp x cp.
    The dry run names the layout and both token counts."""
    from molt.driver.compose import compose
    from molt.driver.launch import describe_plan
    from molt.plan.arch import arch_of
    from molt.plan.memory import trainer_estimate

    specs = [compose(["parallel=cpu2", f"parallel.cp_size={cp}"]) for cp in (1, 2)]
    one, two = (trainer_estimate(s, "policy", arch_of(s)).parts for s in specs)
    for part in ("activations", "logits"):
        assert two[part] == one[part] / 2
    for part in ("params", "grads", "optimizer"):
        assert two[part] == one[part] / 2
    plan = describe_plan(specs[1])
    assert "policy trainer: 4 rank(s) [dp=2 cp=2 tp=1 ep=1] FSDP2" in plan
    assert "8192 tokens per micro-batch, 4096 on each of its cp=2 ranks" in plan
