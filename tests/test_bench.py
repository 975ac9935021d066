"""Benchmarks that drive Molt's Python API in-process still run against it (the timing runs are in bench/;
nothing here is timed). The ones that run `python -m molt` follow the CLI, which its own tests cover."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import pytest

from molt.spec.user_modules import REPO_ROOT


def test_the_agentic_bench_runs_every_path(tok) -> None:
    """bench/agentic.py subclasses the Env runner and runs a ChatAgent over the loopback server (with its
    own SDK client and with ctx.http_client): 2 rollouts of 2 turns on each path complete and record a
    latency per turn (its run of 2026-12-02 found it broken by a runner signature change a stop earlier)."""
    from molt.driver.compose import compose

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


@pytest.fixture(scope="module")
def smoke_cache(tmp_path_factory) -> Path:
    """One MOLT_CACHE for the gpu_smoke tests: its 2-layer dense model is built once (≈10 s)."""
    return tmp_path_factory.mktemp("smoke_cache")


def test_the_gpu_smoke_composes_its_runs_builds_its_model_and_stops_without_gpus(smoke_cache, monkeypatch,
                                                                                 capsys) -> None:
    """bench/gpu_smoke.py cannot run here; its CPU parts can: every run's overrides compose into a spec the
    real config accepts and the placement plan fits, the dense model builds offline (2 of its 28 layers,
    the depth being a flag) at the stated size, and on a machine without 2 GPUs it stops with exit code 2
    naming the assumption before it starts anything; `--only colocated` asks for one GPU."""
    from molt.driver.compose import compose
    from molt.plan.models import model_path
    from molt.plan.placement import plan

    loaded = importlib.util.spec_from_file_location("gpu_smoke", REPO_ROOT / "bench" / "gpu_smoke.py")
    smoke = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(smoke)
    runs = smoke.runs(smoke.parse_args(["--layers", "2", "--steps", "3"]))
    assert sorted(runs) == ["colocated_sync", "dense_async", "dense_sync", "moe_async", "moe_sync"]
    for name, overrides in runs.items():
        spec = compose(overrides)
        assert (spec.parallel.device, spec.model.dtype, spec.train.steps) == ("cuda", "bfloat16", 3)
        kind, mode = name.split("_")
        # router replay with partial rollouts is refused on cuda: the MoE runs keep requests whole
        assert spec.rollout.mode == mode and spec.rollout.partial_rollout == (kind == "dense")
        assert spec.model.router_replay == name.startswith("moe")
        assert sorted(slot.role for slot in plan(spec)) == ["engine", "policy"]   # on 2 GPUs, or 1 shared
        assert spec.parallel.colocate == (kind == "colocated")
    monkeypatch.setenv("MOLT_CACHE", str(smoke_cache))
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
    # its one-GPU part: the colocated run alone, which a machine with one GPU passes the preflight for
    one = smoke.parse_args(["--only", "colocated"])
    assert list(smoke.runs(one)) == ["colocated_sync"] and smoke.gpus_needed(one) == 1
    dense = smoke.parse_args(["--only", "dense"])
    assert smoke.gpus_needed(dense) == 2 and "colocated_sync" not in smoke.runs(dense)


def torch_numel(shape: list[int]) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


def _gpu_smoke(monkeypatch):
    """bench/gpu_smoke.py and its check modules, importable as the script imports them."""
    monkeypatch.syspath_prepend(str(REPO_ROOT / "bench"))
    loaded = importlib.util.spec_from_file_location("gpu_smoke", REPO_ROOT / "bench" / "gpu_smoke.py")
    smoke = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(smoke)
    return smoke


def test_the_gpu_smoke_plan_holds_and_each_items_cpu_part_can_fail(smoke_cache, tmp_path, monkeypatch,
                                                                    capsys) -> None:
    """`gpu_smoke.py --plan` (what the first GPU run relies on, checked without one): every run's and item
    check's spec is accepted on cuda, the models build offline (a block-FP8 copy, a DeepSeek-V3 with an
    fp32 bias, the tiny VLM), and each check's CPU part holds. Each part fails on a broken variant: a
    chunk no tensor exceeds (item 1), no freeze for the GPU loader (5), a quantizer with another FP8
    range than the checkpoint's (9), replay with partial rollouts (10), a bias bf16 can hold (11), no
    context parallel for the cp check's loader (cp)."""
    import torch
    from safetensors.torch import load_file, save_file

    from molt.trainer import fp8

    monkeypatch.setenv("MOLT_CACHE", str(smoke_cache))
    smoke = _gpu_smoke(monkeypatch)
    from gpu_checks import plan_checks  # bench/, on the path once _gpu_smoke has run
    argv = ["--layers", "2", "--out", str(tmp_path / "out")]
    assert smoke.main(["--plan", *argv]) == 0
    out = capsys.readouterr().out
    assert "every check's CPU part holds" in out
    for name in ("item1", "item5", "item9", "item10", "item11"):
        assert f"PLAN {name}: cuda, bfloat16" in out
    assert "PLAN cp: cuda, float32" in out
    specs, paths = smoke.plan_specs(smoke.parse_args(argv))
    assert specs["item1"].parallel.world_size == specs["item5"].parallel.world_size == 2
    assert plan_checks(specs, paths) == []

    def broken(name: str, **update) -> list[str]:
        section, key = next(iter(update)).split("__")
        spec = specs[name].model_copy(deep=True)
        setattr(getattr(spec, section), key, update[f"{section}__{key}"])
        return plan_checks({**specs, name: spec}, paths)

    assert [p[:6] for p in broken("item1", rollout__refit_chunk_mb=100.0)] == ["item1:"]
    assert [p[:6] for p in broken("item5", model__freeze_vision=False)] == ["item5:"]
    assert [p[:7] for p in broken("item10", rollout__partial_rollout=True)] == ["item10:"]
    assert [p[:3] for p in broken("cp", parallel__cp_size=1)] == ["cp:"]
    with monkeypatch.context() as patched:
        patched.setattr(fp8, "FP8_MAX", 240.0)   # e4m3fnuz's range, not the checkpoint's e4m3fn
        assert [p[:6] for p in plan_checks(specs, paths)] == ["item9:"]
    dsv3 = paths["item11"] / "model.safetensors"
    weights = load_file(str(dsv3))
    name = next(k for k in weights if k.endswith("e_score_correction_bias"))
    save_file({**weights, name: torch.ones_like(weights[name])}, str(dsv3))
    assert [p[:7] for p in plan_checks(specs, paths)] == ["item11:"]


