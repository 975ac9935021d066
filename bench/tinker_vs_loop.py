"""A tinker-cookbook RL recipe through `python -m molt.tinker serve` beside `python -m molt` on the same
task, model, batch, LoRA and cores: seconds per step.

    python bench/tinker_vs_loop.py [--model PATH] [--steps 12] [--modes sync,async] [--quick] [--no-results]
    python bench/tinker_vs_loop.py --model SFT_EXPORT --steps 30 --lr 1e-3 --modes none --no-results
    python bench/tinker_vs_loop.py --report bench/out/tinker/STAMP      # the section again from saved runs
    python bench/tinker_vs_loop.py --report bench/out/tinker/STAMP --curve PNG      # or the curve

The recipe is the cookbook's own `tinker_cookbook.recipes.math_rl.train` (its `arithmetic` env), run
unmodified from .venv-tinker-client (`bash install.sh tinker-client`) against a service this script starts;
Molt's loop runs the same task (bench/tinker_arith_agent.py, the cookbook's prompt and reward) with the
same groups x samples, max tokens, LoRA rank (refit merged, as the service refits) and learning rate. Each
side reports its own step time: the cookbook's `time/total`, Molt's `time/step`; the first `--warmup` steps
are left out. Writes the `tinker` section of RESULTS.md; `--curve` draws the recipe's correct-sum rate,
reward and stop-token rate per step. The model defaults to the tiny one with its output head untied (the
recipe adapts the head: train_unembed); docs/tinker.md's curve serves an SFT export
(examples/data/make_arith_sft.py).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import OUT, REPO, header, table, write_section
from molt_run import QUIET, run_molt
from tinker_arith_agent import FEW_SHOT

CLIENT = REPO / ".venv-tinker-client" / "bin" / "python"
RECIPE = "tinker_cookbook.recipes.math_rl.train"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_recipe(args: argparse.Namespace, out: Path) -> dict:
    """The service in one process, the cookbook's recipe in another; their metrics read back."""
    port, env = free_port(), {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled",
                              "TINKER_API_KEY": "tml-local", "TINKER_TELEMETRY": "0", "PYTHONUNBUFFERED": "1"}
    serve = [sys.executable, "-m", "molt.tinker", "serve", "--port", str(port), f"model.path={args.model}",
             f"run.dir={out / 'service'}", *QUIET]
    client = [str(CLIENT), "-m", RECIPE, f"base_url=http://127.0.0.1:{port}", f"model_name={args.model}",
              "renderer_name=qwen3_instruct", f"log_path={out / 'recipe'}", f"max_steps={args.steps}",
              f"groups_per_batch={args.groups}", f"group_size={args.group_size}", f"lora_rank={args.lora}",
              f"learning_rate={args.lr}", "eval_every=0", "save_every=0", "behavior_if_log_dir_exists=delete"]
    out.mkdir(parents=True, exist_ok=True)
    with (out / "service.log").open("w") as log:
        service = subprocess.Popen(serve, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            while "molt.tinker: serving" not in (out / "service.log").read_text():
                if service.poll() is not None:
                    raise SystemExit(f"the service exited: {(out / 'service.log').read_text()[-2000:]}")
                time.sleep(1)
            with (out / "recipe.log").open("w") as recipe_log:
                rc = subprocess.run(client, cwd=out, env=env, stdout=recipe_log, stderr=subprocess.STDOUT,
                                    timeout=args.timeout).returncode
        finally:
            service.send_signal(signal.SIGINT)
            try:
                service.wait(timeout=120)
            except subprocess.TimeoutExpired:
                service.kill()
    rows = [json.loads(line) for line in (out / "recipe" / "metrics.jsonl").read_text().splitlines()] \
        if (out / "recipe" / "metrics.jsonl").exists() else []
    return {"rc": rc, "command": " ".join(client[1:]), "serve": " ".join(serve[1:]), "steps": [
        {"time": r["time/total"], "sampling": r.get("time/sampling", float("nan")),
         "train": r.get("time/train_step", float("nan")),
         "refit": r.get("time/save_checkpoint_and_get_sampling_client", float("nan")),
         "reward": r["env/all/reward/total"], "format": r["env/all/format"], "correct": r["env/all/correct"]}
        for r in rows if "time/total" in r]}


def recipe_metrics(out: Path) -> list[dict]:
    """The recipe's own metrics.jsonl rows of a run in `out` (a step per row)."""
    path = out / "recipe" / "recipe" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def run_loop(args: argparse.Namespace, mode: str, out: Path) -> dict:
    """`python -m molt` on the cookbook's task: the same prompts, reward, batch, LoRA and learning rate."""
    data = out / "arithmetic.jsonl"
    data.parent.mkdir(parents=True, exist_ok=True)
    import random
    rng = random.Random(0)
    with data.open("w") as f:
        for _ in range(args.groups * (args.steps + 2)):
            x, y = rng.randint(0, 100), rng.randint(0, 100)
            f.write(json.dumps({"messages": [*FEW_SHOT, {"role": "user", "content": f"What is {x} + {y}?"}],
                                "label": str(x + y)}) + "\n")
    overrides = [f"model.path={args.model}", f"model.lora.rank={args.lora}", "model.lora.refit=merged",
                 "model.lora.target_modules=[*_proj,lm_head]", f"data.train_path={data}", "data.eval=[]",
                 f"agent.module={REPO}/bench/tinker_arith_agent.py", "rollout.max_tokens=5",
                 f"rollout.mode={mode}", f"rollout.samples_per_prompt={args.group_size}",
                 f"train.prompts_per_step={args.groups}", f"rollout.groups_in_flight={args.groups}",
                 f"train.steps={args.steps}", f"train.lr={args.lr}", "train.save_every=0", *QUIET]
    result = run_molt(overrides, out / mode, timeout=args.timeout)
    return {"rc": result["rc"], "command": result["cmd"], "log": result["log"], "steps": [
        {"time": r["time/step"], "sampling": r.get("time/generate", float("nan")),
         "train": r.get("time/train", float("nan")) + r.get("time/logprobs", 0.0),
         "refit": r.get("time/refit", float("nan")), "reward": r["reward/mean"]} for r in result["rows"]
        if "time/step" in r]}


def draw_curve(run: dict, path: str, model: str) -> None:
    """The recipe's correct-sum rate per step (left), its reward and stop-token rate (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.2))
    steps = range(len(run["steps"]))
    correct = [s["correct"] for s in run["steps"]]
    # a step's 400 samples leave a rate near 3% about 0.9 points of noise: the 5-step mean shows the trend
    mean = [statistics.fmean(correct[max(0, i - 4):i + 1]) for i in steps]
    left.plot(steps, correct, color="C2", alpha=0.4, label="per step")
    left.plot(steps, mean, color="C2", label="mean of the last 5 steps")
    left.set_ylim(bottom=0)
    left.set_ylabel("correct sum (env/all/correct)")
    left.legend(fontsize=7)
    right.plot(steps, [s["reward"] for s in run["steps"]], label="reward (env/all/reward/total)")
    right.plot(steps, [s["format"] for s in run["steps"]], label="ended on the stop token (env/all/format)")
    right.legend(fontsize=7)
    for ax in (left, right):
        ax.set_xlabel("step (100 groups x 4 samples)")
    shown = Path(model).relative_to(REPO) if Path(model).is_relative_to(REPO) else Path(model).name
    fig.suptitle(f"tinker-cookbook math_rl (arithmetic), served by python -m molt.tinker; base: {shown}",
                 fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


RECIPE_RUN = "cookbook recipe → molt.tinker"


def median_of(run: dict, key: str, warmup: int) -> float:
    return statistics.median(s[key] for s in run["steps"][warmup:])


def analysis(runs: dict, recipe_rows: list[dict], warmup: int) -> str:
    """Where the recipe's step goes beside the loop's, from both sides' own metrics."""
    recipe = runs[RECIPE_RUN]
    sync, overlap = runs.get("python -m molt (sync)"), runs.get("python -m molt (async)")
    if not sync or not overlap or any(r["rc"] for r in (recipe, sync, overlap)):
        return ""
    rows = recipe_rows[warmup:]
    prompts = statistics.median(r["env/all/total_episodes"] for r in rows)
    render = statistics.median(r["time/env_initial_observation:total"] for r in rows)
    latency = statistics.median(r["time/policy_sample:mean"] for r in rows)
    served = statistics.median(r["time/forward_backward"] + r["time/optim_step"] for r in rows)
    m = {(name, k): median_of(run, k, warmup) for name, run in (("r", recipe), ("s", sync), ("a", overlap))
         for k in ("time", "sampling", "train", "refit")}
    return (
        "Training and the refit cost the same through the API as in the loop "
        f"({m['r', 'train']:.2f} vs {m['s', 'train']:.2f} s, "
        f"{m['r', 'refit']:.2f} vs {m['s', 'refit']:.2f} s): the same trainer rank and refit group; of the "
        f"recipe's training the service's forward_backward and optim_step took {served:.2f} s, the rest is "
        "the datums' way over HTTP (protobuf) and the client's. The difference is sampling, "
        f"{m['r', 'sampling']:.2f} s against {m['s', 'sampling']:.2f} s of the loop's engine time: the "
        f"recipe builds its {prompts:.0f} prompts in its own Python process ({render:.2f} s per step on the "
        f"same 2 cores) and each of its sample requests takes {latency:.2f} s (HTTP, the SDK's futures and "
        "the engine's batch, which the client's work slows). And the loop pipelines what the service "
        "cannot: in async mode the engines sample the next batch while the trainer steps "
        f"({m['a', 'time']:.2f} s per step against {m['s', 'time']:.2f} s in sync mode); the recipe samples, "
        "trains and refits one after another. Through the API the client decides when to sample and when to "
        "train; the cookbook's own overlap (`max_steps_off_policy`) samples from earlier snapshots, which "
        "this service refuses (its engines hold one set of weights).")


def report(meta: dict, runs: dict, recipe_rows: list[dict]) -> str:
    return "\n".join([
        "## A tinker-cookbook recipe through molt.tinker vs python -m molt (same task, model, cores)", "",
        meta["head"], f"- model: {meta['model']}; {meta['groups']} groups x {meta['group_size']} samples x 5 "
        f"tokens per step, LoRA rank {meta['lora']} (merged refits), lr {meta['lr']}; {meta['steps']} steps, "
        f"the first {meta['warmup']} left out",
        f"- command: `python bench/tinker_vs_loop.py --model {meta['model']} --steps {meta['steps']}`",
        "", table(["run", "s / step", "sampling s", "train s", "refit s", "reward first → last 3"],
                  [row(name, run, meta["warmup"]) for name, run in runs.items()]), "",
        "Sampling / train / refit: the recipe's `time/sampling`, `time/train_step` and "
        "`time/save_checkpoint_and_get_sampling_client`; Molt's `time/generate` (the engine's busy seconds), "
        "`time/logprobs + time/train`, `time/refit`.", "", analysis(runs, recipe_rows, meta["warmup"])])


def row(name: str, run: dict, warmup: int) -> list[str]:
    timed = run["steps"][warmup:]
    if run["rc"] or not timed:
        return [name, f"failed (rc {run['rc']})", "", "", "", ""]
    med = {k: statistics.median(s[k] for s in timed) for k in ("time", "sampling", "train", "refit")}
    rewards = [s["reward"] for s in run["steps"]]
    return [name, *(f"{med[k]:.2f}" for k in ("time", "sampling", "train", "refit")),
            f"{rewards[0]:.3f} → {statistics.fmean(rewards[-3:]):.3f}"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="the served model's folder (default: the tiny model, untied)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--groups", type=int, default=100, help="prompts per step (the recipe's groups_per_batch)")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--lora", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--modes", default="sync,async", help="Molt's rollout.mode(s) (none: the recipe only)")
    p.add_argument("--curve", help="draw the recipe's correct rate, reward and format per step into this PNG")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--quick", action="store_true", help="3 steps of 8 groups; prints, writes nothing")
    p.add_argument("--no-results", action="store_true", help="print the table only")
    p.add_argument("--report", help="a saved run's folder (bench/out/tinker/STAMP): write its section again")
    args = p.parse_args()
    if args.report:
        saved = json.loads((Path(args.report) / "runs.json").read_text())
        body = report(saved["meta"], saved["runs"], recipe_metrics(Path(args.report)))
        if args.curve:
            draw_curve(saved["runs"][RECIPE_RUN], args.curve, saved["meta"]["model"])
            return
        print(body)
        write_section("tinker", body)
        return
    if args.quick:
        args.steps, args.groups, args.warmup, args.no_results = 3, 8, 1, True
    if not CLIENT.exists():
        raise SystemExit("no .venv-tinker-client: run `bash install.sh tinker-client` first")
    if args.model is None:
        from molt.inputs.tiny import tiny_model_path

        args.model = str(tiny_model_path(tie_word_embeddings=0))
    args.model = str(Path(args.model).resolve())   # the recipe runs in the run's folder
    out = OUT / "tinker" / time.strftime("%Y%m%d-%H%M%S")
    meta = {"head": header(), **{k: getattr(args, k) for k in ("model", "groups", "group_size", "lora", "lr",
                                                                "steps", "warmup")}}
    runs = {RECIPE_RUN: run_recipe(args, out / "recipe")}
    for mode in [m for m in args.modes.split(",") if m != "none"]:
        runs[f"python -m molt ({mode})"] = run_loop(args, mode, out / "loop")
    if args.curve:
        draw_curve(runs[RECIPE_RUN], args.curve, args.model)
    body = report(meta, runs, recipe_metrics(out))
    print(body)
    (out / "runs.json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))
    if not args.no_results:
        write_section("tinker", body)


if __name__ == "__main__":
    main()
