"""The tool sandbox (molt.agents.sandbox) against real escape attempts, each bounded so that a sandbox
that failed to contain it could not harm the machine: one socket to a listener of the test's own, files
under unique names that the test removes, a process limit of 8 and children that exit by themselves,
short timeouts (generous where the timeout is not what is tested: the machine is shared). Each attempt
must fail, and through the reference tool agent (examples/agents/tool_env.py) it comes back to the model
as the tool's error message while the rollout itself stays trainable."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
import shutil
import socket
import sys
import time
from pathlib import Path
from textwrap import dedent

import pytest
from faultlib import REPO, small_spec

from molt.agents import StepEnvRunner, load_agent_runner
from molt.agents import sandbox as sandbox_module
from molt.agents.sandbox import SandboxUnavailable, run_python
from molt.driver.select import drop_failed, rollout_metrics
from molt.rollout.dispatch import Dispatcher
from molt.spec import AgentSpec
from molt.tasks.tool_use import PYTHON

TOOL_ENV = str(REPO / "examples" / "agents" / "tool_env.py")


def sandbox_processes(marker: str) -> list[int]:
    """Host pids of live processes whose command line holds `marker` (the sandboxed code carries it)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker.encode() in (proc / "cmdline").read_bytes() and \
                    (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def gone(marker: str) -> bool:
    """True once no sandboxed process with `marker` is left (SIGKILL is final; it only has to land)."""
    deadline = time.time() + 15
    while sandbox_processes(marker) and time.time() < deadline:
        time.sleep(0.05)
    return not sandbox_processes(marker)


@pytest.fixture()
def secrets_on_host(tmp_path):
    """A run directory (spec.yaml, a checkpoint) where runs live and in /tmp, and a file in $HOME; all
    world-readable, so only the sandbox's view can keep them out. Removed afterwards."""
    token = secrets.token_hex(4)
    runs = [REPO / "runs" / f"sandbox-test-{token}", tmp_path / "run"]
    files = [Path.home() / f".molt-sandbox-test-{token}"]
    for run in runs:
        (run / "checkpoints" / "step_000001").mkdir(parents=True)
        (run / "spec.yaml").write_text("run: {name: secret}\n")
        (run / "checkpoints" / "latest").write_text("step_000001")
        (run / "checkpoints" / "step_000001" / "meta.json").write_text('{"step": 1}')
        files += [run / "spec.yaml", run / "checkpoints" / "latest",
                  run / "checkpoints" / "step_000001" / "meta.json"]
    files[0].write_text("secret")
    for f in files:
        f.chmod(0o644)
    yield files
    files[0].unlink()
    shutil.rmtree(runs[0])


def test_no_network_not_even_loopback():
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        local = run_python(f"import socket; socket.create_connection(('127.0.0.1', {port}))", timeout_s=10)
        remote = run_python("import socket; socket.create_connection(('1.1.1.1', 53))", timeout_s=10)
        listener.settimeout(0.5)
        with pytest.raises(TimeoutError):
            listener.accept()   # nothing ever reached the test's listener
    assert local.returncode == 1 and "ConnectionRefusedError" in local.stderr
    assert remote.returncode == 1 and "Network is unreachable" in remote.stderr


def test_run_dir_checkpoints_and_home_are_not_visible(secrets_on_host):
    probe = ("import json, os, sys\nfound = {}\nfor p in json.loads(sys.stdin.read()):\n"
             "    try:\n        found[p] = open(p).read()\n    except OSError as err:\n"
             "        found[p] = type(err).__name__\nprint(json.dumps(found))\n"
             "print(json.dumps(sorted(os.listdir(os.path.expanduser('~')))))\n"
             "print(json.dumps(sorted(os.listdir('/root')) if os.path.isdir('/root') else []))")
    result = run_python(probe, json.dumps([str(f) for f in secrets_on_host]), timeout_s=10)
    found, home, root = map(json.loads, result.stdout.splitlines())
    assert all(Path(f).read_text() for f in secrets_on_host)   # readable outside the sandbox
    assert set(found.values()) == {"FileNotFoundError"}, found
    # HOME is the private /tmp: empty but for the way to a Python installed under /tmp (bound read-only)
    python_dirs = sorted({Path(p).parts[2] for p in (sys.prefix, sys.base_prefix) if p.startswith("/tmp/")})
    assert home == python_dirs and all(not name.startswith(".molt-sandbox-test") for name in root)


def test_writes_outside_the_scratch_dir_fail():
    name = f"molt-sandbox-test-{secrets.token_hex(4)}"
    targets = [f"/etc/{name}", f"/usr/{name}", f"{sys.prefix}/{name}", f"{Path.home()}/{name}", f"/{name}",
               f"/dev/shm/{name}", str(REPO / name)]
    code = dedent(f"""
        import json, sys
        for p in json.loads(sys.stdin.read()):
            try:
                open(p, 'w').write('x')
                print(p, 'written')
            except OSError as err:
                print(p, type(err).__name__)
        open('/tmp/{name}', 'w').write('scratch')
        print(open('/tmp/{name}').read())""")
    result = run_python(code, json.dumps(targets), timeout_s=10)
    lines = result.stdout.splitlines()
    assert result.returncode == 0 and lines[-1] == "scratch"   # the scratch dir is writable
    assert all(line.split()[-1] in ("OSError", "PermissionError", "FileNotFoundError") for line in lines[:-1])
    assert not [p for p in targets + [f"/tmp/{name}"] if Path(p).exists()]   # nothing reached the host


def test_process_limit_stops_a_fork_bomb():
    marker = secrets.token_hex(8)
    code = dedent(f"""
        # {marker}
        import os, time
        n = 0
        try:
            for _ in range(100):
                if os.fork() == 0:
                    time.sleep(5)
                    os._exit(0)
                n += 1
        except OSError as err:
            print(n, type(err).__name__)""")
    result = run_python(code, max_processes=8, timeout_s=10)
    forked, error = result.stdout.split()
    assert error == "BlockingIOError" and int(forked) < 8   # the tool itself is one of the 8
    assert gone(marker)   # its children died with the sandbox, although they were still sleeping


def test_timeout_kills_the_tool_and_children_that_left_its_process_group():
    marker = secrets.token_hex(8)
    code = dedent(f"""
        # {marker}
        import os, time
        if os.fork() == 0:
            os.setsid()   # leaves the process group the timeout kills
            if os.fork() == 0:
                time.sleep(60)
            time.sleep(60)
        time.sleep(60)""")
    t0 = time.monotonic()
    result = run_python(code, timeout_s=2.0)
    assert result.timed_out and result.returncode == -9 and time.monotonic() - t0 < 30
    assert gone(marker)   # the PID namespace dies with bwrap, setsid or not


def test_memory_and_file_size_limits():
    hog = run_python("x = bytearray(1 << 30)", memory_mb=256, timeout_s=10)
    assert hog.returncode == 1 and "MemoryError" in hog.stderr
    ok = run_python("x = bytearray(64 << 20); print(len(x))", memory_mb=256, timeout_s=10)
    assert ok.stdout == str(64 << 20) + "\n"
    big = run_python("open('/tmp/big', 'wb').write(b'0' * (2 << 20))", file_mb=1, timeout_s=10)
    assert big.returncode == 1 and "File too large" in big.stderr
    chatty = run_python("print('x' * (8 << 20))", file_mb=1, timeout_s=10)   # stdout is capped the same way
    assert chatty.returncode == 1 and len(chatty.stdout) == 1 << 20 and "File too large" in chatty.stderr


@pytest.fixture()
def fresh_sandbox_check():
    """Forget the cached bwrap check before and after (tests below change PATH)."""
    sandbox_module.sandbox_command.cache_clear()
    yield
    sandbox_module.sandbox_command.cache_clear()


def test_refuses_without_bubblewrap_or_namespaces(tmp_path, monkeypatch, fresh_sandbox_check):
    """No silent fallback: without bwrap, or where it cannot create namespaces, no tool code runs."""
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SandboxUnavailable, match=r"`bwrap` is not installed.*apt-get install bubblewrap"):
        run_python("print(1)")
    # A bwrap that fails the way it does without namespace permissions (not reproducible as root).
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create a new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    with pytest.raises(SandboxUnavailable, match=r"No permissions to create a new namespace.*needs Linux"):
        run_python("print(1)")


