"""Resident memory of every process a Molt run starts, by role, sampled while it runs.

A run is a process tree: the driver (`python -m molt`), Ray's own services, the engine actor (vLLM's
engine core runs in it), and one process per trainer rank. `RssWatch` samples the RSS of each process in the
tree every `period` seconds; `summary` gives per role the peak and the growth between two moments of the
run (the end of the first timed step and the end of the last one), so a leak shows as growth per step.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import psutil

# Process title or command line fragment -> role; the first match wins, anything else is "other".
ROLES = (("EngineActor", "engine actor"), ("TrainerWorker", "trainer rank"),
         ("-m molt", "driver"), ("raylet", "ray"), ("gcs_server", "ray"), ("site-packages/ray/", "ray"),
         ("ray::IDLE", "ray worker (idle)"), ("ray::", "ray"))


def role_of(proc: psutil.Process) -> str:
    try:
        line = " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "gone"
    return next((role for fragment, role in ROLES if fragment in line), "other")


class RssWatch:
    """Samples the RSS (MiB) of `pid` and all its descendants on a thread, from `start()` until `stop()`."""

    def __init__(self, pid: int, period: float = 0.5) -> None:
        self.pid, self.period = pid, period
        self.samples: list[tuple[float, str, int, float]] = []   # (time.time(), role, pid, MiB)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> RssWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                root = psutil.Process(self.pid)
                procs = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            now = time.time()
            for proc in procs:
                try:
                    mib = proc.memory_info().rss / 2**20
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
                # read every time: a new process first carries its parent's command line (a fork of the
                # raylet), and Ray renames an actor's process once the actor is created
                self.samples.append((now, role_of(proc), proc.pid, mib))
            self._stop.wait(self.period)

    def summary(self, since: float, until: float) -> dict[str, dict[str, float]]:
        """Per role: peak MiB of one process over the whole run, and the change of that role's largest
        process between the samples nearest to `since` and `until` (epoch seconds)."""
        out: dict[str, dict[str, Any]] = {}
        for role in sorted({s[1] for s in self.samples} - {"gone"}):
            mine = [s for s in self.samples if s[1] == role]
            out[role] = {"peak_mib": max(s[3] for s in mine),
                         "growth_mib": _largest_near(mine, until) - _largest_near(mine, since)}
        return out


def _largest_near(samples: list[tuple[float, str, int, float]], at: float) -> float:
    """The largest process's MiB in the sampling round closest to `at`."""
    nearest = min((s[0] for s in samples), key=lambda t: abs(t - at))
    return max(s[3] for s in samples if s[0] == nearest)
