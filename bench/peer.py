"""Peer comparison: Molt vs TRL's GRPOTrainer on identical work, interleaved in one run.

Same model folder (molt.inputs.tiny), task and reward (repeat the letter), prompts per step, samples per
prompt, max tokens, learning rate and sampling (temperature 1, no top-k/top-p). For each repeat, size
and length, Molt (`python -m molt`, its own venv) and TRL (bench/trl_peer.py in bench/.venv-trl) run
back to back, alternating which goes first, so machine load drifts over both alike. Each framework runs
at each of its thread settings (TRL: torch threads; Molt: `parallel.cpu_threads`, `null` = the running
stage takes every core) and is compared in its fastest one. Ratios are taken per repeat (Molt/TRL of
adjacent runs), then reported as median (min–max) over repeats. `--dtype bfloat16` runs both in bf16
(Molt `model.dtype=bfloat16`, TRL `bf16=True`) and writes its own section, never mixed with fp32.

    python bench/peer.py --quick                     # smoke: tiny, 16 tokens, 1 repeat, 3 steps
    python bench/peer.py --sizes tiny,30m --lengths 16,128 --skip 30m:16 --repeats 3 --steps tiny=8,30m=3
    python bench/peer.py --report bench/out/peer/STAMP   # rebuild the table and PNG from saved runs
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import (
    BENCH,
    LR,
    OUT,
    fmt_spread,
    header,
    param_count,
    parse_steps,
    summarize,
    table,
    versions,
    write_section,
)
from molt_run import model_path, overrides, run_molt

TRL_PYTHON = BENCH / ".venv-trl" / "bin" / "python"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="tiny,30m,100m", help="comma list of bench/common.py SIZES")
    p.add_argument("--lengths", default="16,128", help="comma list of max response tokens")
    p.add_argument("--skip", default="", help="size:length cells to leave out, e.g. 30m:16,100m:128")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", default="8", help="optimizer steps per run: N, or per size: tiny=8,30m=4")
    p.add_argument("--warmup", type=int, default=2, help="first steps of each run left out of the timings")
    p.add_argument("--prompts-per-step", type=int, default=4)
    p.add_argument("--samples-per-prompt", type=int, default=8)
    p.add_argument("--modes", default="sync", help="Molt rollout.mode(s) to run: sync, async or sync,async")
    p.add_argument("--trl-threads", default="1,2",
                   help="torch thread counts TRL runs with; ratios take TRL's fastest per repeat")
    p.add_argument("--molt-threads", default="1,null",
                   help="parallel.cpu_threads settings Molt runs with; ratios take Molt's fastest per repeat")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="weights/compute dtype of both frameworks (bfloat16: a separate results section)")
    p.add_argument("--molt-extra", default="",
                   help="more Hydra overrides for every Molt run, space-separated (e.g. 'rollout.top_p=1.0')")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    p.add_argument("--out", type=Path, default=None, help="run folder (default bench/out/peer/<stamp>)")
    p.add_argument("--report", type=Path, default=None, help="only rebuild the report from this run folder")
    p.add_argument("--no-results", action="store_true", help="do not write bench/RESULTS.md / bench/peer.png")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny, 16 tokens, 1 repeat, 3 steps")
    args = p.parse_args()
    if args.quick:
        args.sizes, args.lengths, args.repeats, args.steps, args.warmup = "tiny", "16", 1, "3", 1
    return args


def run_trl(model: str, max_tokens: int, steps: int, args: argparse.Namespace, lr: float,
            out: Path, threads: int) -> dict[str, Any]:
    cmd = [str(TRL_PYTHON), str(BENCH / "trl_peer.py"), "--model", model, "--out", str(out),
           "--steps", str(steps), "--warmup", str(args.warmup), "--max-tokens", str(max_tokens),
           "--prompts-per-step", str(args.prompts_per_step), "--samples-per-prompt",
           str(args.samples_per_prompt), "--lr", str(lr), "--threads", str(threads),
           *(["--bf16"] if args.dtype == "bfloat16" else [])]
    start, load = time.perf_counter(), os.getloadavg()[0]
    log = out.with_suffix(".log")
    with log.open("w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    if rc or not out.exists():
        return {"rc": rc or 1, "log": log.read_text()[-3000:], "wall_s": time.perf_counter() - start}
    return {"rc": 0, "load": load, **json.loads(out.read_text())}


def run_all(args: argparse.Namespace, folder: Path) -> None:
    sizes, lengths = args.sizes.split(","), [int(x) for x in args.lengths.split(",")]
    skip = set(filter(None, args.skip.split(",")))
    steps = parse_steps(args.steps, sizes)
    paths = {s: model_path(s) for s in sizes}
    meta = {"args": {k: str(v) for k, v in vars(args).items()}, "models": paths,
            "command": " ".join(["python bench/peer.py", *sys.argv[1:]]),
            "params": {s: param_count(p) for s, p in paths.items()},
            "molt_versions": versions(), "trl_versions": versions(TRL_PYTHON), "header": header()}
    (folder / "meta.json").write_text(json.dumps(meta, indent=1))
    modes = args.modes.split(",")
    for r in range(args.repeats):
        for size in sizes:
            for length in [n for n in lengths if f"{size}:{n}" not in skip]:
                jobs = ([("molt", (m, t)) for m in modes for t in args.molt_threads.split(",")]
                        + [("trl", t) for t in args.trl_threads.split(",")])
                for fw, setting in jobs if r % 2 == 0 else jobs[::-1]:  # alternate who goes first
                    if fw == "trl":
                        name = f"trl{setting}-{size}-{length}-r{r}"
                        result = run_trl(paths[size], length, steps[size], args, LR[size],
                                         folder / f"{name}.json", int(setting))
                    else:
                        mode, threads = setting
                        name = f"molt{threads}-{size}-{length}-{mode}-r{r}"
                        extra = [f"rollout.mode={mode}", f"run.name=peer-{name}", f"model.dtype={args.dtype}",
                                 f"parallel.cpu_threads={threads}", *args.molt_extra.split()]
                        result = run_molt(overrides(size, length, steps[size], args.prompts_per_step,
                                                    args.samples_per_prompt, extra=extra),
                                          folder / name, args.timeout)
                        if result["steps"]:
                            result["summary"] = summarize(result["steps"], args.warmup)
                    (folder / f"{name}.json").write_text(json.dumps(result, indent=1))
                    status = "ok" if result["rc"] == 0 else f"FAILED rc={result['rc']}"
                    line = result.get("summary", {})
                    print(f"[peer] {name}: {status} step_s={line.get('step_s', float('nan')):.3g} "
                          f"trained_tok_s={line.get('trained_tok_s', float('nan')):.4g}", flush=True)


def load(folder: Path) -> tuple[dict, dict[tuple, dict]]:
    runs = {}
    for path in folder.glob("*.json"):
        if path.name == "meta.json":
            continue
        parts = path.stem.split("-")
        data = json.loads(path.read_text())
        if data.get("rc") == 0 and "summary" in data:
            runs[tuple(parts)] = data
    return json.loads((folder / "meta.json").read_text()), runs


def compare(pairs: list[tuple[dict, dict]]) -> tuple[list[str], list[float], list[float]]:
    """Table cells for (Molt, TRL) run pairs of one size/length/mode, and the per-repeat ratios."""
    ms, ts = [m["summary"] for m, _ in pairs], [t["summary"] for _, t in pairs]

    def ratios(key: str) -> list[float]:
        return [m[key] / t[key] for m, t in zip(ms, ts, strict=True)]

    def both(key: str, fmt: str = ".3g") -> str:  # median Molt / median TRL
        return " / ".join(format(statistics.median(x.get(key, float("nan")) for x in side), fmt)
                          for side in (ms, ts))

    step_ratio, trained = ratios("step_s"), ratios("trained_tok_s")
    cells = [both("step_s"), both("generate_s"), fmt_spread(step_ratio), fmt_spread(trained),
             fmt_spread(ratios("sampled_tok_s")), both("trained_tok_s", ".4g"),
             f"{both('reward_first', '.3f')} → {both('reward_last', '.3f')}",
             f"{len(pairs)}; setup {statistics.median(m['setup_s'] for m, _ in pairs):.0f} s / "
             f"{statistics.median(t['setup_s'] for _, t in pairs):.0f} s; load "
             f"{statistics.median(x.get('load', float('nan')) for p in pairs for x in p):.1f}"]
    return cells, step_ratio, trained


def framework_runs(runs: dict[tuple, dict], fw: str, cell: tuple[str, ...]) -> dict[str, dict]:
    """One framework's runs of one cell and repeat by thread setting (folders from before thread
    variants: 1 thread)."""
    return {key[0][len(fw):] or "1": run for key, run in runs.items()
            if key[0].startswith(fw) and key[1:] == cell}


def fastest(runs: dict[str, dict]) -> dict:
    return min(runs.values(), key=lambda t: t["summary"]["step_s"])


def by_setting(steps: dict[str, list[float]]) -> str:
    return " / ".join(f"{statistics.median(v):.3g} ({t})" for t, v in sorted(steps.items()))


def report(folder: Path, write_results: bool) -> str:
    meta, runs = load(folder)
    a = meta["args"]
    sizes, lengths, modes = a["sizes"].split(","), a["lengths"].split(","), a["modes"].split(",")
    rows, plot = [], []
    skip = set(filter(None, a.get("skip", "").split(",")))
    for size in sizes:
        for length in [n for n in lengths if f"{size}:{n}" not in skip]:
            for mode in modes:
                pairs, steps = [], {"molt": {}, "trl": {}}
                for r in range(int(a["repeats"])):
                    found = {"molt": framework_runs(runs, "molt", (size, length, mode, f"r{r}")),
                             "trl": framework_runs(runs, "trl", (size, length, f"r{r}"))}
                    for fw, by in found.items():
                        for threads, run in by.items():
                            steps[fw].setdefault(threads, []).append(run["summary"]["step_s"])
                    if found["molt"] and found["trl"]:   # each in its fastest setting of this repeat
                        pairs.append((fastest(found["molt"]), fastest(found["trl"])))
                if not pairs:
                    rows.append([size, length, mode, "—", "—", "—", "—", "—", "—", "—", "—",
                                 "no complete pair"])
                    continue
                row, step_ratio, trained = compare(pairs)
                rows.append([f"{size} ({meta['params'][size] / 1e6:.1f}M)", length, mode,
                             by_setting(steps["molt"]), by_setting(steps["trl"]), *row])
                plot.append((f"{size}\n{length} tok\n{mode}", step_ratio, trained))
    head = ["model", "max tokens", "Molt mode", "Molt step s (cpu_threads)", "TRL step s (threads)",
            "step s best Molt / best TRL",
            "generate s Molt / TRL",
            "step time ratio Molt/TRL", "trained tok/s ratio", "sampled tok/s ratio",
            "trained tok/s Molt / TRL",
            "reward first (Molt / TRL) → last", "repeats; setup Molt / TRL; 1-min load"]
    bf16 = a.get("dtype", "float32") == "bfloat16"
    name = "peer_bf16" if bf16 else "peer"
    body = "\n".join([
        f"## Peer comparison: Molt vs TRL GRPOTrainer{', bf16' if bf16 else ''}", "",
        meta["header"], f"- TRL env: {meta['trl_versions']}",
        f"- work per step: {a['prompts_per_step']} prompts x {a['samples_per_prompt']} samples, GRPO, "
        f"steps per run {a['steps']} (first {a['warmup']} untimed), lr per size {LR}, "
        f"dtype {a.get('dtype', 'float32')}",
        f"- command: `{meta.get('command', 'python bench/peer.py')}`",
        "- ratios: per repeat (adjacent runs), each framework in its fastest thread setting of that repeat, "
        "median (min–max); step time < 1 and tok/s > 1 favour Molt. Molt's extra overrides: "
        f"`{a.get('molt_extra') or 'none'}`.",
        "",
        table(head, rows), "", f"![{name}]({name}.png)",
    ])
    if write_results:
        write_section(name, body)
        draw(plot, BENCH / f"{name}.png")
    print(body)
    return body


def draw(plot: list[tuple[str, list[float], list[float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not plot:
        return
    fig, axes = plt.subplots(1, 2, figsize=(max(6, 1.6 * len(plot)) * 1.6, 4))
    for ax, idx, title in ((axes[0], 1, "step time Molt/TRL (lower is better)"),
                           (axes[1], 2, "trained tokens/s Molt/TRL (higher is better)")):
        meds = [statistics.median(p[idx]) for p in plot]
        err = [[m - min(p[idx]) for m, p in zip(meds, plot, strict=True)],
               [max(p[idx]) - m for m, p in zip(meds, plot, strict=True)]]
        ax.bar(range(len(plot)), meds, yerr=err, capsize=4, color="#4c72b0")
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks(range(len(plot)), [p[0] for p in plot], fontsize=8)
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    args = parse_args()
    if args.report:
        report(args.report, not args.no_results)
        return
    if not TRL_PYTHON.exists():
        sys.exit("bench/.venv-trl is missing: run `bash bench/setup_trl.sh` first")
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
    folder = args.out or OUT / "peer" / stamp
    folder.mkdir(parents=True, exist_ok=True)
    print(f"[peer] runs in {folder}", flush=True)
    run_all(args, folder)
    report(folder, not args.no_results and not args.quick)


if __name__ == "__main__":
    main()
