"""The first thing to run on a GPU machine:  .venv/bin/python bench/gpu_smoke.py

ASSUMPTIONS (checked first; the script stops with exit code 2 and says which one failed):
- Linux x86_64, this checkout installed with `bash install.sh gpu` (.venv: CUDA torch, vLLM's GPU build).
- 2 CUDA GPUs visible, bf16-capable (Ampere or newer), >= 24 GB each, `nvidia-smi` on PATH. Two, not one:
  the placement puts the trainer and the engines on disjoint GPUs, and NCCL refuses two ranks of one group on
  one GPU ("Duplicate GPU detected"), so the NCCL refit needs a second GPU. `--only colocated` needs one:
  its run shares GPU 0 between the trainer and the engine (parallel.colocate).
- No network and no download: every model is random-init, built offline (molt.inputs.tiny: a ~0.5B dense
  Qwen3 of 28 layers, hidden 1024, as Qwen3-0.6B without its vocabulary; a tiny Qwen3-MoE; the tiny
  Qwen2.5-VL; bench/gpu_smoke_models.py: a block-FP8 copy of a 2-layer dense Qwen3, a 2-layer DeepSeek-V3).
- It starts Ray locally, writes under --out (default bench/out/gpu_smoke) and takes about 20-30 minutes.

WHAT IT CHECKS; each check prints one `CHECK name: PASS|FAIL  <what it measured>` line:
- run_dense_sync, run_dense_async, item10_run_moe_sync, item10_run_moe_async: 5 steps each, sync and async
  (partial rollouts on the dense model; the MoE runs router replay without them: replay with partial
  rollouts is refused on cuda), bf16, the NCCL refit in 1 MiB payloads (`python -m molt`, as a user runs
  it): every step's engine/trainer `mismatch/max_abs` <= --max-abs (default 0.1, a first bound: bf16
  rounds each logit to ~3 significant digits, and a random-init model's logits are near 0, so a gap of a
  tenth of a nat means a real disagreement; replace it by the measured value once known). Each run also
  prints the dry run's plan and memory estimate, its step times and each role's peak GPU memory.
- run_colocated_sync: the same on GPU 0 alone (parallel=gpu1, parallel.colocate): the engine sleeps while the
  trainer steps and wakes for generation (vLLM's sleep mode), the refit goes over CUDA IPC; per-role peaks
  (nvidia-smi) against the dry run's two colocated phases.
- item1_engine_refit_{dense,moe}: an engine refit over NCCL with perturbed weights in 1 MiB payloads (its
  larger tensors split) generates (greedy) the tokens of an engine started on those weights, logprobs
  within 1e-3. item13_reformed_group_{dense,moe}: that refit went over a re-formed group (the first one
  aborted on both sides). item10_routes_after_refit_moe: the routes returned after it equal a re-scoring.
- item1_trainer_ranges: 2 FSDP ranks stream a model whose tensors exceed the chunk (ranged gathers over
  NCCL); every tensor arrives bit-equal, no payload above the chunk, the receiver's peak memory bounded.
- item5_vlm_rank_without_image: the tiny VLM, model.freeze_vision, 2 ranks, rank 1's micro-batch without
  an image: the step completes within --hang-timeout. item5_trained_tower_no_image: the same with the tower
  trained (sharded per block; rank 1 runs it on a placeholder image, molt/trainer/tower.py).
- item9_fp8_refit: a block-FP8 engine refit with bf16 weights quantized by molt/trainer/fp8.py equals a
  fresh FP8 engine on the same weights, and stays within --fp8-max-abs of a bf16 forward of them.
- item11_fp32_buffer: DeepSeek-V3's fp32 e_score_correction_bias arrives in the engine bit-equal.
- cp_trainer: context parallel (parallel.cp_size=2) over the 2 GPUs equals one GPU at cp=1 in fp32
  (logprobs of ragged rows, an update's loss and gradient norm, within 1e-4): the all-to-alls over NCCL.
(Item numbers: docs/parallelism.md's GPU-only column.) --plan runs the CPU part of every check (specs
composed and accepted, models built and checked) without a GPU; tests/test_bench.py runs it.
Exit code 0 when every check passes, 1 when one fails (the summary says which).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_checks import report  # noqa: E402
from molt_run import run_molt  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DENSE = dict(hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
             intermediate_size=3072, vocab_size=320, max_position_embeddings=4096)
QUIET = ["logging.wandb.mode=disabled", "logging.plots=false", "logging.progress=false",
         "logging.dump_rollouts=false", "train.eval_every=0"]
CHUNK_MB = 1   # rollout.refit_chunk_mb of every check: the dense model's projections (2-6 MiB) are split


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "gpu_smoke")
    p.add_argument("--steps", type=int, default=5, help="steps per run (sync and async)")
    p.add_argument("--only", choices=["dense", "moe", "colocated", "items", "all"], default="all",
                   help="the dense runs, the MoE runs, the colocated run (one GPU), the item checks, or all")
    p.add_argument("--layers", type=int, default=DENSE["num_layers"], help="dense model depth")
    p.add_argument("--max-abs", type=float, default=0.1, help="bound on every step's mismatch/max_abs")
    p.add_argument("--fp8-max-abs", type=float, default=0.1,
                   help="bound on an FP8 engine's logprob gap to a bf16 forward of the weights refit into it")
    p.add_argument("--hang-timeout", type=float, default=300.0, help="seconds a VLM step may take")
    p.add_argument("--print-specs", action="store_true", help="print each run's overrides and exit")
    p.add_argument("--plan", action="store_true",
                   help="no GPU needed: compose every spec, build every model, run the checks' CPU parts")
    return p.parse_args(argv)


def model_overrides(kind: str, layers: int) -> list[str]:
    if kind == "moe":
        return ["model=tiny_moe"]   # 4 experts, top-2; router_replay: true in the group
    sizes = {**DENSE, "num_layers": layers}
    # keys the spec's model.tiny default does not list are added (+), the others overridden
    listed = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "vocab_size")
    return [f"{'' if key in listed else '+'}model.tiny.{key}={value}" for key, value in sizes.items()]


# Every run and check: bf16 on cuda, one node, refit payloads that split the larger tensors.
CUDA = ["model.dtype=bfloat16", "model.max_model_len=1024", "parallel.device=cuda", "parallel.nodes=1",
        "rollout.engine.gpu_memory_utilization=0.5", f"rollout.refit_chunk_mb={CHUNK_MB}", *QUIET]
# The trainer-only checks put 2 ranks on the 2 GPUs; the plan also counts the engine a run would start,
# which these checks never start, so it is given a third (absent) GPU to be accepted.
TWO_RANKS = ["parallel.dp_size=2", "parallel.gpus_per_node=3"]


def runs(args: argparse.Namespace) -> dict[str, list[str]]:
    """Every run's `python -m molt` overrides, by name (kind_mode)."""
    out = {}
    kinds = {"all": ["dense", "moe"], "items": [], "colocated": []}.get(args.only, [args.only])
    for kind in kinds:
        for mode in ("sync", "async"):
            out[f"{kind}_{mode}"] = [
                *model_overrides(kind, args.layers), *CUDA, "parallel.gpus_per_node=2",
                f"rollout.mode={mode}",
                # router replay with partial rollouts is refused on cuda (vLLM's GPU route capture)
                f"rollout.partial_rollout={'false' if kind == 'moe' else 'true'}",
                "rollout.max_tokens=256", "agent.max_total_tokens=512",
                "rollout.groups_in_flight=8",
                f"train.steps={args.steps}", "train.prompts_per_step=8", "rollout.samples_per_prompt=4",
                "train.micro_batch_size=8", "train.save_every=0"]
    if args.only in ("colocated", "all"):   # parallel.colocate: GPU 0 alone (train_run hides GPU 1)
        out["colocated_sync"] = [
            *model_overrides("dense", args.layers), *CUDA, "parallel=gpu1", "rollout.mode=sync",
            "rollout.partial_rollout=false",
            "rollout.engine.gpu_memory_utilization=0.3", "rollout.max_tokens=256",
            "agent.max_total_tokens=512", f"train.steps={args.steps}", "train.prompts_per_step=8",
            "rollout.samples_per_prompt=4", "train.micro_batch_size=8", "train.save_every=0"]
    return out


