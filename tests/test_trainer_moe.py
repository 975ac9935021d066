"""MoE: refit from real trainer ranks into a real vLLM CPU engine, routes captured during generation,
router replay in the trainer, and partial rollouts across a refit with both (tiny Qwen3-MoE)."""

from __future__ import annotations

import asyncio
import os

import pytest
import ray
import torch
from safetensors.torch import load_file, save_file
from trainerlib import full_weights, one_rank

from molt.spec import RunSpec
from molt.trainer import TrainerRanks, make_batch
from molt.trajectory import NO_VERSION, Segment

pytestmark = pytest.mark.timeout(300)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
PROMPTS = [[1, *range(10, 40)], [1, *range(10, 40), 7, 8], [1, 5, 6], [1, *range(50, 60)]]  # shared prefix
GREEDY = {"temperature": 0.0, "max_tokens": 12}


def moe_spec(path: str, ws: int = 1, **model) -> RunSpec:
    return RunSpec.model_validate({
        "model": {"path": path, "router_replay": True, "max_model_len": 256, **model},
        "parallel": {"dp_size": ws},
        # 40 KB refit chunks: the experts (128 KB per layer in bf16), the embedding (80 KB) and the wire's
        # payloads are all split, so the refit tests below run the ranged gathers of 2 FSDP ranks
        "rollout": {"samples_per_prompt": 4, "max_tokens": 8, "temperature": 1.0, "refit_chunk_mb": 0.04,
                    "engine": {"kv_cache_gib": 0.25}},
        "train": {"prompts_per_step": 1, "micro_batch_size": 2, "lr": 1e-3},
    })


def random_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    segs = []
    for i, n in enumerate((12, 17, 9, 20)):
        ids = torch.randint(0, 320, (n,), generator=g).tolist()
        mask = [0] * 3 + [1] * (n - 3)
        segs.append(Segment(token_ids=ids, loss_mask=mask, logprobs=[-1.0 * m for m in mask],
                            versions=[0] * n, rollout_id=str(i), group_id="g"))
    return make_batch(segs, advantages=[[float(i % 2) - 0.5] * len(s.token_ids) for i, s in enumerate(segs)])


@pytest.fixture(scope="module")
def policy(ray_session):
    """A tiny MoE policy on 2 ranks, trained 2 steps (without replay: the batch has no routes)."""
    from molt.inputs.tiny import tiny_model_path

    group = TrainerRanks(moe_spec(str(tiny_model_path(**MOE)), ws=2))
    for _ in range(2):
        group.update(random_batch())
    yield group
    group.shutdown()


@pytest.fixture(scope="module")
def exported(policy, tmp_path_factory):
    out = tmp_path_factory.mktemp("moe") / "export"
    policy.export_hf(str(out))
    return str(out)


@pytest.fixture(scope="module")
def moe_engine(ray_session):
    """An engine actor on the initial tiny-MoE weights, capturing routes as it generates."""
    from molt.inputs.tiny import tiny_model_path
    from molt.rollout.engine import start_engines

    [engine] = start_engines(moe_spec(str(tiny_model_path(**MOE))), str(tiny_model_path(**MOE)))
    yield engine
    ray.get(engine.shutdown.remote())
    ray.kill(engine)


@pytest.fixture(scope="module")
def across_refit(policy, moe_engine):
    """Long requests started on version 0 (the initial weights); the 2-rank policy refits the engine to
    version 1 through the run's own refit path while they are in flight. Returns their outputs."""
    from molt.driver.fleet import Fleet
    from molt.inputs.tiny import tiny_model_path

    long = {"temperature": 1.0, "max_tokens": 120, "ignore_eos": True}
    refs = [moe_engine.generate.remote(p, {**long, "seed": i}) for i, p in enumerate(PROMPTS)]
    ray.get(moe_engine.generate.remote(PROMPTS[2], {**long, "max_tokens": 6}))   # a few decode steps in
    path = str(tiny_model_path(**MOE))

    async def to_version_1() -> None:
        fleet = Fleet(moe_spec(path), path, engines=[moe_engine])
        await fleet.connect(policy)
        await fleet.refit(1)

    asyncio.run(to_version_1())
    return ray.get(refs)


