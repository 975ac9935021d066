r"""vLLM's engine core in a child process (`AsyncLLM`, what Molt's engine actor ran until 2026-12-02) against
the same core in-process (`LLMEngine` with `VLLM_ENABLE_V1_MULTIPROCESSING=0`, stepped by its caller, what it
runs now): plain vLLM, without Molt's actor around it (issue 15's start-up and tiny-scale targets,
bench/RESULTS.md `targets`).

Each run is a fresh process: start-up is from the process's start to a built engine (the imports included),
CPU the process's and its waited children's user + system seconds, then `--rounds` rounds of `--requests`
seeded requests of `--tokens` tokens at once on the tiny model (the first round untimed). Modes alternate.
A third mode builds the in-process engine on the main thread and steps it on another: OpenMP keeps a team
per computing thread, and at more than one thread the stepping thread's workers then sleep between
parallel regions (why Molt's engine thread builds its engine itself). `--profile` runs the in-process mode
once under cProfile and prints how an engine step splits: model forward, input preparation, sampler,
scheduler, output processing (the tiny target: how much of a step is vLLM's own per-step work).

    python bench/engine_modes.py --quick
    python bench/engine_modes.py --repeats 3 --modes child,inproc
    python bench/engine_modes.py --quick --size 30m --tokens 128 --threads 2 \
        --modes inproc,inproc_other_thread
    python bench/engine_modes.py --profile --tokens 128 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

START = time.time()   # a run's start-up clock: the script's first lines, before any import of Molt or vLLM

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import fmt_spread, header, table, write_section  # noqa: E402

# AsyncLLM (the core in a child process) / LLMEngine (the core in-process), built and stepped on one thread /
# LLMEngine built on the main thread and stepped on another (what Molt's engine thread must avoid)
MODES = ("child", "inproc", "inproc_other_thread")
# --profile: vLLM 0.32 functions (file, name) whose cumulative time splits an in-process engine's step
PARTS = {"engine step": ("llm_engine.py", "step"), "model forward": ("gpu_model_runner.py", "_model_forward"),
         "input preparation": ("gpu_model_runner.py", "_prepare_inputs"),
         "sampler": ("gpu_model_runner.py", "sample_tokens"), "scheduler": ("scheduler.py", "schedule"),
         "scheduler update": ("scheduler.py", "update_from_output"),
         "output processing": ("output_processor.py", "process_outputs")}


def engine_args(path: str) -> dict:
    """The tiny model as Molt's CPU engine runs it (molt/rollout/engine_args.py: eager, no chunked
    prefill)."""
    return dict(model=path, dtype="float32", max_model_len=1024, enforce_eager=True, seed=0,
                kv_cache_memory_bytes=2**28, enable_chunked_prefill=False, distributed_executor_backend="uni")


def parts(profiler: cProfile.Profile) -> dict[str, float]:
    """Cumulative seconds of each of `PARTS` (cProfile's own cost inflates the Python-heavy ones)."""
    stats = pstats.Stats(profiler).stats   # (file, line, name) -> (calls, ..., total, cumulative, callers)
    return {part: sum(v[3] for (path, _, name), v in stats.items() if path.endswith(file) and name == fn)
            for part, (file, fn) in PARTS.items()}


def child(mode: str, requests: int, tokens: int, rounds: int, start: float, size: str,
          profile: bool = False) -> dict:
    """One run in this process: start-up seconds, then seconds per round of `requests` at once."""
    from common import SIZES
    from vllm import AsyncEngineArgs, EngineArgs, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    from molt.inputs.tiny import tiny_model_path

    prompts = [TokensPrompt(prompt_token_ids=[1, 5 + i % 200, 9, 13]) for i in range(requests)]

    def params(i: int) -> SamplingParams:
        return SamplingParams(max_tokens=tokens, ignore_eos=True, seed=i, logprobs=0, detokenize=False,
                              output_kind=RequestOutputKind.FINAL_ONLY)

    kwargs, seconds = engine_args(str(tiny_model_path(**SIZES[size]))), []
    if mode.startswith("inproc"):
        from vllm.v1.engine.llm_engine import LLMEngine

        engine = LLMEngine.from_engine_args(EngineArgs(**kwargs))
        ready = time.time() - start

        def timed() -> None:
            for r in range(rounds):
                t0 = time.perf_counter()
                for i, p in enumerate(prompts):
                    engine.add_request(f"{r}-{i}", p, params(i))
                while engine.has_unfinished_requests():
                    engine.step()
                seconds.append(time.perf_counter() - t0)
        if mode == "inproc_other_thread":
            stepper = threading.Thread(target=timed)
            stepper.start()
            stepper.join()
        elif profile:
            profiler = cProfile.Profile()
            profiler.runcall(timed)
            return {"ready_s": ready, "round_s": seconds, "parts_s": parts(profiler)}
        else:
            timed()
    else:
        from vllm.v1.engine.async_llm import AsyncLLM

        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
        ready = time.time() - start

        async def one(key: str, prompt: TokensPrompt, i: int) -> None:
            async for _ in engine.generate(prompt, params(i), key):
                pass

        async def timed() -> None:
            for r in range(rounds):
                t0 = time.perf_counter()
                await asyncio.gather(*[one(f"{r}-{i}", p, i) for i, p in enumerate(prompts)])
                seconds.append(time.perf_counter() - t0)
        asyncio.run(timed())
        engine.shutdown()
    return {"ready_s": ready, "round_s": seconds}


def run(mode: str, args: argparse.Namespace) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TORCH_COMPILE_DISABLE="1",
               VLLM_CPU_OMP_THREADS_BIND="nobind",
               **({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if mode.startswith("inproc") else {}))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run([sys.executable, __file__, "--child", mode, "--requests", str(args.requests),
                           "--tokens", str(args.tokens), "--rounds", str(args.rounds), "--size", args.size]
                          + ["--profile"] * args.profile,
                          env=env, capture_output=True, text=True, timeout=900)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        raise RuntimeError(f"{mode} run failed (rc {done.returncode}): {done.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {**json.loads(lines[-1]), "cpu_s": cpu}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3, help="runs per mode, alternating")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=6, help="rounds per run; the first is untimed")
    p.add_argument("--quick", action="store_true", help="one run per mode, 3 rounds; prints only")
    p.add_argument("--size", default="tiny", help="a bench/common.py SIZES model")
    p.add_argument("--threads", type=int, default=1, help="the engine's OpenMP threads")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    p.add_argument("--profile", action="store_true",
                   help="one in-process run under cProfile: where an engine step's time goes (prints only)")
    p.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        out = child(args.child, args.requests, args.tokens, args.rounds, START, args.size, args.profile)
        print(json.dumps(out), flush=True)
        return
    if args.profile:
        got = run("inproc", args)["parts_s"]
        print(f"{args.size} model, {args.threads} thread(s), {args.rounds} rounds of {args.requests} x "
              f"{args.tokens} tokens, under cProfile:")
        print(table(["part of vLLM's engine step", "seconds", "share of the step"],
                    [[part, f"{sec:.2f}", f"{sec / got['engine step']:.2f}"] for part, sec in got.items()]))
        return
    if args.quick:
        args.repeats, args.rounds = 1, 3
    modes = args.modes.split(",")
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    for r in range(args.repeats):
        for mode in modes if r % 2 == 0 else modes[::-1]:
            runs[mode].append(run(mode, args))
            print(f"[engine_modes] r{r} {mode}: {runs[mode][-1]}", flush=True)
    names = {"child": "AsyncLLM, core in a child process (Molt until 2026-12-02)",
             "inproc": "LLMEngine, core in-process (Molt since 2026-12-02)",
             "inproc_other_thread": "LLMEngine, core in-process, stepped on another thread than built on"}
    rows = [[names[mode], fmt_spread([x["ready_s"] for x in got], 1),
             fmt_spread([x["cpu_s"] for x in got], 1),
             fmt_spread([1e3 * statistics.median(x["round_s"][1:]) for x in got], 0)]
            for mode, got in runs.items()]
    about = (f"- work: the {args.size} model at {args.threads} thread(s), {args.requests} seeded requests x "
             f"{args.tokens} tokens at once, "
             f"{args.rounds} rounds per run (first untimed), {args.repeats} run(s) per mode, modes "
             "alternating\n"
             f"- command: `python bench/engine_modes.py {' '.join(sys.argv[1:])}`\n"
             "- median (min–max) over runs; a round's ms is the median of its run's timed rounds")
    head = ["engine", "start-up s (process start → engine built)", "CPU s (process + core)", "ms per round"]
    body = f"## vLLM engine core: child process vs in-process\n\n{header(about)}\n\n{table(head, rows)}"
    if not args.quick:
        write_section("engine_modes", body)
    print(body)


if __name__ == "__main__":
    main()
