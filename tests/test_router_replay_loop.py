"""Router replay through the trajectory: an async run with partial rollouts on the tiny Qwen3-MoE.

The engines capture each request's routed experts while they generate; the routes travel with the
segments into the batch and the trainer replays them. The dumped routes are checked against an
independent reference: the top-k of the router logits of a plain transformers forward on the initial
weights (which sampled step 1).
"""

from __future__ import annotations

import json

import pytest
import torch

from molt.driver.compose import compose
from molt.driver.metrics import load_rollouts

pytestmark = pytest.mark.timeout(300)


def reference_routes(model: torch.nn.Module, token_ids: list[int]) -> list[list[list[int]]]:
    """[len][layers][top_k] expert ids (sorted) that the Hugging Face routers pick for these tokens."""
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    picked: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda _m, _a, out: picked.append(out[2])) for r in routers]
    try:
        with torch.no_grad():
            model(torch.tensor([token_ids]))
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(picked, dim=1).sort(dim=-1).values.tolist()


def test_async_partial_run_replays_the_engine_routes(tmp_path, ray_session, monkeypatch):
    from transformers import AutoModelForCausalLM

    from molt.driver.loop import train
    from molt.plan.models import model_path

    monkeypatch.setenv("WANDB_MODE", "disabled")
    spec = compose(["model=tiny_moe", "rollout.mode=async", "rollout.partial_rollout=true",
                    "rollout.groups_in_flight=4", "rollout.max_tokens=24",
                    "rollout.refit_chunk_mb=0.05", "algo.correction.level=token", "train.steps=3",
                    "train.prompts_per_step=2", "rollout.samples_per_prompt=4", "train.micro_batch_size=8",
                    "train.save_every=0", "train.eval_every=0", "logging.plots=false",
                    "logging.progress=false", "logging.wandb.mode=disabled",
                    "rollout.engine.kv_cache_gib=0.25"])
    spec.run.dir = str(tmp_path)
    train(spec)

    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines if line.strip()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    print("stale fraction per step:", [r["mismatch/stale_frac"] for r in rows])
    measured = [r for r in rows if "mismatch/max_abs" in r]
    assert measured
    for r in measured:
        # on the tokens sampled by the weights the trainer holds, replaying the routes the engine
        # returned reproduces the engine's logprobs
        assert r["mismatch/max_abs"] < 1e-4, r

    model = AutoModelForCausalLM.from_pretrained(model_path(spec), dtype=torch.float32)
    same = total = 0
    for rollout in load_rollouts(tmp_path / "rollouts" / "step_000001.jsonl"):
        for s in rollout.segments:
            routes = s.routed_experts
            assert routes is not None and routes.shape == (len(s.token_ids), 2, 2)   # 2 MoE layers, top-2
            expected = reference_routes(model, s.token_ids)
            for got, want in zip(routes[:-1].tolist(), expected[:-1], strict=True):  # the last: filler
                same += sum(sorted(g) == w for g, w in zip(got, want, strict=True))
                total += len(want)
    # a near-tie may flip between two fp32 implementations; anything else is a capture/alignment bug
    assert total and same / total > 0.98, f"{same}/{total} routed (token, layer) pairs agree"
    later = [load_rollouts(tmp_path / "rollouts" / f"step_{k:06d}.jsonl") for k in (2, 3)]
    assert all(s.routed_experts is not None for batch in later for r in batch for s in r.segments)


def test_router_replay_refuses_engines_that_cannot_return_routes():
    from molt.spec import SpecError

    with pytest.raises(SpecError, match="router_replay=true on parallel.device=cpu needs rollout.engine"):
        compose(["model=tiny_moe", "rollout.engine.enforce_eager=false"])
    with pytest.raises(SpecError, match="vLLM's routed-experts capture requires it"):
        compose(["+experiment=qwen30b_tools", "rollout.engine.enable_prefix_caching=false"])