def segment_of(prompt: list[int], out: dict, i: int) -> Segment:
    n, k = len(prompt), len(out["token_ids"])
    return Segment(token_ids=prompt + out["token_ids"], loss_mask=[0] * n + [1] * k,
                   logprobs=[0.0] * n + out["logprobs"], versions=[NO_VERSION] * n + out["versions"],
                   rollout_id=str(i), group_id="g", routed_experts=out["routed_experts"])


def batch_of(outs: list[dict]) -> dict[str, torch.Tensor]:
    """The outputs as the loop batches them: prompt + response segments with routes and versions."""
    segs = [segment_of(p, out, i) for i, (p, out) in enumerate(zip(PROMPTS, outs, strict=True))]
    return make_batch(segs, versions=[[float(v) for v in s.versions] for s in segs])


def test_moe_refit_equals_the_exported_weights(across_refit, moe_engine, exported):
    """The refit engine (2 trainer ranks -> gloo broadcast -> reload + CPU MoE prepack) samples as a
    transformers forward of the exported weights does: greedy ids, logprobs within 1e-5 (max)."""
    from transformers import AutoModelForCausalLM

    got = ray.get([moe_engine.generate.remote(p, GREEDY) for p in PROMPTS])
    model = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    for out, prompt in zip(got, PROMPTS, strict=True):
        assert out["versions"] == [1] * len(out["token_ids"]) == [1] * GREEDY["max_tokens"]
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([prompt + out["token_ids"]])).logits[0], dim=-1)
        rows = logp[len(prompt) - 1:-1]   # the distributions each generated token was taken from
        assert out["token_ids"] == rows.argmax(-1).tolist()   # greedy: the reference's choices
        sampled = rows.gather(1, torch.tensor(out["token_ids"])[:, None])[:, 0]
        assert float((torch.tensor(out["logprobs"]) - sampled).abs().max()) <= 1e-5


def test_partial_rollouts_carry_routes_and_replay_matches(across_refit, policy):
    """Requests in flight across the refit keep going; their tokens carry both versions and the routes of
    the forward that read them, and the trainer (now = version 1) replaying those routes reproduces the
    engine's logprob of every version-1 token."""
    for p, out in zip(PROMPTS, across_refit, strict=True):
        k = out["versions"].count(0)
        assert len(out["token_ids"]) == 120 and out["versions"] == [0] * k + [1] * (120 - k)
        assert out["routed_experts"].shape == (len(p) + 120 - 1, 2, 2)   # the last token was never read
    assert all(0 < out["versions"].count(0) < 120 for out in across_refit)
    batch = batch_of(across_refit)
    current = (batch["versions"] == 1) & (batch["loss_mask"] > 0)
    old = (batch["versions"] == 0) & (batch["loss_mask"] > 0)
    gap = (policy.logprobs(batch) - batch["behaviour_logp"]).abs()
    print(f"replayed: max gap {float(gap[current].max()):.2e} on version-1 tokens, "
          f"mean {float(gap[old].mean()):.2e} on version-0 tokens")
    assert float(gap[current].max()) <= 1e-4
    assert float(gap[old].mean()) > 1e-3             # version-0 tokens were sampled by other weights
    shifted = dict(batch, routed_experts=(batch["routed_experts"] + 1) % 4)
    assert float((policy.logprobs(shifted) - batch["behaviour_logp"]).abs()[current].mean()) > 1e-3


def test_fallback_rescoring_gives_the_generation_routes(across_refit, moe_engine):
    """`capture_routes` (the loop's fallback for segments without routes) re-scores on the current weights:
    for tokens those weights sampled it yields the routes the generation returned."""
    outs = ray.get([moe_engine.generate.remote(p, {"temperature": 1.0, "max_tokens": 20, "seed": 5})
                    for p in PROMPTS])
    seqs = [p + o["token_ids"] for p, o in zip(PROMPTS, outs, strict=True)]
    rescored = ray.get(moe_engine.capture_routes.remote(seqs))
    for out, again in zip(outs, rescored, strict=True):
        assert again.shape == out["routed_experts"].shape
        same = (again == out["routed_experts"]).all(-1).mean()
        assert same > 0.98, same   # a near-tie may flip between a decode step and a prefill


