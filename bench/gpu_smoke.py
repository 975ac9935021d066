"""The first thing to run on a GPU machine:  .venv/bin/python bench/gpu_smoke.py

ASSUMPTIONS (checked first; the script stops with exit code 2 and says which one failed):
- Linux x86_64, this checkout installed with `bash install.sh gpu` (.venv: CUDA torch, vLLM's GPU build).
- 2 CUDA GPUs visible, bf16-capable (Ampere or newer), >= 24 GB each, `nvidia-smi` on PATH. Two, not one:
  the placement puts the trainer and the engines on disjoint GPUs, and NCCL refuses two ranks of one group on
  one GPU ("Duplicate GPU detected"), so the NCCL refit needs a second GPU.
- No network and no download: both models are random-init, built offline by molt.inputs.tiny (a ~0.5B dense
Qwen3 of 28 layers, hidden 1024, as Qwen3-0.6B without its vocabulary; a tiny Qwen3-MoE) into $MOLT_CACHE.
- It starts Ray locally, writes under --out (default bench/out/gpu_smoke) and takes about 10-20 minutes.

WHAT IT CHECKS, for the dense model and then the MoE (router replay on):
1. 5 sync steps and 5 async steps with partial rollouts (the MoE runs without them: router replay with
   partial rollouts is refused on cuda), bf16, the NCCL refit (`python -m molt`, as a user
   runs it): every step's engine/trainer `mismatch/max_abs` <= --max-abs (default 0.1, a first bound: bf16
   rounds each logit to ~3 significant digits, and a random-init model's logits are near 0, so a gap of a
   tenth of a nat means a real disagreement; replace it by the measured value once known).
2. A refit against a fresh engine: an engine refit over NCCL with perturbed weights generates (greedy) the
   same tokens, and logprobs within 1e-3, as an engine started on those weights.
3. Prints each run's step times and the peak GPU memory of each role (nvidia-smi, per process) next to the
   dry run's plan (where the dry run prints a memory estimate per role, it is printed there too).
Exit code 0 when every check passes, 1 when one fails (the summary says which).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from molt_run import run_molt  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DENSE = dict(hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
             intermediate_size=3072, vocab_size=320, max_position_embeddings=4096)
QUIET = ["logging.wandb.mode=disabled", "logging.plots=false", "logging.progress=false",
         "logging.dump_rollouts=false", "train.eval_every=0"]
GREEDY = {"temperature": 0.0, "max_tokens": 32}
PROMPTS = [[1, 40, 41, 42, 43], [1, 7, 8], list(range(3, 163))]   # the last spans several KV blocks


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "gpu_smoke")
    p.add_argument("--steps", type=int, default=5, help="steps per run (sync and async)")
    p.add_argument("--only", choices=["dense", "moe", "all"], default="all")
    p.add_argument("--layers", type=int, default=DENSE["num_layers"], help="dense model depth")
    p.add_argument("--max-abs", type=float, default=0.1, help="bound on every step's mismatch/max_abs")
    p.add_argument("--print-specs", action="store_true", help="print each run's overrides and exit")
    return p.parse_args(argv)


def model_overrides(kind: str, layers: int) -> list[str]:
    if kind == "moe":
        return ["model=tiny_moe"]   # 4 experts, top-2; router_replay: true in the group
    sizes = {**DENSE, "num_layers": layers}
    # keys the spec's model.tiny default does not list are added (+), the others overridden
    listed = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "vocab_size")
    return [f"{'' if key in listed else '+'}model.tiny.{key}={value}" for key, value in sizes.items()]


def runs(args: argparse.Namespace) -> dict[str, list[str]]:
    """Every run's `python -m molt` overrides, by name (kind_mode)."""
    out = {}
    for kind in (["dense", "moe"] if args.only == "all" else [args.only]):
        for mode in ("sync", "async"):
            out[f"{kind}_{mode}"] = [
                *model_overrides(kind, args.layers), "model.dtype=bfloat16", "model.max_model_len=1024",
                "parallel.device=cuda", "parallel.nodes=1", "parallel.gpus_per_node=2",
                "rollout.engine.gpu_memory_utilization=0.5", f"rollout.mode={mode}",
                # router replay with partial rollouts is refused on cuda (vLLM's GPU route capture)
                f"rollout.partial_rollout={'false' if kind == 'moe' else 'true'}",
                "rollout.max_tokens=256", "agent.max_total_tokens=512",
                "rollout.groups_in_flight=8",
                f"train.steps={args.steps}", "train.prompts_per_step=8", "rollout.samples_per_prompt=4",
                "train.micro_batch_size=8", "train.save_every=0", *QUIET]
    return out


def preflight() -> str | None:
    """What of the assumptions above does not hold here (None: all hold)."""
    try:
        import torch
    except ImportError as error:
        return f"torch does not import ({error}): run `bash install.sh gpu` first"
    if not torch.version.cuda:
        return f"torch {torch.__version__} has no CUDA: run `bash install.sh gpu`"
    if torch.cuda.device_count() < 2:
        return (f"needs 2 CUDA GPUs, sees {torch.cuda.device_count()} (trainer and engine on disjoint GPUs; "
                "NCCL refuses two ranks on one GPU)")
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
    return proc.stdout if proc.returncode == 0 else f"dry run failed:\n{proc.stderr[-2000:]}"


