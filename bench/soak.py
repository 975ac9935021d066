"""Soak: the default experiment on 2 engines for many steps while faults are injected, vs an undisturbed run.

    python bench/soak.py                 # 1000 steps each (the default)
    python bench/soak.py --steps 200     # what fits a busy 2-core machine

Both runs use the default experiment with `rollout.engine.num_engines=2`, checkpoints every `--save-every`
steps, and the faulty agent (examples/agents/faulty.py: the repeat task, reward 1 when the reply holds the
letter) on a copy of the training set in which 1 row in 32 makes the agent crash: agent crashes happen
throughout both runs. Into the disturbed run the injector, watching its metrics.jsonl, does in order:
SIGKILL one engine actor, vLLM's engine core with it (at 20% of the steps), SIGKILL a trainer rank
(40%), SIGKILL an engine actor again (55%), SIGKILL the driver and every process it started (70%, a lost
node), then runs the same command again with `run.resume=auto`. Writes the `soak` section of
bench/RESULTS.md and bench/soak.png (reward of both runs, driver RSS and open fds over time).

"Rollouts lost" is checked where it can be exact: the run is sync, so every step trains exactly
`train.prompts_per_step` prompt groups; the final checkpoint's data position must then equal steps x
prompts_per_step (a prompt trained twice or dropped moves it), and every step's batch must hold all its
rollouts (`rollout/count`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from common import OUT, REPO, header, table, write_section
from molt_run import QUIET

PROMPTS, SAMPLES = 8, 8


def faulty_dataset(out: Path) -> Path:
    """The training set with `fault: raise` on every 32nd row (the agent raises on it)."""
    rows = [json.loads(line) for line in (REPO / "examples/data/repeat_train.jsonl").read_text().splitlines()]
    for i, row in enumerate(rows):
        if i % 32 == 31:
            row["fault"] = "raise"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = []
        for task in Path(f"/proc/{p}/task").glob("*"):   # children of every thread (Ray spawns from threads)
            try:
                kids += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
        out += kids
        todo += kids
    return out


def named(pid: int, prefix: bytes) -> list[int]:
    found = []
    for p in descendants(pid):
        try:
            if Path(f"/proc/{p}/cmdline").read_bytes().startswith(prefix):
                found.append(p)
        except OSError:
            pass
    return found


def last_step(metrics: Path) -> int:
    if not metrics.exists():
        return 0
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines() if line.endswith("}")]
    return max(steps, default=0)


class Watch:
    """Samples the driver's RSS and open fds every 2 s; runs the fault plan against the current part."""

    def __init__(self, plan: list[tuple[int, str]]) -> None:
        self.plan, self.samples, self.done = list(plan), [], []
        self.proc: subprocess.Popen | None = None
        self.metrics: Path | None = None
        self.t0 = time.time()

    def loop(self, stop: threading.Event) -> None:
        while not stop.wait(2.0):
            proc = self.proc
            if proc is None or proc.poll() is not None:
                continue
            try:
                rss = int(next(x for x in Path(f"/proc/{proc.pid}/status").read_text().splitlines()
                               if x.startswith("VmRSS")).split()[1]) / 1024
                fds = len(os.listdir(f"/proc/{proc.pid}/fd"))
            except (OSError, StopIteration):
                continue
            step = last_step(self.metrics)
            self.samples.append((time.time() - self.t0, step, rss, fds))
            if self.plan and step >= self.plan[0][0]:
                self.inject(self.plan.pop(0), proc)

    def inject(self, fault: tuple[int, str], proc: subprocess.Popen) -> None:
        at, kind = fault
        targets = {"trainer_rank": b"ray::TrainerWorker", "engine_actor": b"ray::EngineActor"}
        if kind == "driver":
            victims = [proc.pid, *descendants(proc.pid)]
        else:
            victims = named(proc.pid, targets[kind])[:1]
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        self.done.append((at, kind, last_step(self.metrics), len(victims)))
        print(f"soak: killed {kind} ({len(victims)} process(es)) at step {self.done[-1][2]}", flush=True)