def item_models(args: argparse.Namespace) -> dict[str, Path]:
    """The model folders of the item checks, built offline (seconds): the dense one at 2 layers."""
    from gpu_checks import build_models

    from molt.driver.compose import compose
    from molt.plan.models import model_path

    dense = Path(model_path(compose(model_overrides("dense", 2))))
    return {"dense": dense, **build_models(args.out / "models", dense)}


def item_overrides(models: dict[str, Path]) -> dict[str, list[str]]:
    """Each item check's spec overrides (the MoE's, item 10, are the moe runs')."""
    return {
        "item1": [*model_overrides("dense", 2), *CUDA, *TWO_RANKS],
        "item5": ["model=tiny_vl", "model.freeze_vision=true", *CUDA, *TWO_RANKS, "train.micro_batch_size=2"],
        "item5_trained": ["model=tiny_vl", "model.freeze_vision=false", *CUDA, *TWO_RANKS,
                          "train.micro_batch_size=2"],
        "item9": [f"model.path={models['item9']}", *CUDA, "parallel.gpus_per_node=2"],
        "item11": [f"model.path={models['item11']}", *CUDA, "parallel.gpus_per_node=2"],
        # the 2 GPUs are the cp ranks of one data-parallel rank; fp32 so cp=2 and cp=1 compare closely
        "cp": [*model_overrides("dense", 2), *CUDA, "model.dtype=float32", "parallel.cp_size=2",
               "parallel.gpus_per_node=3"],
    }