def test_router_replay_beats_a_perturbed_router(across_refit, exported, tmp_path):
    """A trainer whose router differs slightly from the engine's gets close to the engine's logprobs only
    with the routes replayed; with model.freeze_router a step moves experts but not the router."""
    batch = batch_of(across_refit)
    plain = {k: v for k, v in batch.items() if k != "routed_experts"}
    current = (batch["versions"] == 1) & (batch["loss_mask"] > 0)
    perturbed = tmp_path / "perturbed"
    perturbed.mkdir()
    for name in os.listdir(exported):
        if not name.endswith(".safetensors"):
            os.symlink(os.path.join(exported, name), perturbed / name)
    g = torch.Generator().manual_seed(0)
    for name in {n for n in os.listdir(exported) if n.endswith(".safetensors")}:
        tensors = load_file(os.path.join(exported, name))
        for k in tensors:
            if k.endswith("mlp.gate.weight"):
                tensors[k] = tensors[k] + 0.02 * torch.randn(tensors[k].shape, generator=g)
        save_file(tensors, str(perturbed / name), metadata={"format": "pt"})
    with one_rank(moe_spec(str(perturbed), freeze_router=True)) as rank:
        with_replay = float((rank.forward(batch) - batch["behaviour_logp"]).abs()[current].mean())
        without = float((rank.forward(plain) - batch["behaviour_logp"]).abs()[current].mean())
        print(f"perturbed router: replay gap {with_replay:.2e}, no-replay gap {without:.2e}")
        assert without > 1e-3 and with_replay < without / 2

        before = full_weights(rank)
        rank.update(dict(batch, advantages=torch.ones_like(batch["loss_mask"])))
        after = full_weights(rank)
    gates = [k for k in before if k.endswith("mlp.gate.weight")]
    assert gates and all(torch.equal(before[k], after[k]) for k in gates)
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in before and "lm_head.weight" not in before
    assert not torch.equal(before["model.layers.0.mlp.experts.0.up_proj.weight"],
                           after["model.layers.0.mlp.experts.0.up_proj.weight"])


def test_automodel_moe_classes_need_cuda() -> None:
    """Why the spec refuses parallel.ep_size > 1 on CPU (docs/parallelism.md): AutoModel's expert parallel
    shards only its own MoE classes, and they cannot be built without CUDA. If this stops raising, EP can
    be tested on CPU: revisit the refusal."""
    from nemo_automodel.components.models.qwen3_moe.model import Qwen3MoeForCausalLM
    from transformers import AutoConfig

    from molt.inputs.tiny import tiny_model_path

    config = AutoConfig.from_pretrained(tiny_model_path(**MOE))
    config.tie_word_embeddings = False  # AutoModel's class rejects tied heads before it gets to CUDA
    with pytest.raises(AssertionError, match="not compiled with CUDA"):
        Qwen3MoeForCausalLM(config)


def test_the_reference_routes_itself_and_ignores_the_freeze_switches() -> None:
    """model.router_replay and freeze_router act on the policy: a reference of its own (a teacher) routes
    with its own router however the batch's routes read, and a dense teacher builds (it used to fail its
    set-up with "the model has no MoE router")."""
    from molt.inputs.tiny import tiny_model_path

    path, batch = str(tiny_model_path(**MOE)), random_batch()
    g = torch.Generator().manual_seed(1)
    routes = torch.rand(*batch["input_ids"].shape, 2, 4, generator=g).argsort(-1)[..., :2]
    moe_teacher = moe_spec(path, freeze_router=True, reference="tiny", reference_tiny={**MOE, "seed": 1})
    with one_rank(moe_teacher, "reference") as reference:
        assert torch.equal(reference.forward(batch), reference.forward({**batch, "routed_experts": routes}))
    dense_teacher = moe_spec(path, freeze_router=True, reference="tiny", reference_tiny={"seed": 1})
    with one_rank(dense_teacher, "reference") as reference:
        assert reference.forward(batch).abs().max() > 0