def run_part(args: list[str], run_dir: Path, watch: Watch | None) -> int:
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    with (run_dir / "molt.log").open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "molt", *args, f"hydra.run.dir={run_dir}"], cwd=REPO,
                                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        if watch:
            watch.proc, watch.metrics = proc, run_dir / "metrics.jsonl"
        return proc.wait()


def rows_of(run_dirs: list[Path]) -> dict[int, dict]:
    """step → the last record of it over the parts (a redone step's last record wins)."""
    rows: dict[int, dict] = {}
    for d in run_dirs:
        for line in (d / "metrics.jsonl").read_text().splitlines() if (d / "metrics.jsonl").exists() else []:
            if line.endswith("}"):
                r = json.loads(line)
                rows[r["step"]] = r
    return dict(sorted(rows.items()))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--save-every", type=int, default=20)
    parser.add_argument("--reuse-baseline", action="store_true", help="keep the undisturbed run of last time")
    a = parser.parse_args()
    root = OUT / "soak"
    for old in [root / "disturbed"] if a.reuse_baseline else [root]:
        subprocess.run(["rm", "-rf", str(old)], check=True)
    root.mkdir(parents=True, exist_ok=True)
    data = faulty_dataset(root / "train_faulty.jsonl")
    common = ["rollout.engine.num_engines=2", f"train.steps={a.steps}", f"train.save_every={a.save_every}",
              "agent.module=examples/agents/faulty.py", f"data.train_path={data}", "run.resume=auto",
              f"train.prompts_per_step={PROMPTS}", f"rollout.samples_per_prompt={SAMPLES}", *QUIET]
    t0, base = time.time(), root / "undisturbed" / "part0"
    rc_base = 0 if a.reuse_baseline else run_part(common + ["run.name=soak_undisturbed"], base, None)
    base_s = time.time() - t0 if not a.reuse_baseline else float((base / "wall_s").read_text())
    (base / "wall_s").write_text(f"{base_s:.0f}")

    plan = [(int(a.steps * f), kind) for f, kind in ((0.2, "engine_actor"), (0.4, "trainer_rank"),
                                                     (0.55, "engine_actor"), (0.7, "driver"))]
    watch, stop = Watch(plan), threading.Event()
    sampler = threading.Thread(target=watch.loop, args=(stop,), daemon=True)
    sampler.start()
    parts, rcs, t0 = [], [], time.time()
    for k in range(3):   # the driver is killed once: part 1 continues with run.resume=auto
        parts.append(root / "disturbed" / f"part{k}")
        rcs.append(run_part(common + ["run.name=soak_disturbed"], parts[-1], watch))
        if rcs[-1] == 0:
            break
    stop.set()
    sampler.join()
    report(a, root, parts, rcs, rc_base, watch, time.time() - t0, base_s, data)


