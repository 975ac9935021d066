"""MoE router replay and export: trainer ↔ real vLLM CPU engine on a tiny Qwen3-MoE."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from molt.spec import RunSpec
from molt.trainer import TrainerGroup, make_batch
from molt.trainer.router_replay import capture_routes
from molt.trajectory import Segment

pytestmark = pytest.mark.timeout(300)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)


def moe_spec(path: str, ws: int = 1, **model) -> RunSpec:
    return RunSpec.model_validate({
        "model": {"path": path, "router_replay": True, **model},
        "parallel": {"world_size": ws, "dp_size": ws},
        "rollout": {"samples_per_prompt": 4, "max_tokens": 8, "temperature": 1.0},
        "train": {"prompts_per_step": 1, "micro_batch_size": 2, "lr": 1e-3},
    })


def moe_batch(routes=None, logps=None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    segs = []
    for i, n in enumerate((12, 17, 9, 20)):
        ids = torch.randint(0, 320, (n,), generator=g).tolist()
        mask = [0] * 3 + [1] * (n - 3)
        behaviour = logps[i] if logps else [-1.0 * m for m in mask]
        segs.append(Segment(token_ids=ids, loss_mask=mask, logprobs=behaviour,
                            versions=[0] * n, rollout_id=str(i), group_id="g",
                            routed_experts=routes[i] if routes else None))
    return make_batch(segs, advantages=[[float(i % 2) - 0.5] * len(s.token_ids) for i, s in enumerate(segs)])


def mean_gap(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    keep = mask.clone()
    keep[:, 0] = 0  # token 0 has no logprob
    return float((a - b).abs()[keep > 0].mean())


@pytest.fixture(scope="module")
def policy(ray_session):
    """A tiny MoE policy on 2 ranks, trained 2 steps (without replay: the batch has no routes)."""
    from molt.tiny import tiny_model_path

    group = TrainerGroup(moe_spec(str(tiny_model_path(**MOE)), ws=2))
    for _ in range(2):
        group.train_step(moe_batch())
    yield group
    group.shutdown()


@pytest.fixture(scope="module")
def exported(policy, tmp_path_factory):
    """The policy exported as a Hugging Face folder, and its weight chunks."""
    import ray

    out = tmp_path_factory.mktemp("moe") / "export"
    chunks = [ray.get(r) for r in policy.weight_chunks(32 << 10)]
    policy.export_hf(str(out))
    return str(out), chunks


@pytest.fixture(scope="module")
def engine(exported):
    from vllm import LLM

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    llm = LLM(exported[0], dtype="float32", enforce_eager=True, max_model_len=256, seed=0,
              worker_extension_cls="molt.trainer.router_replay.RouterCapture")
    yield llm
    llm.llm_engine.engine_core.shutdown()


def test_weight_chunks_match_export(exported) -> None:
    path, chunks = exported
    assert len(chunks) > 1  # streamed, not one blob
    merged = {k: v for c in chunks for k, v in c.items()}
    index = json.load(open(os.path.join(path, "model.safetensors.index.json")))["weight_map"]
    on_disk = {}
    for file in set(index.values()):
        on_disk.update(load_file(os.path.join(path, file)))
    assert merged.keys() == on_disk.keys()
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in merged and "lm_head.weight" not in merged
    assert all(torch.equal(merged[k], on_disk[k]) for k in merged)


def test_router_replay_matches_engine(policy, exported, engine, tmp_path) -> None:
    path, _ = exported
    plain = moe_batch()
    rows = zip(plain["input_ids"], plain["attention_mask"], strict=True)
    tokens = [row[: int(m.sum())].tolist() for row, m in rows]
    routes, engine_logp = capture_routes(engine, tokens, top_k=2)
    batch = moe_batch(routes=routes, logps=engine_logp)

    # the engine runs the exported weights; the trainer replays the engine's routes: trainer == engine
    replayed = policy.logprobs(batch)
    assert mean_gap(replayed, batch["behaviour_logp"], batch["attention_mask"]) <= 1e-4
    # replay really forces the routes: other experts give other logprobs
    shifted = dict(batch, routed_experts=(batch["routed_experts"] + 1) % 4)
    assert mean_gap(policy.logprobs(shifted), replayed, batch["attention_mask"]) > 1e-3

    # perturb the trainer's router so that it would pick other experts for some tokens
    perturbed = tmp_path / "perturbed"
    perturbed.mkdir()
    for name in os.listdir(path):
        if not name.endswith(".safetensors"):
            os.symlink(os.path.join(path, name), perturbed / name)
    g = torch.Generator().manual_seed(0)
    for name in {n for n in os.listdir(path) if n.endswith(".safetensors")}:
        tensors = load_file(os.path.join(path, name))
        for k in tensors:
            if k.endswith("mlp.gate.weight"):
                tensors[k] = tensors[k] + 0.02 * torch.randn(tensors[k].shape, generator=g)
        save_file(tensors, str(perturbed / name), metadata={"format": "pt"})
    group = TrainerGroup(moe_spec(str(perturbed), freeze_router=True))
    with_replay = mean_gap(group.logprobs(batch), batch["behaviour_logp"], batch["attention_mask"])
    without = mean_gap(group.logprobs(plain), batch["behaviour_logp"], batch["attention_mask"])
    print(f"perturbed router: replay gap {with_replay:.2e}, no-replay gap {without:.2e}")
    assert without > 1e-3 and with_replay < without / 4

    # freeze-router: a train step moves experts and attention but not the router
    import ray

    before = {k: v for r in group.weight_chunks() for k, v in ray.get(r).items()}
    group.train_step(batch)
    after = {k: v for r in group.weight_chunks() for k, v in ray.get(r).items()}
    group.shutdown()
    gates = [k for k in before if k.endswith("mlp.gate.weight")]
    assert gates and all(torch.equal(before[k], after[k]) for k in gates)
    assert not torch.equal(before["model.layers.0.mlp.experts.0.up_proj.weight"],
                           after["model.layers.0.mlp.experts.0.up_proj.weight"])


def test_automodel_moe_classes_need_cuda() -> None:
    """Why the spec refuses parallel.ep_size > 1 on CPU (docs/parallelism.md): AutoModel's expert parallel
    shards only its own MoE classes, and they cannot be built without CUDA. If this stops raising, EP can
    be tested on CPU: revisit the refusal."""
    from nemo_automodel.components.models.qwen3_moe.model import Qwen3MoeForCausalLM
    from transformers import AutoConfig

    from molt.tiny import tiny_model_path

    config = AutoConfig.from_pretrained(tiny_model_path(**MOE))
    config.tie_word_embeddings = False  # AutoModel's class rejects tied heads before it gets to CUDA
    with pytest.raises(AssertionError, match="not compiled with CUDA"):
        Qwen3MoeForCausalLM(config)
