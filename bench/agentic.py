"""Agentic path: what the loopback chat server adds per turn, against the same turns through `Env`.

N concurrent multi-turn rollouts run the same conversation three times, in one process: through `Env`
(the framework samples, renders and decodes) and as a `ChatAgent` talking to the loopback server with the
stock OpenAI SDK (HTTP, wire validation, history re-encoding, reply parsing), once with an SDK client
each rollout builds for itself and once with `http_client=ctx.http_client` (the runner's TLS context).
All three sample from the same stand-in engine: it answers every request after a fixed delay with the
same tokens, so the engine's own speed and noise drop out and the difference per turn is the server
path's cost. A turn's latency is, for the chat agent, the SDK call; for `Env`, from the previous
`step()`'s return (or the rollout's start) to the next `step()` call. Each path runs first in one repeat
of three. With every session in one process, a turn's latency is mostly its wait behind the other
sessions' Python work, so the work itself is reported too: the run's wall time per turn (all sessions'
turns), whose chat − Env difference is what the chat path (the agent's SDK client and the server) costs
each turn in CPU, and the process's CPU seconds per turn, which a loaded host does not inflate.

    python bench/agentic.py --quick
    python bench/agentic.py --sessions 256 --turns 4 --delay-ms 20 --repeats 3
    python bench/agentic.py --workers 1,2 --sessions 256 --turns 4 --delay-ms 20 --repeats 3
    python bench/agentic.py --profile --sessions 64 --turns 8
    python bench/agentic.py --workers 1,2 --delay-ms 20,500,2000 --sessions 256 --turns 4 --repeats 1
    python bench/agentic.py --paper

`--workers 1,2` runs the lent-client chat path in agent workers instead (`agent.workers`, one count after
another; bench/agentic_workers.py), into its own section `agentic_workers`; there `--delay-ms` may list
several answer times (each with every worker count), to see where the workers' CPU stops being the queue.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import header, table, write_section  # noqa: E402


class StandInEngine:
    """A sampler answering every request after `delay` seconds with `reply` (ids) and logprob -1."""

    def __init__(self, reply: list[int], delay: float) -> None:
        self.reply, self.delay = reply, delay

    async def generate(self, prompt_ids: list[int], sampling: dict, key: str,
                       images: list | None = None) -> dict:
        await asyncio.sleep(self.delay)
        n = len(self.reply)
        return {"token_ids": list(self.reply), "logprobs": [-1.0] * n, "versions": [0] * n,
                "finish_reason": "stop", "prompt_ids": list(prompt_ids),
                "sampling": [sampling.get("temperature", 1.0), sampling.get("top_p", 1.0),
                             sampling.get("top_k", -1)]}


# chat: each rollout builds its own SDK client; chat_lent: it passes ctx.http_client
PATHS = ("env", "chat", "chat_lent")


def runners(turns: int, latencies: dict[str, list[float]]) -> dict:
    """{path: runner} doing `turns` turns each and appending per-turn seconds to `latencies[path]`."""
    import openai

    from molt.agents import ChatAgent, ChatAgentRunner, ChatContext, Env, Result, State, StepEnvRunner

    class TurnsEnv(Env):
        async def step(self, state: State) -> Result:
            latencies["env"].append(time.perf_counter() - getattr(self, "since", state.item["start"]))
            done = state.turn + 1 >= turns
            result = Result(reward=0.0, observation=None if done else "again", terminated=done)
            self.since = time.perf_counter()
            return result

    class TurnsChat(ChatAgent):
        path = "chat"

        async def run(self, ctx: ChatContext) -> Result:
            lent = {"http_client": ctx.http_client} if self.path == "chat_lent" else {}
            client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0, **lent)
            messages = list(ctx.messages)
            for _ in range(turns):
                t0 = time.perf_counter()
                reply = await client.chat.completions.create(model=ctx.model_name, messages=messages)
                latencies[self.path].append(time.perf_counter() - t0)
                messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                             {"role": "user", "content": "again"}]
            await client.close()
            return Result(reward=0.0)

    class TimedEnvRunner(StepEnvRunner):
        async def _run(self, item, *rest):
            # the first turn counts from here, before the prompt is rendered (as the chat path's first call);
            # the rest of the arguments pass through whole, so this stand-in follows StepEnvRunner's
            return await super()._run({**item, "start": time.perf_counter()}, *rest)

    class TurnsChatLent(TurnsChat):
        path = "chat_lent"

    return {"env": TimedEnvRunner(TurnsEnv), "chat": ChatAgentRunner(TurnsChat),
            "chat_lent": ChatAgentRunner(TurnsChatLent)}


async def run_path(runner, engine: StandInEngine, sessions: int) -> list:
    rollouts = await asyncio.gather(*[runner.run({"prompt": "a", "label": "a"}, f"r{i}", f"g{i}", engine)
                                      for i in range(sessions)])
    failed = [r.error for r in rollouts if r.error]
    if failed:
        raise RuntimeError(f"{len(failed)} rollouts failed, e.g. {failed[0]}")
    return rollouts


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=256, help="concurrent rollouts")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--delay-ms", default="20", help="the stand-in engine's answer time; with --workers a "
                   "comma-separated list (e.g. 20,500,2000) runs each")
    p.add_argument("--reply-tokens", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="16 sessions, 2 turns, 1 repeat; prints only")
    p.add_argument("--tools", action="store_true", help="the stand-in engine replies with a tool call every "
                   "turn and the agent answers it (--workers only)")
    p.add_argument("--paper", action="store_true", help="the paper's shape: --workers 1,2 --sessions 1024 "
                   "--turns 8 --tools --repeats 1, into its own section `agentic_paper`")
    p.add_argument("--profile", action="store_true", help="the lent-client chat path's CPU per turn by "
                   "thread and by stage of the server (bench/agentic_profile.py); prints only")
    p.add_argument("--workers", default="", help="comma-separated agent.workers counts (e.g. 1,2): the chat "
                   "path in agent workers, each count in turn (bench/agentic_workers.py)")
    args = p.parse_args()
    if args.paper:
        args.workers, args.sessions, args.turns, args.tools, args.repeats = "1,2", 1024, 8, True, 1
    if args.quick:
        args.sessions, args.turns, args.repeats = 16, 2, 1
    if args.tools and not args.workers:
        p.error("--tools runs with --workers")
    args.delays = [float(d) for d in args.delay_ms.split(",")]
    if len(args.delays) > 1 and not args.workers:
        p.error("several --delay-ms values run with --workers")
    return args


def main() -> None:
    args = parse_args()
    from transformers import AutoTokenizer

    from molt.driver.compose import compose
    from molt.inputs.tiny import tiny_model_path

    path = str(tiny_model_path())
    tok = AutoTokenizer.from_pretrained(path)
    text = "b" * args.reply_tokens
    if args.tools:
        from agentic_agent import CALL as text

        args.reply_tokens = len(tok.encode(text, add_special_tokens=False)) + 1
    spec = compose([f"agent.max_turns={args.turns}", "agent.max_total_tokens=4096",
                    "model.max_model_len=4096", f"rollout.max_tokens={args.reply_tokens}"])
    reply = tok.encode(text, add_special_tokens=False)[:args.reply_tokens - 1] + [tok.eos_token_id]
    if args.workers:
        return workers_axis(args, reply, path)
    engine = StandInEngine(reply, args.delays[0] / 1000)
    if args.profile:
        from agentic_profile import profile

        lent = lambda: runners(args.turns, {p: [] for p in PATHS})["chat_lent"]  # noqa: E731
        return print(profile(lent, engine, tok, spec, args.sessions, args.turns, run_path))
    latencies: dict[str, list[float]] = {path: [] for path in PATHS}
    runner_of = runners(args.turns, latencies)
    # walls / cpus: a run's wall / process CPU seconds per turn (CPU: what a loaded host does not inflate)
    medians, p99, walls, cpus = ({path: [] for path in PATHS} for _ in range(4))

    async def measure() -> None:
        for runner in runner_of.values():
            runner.setup(tok, spec)
            await run_path(runner, engine, min(16, args.sessions))   # warm-up: imports, first connections
        for r in range(args.repeats):
            for name in PATHS[r % 3:] + PATHS[:r % 3]:   # each path goes first once in three repeats
                latencies[name].clear()
                start, cpu = time.perf_counter(), time.process_time()
                await run_path(runner_of[name], engine, args.sessions)
                walls[name].append((time.perf_counter() - start) / (args.sessions * args.turns))
                cpus[name].append((time.process_time() - cpu) / (args.sessions * args.turns))
                medians[name].append(statistics.median(latencies[name]))
                p99[name].append(percentile(latencies[name], 0.99))
                print(f"[agentic] r{r} {name}: median {medians[name][-1] * 1e3:.1f} ms, p99 "
                      f"{p99[name][-1] * 1e3:.1f} ms over {len(latencies[name])} turns, CPU per turn "
                      f"{cpus[name][-1] * 1e3:.3f} ms", flush=True)
        for runner in runner_of.values():
            runner.close()

    asyncio.run(measure())
    ms = lambda x: f"{statistics.median(x) * 1e3:.1f} ({min(x) * 1e3:.1f}–{max(x) * 1e3:.1f})"  # noqa: E731
    rows = [[label, *(ms(d[p]) for p in PATHS),
             *(ms([c - e for c, e in zip(d[p], d["env"], strict=True)]) for p in PATHS[1:]), target]
            for label, d, target in [("median", medians, "≤ 2 ms"), ("p99", p99, "≤ 10 ms"),
                                     ("run wall / turns (work per turn)", walls, "—"),
                                     ("run CPU / turns (process CPU per turn)", cpus, "—")]]
    command = "python " + " ".join(["bench/agentic.py", *sys.argv[1:]])
    body = "\n".join([
        "## Agentic path: loopback server vs Env", "", header(),
        f"- work: {args.sessions} concurrent rollouts x {args.turns} turns, a stand-in engine answering "
        f"{args.reply_tokens} tokens after {args.delays[0]:g} ms; {args.repeats} repeat(s), each path first "
        "in turn",
        f"- command: `{command}`",
        "- ms per turn, median over repeats (min–max); added = chat − Env per repeat. chat: each rollout"
        " builds its own `AsyncOpenAI` client; lent: it passes `http_client=ctx.http_client`",
        "", table(["per turn", "Env", "chat (OpenAI SDK → server)", "chat, lent client", "added: chat",
                   "added: lent client", "target"], rows)])
    if not args.quick:
        write_section("agentic", body)
    print(body)


TOOL_REPLY = " (a tool call, which the agent answers with a tool message)"


def workers_axis(args: argparse.Namespace, reply: list[int], path: str) -> None:
    from agentic_workers import run_axis

    counts = [int(n) for n in args.workers.split(",")]
    head, rows = run_axis(counts, args.sessions, args.turns, args.delays, reply, path, args.repeats,
                          args.tools)
    command = "python " + " ".join(["bench/agentic.py", *sys.argv[1:]])
    body = "\n".join([
        "## Agentic path at the paper's shape, in agent workers" if args.paper else
        "## Agentic path in agent workers (`agent.workers`)", "", header(),
        f"- work: {args.sessions} concurrent chat rollouts (groups of 8) x {args.turns} turns through the "
        f"stock OpenAI SDK (lent client), a stand-in engine actor answering {args.reply_tokens} tokens after "
        f"{args.delay_ms} ms{TOOL_REPLY if args.tools else ''}; {args.repeats} repeat(s) per worker count "
        "and delay",
        f"- command: `{command}`",
        "- ms, median over repeats (min–max); added = the SDK call's latency − the stand-in's delay; CPU per "
        "turn from each process's user + system seconds over the measured runs",
        "", table(head, rows)])
    if not args.quick:
        write_section("agentic_paper" if args.paper else "agentic_workers", body)
    print(body)


if __name__ == "__main__":
    main()
