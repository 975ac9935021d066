"""Does RL teach an agent decisions? The decision tasks of docs/tool_use.md over seeds and credit rules.

One SFT run (experiments/decision_sft.yaml) on traces that leave every decision to chance, then RL from
its export for each task x seed (experiments/decision_{choice,chain,recovery}.yaml), the chain task with
rollout and with turn credit (algo.turn_credit=turn), the choice task also through the ChatAgent path
(examples/agents/decision_chat.py). Each run is `python -m molt` as a user runs it (bench/molt_run.py);
the data is written first by examples/agents/decision_env.py into bench/out/agentic_learning/data.

    python bench/agentic_learning.py                      # the matrix: section agentic_learning + PNG
    python bench/agentic_learning.py --quick              # 2 RL steps a task, 1 seed: prints, writes nothing
    python bench/agentic_learning.py --tasks chain --seeds 1 --reuse --no-results   # one cell (cached)

Per task: held-out greedy accuracy (eval/decision_TASK_eval/pass@1; step 0 is the SFT model), the task's
decision metric greedy on the held-out set (eval/.../info/KEY) and sampled at temperature 1 (the training
rollouts' info/KEY: each training prompt is new to the model), tool calls and turns per rollout, and the
tool-off control (eval/decision_TASK_eval_off/pass@1), each as the mean and min-max over seeds.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import shlex
import statistics
import sys
from pathlib import Path

from common import BENCH, OUT, header, table
from molt_run import finish, run_cached

TASKS = ("choice", "chain", "recovery")
DECISION = {"choice": "right_tool", "chain": "chained", "recovery": "retried"}
DATA = OUT / "agentic_learning" / "data"
QUIET = ["logging.wandb.mode=disabled", "logging.plots=false", "logging.progress=false",
         "logging.dump_rollouts=false"]
TARGET = 0.3   # held-out accuracy above the SFT model's, every seed's mean
# RL steps per task: the greedy decision flips by step 10 on chain and recovery, by 20 on choice (whose
# SFT policy starts near even odds between two tools, so the sampled choice has further to move)
STEPS = {"choice": 20, "chain": 10, "recovery": 10}


def write_data() -> None:
    spec = importlib.util.spec_from_file_location("decision_env",
                                                  BENCH.parent / "examples" / "agents" / "decision_env.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main([str(DATA)])


def sft(steps: int, reuse: bool, timeout: float) -> tuple[str, dict]:
    """The SFT run (cached) and its Hugging Face export."""
    # an export every 50 steps (kept) shows how far SFT got; the RL runs start from the last
    args = ["+experiment=decision_sft", f"train.steps={steps}", "train.keep_checkpoints=100",
            f"data.train_path={DATA}/decision_sft.jsonl", f"data.eval=[{DATA}/decision_sft_eval.jsonl]",
            *QUIET]
    result = run_cached(args, reuse, timeout, module="molt.sft")
    if result["rc"]:
        sys.exit(f"[bench] SFT failed rc={result['rc']}\n{result['log']}")
    print(f"[bench] SFT: {result['wall_s']:.0f} s", flush=True)
    return f"{result['dir']}/checkpoints/step_{steps:06d}/hf", result


def rl(task: str, credit: str, path: str, seed: int, model: str, steps: int, reuse: bool,
       timeout: float) -> dict:
    args = [f"+experiment=decision_{task}", f"model.path={model}", f"run.seed={seed}", f"train.steps={steps}",
            f"data.train_path={DATA}/decision_{task}_train.jsonl",
            f"data.eval=[{DATA}/decision_{task}_eval.jsonl,{DATA}/decision_{task}_eval_off.jsonl]",
            "train.best_metric=null", *QUIET]
    if credit == "turn":
        args.append("algo.turn_credit=turn")
    if path == "chat":
        args.append("agent.module=examples/agents/decision_chat.py")
    result = run_cached(args, reuse, timeout)
    status = "ok" if result["rc"] == 0 else f"FAILED rc={result['rc']}\n{result['log']}"
    print(f"[bench] {task} {credit} credit, {path}, seed {seed}: {status} ({result['wall_s']:.0f} s)",
          flush=True)
    return {"task": task, "credit": credit, "path": path, "seed": seed, **result}


def curves(run: dict) -> dict[str, tuple[list[int], list[float]]]:
    """Each plotted series of a run: name -> (steps, values)."""
    task, rows = run["task"], run["rows"]
    held, off = f"eval/decision_{task}_eval", f"eval/decision_{task}_eval_off"
    keys = {"accuracy": f"{held}/pass@1", "greedy": f"{held}/info/{DECISION[task]}",
            "control": f"{off}/pass@1", "sampled": f"info/{DECISION[task]}",
            "calls": f"{held}/agent/tool_calls", "turns": f"{held}/agent/turns"}
    return {name: ([r["step"] for r in rows if key in r], [r[key] for r in rows if key in r])
            for name, key in keys.items()}


def spread(values: list[float]) -> str:
    if not values:
        return "–"
    mean = statistics.fmean(values)
    return f"{mean:.2f}" if len(values) == 1 else f"{mean:.2f} ({min(values):.2f}–{max(values):.2f})"


def summary(runs: list[dict]) -> list:
    """One table row for the runs of one task x credit x path (its seeds)."""
    ok = [curves(r) for r in runs if r["rc"] == 0]
    # a series a run never logged (an eval whose every rollout failed has no info/*) reads as NaN
    first, last = ((lambda c, k: c[k][1][0] if c[k][1] else math.nan),   # noqa: E731
                   (lambda c, k: c[k][1][-1] if c[k][1] else math.nan))
    if not ok or any(not c["accuracy"][1] for c in ok):
        return [runs[0]["task"], runs[0]["credit"], runs[0]["path"], "failed"] + [""] * 8
    gains = [last(c, "accuracy") - first(c, "accuracy") for c in ok]
    sampled_end = [statistics.fmean(c["sampled"][1][-5:]) for c in ok if c["sampled"][1]]
    sampled_start = [c["sampled"][1][0] for c in ok if c["sampled"][1]]
    met = "yes" if min(gains) >= TARGET else ("mean only" if statistics.fmean(gains) >= TARGET else "no")
    # a run stopped early (SIGTERM: the step ends, a checkpoint is written, rc 0) ends at its last eval
    evals = sorted({c["accuracy"][0][-1] for c in ok})
    return [runs[0]["task"], runs[0]["credit"], runs[0]["path"], len(ok),
            spread([first(c, "accuracy") for c in ok]),
            spread([last(c, "accuracy") for c in ok]) + f" (step {'/'.join(map(str, evals))})",
            spread(gains) + f" ({met})",
            spread([first(c, "greedy") for c in ok]) + " → " + spread([last(c, "greedy") for c in ok]),
            spread(sampled_start) + " → " + spread(sampled_end),
            spread([first(c, "calls") for c in ok]) + " → " + spread([last(c, "calls") for c in ok]) + " / "
            + spread([first(c, "turns") for c in ok]) + " → " + spread([last(c, "turns") for c in ok]),
            spread([last(c, "control") for c in ok]),
            f"{statistics.fmean(r['wall_s'] for r in runs):.0f} s"]


def draw(groups: dict[tuple, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({key[0] for key in groups}, key=TASKS.index)
    fig, axes = plt.subplots(len(tasks), 3, figsize=(13, 3.2 * len(tasks)), squeeze=False)
    titles = ("held-out accuracy (greedy); dashed: tool off", "decision, greedy (held-out)",
              "decision, sampled (training rollouts, T=1)")
    for (task, credit, path_), runs in groups.items():
        row = axes[tasks.index(task)]
        label = f"{credit} credit" + (", ChatAgent" if path_ == "chat" else "")
        ok = [curves(r) for r in runs if r["rc"] == 0]
        color = None
        for ax, name in zip(row, ("accuracy", "greedy", "sampled"), strict=True):
            series = [c[name] for c in ok if c[name][1]]
            if not series:
                continue
            n = min(len(v) for _, v in series)
            steps = series[0][0][:n]
            values = [[v[i] for _, v in series] for i in range(n)]
            mean = [statistics.fmean(v) for v in values]
            line, = ax.plot(steps, mean, marker="o" if name != "sampled" else None, ms=3, color=color,
                            label=f"{label} (mean of {len(series)} seeds; band: min–max)")
            color = line.get_color()
            ax.fill_between(steps, [min(v) for v in values], [max(v) for v in values], color=color, alpha=0.2)
            if name == "accuracy":
                control = [c["control"] for c in ok if c["control"][1]]
                if control:
                    m = min(len(v) for _, v in control)
                    ax.plot(control[0][0][:m], [statistics.fmean(v[i] for _, v in control) for i in range(m)],
                            ls="--", color=color)
        for ax, title in zip(row, titles, strict=True):
            ax.set_title(f"{task}: {title}", fontsize=9)
            ax.set_ylim(-0.02, 1.02)
            ax.set_xlabel("RL step")
        row[0].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", default=",".join(TASKS), help="comma list; empty: only the SFT run")
    p.add_argument("--seeds", default="0,1,2", help="comma list of run.seed values of the RL runs")
    p.add_argument("--credits", default="rollout,turn", help="the chain task's algo.turn_credit values")
    p.add_argument("--chat-seeds", default="0,1,2", help="seeds of the choice task's ChatAgent runs")
    p.add_argument("--steps", type=int, default=None, help=f"RL steps of every run (default: {STEPS})")
    p.add_argument("--sft-steps", type=int, default=600)
    p.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    p.add_argument("--reuse", action="store_true", help="read back finished runs with identical overrides")
    p.add_argument("--quick", action="store_true", help="2 RL steps, one seed, 20 SFT steps: prints only")
    p.add_argument("--no-results", action="store_true", help="print the section; write neither file")
    args = p.parse_args()
    if args.quick:
        args.seeds, args.chat_seeds, args.steps, args.sft_steps, args.no_results = "0", "0", 2, 20, True
    write_data()
    model, tuned = sft(args.sft_steps, args.reuse, args.timeout)
    tasks = [task for task in args.tasks.split(",") if task]
    cells = [(task, credit, "env", int(seed)) for task in tasks for seed in args.seeds.split(",")
             for credit in (args.credits.split(",") if task == "chain" else ("rollout",))]
    if "choice" in tasks:
        cells += [("choice", "rollout", "chat", int(seed)) for seed in args.chat_seeds.split(",") if seed]
    runs = [rl(*cell, model, args.steps or STEPS[cell[0]], args.reuse, args.timeout) for cell in cells]
    if not runs:
        return
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        groups.setdefault((run["task"], run["credit"], run["path"]), []).append(run)
    command = "python " + shlex.join(["bench/agentic_learning.py", *sys.argv[1:]])
    total = tuned["wall_s"] + sum(r["wall_s"] for r in runs)
    head = ["task", "credit", "path", "seeds", "held-out accuracy, SFT model", "after RL (last eval's step)",
            f"gain (target >= {TARGET} on every seed)", "decision, greedy: SFT → RL",
            "decision, sampled: step 1 → last 5 steps", "calls / turns per rollout (greedy): SFT → RL",
            "tool-off control after RL", "wall per run"]
    body = "\n".join([
        "## Agentic learning: RL teaches decisions (choice, chain, recovery) over seeds", "", header(),
        f"- work: one SFT run (`+experiment=decision_sft`, {args.sft_steps} steps, "
        f"{tuned['wall_s']:.0f} s), then {len(runs)} RL runs of {args.steps or STEPS} steps from its export "
        f"(`+experiment=decision_TASK`); decision metrics: choice `info/right_tool`, chain `info/chained`, "
        "recovery `info/retried`; values are the mean (min–max) over seeds",
        f"- command: `{command}`; wall of all runs: {total / 60:.0f} min; 1-minute load average at each "
        f"RL run's start: {', '.join(str(round(r['load'])) for r in runs)}", "",
        table(head, [summary(g) for g in groups.values()]), "", "![agentic learning](agentic_learning.png)"])
    if not args.no_results:
        draw(groups, BENCH / "agentic_learning.png")
    finish(args, "agentic_learning", body)


if __name__ == "__main__":
    main()
