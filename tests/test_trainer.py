"""Trainer: real FSDP2 ranks (gloo; Ray actors, or one rank in this process), checked against single-process
and independent numbers."""

from __future__ import annotations

import math
import os
import random
import time

import pytest
import ray
import torch
from trainerlib import full_weights, one_rank

from molt.algo import loss_normalizer, policy_loss
from molt.spec import RunSpec
from molt.trainer import TrainerRanks, make_batch
from molt.trainer.model import token_logprobs
from molt.trajectory import Segment

pytestmark = pytest.mark.timeout(300)


def make_spec(path: str, ws: int = 1, mbs: int = 4, lr: float = 1e-3, **train) -> RunSpec:
    # a collective one rank never joins (ranks calling FSDP's gathers a different number of times) fails
    # the test within a minute, not at pytest's timeout
    return RunSpec.model_validate({
        "model": {"path": path},
        "parallel": {"dp_size": ws, "collective_timeout_s": 60},
        "rollout": {"samples_per_prompt": 8, "max_tokens": 8, "temperature": 0.7},
        "train": {"prompts_per_step": 1, "micro_batch_size": mbs, "lr": lr, "steps": 4, **train},
    })


def segments(seed: int, n: int = 8) -> list[Segment]:
    """Rows of very different lengths, so ranks and micro-batches hold different token counts."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt, length = rng.randint(2, 5), rng.randint(7, 22)
        mask = [0] * prompt + [1] * (length - prompt)
        out.append(Segment(token_ids=[rng.randrange(320) for _ in range(length)], loss_mask=mask,
                           logprobs=[-rng.uniform(0.5, 4) * m for m in mask],
                           versions=[0 if m else -1 for m in mask], rollout_id=str(i), group_id="g"))
    return out


def batch_of(seed: int) -> dict[str, torch.Tensor]:
    segs = segments(seed)
    rng = random.Random(seed + 100)
    adv = [[rng.gauss(0, 1)] * len(s.token_ids) for s in segs]
    return make_batch(segs, advantages=adv)


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def test_make_batch_pads_and_aligns() -> None:
    segs = segments(0, n=3)
    batch = make_batch(segs, advantages=[[1.0] * len(s.token_ids) for s in segs])
    longest = max(len(s.token_ids) for s in segs)
    assert batch["input_ids"].shape == (3, longest)
    for i, s in enumerate(segs):
        n = len(s.token_ids)
        assert batch["input_ids"][i, :n].tolist() == s.token_ids
        assert batch["loss_mask"][i, :n].tolist() == s.loss_mask and batch["loss_mask"][i, n:].sum() == 0
        assert batch["attention_mask"][i].sum() == n and batch["advantages"][i, n:].sum() == 0
    with pytest.raises(ValueError, match="advantages"):
        make_batch(segs, advantages=[[1.0]] * 3)


def test_token_logprobs_use_temperature() -> None:
    torch.manual_seed(0)
    logits, ids = torch.randn(2, 5, 11), torch.randint(0, 11, (2, 5))
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    logp, ent = token_logprobs(logits, ids, mask, 0.5, entropy=True)
    ref = torch.log_softmax(logits / 0.5, -1)
    for b in range(2):
        for t in range(1, int(mask[b].sum())):
            assert abs(float(logp[b, t]) - float(ref[b, t - 1, ids[b, t]])) < 1e-5
            assert abs(float(ent[b, t]) + float((ref[b, t - 1].exp() * ref[b, t - 1]).sum())) < 1e-5
    assert logp[:, 0].abs().sum() == 0 and logp[1, 3:].abs().sum() == 0


def test_truncation_is_vllms() -> None:
    """The trainer's top-k / top-p mask equals vLLM's own sampler function on the same logits (ties in
    top-k included: repeated values), so processed logprobs are recomputed on the same support."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    from molt.trainer.model import vllm_truncation

    gen = torch.Generator().manual_seed(0)
    for scale in (0.1, 1.0, 4.0):
        logits = (torch.randn(64, 320, generator=gen) * scale).round(decimals=1)   # many exact ties
        top_k = torch.randint(-1, 400, (64,), generator=gen)
        top_p = torch.rand(64, generator=gen).clamp(min=0.05)
        top_p[::3] = 1.0
        vocab_k = torch.where((top_k > 0) & (top_k < 320), top_k, 320)
        for p in (top_p, None):
            theirs = apply_top_k_top_p_pytorch(logits.clone(), vocab_k, p, allow_cpu_sync=True) == -torch.inf
            ours = vllm_truncation(logits, top_k, torch.ones(64) if p is None else p)
            assert torch.equal(ours, theirs) and 0 < int(ours.sum()) < ours.numel()