@pytest.mark.slow   # four engine starts and two 2-rank trainers: 3.5-10 min on 2 busy cores
@pytest.mark.timeout(1800)
def test_the_gpu_item_checks_run_on_cpu_and_fail_when_broken(tmp_path, monkeypatch, capsys) -> None:
    """The item checks' code, run on CPU (gloo, the vLLM CPU engine, fp32) so that a check broken by a
    change fails here before a GPU runs it: item 1 on both sides (2 trainer ranks' ranged gathers to a
    receiver; an engine refit in 1 MiB payloads against a fresh engine), item 5 (the VLM step with a
    rank without an image), item 11 (DeepSeek-V3's fp32 bias read back bit-equal, the refit engine
    against a fresh one). They fail with payloads above the chunk, with the bias sent in bf16, and with a
    receiver that loses a tensor. Item
    9 needs vLLM's GPU FP8 kernels (the CPU build has none); its CPU part is in the test above."""
    monkeypatch.setenv("MOLT_CACHE", str(tmp_path / "cache"))
    smoke = _gpu_smoke(monkeypatch)
    import gpu_checks
    from gpu_smoke_models import perturbed_copy, tiny_deepseek_v3

    from molt import refit
    from molt.driver.compose import compose
    from molt.plan.models import model_path

    def on_cpu(overrides: list[str]):
        cpu = {"parallel.device=cuda": "parallel.device=cpu", "model.dtype=bfloat16": "model.dtype=float32"}
        return compose([cpu.get(o, o) for o in overrides if "gpu_memory" not in o]
                       + ["rollout.engine.kv_cache_gib=0.25", "rollout.engine.enforce_eager=true"])

    items = smoke.item_overrides({"item9": "unused", "item11": "unused"})
    dense = on_cpu([*smoke.model_overrides("dense", 2), *smoke.CUDA])
    path = Path(model_path(dense))
    new = perturbed_copy(path, tmp_path / "new", scale=0.05)
    dsv3 = tiny_deepseek_v3(tmp_path / "dsv3")
    item11 = on_cpu(smoke.item_overrides({"item9": "", "item11": dsv3})["item11"])
    gpu_checks.refit_ranges(on_cpu(items["item1"]))
    gpu_checks.vlm_no_image_rank(on_cpu(items["item5"]), 300)
    gpu_checks.vlm_no_image_rank(on_cpu(items["item5_trained"]), 300, "item5_trained_tower_no_image")
    gpu_checks.context_parallel_ranks(on_cpu(items["cp"]))
    gpu_checks.engine_refit("dense", dense, path, new, smoke.CHUNK_MB)
    gpu_checks.fp32_buffer(item11, dsv3, tmp_path)
    send = refit.send
    monkeypatch.setattr(refit, "send", lambda group, chunks, device, size: send(group, chunks, device,
                                                                              4 * size))   # over the cap
    gpu_checks.engine_refit("dense", dense, path, new, smoke.CHUNK_MB)
    monkeypatch.setattr(refit, "send", send)
    refit_engine = gpu_checks.refit_engine
    monkeypatch.setattr(gpu_checks, "refit_engine", lambda engine, tensors, *a: refit_engine(
        engine, {k: v.bfloat16() if k.endswith("bias") else v for k, v in tensors.items()}, *a))
    gpu_checks.fp32_buffer(item11, dsv3, tmp_path)
    receive = refit.receive
    monkeypatch.setattr(refit, "receive", lambda group, device: (
        (name, t) for name, t in receive(group, device) if not name.endswith("down_proj.weight")))
    gpu_checks.refit_ranges(on_cpu(items["item1"]))   # a receiver that loses a tensor
    # the check lines alone (Ray also prints the workers' logs here)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("CHECK ")]
    verdicts = [line.split("  ")[0] for line in lines]
    assert verdicts == ["CHECK item1_trainer_ranges: PASS", "CHECK item5_vlm_rank_without_image: PASS",
                        "CHECK item5_trained_tower_no_image: PASS", "CHECK cp_trainer: PASS",
                        "CHECK item1_engine_refit_dense: PASS", "CHECK item13_reformed_group_dense: PASS",
                        "CHECK item11_fp32_buffer: PASS", "CHECK item1_engine_refit_dense: FAIL",
                        "CHECK item13_reformed_group_dense: PASS", "CHECK item11_fp32_buffer: FAIL",
                        "CHECK item1_trainer_ranges: FAIL"], lines