def train_run(name: str, overrides: list[str], args: argparse.Namespace) -> list[str]:
    """Run one `python -m molt`; prints its numbers, returns the failed checks."""
    print(f"\n=== {name}\n--- dry run (the plan; a per-role memory estimate appears here once the dry run "
          f"prints one)\n{dry_run(overrides)}", flush=True)
    with GpuMemory() as memory:
        result = run_molt(overrides, args.out / name, timeout=1800)
    if result["rc"]:
        return [f"{name}: the run failed (rc {result['rc']}); log tail:\n{result['log']}"]
    steps = [r for r in result["rows"] if "time/step" in r]
    gaps = [r["mismatch/max_abs"] for r in steps if "mismatch/max_abs" in r]
    print(f"--- measured: {len(steps)} steps, step times (s): {[round(r['time/step'], 2) for r in steps]}, "
          f"start-up {result.get('startup_s', float('nan')):.0f} s")
    print("--- peak GPU memory per role (GiB, nvidia-smi): "
          + ", ".join(f"{role} {gib:.1f}" for role, gib in sorted(memory.peak.items())))
    print(f"--- mismatch/max_abs per step: {[f'{g:.2e}' for g in gaps]} (bound {args.max_abs})")
    failed = []
    if len(steps) != args.steps:
        failed.append(f"{name}: {len(steps)} of {args.steps} steps logged")
    if not gaps or max(gaps) > args.max_abs:
        failed.append(f"{name}: mismatch/max_abs {max(gaps) if gaps else 'never logged'} > {args.max_abs}")
    return failed


def perturbed_copy(path: Path, new: Path) -> dict:
    """Copy the model folder `path` to `new` with every weight perturbed (seeded); returns the new weights."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.rmtree(new, ignore_errors=True)
    shutil.copytree(path, new)
    generator, weights = torch.Generator().manual_seed(1), {}
    for file in sorted(glob.glob(str(new / "*.safetensors"))):
        part = {k: v + 0.05 * v.float().std() * torch.randn(v.shape, generator=generator)
                for k, v in load_file(file).items()}
        save_file(part, file, metadata={"format": "pt"})
        weights.update(part)
    return weights


def refit_check(name: str, overrides: list[str], args: argparse.Namespace) -> list[str]:
    """Refit an engine over NCCL with perturbed weights; compare its greedy output with a fresh engine's."""
    import asyncio
    import socket

    import ray
    import torch

    from molt import refit
    from molt.plan.models import model_path
    from molt.rollout.dispatch import Dispatcher
    from molt.rollout.engine import start_engine
    from molt.spec.config import compose

    spec = compose(overrides)
    path = Path(model_path(spec))
    new = args.out / f"{name}_new_weights"
    weights = perturbed_copy(path, new)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")   # a private local cluster, as molt's own
    ray.init(num_gpus=1, include_dashboard=False)   # the engine gets GPU 0; this process sends from GPU 1
    try:
        engine = start_engine(spec, str(path), 0)
        ray.get(engine.ready.remote())
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dispatcher, device = Dispatcher([engine]), torch.device("cuda", 1)

        async def connect():
            size = await dispatcher.refit_size()
            opened = asyncio.to_thread(refit.open_group, "127.0.0.1", port, 0, size, device)
            return (await asyncio.gather(opened, dispatcher.join_refit("127.0.0.1", port)))[0]

        group = asyncio.run(connect())
        receiving = engine.update_weights.remote(1)
        dtype = getattr(torch, spec.model.dtype)
        refit.send(group, [{k: v.to(device, dtype) for k, v in weights.items()}], device)
        ray.get(receiving)
        refitted = ray.get([engine.generate.remote(p, GREEDY) for p in PROMPTS])
        ray.kill(engine)
        fresh_engine = start_engine(spec, str(new), 0)
        ray.get(fresh_engine.ready.remote())
        fresh = ray.get([fresh_engine.generate.remote(p, GREEDY) for p in PROMPTS])
    finally:
        ray.shutdown()
    same = all(a["token_ids"] == b["token_ids"] for a, b in zip(refitted, fresh, strict=True))
    gap = max(abs(x - y) for a, b in zip(refitted, fresh, strict=True)
              for x, y in zip(a["logprobs"], b["logprobs"], strict=False))
    print(f"--- refit vs fresh engine ({name}): same greedy tokens {same}, max logprob gap {gap:.2e}")
    return [] if same and gap <= 1e-3 else [f"{name}: refit differs from a fresh engine (tokens equal: "
                                            f"{same}, max logprob gap {gap:.2e} > 1e-3)"]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = runs(args)
    if args.print_specs:
        print(json.dumps(plan, indent=1))
        return 0
    problem = preflight()
    if problem:
        print(f"gpu_smoke: an assumption does not hold: {problem}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    failed, start = [], time.perf_counter()
    for name, overrides in plan.items():
        failed += train_run(name, overrides, args)
        if name.endswith("_sync"):
            failed += refit_check(name.removesuffix("_sync"), overrides, args)
    print(f"\ngpu_smoke: {len(plan)} runs in {time.perf_counter() - start:.0f} s; "
          + ("all checks passed" if not failed else f"{len(failed)} failed:\n  " + "\n  ".join(failed)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