def gpus_needed(args: argparse.Namespace) -> int:
    """GPUs the chosen checks need: one for the colocated run alone, two for anything else."""
    return 1 if args.only == "colocated" else 2


def preflight(gpus: int) -> str | None:
    """What of the assumptions above does not hold here for checks that need `gpus` GPUs (None: all hold)."""
    try:
        import torch
    except ImportError as error:
        return f"torch does not import ({error}): run `bash install.sh gpu` first"
    if not torch.version.cuda:
        return f"torch {torch.__version__} has no CUDA: run `bash install.sh gpu`"
    from gpu_one import driver_problem, driver_version

    problem = driver_problem(torch.version.cuda, driver_version())
    if problem:
        return problem
    if torch.cuda.device_count() < gpus:
        return (f"needs {gpus} CUDA GPUs, sees {torch.cuda.device_count()} (trainer and engine on disjoint "
                "GPUs; NCCL refuses two ranks on one GPU); on one GPU run `--only colocated`")
    if not torch.cuda.is_bf16_supported():
        return "the GPU has no bf16 (Ampere or newer needed)"
    try:
        subprocess.run(["nvidia-smi", "-L"], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as error:
        return f"nvidia-smi does not run ({error})"
    return None


class GpuMemory:
    """Peak GPU memory per role over a run: nvidia-smi's per-process use, polled, each process named by its
    command line (Ray sets `ray::TrainerWorker...`, vLLM `VLLM::EngineCore` / `VLLM::Worker`)."""

    def __init__(self) -> None:
        self.peak: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    @staticmethod
    def role(pid: str) -> str:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            return "other"
        for role, marks in (("trainer", ("Trainer",)), ("engine", ("Engine", "VLLM", "vllm"))):
            if any(mark in cmd for mark in marks):
                return role
        return "other"

    def _poll(self) -> None:
        while not self._stop.wait(0.5):
            out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                                  "--format=csv,noheader,nounits"], capture_output=True, text=True).stdout
            now: dict[str, float] = {}
            for line in out.splitlines():
                pid, _, mib = line.partition(",")
                if mib.strip().isdigit():
                    role = self.role(pid.strip())
                    now[role] = now.get(role, 0.0) + int(mib) / 1024
            for role, gib in now.items():
                self.peak[role] = max(self.peak.get(role, 0.0), gib)

    def __enter__(self) -> GpuMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def dry_run(overrides: list[str]) -> str:
    proc = subprocess.run([sys.executable, "-m", "molt", *overrides, "run.dry_run=true"], cwd=REPO,
                          capture_output=True, text=True)
    # the whole plan, then each problem the dry run found (exit code 2)
    problems = "\n".join(line for line in proc.stderr.splitlines() if line.startswith("molt: "))
    found = f"dry run found problems:\n{problems or proc.stderr[-2000:]}" if proc.returncode else ""
    return proc.stdout + found


