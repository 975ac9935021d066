"""Router replay wired end to end: a short in-process run of the loop on the tiny Qwen3-MoE.

The loop captures each trained segment's routed experts from the engine actor and replays them in the
trainer. The dumped routes are checked against an independent reference: the top-k of the router
logits of a plain transformers forward on the initial weights (which sampled step 1).
"""

from __future__ import annotations

import json

import pytest
import torch

from molt.config import compose
from molt.metrics import load_rollouts

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


def test_loop_captures_and_replays_routes(tmp_path, ray_session, monkeypatch):
    from transformers import AutoModelForCausalLM

    from molt.loop import model_path_of, train

    monkeypatch.setenv("WANDB_MODE", "disabled")
    spec = compose(["model=tiny_moe", "train.steps=2", "train.prompts_per_step=2",
                    "rollout.samples_per_prompt=4", "train.micro_batch_size=8", "train.save_every=0",
                    "train.eval_every=0",
                    "logging.plots=false", "logging.progress=false", "logging.wandb.mode=disabled",
                    "rollout.engine.kv_cache_gib=0.25"])
    spec.run.dir = str(tmp_path)
    train(spec)

    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines if line.strip()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        # every trained token was sampled by the weights the trainer holds (sync), and with the engine's
        # routes replayed the trainer reproduces the engine's logprobs
        assert r["time/route_capture"] > 0 and r["mismatch/stale_frac"] == 0.0
        assert r["mismatch/mean_abs"] < 1e-4, r

    model = AutoModelForCausalLM.from_pretrained(model_path_of(spec), dtype=torch.float32)
    same = total = 0
    for rollout in load_rollouts(tmp_path / "rollouts" / "step_000001.jsonl"):
        for s in rollout.segments:
            routes = s.routed_experts
            assert routes is not None and len(routes) == len(s.token_ids)
            assert {(len(t), len(t[0])) for t in routes} == {(2, 2)}   # 2 MoE layers, top-2
            expected = reference_routes(model, s.token_ids)
            for got, want in zip(routes, expected, strict=True):
                same += sum(sorted(g) == w for g, w in zip(got, want, strict=True))
                total += len(want)
    # a near-tie may flip between two fp32 implementations; anything else is a capture/alignment bug
    assert total and same / total > 0.98, f"{same}/{total} routed (token, layer) pairs agree"
    # step 2 was sampled (and captured) by the refit weights, and carries routes too
    step2 = load_rollouts(tmp_path / "rollouts" / "step_000002.jsonl")
    assert all(s.routed_experts is not None for r in step2 for s in r.segments)


def test_capture_holds_the_engine_alone(ray_session):
    """Requests in flight when a capture starts finish first; one arriving during it waits. Any of their
    rows inside the capture would break its one-row-per-token check or change the routes."""
    from molt.loop import model_path_of
    from molt.rollout.engine import start_engines

    spec = compose(["model=tiny_moe", "rollout.engine.kv_cache_gib=0.25"])
    [engine] = start_engines(spec, model_path_of(spec))
    try:
        seqs = [[1, *range(10, 10 + n)] for n in (5, 17, 30)]
        sampling = {"temperature": 1.0, "max_tokens": 24, "ignore_eos": True}
        running = [engine.generate.remote([1, 2 + i, 3], sampling) for i in range(3)]
        during = engine.capture_routes.remote(seqs, 2)
        late = engine.generate.remote([1, 9, 9], sampling)
        assert all(len(o["token_ids"]) == 24 for o in ray_session.get([*running, late]))
        alone = ray_session.get(engine.capture_routes.remote(seqs, 2))
        assert ray_session.get(during) == alone
        assert [len(r) for r in alone] == [len(s) for s in seqs]
    finally:
        ray_session.get(engine.shutdown.remote())
        ray_session.kill(engine)


def test_cpu_async_replay_is_rejected():
    from molt.spec import SpecError

    with pytest.raises(SpecError, match="router_replay=true needs rollout.mode=sync"):
        compose(["model=tiny_moe", "rollout.mode=async"])
