"""Benchmarks that drive Molt's Python API in-process still run against it (the timing runs are in bench/;
nothing here is timed). The ones that run `python -m molt` follow the CLI, which its own tests cover."""

from __future__ import annotations

import asyncio
import importlib.util

from molt.data import REPO_ROOT


def test_the_agentic_bench_runs_every_path(tok) -> None:
    """bench/agentic.py subclasses the Env runner and runs a ChatAgent over the loopback server (with its
    own SDK client and with ctx.http_client): 2 rollouts of 2 turns on each path complete and record a
    latency per turn (its run of 2026-12-02 found it broken by a runner signature change a stop earlier)."""
    from molt.config import compose

    loaded = importlib.util.spec_from_file_location("agentic", REPO_ROOT / "bench" / "agentic.py")
    bench = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(bench)
    latencies: dict[str, list[float]] = {path: [] for path in bench.PATHS}
    spec = compose(["agent.max_turns=2", "rollout.max_tokens=4"])
    engine = bench.StandInEngine(tok.encode("bbb", add_special_tokens=False) + [tok.eos_token_id], 0.0)

    async def both() -> None:
        for runner in bench.runners(2, latencies).values():
            runner.setup(tok, spec)
            try:
                await bench.run_path(runner, engine, 2)   # raises if a rollout failed
            finally:
                runner.close()

    asyncio.run(both())
    assert bench.PATHS == ("env", "chat", "chat_lent")
    assert [len(latencies[path]) for path in bench.PATHS] == [4, 4, 4]


def test_the_agentic_bench_runs_its_chat_turns_in_agent_workers(ray_session, tok, tiny_model_path) -> None:
    """bench/agentic.py --workers: 16 chat rollouts of 2 turns in an agent worker against the stand-in engine
    actor complete (`measure` raises on a failed rollout) and give one latency per turn and each process's
    CPU per turn."""
    import sys

    sys.path.insert(0, str(REPO_ROOT / "bench"))
    from agentic_workers import measure

    reply = tok.encode("bbb", add_special_tokens=False) + [tok.eos_token_id]
    out = measure(1, 16, 2, 0.001, reply, tiny_model_path, repeats=1)
    assert out["turns_per_s"][0] > 0 and out["median"][0] <= out["p99"][0]
    assert out["workers"][0] > 0 and out["engine"][0] > 0


def test_the_trainer_floor_bench_times_both_steps(ray_session, monkeypatch) -> None:
    """bench/trainer_floor.py (Molt's update against a plain PyTorch step on the same batch, the evidence
    in bench/RESULTS.md that the trainer is not the gap to the peer) still runs against the trainer's API:
    one timed step of each at the tiny size."""
    import torch

    monkeypatch.syspath_prepend(str(REPO_ROOT / "bench"))   # its own imports (common, molt_run)
    loaded = importlib.util.spec_from_file_location("trainer_floor", REPO_ROOT / "bench" / "trainer_floor.py")
    bench = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(bench)
    threads = torch.get_num_threads()
    try:
        seconds = bench.compare("tiny", threads=1, repeats=1, length=16)
    finally:
        torch.set_num_threads(threads)
    assert sorted(seconds) == ["molt", "plain"] and all(len(v) == 1 and v[0] > 0 for v in seconds.values())


def test_the_gpu_smoke_composes_its_runs_builds_its_model_and_stops_without_gpus(tmp_path, monkeypatch,
                                                                                 capsys) -> None:
    """bench/gpu_smoke.py cannot run here; its CPU parts can: every run's overrides compose into a spec the
    real config accepts and the placement plan fits, the dense model builds offline (2 of its 28 layers,
    the depth being a flag) at the stated size, and on a machine without 2 GPUs it stops with exit code 2
    naming the assumption before it starts anything."""
    from molt.config import compose
    from molt.models import model_path
    from molt.placement import plan

    loaded = importlib.util.spec_from_file_location("gpu_smoke", REPO_ROOT / "bench" / "gpu_smoke.py")
    smoke = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(smoke)
    runs = smoke.runs(smoke.parse_args(["--layers", "2", "--steps", "3"]))
    assert sorted(runs) == ["dense_async", "dense_sync", "moe_async", "moe_sync"]
    for name, overrides in runs.items():
        spec = compose(overrides)
        assert (spec.parallel.device, spec.model.dtype, spec.train.steps) == ("cuda", "bfloat16", 3)
        kind, mode = name.split("_")
        # router replay with partial rollouts is refused on cuda: the MoE runs keep requests whole
        assert spec.rollout.mode == mode and spec.rollout.partial_rollout == (kind == "dense")
        assert spec.model.router_replay == name.startswith("moe")
        assert sorted(slot.role for slot in plan(spec)) == ["engine", "policy"]   # on 2 GPUs
    monkeypatch.setenv("MOLT_CACHE", str(tmp_path))
    from safetensors import safe_open
    from transformers import AutoConfig

    path = model_path(compose(runs["dense_sync"]))
    config = AutoConfig.from_pretrained(path)
    assert (config.hidden_size, config.num_hidden_layers, config.head_dim) == (1024, 2, 128)
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        sizes = {k: f.get_slice(k).get_shape() for k in f.keys()}
    per_layer = sum(int(torch_numel(s)) for k, s in sizes.items() if ".layers.0." in k)
    rest = sum(int(torch_numel(s)) for k, s in sizes.items() if ".layers." not in k)
    assert 0.4e9 < rest + smoke.DENSE["num_layers"] * per_layer < 0.6e9   # the 28-layer model: ~0.5B
    assert smoke.main(["--print-specs"]) == 0 and "dense_sync" in capsys.readouterr().out
    assert smoke.main([]) == 2
    assert "an assumption does not hold" in capsys.readouterr().err


def torch_numel(shape: list[int]) -> int:
    out = 1
    for n in shape:
        out *= n
    return out