def train_run(name: str, overrides: list[str], args: argparse.Namespace) -> list[str]:
    """Run one `python -m molt`; prints its numbers and its check line, returns the failed checks."""
    label = f"item10_run_{name}" if name.startswith("moe") else f"run_{name}"
    print(f"\n=== {name}\n--- dry run (the plan and each role's memory estimate)\n{dry_run(overrides)}",
          flush=True)
    environ = dict(os.environ)
    if name.startswith("colocated"):   # one GPU for the trainer and the engine: Ray sees only GPU 0
        os.environ["CUDA_VISIBLE_DEVICES"] = "0"
    try:
        with GpuMemory() as memory:
            result = run_molt(overrides, args.out / name, timeout=1800)
    finally:
        os.environ.clear()
        os.environ.update(environ)
    if result["rc"]:
        return report(label, False, f"the run failed (rc {result['rc']}); log tail:\n{result['log']}")
    steps = [r for r in result["rows"] if "time/step" in r]
    gaps = [r["mismatch/max_abs"] for r in steps if "mismatch/max_abs" in r]
    print(f"--- measured: {len(steps)} steps, step times (s): {[round(r['time/step'], 2) for r in steps]}, "
          f"start-up {result.get('startup_s', float('nan')):.0f} s")
    print("--- peak GPU memory per role (GiB, nvidia-smi): "
          + ", ".join(f"{role} {gib:.1f}" for role, gib in sorted(memory.peak.items())))
    ok = len(steps) == args.steps and bool(gaps) and max(gaps) <= args.max_abs
    return report(label, ok, f"{len(steps)} of {args.steps} steps; mismatch/max_abs per step "
                  f"{[f'{g:.2e}' for g in gaps]} (bound {args.max_abs:g})")


def item_checks(args: argparse.Namespace, plan: dict[str, list[str]]) -> list[str]:
    """The engine refits after each sync run's kind, then the item checks (gpu_checks.py). The colocated
    run has none: its refit is the shared transport's, which every one of its steps checks."""
    from gpu_checks import (
        context_parallel_ranks,
        engine_refit,
        fp8_refit,
        fp32_buffer,
        refit_ranges,
        vlm_no_image_rank,
    )
    from gpu_smoke_models import perturbed_copy

    from molt.driver.compose import compose
    from molt.plan.models import model_path

    failed = []
    for name in [n for n in plan if n.endswith("_sync") and not n.startswith("colocated")]:
        spec = compose(plan[name])
        path = Path(model_path(spec))
        new = perturbed_copy(path, args.out / f"{name}_new_weights", scale=0.05)
        failed += engine_refit(name.removesuffix("_sync"), spec, path, new, CHUNK_MB)
    if args.only not in ("items", "all"):
        return failed
    models = item_models(args)
    specs = {name: compose(overrides) for name, overrides in item_overrides(models).items()}
    failed += refit_ranges(specs["item1"])
    failed += vlm_no_image_rank(specs["item5"], args.hang_timeout)
    failed += vlm_no_image_rank(specs["item5_trained"], args.hang_timeout, "item5_trained_tower_no_image")
    failed += fp8_refit(specs["item9"], models["dense"], args.out / "models", args.fp8_max_abs)
    failed += fp32_buffer(specs["item11"], models["item11"], args.out / "models")
    failed += context_parallel_ranks(specs["cp"])
    return failed


def plan_specs(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Path]]:
    """Every run's and item check's spec, composed (the spec's refusals apply), and its model folder,
    built offline; item10 is the moe_sync run's spec, item9_dense the folder the FP8 model copies."""
    from molt.driver.compose import compose
    from molt.plan.models import model_path

    specs = {name: compose(overrides) for name, overrides in runs(args).items()}
    models = item_models(args)
    specs.update({name: compose(overrides) for name, overrides in item_overrides(models).items()})
    specs["item10"] = compose(runs(argparse.Namespace(**{**vars(args), "only": "moe"}))["moe_sync"])
    paths = {name: Path(model_path(spec)) for name, spec in specs.items()}
    paths["item9_dense"] = models["dense"]
    return specs, paths


def plan_only(args: argparse.Namespace) -> int:
    """--plan: `plan_specs` and the checks' CPU parts (gpu_checks.plan_checks); no GPU, no Ray."""
    from gpu_checks import plan_checks

    specs, paths = plan_specs(args)
    problems = plan_checks(specs, paths)
    for name, spec in specs.items():
        print(f"PLAN {name}: {spec.parallel.device}, {spec.model.dtype}, {paths[name]}")
    print("gpu_smoke --plan: " + ("every check's CPU part holds" if not problems else
                                  f"{len(problems)} problem(s):\n  " + "\n  ".join(problems)))
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = runs(args)
    if args.print_specs:
        print(json.dumps(plan, indent=1))
        return 0
    if args.plan:
        return plan_only(args)
    problem = preflight(gpus_needed(args))
    if problem:
        print(f"gpu_smoke: an assumption does not hold: {problem}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    failed, start = [], time.perf_counter()
    for name, overrides in plan.items():
        failed += train_run(name, overrides, args)
    failed += item_checks(args, plan)
    print(f"\ngpu_smoke: {len(plan)} runs and the item checks in {time.perf_counter() - start:.0f} s; "
          + ("all checks passed" if not failed else f"{len(failed)} failed:\n  " + "\n  ".join(failed)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
