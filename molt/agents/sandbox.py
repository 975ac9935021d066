"""Run untrusted tool code (what a model wrote) in a throw-away Python process with hard limits.

The child is `python -I` (no site-packages, no PYTHON* variables) in its own session. Before the tool's
code runs, the child caps its own address space, CPU seconds and file size (`resource.setrlimit`) and,
when it runs as root, drops to the unprivileged `nobody` uid/gid: the run directory is root-owned and
mode 0700, so the tool can neither read nor write it. Past `timeout_s` the whole process group is
killed. Without root there is no uid to drop to: the limits still hold, file access is the caller's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass

NOBODY = 65534

# Runs in the child before the tool's code; modules the tool may need are imported while still
# privileged (the interpreter's own files may not be readable by `nobody`).
_PRELUDE = r"""
import ast, json, math, operator, os, re, resource, sys
memory, cpu_s, file_bytes, code = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
if os.getuid() == 0:
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)
del memory, cpu_s, file_bytes
exec(compile(code, "<tool>", "exec"), {"__name__": "__main__"})
""".replace("NOBODY", str(NOBODY))


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    returncode: int       # negative: killed by that signal
    timed_out: bool


def run_python(code: str, stdin: str = "", timeout_s: float = 2.0, memory_mb: int = 256,
               file_mb: int = 1) -> SandboxResult:
    """Run `code` with `stdin`; at most `timeout_s` wall seconds, `memory_mb` of address space."""
    limits = [str(memory_mb << 20), str(max(1, int(timeout_s) + 1)), str(file_mb << 20)]
    proc = subprocess.Popen([sys.executable, "-I", "-c", _PRELUDE, *limits, code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/",
                            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, start_new_session=True)
    try:
        out, err = proc.communicate(stdin, timeout=timeout_s)
        return SandboxResult(out, err, proc.returncode, False)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)   # the tool's children too (its own session)
        out, err = proc.communicate()
        return SandboxResult(out, err, proc.returncode, True)
