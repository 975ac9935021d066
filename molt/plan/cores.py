"""The cores a CPU process may compute on now: the rest of its planned share is taken by other work.

With `parallel.cpu_threads` null every CPU process computes with its planned share of the cores
(`molt.plan.placement.cpu_threads`), capped by the cores of its affinity that everything else on the host
(other jobs, and the run's other processes) left idle over the last second. OpenMP threads wait for each
other at the end of every parallel region: a thread whose core other work holds makes each region wait a
scheduler time slice, so on a busy host more threads are slower than one (the tool example's SFT step:
0.4-5 s with one thread, 14-46 s with two at load 10-37 on 2 cores), while one thread fewer only loses its
share. Measured from /proc/stat (the busy time of this process's cores) less this process's own CPU time.
"""

from __future__ import annotations

import os
import time

RESAMPLE_S = 1.0   # the shortest window the idle cores are measured over (/proc/stat counts 10 ms ticks)


class FreeCores:
    """`cap(planned)`: at most `planned` threads, and no more than the cores of this process's affinity that
    the host's other work left idle since the last window (a core at least half idle counts)."""

    def __init__(self, planned: int | None = None) -> None:
        self.planned = planned   # `set_threads`' count (None: it leaves torch's threads alone)
        self.cores = sorted(os.sched_getaffinity(0))
        self.tick = os.sysconf("SC_CLK_TCK")
        self.free = len(self.cores)
        self.last = self._sample()

    def _sample(self) -> tuple[float, float, float]:
        """(wall, CPU seconds busy on this process's cores, this process's own CPU seconds)."""
        busy = 0
        mine = {f"cpu{c}" for c in self.cores}
        with open("/proc/stat") as stat:
            for line in stat:
                name, *ticks = line.split()
                if name in mine:   # user nice system idle iowait irq softirq steal (guest is in user)
                    busy += sum(int(t) for t in ticks[:8]) - int(ticks[3]) - int(ticks[4])
        return time.monotonic(), busy / self.tick, time.process_time()

    def cap(self, planned: int) -> int:
        now = time.monotonic()
        if now - self.last[0] >= RESAMPLE_S:
            sample = self._sample()
            wall, busy, own = (a - b for a, b in zip(sample, self.last, strict=True))
            others = max(0.0, busy - own) / wall
            self.free, self.last = len(self.cores) - others, sample
        return max(1, min(planned, int(self.free + 0.5)))

    def set_threads(self) -> None:
        """The calling thread computes with `cap(planned)` torch threads (a CPU engine, before each step)."""
        import torch

        if self.planned is not None and torch.get_num_threads() != (n := self.cap(self.planned)):
            torch.set_num_threads(n)
