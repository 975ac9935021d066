"""A CPU trainer rank's torch threads, following whether the engines generate.

In async mode on CPU with `parallel.cpu_threads` null, the engines' cores are lent to the trainer while
the engines are idle (molt/plan/placement.py `cpu_threads` plans both counts). The loop says which state
holds through `set_engines_idle`, delivered in the middle of a step; the computing thread applies it
between operations (torch's setting is per thread once it computed): before each micro-batch, and at
each block of the model in the forward and the backward. Null also leaves to other work the cores it
keeps busy (molt/plan/cores.py).
"""

from __future__ import annotations

import torch

from molt.plan.cores import FreeCores
from molt.plan.placement import cpu_threads
from molt.spec import RunSpec


class RankThreads:
    def __init__(self, spec: RunSpec, role: str, rank: int) -> None:
        self.cuda = spec.parallel.device == "cuda"
        # threads while the engines generate (False) and while they are idle (True)
        self.counts = {idle: cpu_threads(spec, role, rank, engines_idle=idle) for idle in (False, True)}
        self.free = FreeCores() if spec.parallel.cpu_threads is None and not self.cuda else None
        self.engines_idle = False
        self.seen: list[int] = []   # the threads read at each switch point of the current micro-batch
        self.apply()

    def apply(self) -> int:
        """Set torch's threads for the engines' current state; the count in use after it."""
        n = self.counts[self.engines_idle]
        n = self.free.cap(n) if self.free else n
        if not self.cuda and n != torch.get_num_threads():
            torch.set_num_threads(n)
        self.seen.append(torch.get_num_threads())
        return self.seen[-1]

    def start_micro_batch(self) -> None:
        self.seen = []
        self.apply()

    def mean(self) -> float:
        """The mean thread count over the current micro-batch's switch points (metric w/threads)."""
        return sum(self.seen) / len(self.seen)

    def follow_blocks(self, model: torch.nn.Module) -> None:
        """Async on CPU (and wherever null follows the free cores): a step is one micro-batch or a few, so
        the engines' cores, or those other work leaves, are taken (or given back) at each block of the
        model: its forward, and the gradient of its input in the backward."""
        if self.cuda or (self.counts[True] == self.counts[False] and not self.free):
            return

        def backward(grad: torch.Tensor) -> None:
            self.apply()

        def forward(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            self.apply()
            hidden = args[0] if args else kwargs.get("hidden_states")
            if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
                hidden.register_hook(backward)
        for blocks in [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]:
            for block in blocks:
                block.register_forward_pre_hook(forward, with_kwargs=True)
