"""`bench/agentic.py --profile`: where a chat turn's CPU goes, split by stage.

The lent-client chat path of `agentic.py` (stock OpenAI SDK → loopback server → stand-in engine), all in
one process as an agent worker runs it. Two runs of the same sessions: the first without a profiler, for
each thread's CPU per turn (the agent's event loop: the SDK client, the runner, the stand-in engine; the
server's thread: HTTP, parsing, the session, the response); the second under cProfile with a CPU clock
in both threads, for the split of the server's part by stage (cProfile inflates Python calls, so the split
is read as shares of the server thread, scaled to its unprofiled CPU).
"""

from __future__ import annotations

import asyncio
import cProfile
import pstats
import threading
import time
from typing import Any

# Server-thread stages: (label, (file suffix, function name)) summed by cumulative CPU time. A coroutine's
# cumulative time under cProfile is its running time only (never its waits), so stages nest as the code.
STAGES = [
    ("read body, auth, json.loads", ("molt/agents/server.py", "_admit")),
    ("validate: vLLM's ChatCompletionRequest", ("pydantic/main.py", "model_validate")),
    ("check unsupported fields", ("molt/agents/server.py", "_check")),
    ("messages: normalize, sampling", ("molt/agents/server.py", "_normalize")),
    ("", ("molt/agents/server.py", "_sampling")),
    ("session: render + tokenize new messages", ("molt/agents/session.py", "prompt_ids")),
    ("  of which chat-template renders", ("molt/agents/render.py", "render")),
    ("  of which tokenizing", ("molt/agents/render.py", "encode")),
    ("session: recognise replies (offer)", ("molt/agents/session.py", "offer")),
    ("trace bookkeeping (checkpoint)", ("molt/agents/session.py", "checkpoint")),
    ("engine call (hand-off to the rollout's loop)", ("molt/agents/server.py", "_sample")),
    ("parse reply (tool parser)", ("molt/agents/tools.py", "parse_reply")),
    ("response: vLLM's ChatCompletionResponse", ("molt/agents/wire.py", "openai_response")),
    ("response: JSON encoding", ("starlette/responses.py", "render")),
]


def thread_cpu(native_id: int) -> float:
    import psutil

    return next(sum(t[1:3]) for t in psutil.Process().threads() if t.id == native_id)


def profile(runner_cls: Any, engine: Any, tok: Any, spec: Any, sessions: int, turns: int,
            run_path: Any) -> str:
    """The report: CPU ms per turn of each thread, then the server thread's stages."""
    import uvicorn

    main_id = threading.get_native_id()
    runner = runner_cls()
    runner.setup(tok, spec)
    asyncio.run(run_path(runner, engine, min(16, sessions)))   # imports, first connections
    server_id = runner.server._thread.native_id
    before = thread_cpu(main_id), thread_cpu(server_id)
    start, cpu = time.perf_counter(), time.process_time()
    asyncio.run(run_path(runner, engine, sessions))
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    n = sessions * turns
    main_ms, server_ms = ((thread_cpu(t) - b) * 1e3 / n for t, b in zip((main_id, server_id), before,
                                                                        strict=True))
    runner.close()

    server_prof, main_prof = cProfile.Profile(time.thread_time), cProfile.Profile(time.thread_time)
    run = uvicorn.Server.run

    def profiled_run(self: Any, *args: Any, **kwargs: Any) -> Any:
        server_prof.enable()
        try:
            return run(self, *args, **kwargs)
        finally:
            server_prof.disable()

    uvicorn.Server.run = profiled_run   # the next server's thread runs under its own profiler
    try:
        runner = runner_cls()
        runner.setup(tok, spec)
    finally:
        uvicorn.Server.run = run
    main_prof.enable()
    asyncio.run(run_path(runner, engine, sessions))
    main_prof.disable()
    runner.close()
    server_total = sum(v[2] for v in pstats.Stats(server_prof).stats.values())   # tottime: all of it
    stats = pstats.Stats(server_prof).stats
    lines = [f"{sessions} sessions x {turns} turns, {n / wall:.0f} turns/s unprofiled; CPU ms per turn: "
             f"process {cpu * 1e3 / n:.2f}, agent loop thread (SDK client, runner, stand-in engine) "
             f"{main_ms:.2f}, server thread {server_ms:.2f}; under cProfile: server thread "
             f"{server_total * 1e3 / n:.2f}",
             "server thread, by stage (share of its profiled CPU → ms per turn):"]
    for label, (path, name) in STAGES:
        cum = sum(v[3] for (file, _, func), v in stats.items() if file.endswith(path) and func == name)
        share = cum / server_total
        lines.append(f"  {label or name:48s} {share:6.1%}  {share * server_ms:6.3f} ms")
    mains = pstats.Stats(main_prof).stats
    main_total = sum(v[2] for v in mains.values())
    sdk = sum(v[3] for (file, _, func), v in mains.items()
              if "openai/resources/chat/completions" in file and func == "create")
    lines.append(f"agent loop thread: the SDK's chat.completions.create {sdk / main_total:.1%} of its CPU")
    return "\n".join(lines)