def test_per_token_sampling_parameters(monkeypatch) -> None:
    """Per-token temperature / top-p / top-k: each position is scored under its own distribution; the
    sampled token is never truncated away (a boundary rounding difference must not give -inf)."""
    from molt.trainer import model
    from molt.trainer.model import token_logprobs

    monkeypatch.setattr(model, "TRUNCATION_ROWS", 3)   # several chunks of truncated positions

    gen = torch.Generator().manual_seed(1)
    logits, ids = torch.randn(2, 6, 50, generator=gen), torch.randint(0, 50, (2, 6), generator=gen)
    mask = torch.ones(2, 6, dtype=torch.long)
    temp = torch.tensor([[1.0, 0.5, 0.5, 2.0, 1.0, 0.7]] * 2)
    top_p = torch.tensor([[1.0, 1.0, 0.6, 1.0, 0.3, 1.0]] * 2)
    top_k = torch.tensor([[0, 0, 0, 10, 0, 3]] * 2)
    logp, ent = token_logprobs(logits, ids, mask, temp, top_p, top_k, entropy=True)
    for b in range(2):
        for t in range(1, 6):
            row = logits[b, t - 1] / temp[b, t]
            k = int(top_k[b, t]) or 50
            probs = torch.where(row >= row.topk(k).values[-1], row, -torch.inf).softmax(-1)
            order = probs.argsort(descending=True)          # smallest set with mass >= top_p
            need = int((probs[order].cumsum(0) < top_p[b, t] - 1e-6).sum()) + 1
            kept = torch.zeros(50, dtype=bool)
            kept[order[:need]] = True
            kept[ids[b, t]] = True
            ref = torch.where(kept, row, -torch.inf).log_softmax(-1)
            assert abs(float(logp[b, t]) - float(ref[ids[b, t]])) < 1e-5
            assert abs(float(ent[b, t]) + float((ref.exp() * ref.nan_to_num(neginf=0)).sum())) < 1e-5
    assert logp.isfinite().all() and logp[:, 0].abs().sum() == 0