def report(a: argparse.Namespace, root: Path, parts: list[Path], rcs: list[int], rc_base: int, watch: Watch,
           seconds: float, base_s: float, data: Path) -> None:
    base, hit = rows_of([root / "undisturbed" / "part0"]), rows_of(parts)
    logs = "".join((p / "molt.log").read_text() for p in parts)
    final = parts[-1] / "checkpoints"
    meta = json.loads((final / (final / "latest").read_text().strip() / "meta.json").read_text()) \
        if (final / "latest").exists() else {}
    rows_per_epoch = len(data.read_text().splitlines())
    position = meta.get("data", {}).get("index", -1) + rows_per_epoch * meta.get("data", {}).get("epoch", 0)
    incomplete = [s for s, r in hit.items() if r.get("rollout/count") != PROMPTS * SAMPLES]
    parts_last = [rows_of([p]) for p in parts]
    engine_restarts = sum(max((r.get("engine/restarts", 0) for r in rows.values()), default=0)
                          for rows in parts_last)
    trainer_restarts = sum(max((r.get("trainer/restarts", 0) for r in rows.values()), default=0)
                           for rows in parts_last)
    requeued = 0.0   # the pool's counter is cumulative, and a new pool (after a restart) starts at 0
    for rows in parts_last:
        counts = [r.get("pool/engine_requeued", 0.0) for r in rows.values()]
        requeued += sum(b - a if b >= a else b for a, b in zip([0.0, *counts], counts, strict=False))
    failed = sum(r.get("rollout/failed", 0) for r in hit.values())

    def mean_reward(rows: dict[int, dict], lo: float, hi: float) -> float:
        picked = [r["reward/mean"] for s, r in rows.items() if lo * a.steps < s <= hi * a.steps]
        return sum(picked) / max(len(picked), 1)

    rss = [s[2] for s in watch.samples]
    fds = [s[3] for s in watch.samples]
    half = len(watch.samples) // 2
    body = "\n".join([
        "## Soak: faults injected into a long run (`bench/soak.py`)", "", header(), "",
        f"Command: `python bench/soak.py --steps {a.steps} --save-every {a.save_every}`. The default "
        f"experiment (tiny model, repeat data, GRPO, sync) with 2 engines, {PROMPTS} prompts x {SAMPLES} "
        "samples a step, the faulty agent (1 row in 32 crashes it) in both runs.", "",
        table(["", "undisturbed", "disturbed"], [
            ["exit codes", rc_base, " / ".join(map(str, rcs)) + " (parts; the driver was SIGKILLed once)"],
            ["steps completed", max(base, default=0), max(hit, default=0)],
            ["wall (s)", f"{base_s:.0f}", f"{seconds:.0f}"],
            ["faults injected (at step)", "-", ", ".join(f"{k} ({s})" for _, k, s, _ in watch.done)],
            ["engine restarts", "-", f"{engine_restarts:.0f}"],
            ["trainer restarts", "-", f"{trainer_restarts:.0f}"],
            ["driver restarts (run.resume=auto)", "-", len(parts) - 1],
            ["groups restarted whole after an engine death", "-", f"{requeued:.0f}"],
            ["rollouts failed by the agent (crashes, not trained)", "-", f"{failed:.0f}"],
            ["steps whose batch missed rollouts", "-", len(incomplete)],
            ["final data position vs steps x prompts", "-",
             f"{position} vs {max(hit, default=0) * PROMPTS}"],
            ["reward, first 20% / last 20% of steps",
             f"{mean_reward(base, 0, .2):.3f} / {mean_reward(base, .8, 1):.3f}",
             f"{mean_reward(hit, 0, .2):.3f} / {mean_reward(hit, .8, 1):.3f}"],
            ["driver RSS MiB, first half max / second half max of the samples", "-",
             f"{max(rss[:half], default=0):.0f} / {max(rss[half:], default=0):.0f}"],
            ["driver open fds, first half max / second half max", "-",
             f"{max(fds[:half], default=0)} / {max(fds[half:], default=0)}"],
        ]), "",
        f"Engine and trainer messages of the disturbed run: {logs.count('molt: engine')} engine lines, "
        f"{logs.count('a trainer rank died')} trainer restarts logged.", "",
        "![soak](soak.png)"])
    write_section("soak", body)
    plot(base, hit, watch, Path(__file__).with_name("soak.png"))
    print(body)


def plot(base: dict[int, dict], hit: dict[int, dict], watch: Watch, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4))
    FigureCanvasAgg(fig)
    ax1, ax2, ax3 = fig.subplots(1, 3)
    for rows, label in ((base, "undisturbed"), (hit, "disturbed")):
        steps = list(rows)
        rewards = [rows[s]["reward/mean"] for s in steps]
        smooth = [sum(rewards[max(0, i - 19):i + 1]) / len(rewards[max(0, i - 19):i + 1])
                  for i in range(len(rewards))]
        ax1.plot(steps, smooth, label=label)
    for _, kind, step, _ in watch.done:
        ax1.axvline(step, color="grey", lw=0.5)
        ax1.text(step, 0.02, kind, rotation=90, fontsize=7)
    ax1.set(xlabel="step", ylabel="reward (20-step mean)")
    ax1.legend()
    t = [s[0] for s in watch.samples]
    ax2.plot(t, [s[2] for s in watch.samples])
    ax2.set(xlabel="seconds", ylabel="driver RSS (MiB)")
    ax3.plot(t, [s[3] for s in watch.samples])
    ax3.set(xlabel="seconds", ylabel="driver open fds")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    main()