@pytest.mark.parametrize("checkpointing", ["transformers", "automodel"])
def test_replay_holds_in_the_recomputation_of_activation_checkpointing(checkpointing: str) -> None:
    """parallel.activation_checkpointing recomputes each layer in the backward, after the worker's forward
    has returned: the recomputation must replay the routes of that forward. Through the worker's own
    forward, a replayed micro-batch's gradient with checkpointing (transformers' at world size 1,
    AutoModel's layer wrappers above) equals the one without it; and the routes matter: the gradient
    with the router's own routing differs."""
    from nemo_automodel.components.distributed.activation_checkpointing import (
        apply_full_layer_checkpointing_to_layers,
    )
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX
    from transformers import AutoModelForCausalLM

    from molt.inputs.tiny import tiny_model_path
    from molt.trainer.router_replay import install_replay
    from molt.trainer.worker import TrainerWorker

    path = str(tiny_model_path(**MOE))
    batch = random_batch()
    g = torch.Generator().manual_seed(1)
    # random routes (2 distinct experts of 4 per token and layer): not what the router would pick
    batch["routed_experts"] = torch.rand(*batch["input_ids"].shape, 2, 4, generator=g).argsort(-1)[..., :2]
    threads = torch.get_num_threads()

    def gradients(recompute: bool, mb: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        worker = TrainerWorker(moe_spec(path), "policy", 0, path)   # no process group: no setup()
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
        install_replay(model)
        if recompute and checkpointing == "transformers":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        elif recompute:
            apply_full_layer_checkpointing_to_layers(model, list(model.model.layers))
        worker.model = model.train()
        logp, _ = worker._forward(mb)
        (logp * mb["loss_mask"]).sum().backward()   # after the forward, as `_update` does
        return {n.replace(_CHECKPOINT_PREFIX, ""): p.grad for n, p in model.named_parameters()}

    try:
        plain = gradients(False, batch)
        recomputed = gradients(True, batch)
        free = gradients(False, {k: v for k, v in batch.items() if k != "routed_experts"})
    finally:
        torch.set_num_threads(threads)
    assert plain.keys() == recomputed.keys() and all(g is not None for g in plain.values())
    gap = max(float((plain[n] - recomputed[n]).abs().max()) for n in plain)
    routes_matter = max(float((plain[n] - free[n]).abs().max()) for n in plain)
    print(f"{checkpointing}: max |grad gap| checkpointed {gap:.2e}, replayed vs free {routes_matter:.2e}")
    assert gap <= 1e-6 and routes_matter > 1e-3


def test_grouped_experts_refit_one_expert_range_at_a_time(monkeypatch) -> None:
    """rollout.refit_chunk_mb bounds what a refit gathers even inside one tensor: with 40 KB chunks the
    fused experts (4 x 128 x 128, 256 KB in fp32) are gathered, cast and converted one expert at a time,
    and the stream equals the one gathered whole (names, dtypes, values): the checkpoint's per-expert
    tensors numbered from each range's first expert."""
    from molt.inputs.tiny import tiny_model_path
    from molt.trainer import weights

    cpu, chunk_bytes = torch.device("cpu"), 40 << 10
    gathered: list[int] = []
    rows = weights._rows

    def recorded(tensor, start, stop, device):
        piece = rows(tensor, start, stop, device)
        gathered.append(piece.numel() * piece.element_size())
        return piece

    with one_rank(moe_spec(str(tiny_model_path(**MOE)))) as worker:
        whole = [c for c in weights.hf_chunks(worker.model, 1 << 30, torch.bfloat16, cpu, cpu)]
        monkeypatch.setattr(weights, "_rows", recorded)
        ranged = [c for c in weights.hf_chunks(worker.model, chunk_bytes, torch.bfloat16, cpu, cpu)]
        experts = worker.model.model.layers[0].mlp.experts.gate_up_proj
    want = {k: v for c in whole for k, v in c.items()}
    got = {k: v for c in ranged for k, v in c.items()}
    assert sum(len(c) for c in ranged) == len(got) and sorted(got) == sorted(want)
    assert all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want)
    # the largest gather is one expert in fp32 (a chunk's worth in bf16), not the 256 KB tensor
    assert gathered and max(gathered) <= 2 * chunk_bytes < experts.numel() * 4
    # and the experts reach the wire one range per chunk: per layer 4 gate/up ranges of 1 expert (32 KB
    # in bf16) and 2 down ranges of 2 (the embedding, 80 KB, is assembled whole: one checkpoint tensor)
    expert_chunks = [c for c in ranged if any(".experts." in k for k in c)]
    assert len(expert_chunks) == 2 * (4 + 2) and all(sum(t.numel() * t.element_size() for t in c.values())
                                                   <= chunk_bytes for c in expert_chunks)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_automodel_grouped_experts_convert_per_expert_range(family: str) -> None:
    """The GPU trainer's MoE classes (AutoModel's) hold the experts of a layer as one grouped tensor and
    convert it with their state-dict adapter, which expects every expert at once. A range of experts
    converted on its own and renumbered (molt/trainer/weights.py `_convert`) gives exactly the adapter's
    tensors of those experts (uneven ranges: 4 + 2 of 6), and only grouped experts are converted so."""
    from types import SimpleNamespace

    from nemo_automodel.components.models.common import BackendConfig
    from nemo_automodel.components.moe.config import MoEConfig

    from molt.trainer import weights

    if family == "qwen3_moe":
        from nemo_automodel.components.models.qwen3_moe.state_dict_adapter import (
            Qwen3MoeStateDictAdapter as A,
        )
    else:
        from nemo_automodel.components.models.deepseek_v3.state_dict_adapter import (
            DeepSeekV3StateDictAdapter as A,
        )
    moe = MoEConfig(n_routed_experts=6, n_shared_experts=0, n_activated_experts=2, n_expert_groups=1,
                    n_limited_groups=1, train_gate=True, gate_bias_update_factor=0.0, aux_loss_coeff=0.0,
                    score_func="softmax", route_scale=1.0, dim=8, inter_dim=16, moe_inter_dim=4,
                    norm_topk_prob=True)
    model = SimpleNamespace(state_dict_adapter=A(SimpleNamespace(), moe, BackendConfig()))
    g = torch.Generator().manual_seed(0)
    grouped = {"model.layers.1.mlp.experts.gate_and_up_projs": torch.randn(6, 8, 8, generator=g),
               "model.layers.1.mlp.experts.down_projs": torch.randn(6, 4, 8, generator=g)}
    for name, tensor in grouped.items():
        want = model.state_dict_adapter.to_hf({name: tensor})
        assert weights._per_expert(model, name, tensor.shape)
        got = {**weights._convert(model, {name: tensor[:4]}, first_expert=0),
               **weights._convert(model, {name: tensor[4:]}, first_expert=4)}
        assert sorted(got) == sorted(want) and len(want) in (6, 12)
        assert all(torch.equal(got[k], want[k]) for k in want)
    assert not weights._per_expert(model, "model.embed_tokens.weight", torch.Size([6, 8]))