def escapes(home_file: Path, run_spec: Path, port: int) -> dict[str, tuple[str, str]]:
    """Each escape as model-written code for the reference agent's `python` tool, and what the model reads."""
    return {
        "network": (f"import socket; socket.create_connection(('127.0.0.1', {port}))", "ConnectionRefused"),
        "run_dir": (f"print(open({str(run_spec)!r}).read())", "FileNotFoundError"),
        "home": (f"print(open({str(home_file)!r}).read())", "FileNotFoundError"),
        "write": ("open('/etc/molt-escape', 'w')", "Read-only file system"),
        "fork_bomb": ("import os, time\nwhile os.fork():\n    pass\ntime.sleep(2)", "BlockingIOError"),
        "file_size": ("open('/tmp/f', 'wb').write(b'0' * (2 << 20))", "File too large"),
        "sleep": ("import time; time.sleep(60)", "error: timed out after 6.0s"),
        "memory": ("x = bytearray(1 << 30)", "MemoryError"),
    }


def test_escapes_through_the_reference_tool_agent_become_tool_errors_and_training_goes_on(
        tok, engine, secrets_on_host, fresh_sandbox_check, monkeypatch):
    base = load_agent_runner(AgentSpec(module=TOOL_ENV)).env_cls
    listener = socket.create_server(("127.0.0.1", 0))   # something to reach, were the network not cut
    cases = escapes(secrets_on_host[0], secrets_on_host[1], listener.getsockname()[1])

    class Escaping(base):
        """The reference ToolEnv, whose model wrote the escape as its first action."""

        async def step(self, state):
            if state.turn == 0:
                call = {"id": "c0", "type": "function", "function": {
                    "name": "python", "arguments": json.dumps({"code": cases[state.item["escape"]][0]})}}
                state = dataclasses.replace(state, tool_calls=[call])
            return await super().step(state)

    spec = small_spec({"module": TOOL_ENV, "max_turns": 2, "tools": [PYTHON], "max_total_tokens": 512,
                       "options": {"tool_timeout_s": 6.0}})
    runner = StepEnvRunner(Escaping)
    runner.setup(tok, spec)
    dispatcher = Dispatcher([engine])

    async def main():
        return await asyncio.gather(*[runner.run({"prompt": "What is 2+3?", "label": "5", "escape": name},
                                                 f"r-{name}", "g", dispatcher) for name in cases])

    with listener:
        rollouts = dict(zip(cases, asyncio.run(main()), strict=True))
    for name, rollout in rollouts.items():
        assert rollout.ok, (name, rollout.error)
        text = tok.decode(rollout.segments[0].token_ids)
        assert "error: " in text and cases[name][1] in text, (name, text)
    batch = list(rollouts.values())
    assert rollout_metrics(spec, batch)["rollout/failed"] == 0 and drop_failed(spec, batch) == batch

    # A sandbox that cannot start is not the model's doing: the rollout fails with the reason.
    monkeypatch.setenv("PATH", "/nonexistent")
    sandbox_module.sandbox_command.cache_clear()
    row = {"prompt": "q", "label": "5", "escape": "network"}
    failed = asyncio.run(runner.run(row, "r-x", "g", dispatcher))
    assert not failed.ok and "SandboxUnavailable: tool code runs in a bubblewrap sandbox" in failed.error