def test_the_one_gpu_check_runs_its_checks_on_the_host(tmp_path) -> None:
    """`bench/gpu_one.py --plan`: every check of the one-GPU machine's first command runs here with device
    cpu (gloo for NCCL, /dev/shm for CUDA IPC, a 2-layer model), the ones a host cannot measure say so
    (SKIP: the GPU's memory peak, vLLM's Triton sampler), the spec it plans with composes, and the summary
    is written. What it needs beyond torch, transformers and numpy is listed in bench/gpu_one_wheels.sh."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "bench/gpu_one.py", "--plan", "--out", str(tmp_path)],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    lines = [line.split("  ")[0] for line in out.stdout.splitlines() if line.startswith("CHECK ")]
    assert out.returncode == 0 and lines == [
        "CHECK fsdp2_step: PASS", "CHECK memory_vs_plan: SKIP", "CHECK chunked_logprobs: PASS",
        "CHECK fp8_refit_packing: PASS", "CHECK fp32_buffer_cast: PASS", "CHECK nccl_group_abort: PASS",
        "CHECK ipc_refit: PASS", "CHECK topk_topp_mirror: SKIP"], out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary["checks"]) == {line.split()[1].rstrip(":") for line in lines}
    assert set(summary["throughput"]) == {f"throughput/{s}_tokens_per_s_per_gpu" for s in
                                          ("logprobs", "training", "e2e")}


def test_the_gpu_preflight_names_the_driver_cuda_13_needs(monkeypatch) -> None:
    """torch's CUDA 13 builds need an NVIDIA driver >= 580 (CUDA 12: 525); the preflight says which driver
    the machine has and what to do, and stays quiet when it cannot tell."""
    monkeypatch.syspath_prepend(str(REPO_ROOT / "bench"))
    import gpu_one

    problem = gpu_one.driver_problem
    assert "needs an NVIDIA driver >= 580; this machine's is 575.57.08" in problem("13.0", "575.57.08")
    assert problem("13.0", "580.65.06") is None and problem("12.8", "550.1") is None
    assert ">= 525" in problem("12.8", "520.61") and problem("13.0", None) is None
