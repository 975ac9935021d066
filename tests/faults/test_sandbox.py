"""The tool sandbox (molt.agents.sandbox) with real untrusted code: it cannot touch the run directory,
an endless loop is killed at the timeout, a memory hog hits its limit, and the reference calculator
tool turns each of these into an error message for the model instead of a stuck or crashed rollout."""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import time
from pathlib import Path

import pytest
from faultlib import REPO

from molt.agents import State, load_agent_runner
from molt.agents.sandbox import run_python
from molt.spec import AgentSpec


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.fixture()
def run_dir(tmp_path):
    """A run directory as `python -m molt` makes it: owned by the trainer's user, mode 0700."""
    path = tmp_path / "run"
    path.mkdir()
    path.chmod(0o700)
    (path / "metrics.jsonl").write_text('{"step": 1}\n')
    return path


def test_tool_cannot_read_or_write_the_run_dir(run_dir):
    wrote = run_python(f"open({str(run_dir / 'evil.txt')!r}, 'w').write('x')")
    assert wrote.returncode == 1 and "PermissionError" in wrote.stderr
    read = run_python(f"print(open({str(run_dir / 'metrics.jsonl')!r}).read())")
    assert read.returncode == 1 and "PermissionError" in read.stderr and read.stdout == ""
    assert sorted(p.name for p in run_dir.iterdir()) == ["metrics.jsonl"]
    ids = run_python("import os; print(os.getuid(), os.getgid(), os.getgroups())")
    assert ids.stdout == "65534 65534 []\n"


def test_endless_loop_and_its_children_are_killed():
    scratch = Path(tempfile.mkdtemp(prefix="molt-sandbox-"))
    scratch.chmod(0o777)   # writable for the sandbox, so its forked child can report its pid
    marker = scratch / "child"
    code = (f"import os\nif os.fork() == 0:\n    open({str(marker)!r}, 'w').write(str(os.getpid()))\n"
            "while True:\n    pass\n")
    result = run_python(code, timeout_s=1.0)
    assert result.timed_out and result.returncode == -9
    child = int(marker.read_text())
    shutil.rmtree(scratch)
    # The forked child was in the killed process group: SIGKILL is final, it only has to be delivered.
    deadline = time.time() + 10
    while alive(child) and time.time() < deadline:
        time.sleep(0.05)
    assert not alive(child)


def test_memory_and_file_size_limits():
    hog = run_python("x = bytearray(1 << 30)", memory_mb=256)
    assert hog.returncode == 1 and "MemoryError" in hog.stderr
    ok = run_python("x = bytearray(64 << 20); print(len(x))", memory_mb=256)
    assert ok.stdout == str(64 << 20) + "\n"
    scratch = Path(tempfile.mkdtemp(prefix="molt-sandbox-"))
    scratch.chmod(0o777)
    big = run_python(f"open({str(scratch / 'big')!r}, 'wb').write(b'0' * (2 << 20))", file_mb=1)
    size = (scratch / "big").stat().st_size
    shutil.rmtree(scratch)
    assert big.returncode != 0 and size <= 1 << 20


def test_the_reference_calculator_tool_reports_faults_to_the_model():
    runner = load_agent_runner(AgentSpec(module=str(REPO / "examples" / "agents" / "tool_env.py")))

    def call(expression: str) -> str:
        call = {"name": "calculator", "arguments": {"expression": expression}}
        action = f"<tool_call>{json.dumps(call)}</tool_call>"
        env = runner.env_cls({"tool_timeout_s": 1.0})
        result = asyncio.run(env.step(State("q", action, [], "stop", "1", 0, [], {}, {})))
        assert not result.terminated and result.observation["role"] == "tool"
        return result.observation["content"]

    assert call("6*7") == "42"
    assert call("9**9**9**9") == "error: timed out after 1.0s"
    assert call("open('x','w')").startswith("error: ")