def test_a_float32_buffer_is_refit_bit_equal() -> None:
    """DeepSeek-V3's `e_score_correction_bias` is an fp32 buffer in the trainer and in the engine, and
    decides top-k routing: a bf16 refit sends it as fp32, bit-equal, while parameters go in bf16."""
    import torch.distributed as dist
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from molt.trainer import weights

    config = DeepseekV3Config(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                              num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=4,
                              num_experts_per_tok=2, n_group=1, topk_group=1, num_attention_heads=2,
                              num_key_value_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                              qk_nope_head_dim=8, v_head_dim=8)
    model = DeepseekV3ForCausalLM(config)
    [router] = [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]
    bias = torch.tensor([1 + 2**-20, -3e-5, 0.1, 7.0])   # none of them is a bf16 number
    router.e_score_correction_bias.copy_(bias)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        cpu = torch.device("cpu")
        chunks = weights.hf_chunks(model, 1 << 20, torch.bfloat16, cpu, cpu)
        sent = {k: v for c in chunks for k, v in c.items()}
    finally:
        dist.destroy_process_group()
    [name] = [k for k in sent if k.endswith("e_score_correction_bias")]
    assert sent[name].dtype == torch.float32 and torch.equal(sent[name], bias)
    assert sent["model.embed_tokens.weight"].dtype == torch.bfloat16


def test_the_gpu_loader_trains_without_a_load_balancing_loss() -> None:
    """AutoModel's Qwen3-MoE classes (cuda, ep > 1) take their gate's auxiliary loss coefficient from the
    config's router_aux_loss_coef (0.001 in the checkpoint) and add that loss to the gradient beside
    Molt's RL loss; the loader is told 0, and AutoModel's own config loading applies it."""
    from nemo_automodel._transformers.model_init import get_hf_config

    from molt.inputs.tiny import tiny_model_path
    from molt.trainer.model import automodel_kwargs

    path = str(tiny_model_path(**MOE))
    kwargs = automodel_kwargs(moe_spec(path, router_replay=False), "policy", path)
    assert get_hf_config(path, "sdpa").router_aux_loss_coef > 0
    assert get_hf_config(path, "sdpa", config=kwargs["config"]).router_aux_loss_coef == 0