def reference_run(path: str, batches: list[dict[str, torch.Tensor]], spec: RunSpec):
    """Single process, no FSDP, no micro-batches: the whole batch in one forward, plain AdamW (under torch's
    CPU autocast for model.dtype=bfloat16)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.train.lr, betas=spec.train.betas,
                            weight_decay=spec.train.weight_decay)
    losses = []
    for b in batches:
        with torch.autocast("cpu", torch.bfloat16, enabled=spec.model.dtype == "bfloat16"):
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits.float()
        logp, _ = token_logprobs(logits, b["input_ids"], b["attention_mask"], spec.rollout.temperature)
        norm = float(b["loss_mask"].sum())  # the global token count, computed independently
        loss, _ = policy_loss(logp, {**b, "old_logp": logp.detach()}, spec.algo, norm)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), spec.train.grad_clip)
        opt.step()
        opt.zero_grad()
        losses.append((loss.item(), logp.detach(), float(grad_norm)))
    return losses, {k: v.detach() for k, v in model.named_parameters()}


def test_sharding_and_normalization_invariance(ray_session, tiny_model_path, tmp_path) -> None:
    """3 steps at world size 2 (micro-batch 2, FSDP2 CPU offload: offload=full) give the weights, losses
    and gradient norms of one single-process whole-batch run (fp32, 1e-5). On CPU the offload's moves are
    no-ops, but its code path runs. AdamW and clipping hide a wrong gradient scale from the weights, so the
    pre-clipping gradient norm is compared too. (One rank with uneven micro-batches against the same kind
    of reference: test_minibatches_and_epochs_match_a_single_process_reference.) The exported folder
    loads in transformers and scores like the trainer."""
    from transformers import AutoModelForCausalLM

    batches = [batch_of(s) for s in range(3)]
    # Adam turns round-off in near-zero gradients into lr-sized steps; a small lr keeps that below 1e-5
    ref_losses, ref_weights = reference_run(tiny_model_path, batches, make_spec(tiny_model_path, lr=1e-4))
    spec = make_spec(tiny_model_path, 2, 2, lr=1e-4)
    spec.parallel.offload = "full"
    group = TrainerRanks(spec)
    metrics = [group.update(b) for b in batches]
    weights = full_weights(group)
    group.export_hf(str(tmp_path / "hf"))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    b = batches[0]
    with torch.no_grad():
        logits = hf(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    hf_logp, _ = token_logprobs(logits, b["input_ids"], b["attention_mask"], 0.7)
    sampled = b["loss_mask"] > 0   # the trainer scores sampled tokens only (train.logprob_chunk_tokens)
    assert float((hf_logp - group.logprobs(b))[sampled].abs().max()) < 1e-5
    group.shutdown()
    assert max_diff(ref_weights, weights) <= 1e-5
    for m, (loss, _, grad_norm) in zip(metrics, ref_losses, strict=True):
        assert abs(m["train/loss"] - loss) < 1e-5
        assert m["train/grad_norm"] == pytest.approx(grad_norm, rel=1e-5)
    logp, m = ref_losses[0][1], metrics[0]
    gap = (logp - b["behaviour_logp"])[b["loss_mask"] > 0].abs()
    assert abs(m["mismatch/mean_abs"] - float(gap.mean())) < 1e-5
    assert abs(m["mismatch/max_abs"] - float(gap.max())) < 1e-5
    assert m["train/lr"] == pytest.approx(1e-4) and m["train/tokens"] == float(b["loss_mask"].sum())
    assert loss_normalizer(b["loss_mask"], make_spec(tiny_model_path).algo, 8) == m["train/tokens"]


def test_a_collective_one_rank_never_joins_fails_after_the_timeout(ray_session, tiny_model_path) -> None:
    """parallel.collective_timeout_s reaches the ranks' process group: rank 1 alone in an all-reduce (as a
    rank making one more sharded-head call than its peer would be) fails with gloo's time-out after 20 s,
    where torch's default group would wait 30 minutes and the test would run into pytest's timeout."""
    spec = make_spec(tiny_model_path, 2)
    spec.parallel.collective_timeout_s = 20   # the ranks' rendezvous waits as long: not much less
    group = TrainerRanks(spec)

    def alone(worker) -> None:
        import torch.distributed as dist

        dist.all_reduce(torch.ones(1))
    try:
        start = time.monotonic()
        with pytest.raises(ray.exceptions.RayTaskError, match="[Tt]imed out"):
            ray.get(group.workers[1].__ray_call__.remote(alone))
        assert time.monotonic() - start < 120
    finally:
        group.shutdown()


def test_tensor_parallel_with_optimizer_offload_equals_one_process(ray_session, tiny_model_path) -> None:
    """tp=2 with offload=optimizer (AdamW state on the host, here TP's DTensors; through a checkpoint in
    test_resume_is_exact) trains like the single-process reference: logprobs, losses, gradient norm and
    weights after 2 steps (fp32, 1e-5). micro_batch_size 64 is more than the 8 rows of a step (an upper
    bound). On CPU the offload's moves are no-ops, but its code path runs."""
    batches = [batch_of(s) for s in range(2)]
    base = make_spec(tiny_model_path, mbs=64, lr=1e-4)
    ref_losses, ref_weights = reference_run(tiny_model_path, batches, base)
    layout = dict(dp_size=1, tp_size=2, offload="optimizer")
    group = TrainerRanks(base.model_copy(update={"parallel": base.parallel.model_copy(update=layout)}))
    logp = group.logprobs(batches[0])
    metrics = [group.update(b) for b in batches]
    weights = full_weights(group)
    group.shutdown()
    mask = batches[0]["attention_mask"] > 0
    assert float((logp - ref_losses[0][1])[mask].abs().max()) < 1e-5
    for m, (loss, _, grad_norm) in zip(metrics, ref_losses, strict=True):
        assert abs(m["train/loss"] - loss) < 1e-5
        assert m["train/grad_norm"] == pytest.approx(grad_norm, rel=1e-5)
    assert max_diff(ref_weights, weights) <= 1e-5


