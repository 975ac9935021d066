"""Run untrusted tool code (what a model wrote) in a throw-away Python process, contained by Linux namespaces.

The child runs under bubblewrap (`bwrap`) with
- no network: its own network namespace holds only a loopback device of its own;
- a private scratch directory: `/tmp` (also its cwd and HOME) is a fresh size-capped tmpfs;
- a read-only view of the system directories (/usr, /bin, /lib*, /sbin, /etc) and of the Python
  installation, and nothing else of the host: no run directory, no checkpoints, no home directory;
- its own PID, IPC and UTS namespaces, so it cannot see or signal the trainer's processes;
- rlimits on address space, CPU seconds, file size and process count, set before the tool's code runs;
- when Molt runs as root, a fresh unprivileged uid per call (no capabilities, and the process limit
  counts only this call's processes); otherwise bwrap's user namespace keeps the caller's uid.
Past `timeout_s` the process group is killed; bwrap's init dies with it, which kills everything
left in the sandbox's PID namespace. Where bwrap is missing or cannot create namespaces, `run_python`
refuses (`SandboxUnavailable`) instead of running the code with less isolation.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
SCRATCH_MB = 64
# systemd's range for dynamic service users: unused by accounts, and mapped in containers' user namespaces.
_UID_FIRST, _UID_COUNT = 61184, 4336
_UIDS = itertools.count(random.randrange(_UID_COUNT))

# Runs in the sandbox before the tool's code: limits first, then (as root) the uid drop, which also
# drops every capability.
_PRELUDE = r"""
import os, resource, sys
uid, memory, cpu_s, file_bytes, processes = map(int, sys.argv[1:6])
code = sys.argv[6]
for limit, value in ((resource.RLIMIT_AS, memory), (resource.RLIMIT_CPU, cpu_s), (resource.RLIMIT_CORE, 0),
                     (resource.RLIMIT_FSIZE, file_bytes), (resource.RLIMIT_NPROC, processes)):
    resource.setrlimit(limit, (value, value))
if uid:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
sys.argv = ["<tool>"]
del uid, memory, cpu_s, file_bytes, processes, limit, value
exec(compile(code, "<tool>", "exec"), {"__name__": "__main__"})
"""


class SandboxUnavailable(RuntimeError):
    """bubblewrap is missing or cannot create namespaces here; tool code is not run at all."""


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    returncode: int       # -9: killed at the timeout; 128+N: the tool died of signal N
    timed_out: bool


def _layout() -> list[str]:
    """bwrap arguments of the sandbox's view: namespaces, read-only system and Python, private /tmp."""
    args = ["--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
            "--die-with-parent", "--new-session", "--clearenv"]
    for d in SYSTEM_DIRS:
        args += ["--ro-bind-try", d, d]
    # The private /tmp first: a Python installed under /tmp (a checkout there) is bound on top of it.
    args += ["--perms", "1777", "--size", str(SCRATCH_MB << 20), "--tmpfs", "/tmp"]
    made: set[str] = set()
    for prefix in sorted({sys.prefix, sys.base_prefix, sys.exec_prefix}):
        if any(prefix == d or prefix.startswith(d + "/") for d in SYSTEM_DIRS):
            continue
        # bwrap would create the parents with the host's modes (a 0700 home hides the interpreter from
        # the unprivileged uid); the sandbox's own copies only need to be traversable.
        for parent in reversed(Path(prefix).parents[:-1]):
            if str(parent) not in made:
                made.add(str(parent))
                args += ["--perms", "0755", "--dir", str(parent)]
        args += ["--ro-bind", prefix, prefix]
    args += ["--dev", "/dev", "--proc", "/proc", "--chdir", "/tmp"]
    for key, value in (("PATH", "/usr/bin:/bin"), ("HOME", "/tmp"), ("TMPDIR", "/tmp"), ("LANG", "C.UTF-8")):
        args += ["--setenv", key, value]
    return args


@functools.cache
def sandbox_command() -> tuple[str, ...]:
    """The bwrap command line, checked once by starting an empty sandbox; raises `SandboxUnavailable`."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable(
            "tool code runs in a bubblewrap sandbox, and `bwrap` is not installed: install it "
            "(Debian/Ubuntu: `apt-get install bubblewrap`, Fedora: `dnf install bubblewrap`)")
    command = (bwrap, *_layout())
    probe = subprocess.run([*command, "--", sys.executable, "-I", "-c", "pass"], capture_output=True,
                           text=True, timeout=60)
    if probe.returncode:
        raise SandboxUnavailable(
            f"bubblewrap cannot create the tool sandbox here: {probe.stderr.strip() or probe.returncode}. It "
            "needs Linux namespaces: run as root, or allow unprivileged user namespaces "
            "(sysctl user.max_user_namespaces > 0; in a container, a seccomp/AppArmor profile that permits "
            "them); and a bwrap that knows --size (Debian 12 ships 0.8)")
    return command


def _python(code: str, cpu_s: int, memory_mb: int, file_mb: int, max_processes: int) -> list[str]:
    """The interpreter's argv in the sandbox: limits (and, as root, a fresh uid) first, then `code`."""
    uid = _UID_FIRST + next(_UIDS) % _UID_COUNT if os.geteuid() == 0 else 0
    limits = (uid, memory_mb << 20, cpu_s, file_mb << 20, max_processes)
    return [sys.executable, "-I", "-c", _PRELUDE, *map(str, limits), code]


def server_command(script: str | os.PathLike, memory_mb: int = 1024, cpu_s: int = 3600, file_mb: int = 1,
                   max_processes: int = 16) -> list[str]:
    """argv that runs the Python file `script` as a long-lived process in the sandbox (e.g. an MCP server on
    stdio): the same namespaces, view and limits as `run_python` (`cpu_s` CPU seconds over its lifetime);
    the script is bound read-only into the private /tmp. The caller owns the process and its pipes."""
    inside = "/tmp/" + Path(script).name
    code = f"import runpy; runpy.run_path({inside!r}, run_name='__main__')"
    return [*sandbox_command(), "--ro-bind", str(Path(script).resolve()), inside, "--",
            *_python(code, cpu_s, memory_mb, file_mb, max_processes)]


def launch_independent(argv: Sequence[str]) -> tuple[str, ...]:
    """`argv` without the per-launch uid `_python` puts after its prelude: two `server_command`s of one
    script and limits compare equal (what `MCPTools.shared` keys its one server by); other argv as is."""
    argv = tuple(argv)
    return argv[:argv.index(_PRELUDE) + 1] + argv[argv.index(_PRELUDE) + 2:] if _PRELUDE in argv else argv


def run_python(code: str, stdin: str = "", timeout_s: float = 2.0, memory_mb: int = 256, file_mb: int = 1,
               max_processes: int = 16) -> SandboxResult:
    """Run `code` with `stdin` in the sandbox: at most `timeout_s` wall seconds, `memory_mb` of address
    space, files (stdout and stderr included) of `file_mb`, `max_processes` processes."""
    command = [*sandbox_command(), "--",
               *_python(code, math.ceil(timeout_s) + 1, memory_mb, file_mb, max_processes)]
    # Output goes to files, not pipes: the file-size limit then bounds what a chatty tool can make the
    # trainer hold in memory.
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=out, stderr=err, env={},
                                start_new_session=True)
        try:
            proc.communicate(stdin.encode(), timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            timed_out = True
        texts = []
        for f in (out, err):
            f.seek(0)
            texts.append(f.read((file_mb << 20) + 1).decode(errors="replace"))
    return SandboxResult(texts[0], texts[1], proc.returncode, timed_out)