def test_bfloat16_on_cpu_is_autocast_over_fp32_weights(tiny_model_path) -> None:
    """model.dtype=bfloat16 on CPU trains like a single-process run under torch's CPU autocast with fp32
    weights (logprobs, losses and gradient norms of 2 steps), and bf16 is really used: its logprobs are
    more than 1e-3 away from fp32's."""
    batches = [batch_of(s) for s in range(2)]
    base = make_spec(tiny_model_path, mbs=64, lr=1e-4)
    spec = base.model_copy(update={"model": base.model.model_copy(update={"dtype": "bfloat16"})})
    ref_losses, _ = reference_run(tiny_model_path, batches, spec)
    fp32_logp = reference_run(tiny_model_path, batches[:1], base)[0][0][1]
    with one_rank(spec) as rank:
        logp = rank.forward(batches[0])
        metrics = [rank.update(b) for b in batches]
    mask = batches[0]["loss_mask"] > 0
    assert float((logp - ref_losses[0][1])[mask].abs().max()) < 1e-5
    assert float((logp - fp32_logp)[mask].abs().max()) > 1e-3
    for m, (loss, _, grad_norm) in zip(metrics, ref_losses, strict=True):
        assert abs(m["train/loss"] - loss) < 1e-5
        assert m["train/grad_norm"] == pytest.approx(grad_norm, rel=1e-4)


def test_model_dtype_is_autocast_wherever_fsdp_does_not_cast() -> None:
    """model.dtype reaches the compute exactly once: FSDP2's MixedPrecisionPolicy casts only where
    AutoModel shards (CUDA at world size > 1; one rank is left unsharded, `fsdp2_sharding_enabled`), and
    everywhere else, the CPU ranks these tests run included, the worker autocasts over fp32 weights."""
    from molt.trainer.model import autocast_dtype

    want = {("cpu", 1): torch.bfloat16, ("cpu", 2): torch.bfloat16, ("cuda", 1): torch.bfloat16,
            ("cuda", 2): None}
    for (device, ws), dtype in want.items():
        for model_dtype in ("bfloat16", "float32"):
            spec = RunSpec.model_validate({"model": {"dtype": model_dtype},
                                           "parallel": {"device": device, "dp_size": ws}})
            assert autocast_dtype(spec) == (dtype if model_dtype == "bfloat16" else None), (device, ws)


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_lr_schedules_of_both_roles_end_at_the_runs_last_step(schedule: str) -> None:
    """train.steps=100 with train.critic_warmup_steps=20: the critic updates on all 100 batches, the policy
    on the last 80 (its warm-up counts its own updates), and each decays to 0 right after its last
    update, i.e. at the end of the run. Hand values: at the role's k-th update after its warm-up of w,
    progress = (k - w) / (updates - w); linear 1 - progress, cosine (1 + cos(pi * progress)) / 2."""
    from molt.trainer.schedule import lr_factor

    spec = RunSpec.model_validate({
        "model": {"critic": True}, "algo": {"estimator": "gae"},
        "train": {"steps": 100, "critic_warmup_steps": 20, "warmup_steps": 5, "lr_schedule": schedule}})
    for role, updates in (("critic", 100), ("policy", 80)):
        factors = [lr_factor(spec, role, k) for k in range(updates + 1)]
        assert factors[:5] == [0.2, 0.4, 0.6, 0.8, 1.0] and factors[5] == 1.0, role
        for k in (5, updates // 2, updates - 1, updates):
            progress = (k - 5) / (updates - 5)
            hand = 1 - progress if schedule == "linear" else (1 + math.cos(math.pi * progress)) / 2
            assert factors[k] == pytest.approx(hand, abs=1e-12), (role, k)
        assert factors[updates] == pytest.approx(0.0, abs=1e-12) and factors[updates - 1] < 0.02, role


def test_resume_is_exact(ray_session, tiny_model_path, tmp_path) -> None:
    """4 steps straight == 2 steps + checkpoint + new actors + resume + 2 steps (weights and optimizer),
    with optimizer-state offload and activation checkpointing switched on."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    spec = make_spec(tiny_model_path, 2, 4, lr_schedule="cosine", warmup_steps=2, weight_decay=0.01)
    spec.parallel.offload, spec.parallel.activation_checkpointing = "optimizer", True
    batches = [batch_of(10 + s) for s in range(4)]
    first = TrainerRanks(spec)
    lrs = [first.update(b)["train/lr"] for b in batches[:2]]
    first.save(str(tmp_path / "mid"), {"data": 2, "note": "x"})
    lrs += [first.update(b)["train/lr"] for b in batches[2:]]  # saving must not disturb the run
    first.save(str(tmp_path / "straight"), {"data": 4})
    first.shutdown()
    second = TrainerRanks(spec)  # new actors = new processes
    assert second.load(str(tmp_path / "mid")) == {"data": 2, "note": "x"}
    resumed_lrs = [second.update(b)["train/lr"] for b in batches[2:]]
    second.save(str(tmp_path / "resumed"), {"data": 4})
    second.shutdown()
    assert resumed_lrs == lrs[2:] and lrs[0] < lrs[1]
    flat = {}
    for name in ("straight", "resumed", "mid"):
        dcp_to_torch_save(str(tmp_path / name), str(tmp_path / f"{name}.pt"))
        flat[name] = dict(_leaves(torch.load(tmp_path / f"{name}.pt", weights_only=False)))
    straight, resumed = flat["straight"], flat["resumed"]
    assert straight.keys() == resumed.keys() and any("exp_avg_sq" in k for k in straight)
    for k, v in straight.items():
        assert torch.equal(v, resumed[k]), k
    # and the comparison has teeth: 2 more steps did change the weights
    assert any(not torch.equal(flat["mid"][k], straight[k]) for k in straight if k.startswith("model"))


def _leaves(tree, prefix: str = ""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, f"{prefix}{k}.")
    elif isinstance(tree, torch.Tensor):
        yield prefix, tree


@pytest.fixture(scope="module")
def critic(ray_session, tiny_model_path) -> tuple[RunSpec, TrainerRanks]:
    """(spec, group) of one critic rank, with activation checkpointing, that the critic tests share: each
    checks what its own updates do, from whatever weights the one before left (one start, not three)."""
    spec = make_spec(tiny_model_path, mbs=32, critic_lr=1e-3, prompts_per_step=4)   # 32 rows, one forward
    spec.model.critic, spec.algo.estimator, spec.algo.lam = True, "gae", 1.0
    spec.parallel.activation_checkpointing = True
    group = TrainerRanks(spec, "critic")
    yield spec, group
    group.shutdown()


def test_critic_ranks_after_the_first_take_their_shards_from_rank_0(ray_session, tiny_model_path) -> None:
    """With 2 critic ranks only rank 0 reads the checkpoint (a whole fp32 critic per rank would be 120 GB of
    host memory at 30B); rank 1 builds the critic on the meta device and receives its shards and the
    buffers (the rotary frequencies are in no state dict) from rank 0. The values of both ranks' rows equal
    one process's critic, seeded alike (the value head is new: rank 0 initializes it), 1e-5."""
    spec = make_spec(tiny_model_path, 2)
    spec.model.critic, spec.algo.estimator = True, "gae"
    b = batch_of(3)
    group = TrainerRanks(spec, "critic")
    try:
        values = group.values(b)
        nccl = ray.get(group.workers[1].__ray_call__.remote(
            lambda self: os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")))
    finally:
        group.shutdown()
    one = spec.model_copy(update={"parallel": spec.parallel.model_copy(update={"dp_size": 1})})
    with one_rank(one, "critic") as rank:
        want = rank.forward(b)
    assert float(want.abs().max()) > 0.01 and float((values - want).abs().max()) < 1e-5
    assert nccl == "1"   # trainer ranks: a dead NCCL peer ends the collective (placement.NCCL_ENV)


def test_a_critic_rank_after_the_first_reads_no_checkpoint(tiny_model_path, monkeypatch) -> None:
    """The memory half of the test above, which the values alone cannot show: of 2 critic ranks, rank 1
    builds the critic on the meta device (not one weight in its host memory), rank 0 reads the checkpoint.
    Only the rank this process reports changes between the two builds."""
    from molt.trainer import model as trainer_model

    spec, common = make_spec(tiny_model_path, 2), dict(dtype=torch.float32, trust_remote_code=False)
    for rank, on_meta in ((1, True), (0, False)):
        monkeypatch.setattr(trainer_model.dist, "get_rank", lambda rank=rank: rank)
        critic = trainer_model._critic(spec, tiny_model_path, "sdpa", common)
        assert {p.is_meta for p in critic.parameters()} == {on_meta}, rank


def test_critic_fits_returns_and_reference_is_frozen(critic, tiny_model_path) -> None:
    from transformers import AutoModelForCausalLM

    _, critic = critic
    b = batch_of(5)
    batch = {**b, "returns": b["loss_mask"] * 1.0}
    errors = []
    for _ in range(6):
        values = critic.values(b)
        errors.append(critic.update({**batch, "old_values": values})["critic/value_error"])
    assert values.shape == b["input_ids"].shape and values[b["attention_mask"] == 0].abs().sum() == 0
    assert errors[-1] < errors[0] / 2
    with pytest.raises(ValueError, match="critic"):
        critic.logprobs(b)

    reference = TrainerRanks(make_spec(tiny_model_path), "reference")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    expected, _ = token_logprobs(logits, b["input_ids"], b["attention_mask"], 0.7)
    assert float((reference.logprobs(b) - expected)[b["loss_mask"] > 0].abs().max()) < 1e-5
    with pytest.raises(ValueError, match="frozen"):
        reference.update(b)
    reference.shutdown()


def test_gae_with_a_real_critic_learns_the_right_baseline(critic) -> None:
    """Reward 1 when the first response token is one of 8 of the 16 it is drawn from. The right baseline
    of the first action is 0.5 (before it, nothing tells the outcome); after it, the value is the reward,
    so only the first action carries advantage. A critic read one token late would already have seen
    the first action and cancel its advantage."""
    from molt.algo import compute_advantages, token_gae

    spec, critic = critic
    rng = random.Random(0)

    def batch(n: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        segs, rewards = [], []
        for i in range(n):
            response = [rng.randrange(100, 116) for _ in range(4)]
            segs.append(Segment([1, 7, *response], [0, 0, 1, 1, 1, 1], [0.0, 0.0, -1.0, -1.0, -1.0, -1.0],
                                [-1, -1, 0, 0, 0, 0], str(i), str(i)))
            rewards.append(float(response[0] < 108))
        return make_batch(segs), torch.tensor(rewards)

    for _ in range(STEPS_GAE):
        b, r = batch(32)
        values = critic.values(b)
        adv = compute_advantages(r, torch.arange(32), torch.arange(32), b["loss_mask"], spec.algo, values)
        critic.update({**b, "old_values": values, "returns": adv.returns})
    b, r = batch(64)
    values = critic.values(b)
    assert (values[:, 2] - 0.5).abs().max() < 0.2               # the baseline of the first action
    assert (values[:, 3:] - r[:, None]).abs().max() < 0.2        # afterwards the outcome is known
    assert (values[:, 0] == 0).all()                            # nothing precedes t = 0
    adv, _ = token_gae(torch.zeros_like(values), values, r, torch.arange(64), b["loss_mask"], 1.0, 1.0)
    assert (adv[:, 2] - (r - 0.5)).abs().max() < 0.25 and adv[:, 3:].abs().max() < 0.25


STEPS_GAE = 100


def reference_updates(path: str, b: dict[str, torch.Tensor], spec: RunSpec) -> tuple[list[dict], dict]:
    """Single process: old logprobs from one forward before any update, then train.epochs passes over
    train.minibatches contiguous row chunks, one AdamW step per chunk normalized by its own tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.train.lr, betas=spec.train.betas)

    def logp_of(rows: slice) -> torch.Tensor:
        logits = model(input_ids=b["input_ids"][rows], attention_mask=b["attention_mask"][rows]).logits
        return token_logprobs(logits, b["input_ids"][rows], b["attention_mask"][rows],
                              spec.rollout.temperature)[0]

    with torch.no_grad():
        old = logp_of(slice(None))
    rows, k = b["input_ids"].shape[0], spec.train.minibatches
    chunks = [slice(rows * i // k, rows * (i + 1) // k) for i in range(k)]
    updates = []
    for _ in range(spec.train.epochs):
        for c in chunks:
            part = {key: v[c] for key, v in b.items()}
            loss, m = policy_loss(logp_of(c), {**part, "old_logp": old[c]}, spec.algo,
                                  float(part["loss_mask"].sum()))
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), spec.train.grad_clip)
            opt.step()
            opt.zero_grad()
            updates.append({"loss": loss.item(), "grad_norm": float(grad_norm),
                            **{key: float(v) for key, v in m.items()}})
    return updates, {k: v.detach() for k, v in model.named_parameters()}


def test_minibatches_and_epochs_match_a_single_process_reference(tiny_model_path) -> None:
    """train.minibatches=2, train.epochs=2: four AdamW steps on one batch with the old logprobs fixed
    before the first, as a single-process reference does (weights, mean loss and gradient norm, the last
    update's ratio and approx KL; fp32, 1e-5). The reference's first update has ratio exactly 1 and the
    later ones move, so a trainer that took old == current in every update would show train/ratio_mean_last
    = 1. (minibatches=1, epochs=1 is test_sharding_and_normalization_invariance.)"""
    spec = make_spec(tiny_model_path, mbs=3, lr=1e-4, minibatches=2, epochs=2)
    b = batch_of(7)
    ref, ref_weights = reference_updates(tiny_model_path, b, spec)
    assert ref[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-7) and ref[0]["approx_kl"] < 1e-12
    assert abs(ref[-1]["ratio_mean"] - 1) > 1e-4 and ref[-1]["approx_kl"] > 1e-9
    with one_rank(spec) as rank:
        m = rank.update(b)
        weights = full_weights(rank)
    assert m["train/updates"] == 4 and m["train/tokens"] == float(b["loss_mask"].sum())
    assert max_diff(ref_weights, weights) <= 1e-5
    assert m["train/loss"] == pytest.approx(sum(u["loss"] for u in ref) / 4, abs=1e-5)
    assert m["train/grad_norm"] == pytest.approx(sum(u["grad_norm"] for u in ref) / 4, rel=1e-5)
    assert m["train/ratio_mean_last"] == pytest.approx(ref[-1]["ratio_mean"], abs=1e-6)
    assert m["train/approx_kl_last"] == pytest.approx(ref[-1]["approx_kl"], rel=1e-3, abs=1e-9)
    with pytest.raises(ValueError, match="train.minibatches=9"):
        make_spec(tiny_model_path, minibatches=9)   # 8 rows per rank


def test_critic_warmup_trains_the_critic_alone(critic, tiny_model_path) -> None:
    """A warm-up step (train.critic_warmup_steps) runs learn() with train_policy=False: the critic takes
    its step and the policy is never called (None here would raise), the step is marked."""
    import asyncio

    from molt.driver.loop import learn
    from molt.trainer.ranks import Trainers
    from molt.trajectory import Rollout

    spec, critic = critic
    segs = segments(11)
    rollouts = [Rollout(s.rollout_id, s.group_id, [s], reward=float(i % 2)) for i, s in enumerate(segs)]
    b = make_batch(segs)
    before = critic.values(b)
    metrics = asyncio.run(learn(spec, rollouts, Trainers(critic=critic), 0, train_policy=False))
    after = critic.values(b)
    assert metrics["train/critic_warmup"] == 1.0 and "critic/value_loss" in metrics
    assert "train/loss" not in metrics and "mismatch/mean_abs" not in metrics   # no policy step
    assert float((after - before)[b["loss_mask"] > 0].abs().max()) > 1e-4
    with pytest.raises(ValueError, match="critic_warmup_steps"):
        make_spec(tiny_model_path, critic_warmup_steps=1)   # no critic


def test_async_ranks_take_the_engines_cores_while_the_engines_are_idle(ray_session, tiny_model_path) -> None:
    """rollout.mode=async, parallel.cpu_threads null: a rank computes with its share of the node's cores
    while the engines generate and with all of them while the engines are idle. `set_engines_idle` reaches
    a rank in the middle of a step (its own concurrency group), and the computing thread applies it at the
    next block of the model: `train/threads` is the mean of `torch.get_num_threads()` read there."""
    import ray

    cores = len(os.sched_getaffinity(0))
    spec = make_spec(tiny_model_path, mbs=1)
    spec.rollout.mode = "async"
    group = TrainerRanks(spec)
    [worker] = group.workers
    # The rank's threads follow its plan alone, not the cores the rest of the host (the suite's other test
    # worker) keeps busy: what this test measures. A lambda travels by value; a function of this module would
    # travel by name, which a Ray worker without tests/ on its path cannot import.
    ray.get(worker.__ray_call__.remote(lambda w: setattr(w.threads, "free", None)))
    segs = [s for seed in range(8) for s in segments(seed)]             # 64 rows: 64 micro-batches
    batch = make_batch(segs, advantages=[[0.5] * len(s.token_ids) for s in segs])
    try:
        generating = group.update(batch)["train/threads"]
        running = worker.update.remote(batch, None)
        ray.get(worker.set_engines_idle.remote(True))
        assert not ray.wait([running], timeout=0)[0]     # delivered while the step runs
        switched = ray.get(running)["train/threads"]
        idle = group.update(batch)["train/threads"]
        ray.get(worker.set_engines_idle.remote(False))
        again = group.update(batch)["train/threads"]
    finally:
        group.shutdown()
    assert (generating, idle, again) == (cores // 2, cores, cores // 2)   # one engine and one rank
    assert generating < switched <= idle


def test_null_threads_leave_the_cores_that_other_work_keeps_busy(tiny_model_path) -> None:
    """parallel.cpu_threads null plans every core for a sync run's rank, but with as many processes
    spinning beside it as the host has cores, the rank computes with one thread (`train/threads`): more would
    wait for each other at every parallel region while other work holds their cores."""
    import subprocess
    import sys

    cores = len(os.sched_getaffinity(0))
    if cores < 2:
        pytest.skip("one core: null plans one thread anyway")
    with one_rank(make_spec(tiny_model_path, mbs=1)) as rank:
        assert rank.threads.counts[False] == cores   # the plan: the running stage takes every core
        spinning = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(cores)]
        try:
            time.sleep(1.1)   # a window of the busy host (molt/plan/cores.py RESAMPLE_S)
            threads = rank.update(batch_of(0))["train/threads"]
        finally:
            for proc in spinning:
                proc.kill()
                proc.wait()
    assert threads == 1


def test_a_rank_switches_threads_at_each_block_forward_and_backward(tiny_model_path) -> None:
    """A step may be a single micro-batch: the switch happens at the next block of the model. Here the
    engines go idle while block 0 computes its forward (a hook stands in for the message); block 1's
    forward and both blocks' backward then run with every core. Without the per-block hooks the whole
    micro-batch keeps its first setting."""
    from transformers import AutoModelForCausalLM

    from molt.trainer.worker import TrainerWorker

    spec = make_spec(tiny_model_path)
    spec.rollout.mode = "async"
    before = torch.get_num_threads()
    try:
        worker = TrainerWorker(spec, "policy", 0, tiny_model_path)   # no process group: no setup()
        worker.threads.free = None   # its plan alone, not the cores the suite's other worker keeps busy
        worker.model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
        worker.threads.follow_blocks(worker.model)
        block0 = worker.model.model.layers[0]
        block0.register_forward_hook(lambda *_: worker.set_engines_idle(True))
        worker.threads.start_micro_batch()
        worker.model(input_ids=torch.tensor([[1, 5, 9, 13]])).logits.sum().backward()
        share, cores = worker.threads.counts[False], worker.threads.counts[True]
        assert share < cores
        # micro-batch start, forward of block 0, of block 1, backward of block 1, of block 0
        assert worker.threads.seen == [share, share, cores, cores, cores]
    finally:
        torch.set_num_threads(before)
