"""Atomic, exact checkpoints with torch distributed checkpoint (DCP).

Model and optimizer state are saved sharded (each rank writes its own shards); the scheduler, step,
policy version and the caller's `extra` (data position, ...) go to `meta.pt` from rank 0, and every
rank's RNG state to `rng-<rank>.pt`. Everything is written into a temporary folder that rank 0 renames
into place after a barrier, so a crash mid-save never leaves a half checkpoint under the final name.
`load` keeps the live optimizer's learning rate, betas and weight decay (HYPERPARAMETERS): a resumed run
trains with its own spec's values on the checkpoint's moments.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim.lr_scheduler import LambdaLR

# What the spec sets on an optimizer (train.lr / critic_lr, betas, weight_decay; initial_lr is the
# scheduler's copy of lr). A resume keeps the live values, not the saved ones, so that a value changed on
# resume takes effect, as the schedule and grad_clip (read from the new spec) already do.
HYPERPARAMETERS = ("lr", "initial_lr", "betas", "weight_decay")


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def _states(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    state = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    return state


def save(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None, scheduler: LambdaLR | None,
         meta: dict[str, Any]) -> None:
    final = Path(path)
    tmp = final.with_name(f".{final.name}.tmp")
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    dcp.save(_states(model, optimizer), checkpoint_id=str(tmp))
    torch.save(_rng_state(), tmp / f"rng-{rank}.pt")
    if rank == 0:
        torch.save({**meta, "scheduler": scheduler.state_dict() if scheduler else None}, tmp / "meta.pt")
    dist.barrier()
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    dist.barrier()


def load(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None,
         scheduler: LambdaLR | None) -> dict[str, Any]:
    """Restore everything `save` wrote into the live objects; returns the meta dict. The optimizer's
    moments and step counts and the schedule's position are the checkpoint's; its HYPERPARAMETERS and the
    schedule's base learning rates stay those the live objects were built with (the new run's spec)."""
    state = _states(model, optimizer)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        built = [{k: g[k] for k in HYPERPARAMETERS if k in g} for g in optimizer.param_groups]
        set_optimizer_state_dict(model, optimizer, state["optim"])
        for group, values in zip(optimizer.param_groups, built, strict=True):
            group.update(values)
    meta = torch.load(Path(path) / "meta.pt", weights_only=False)
    if scheduler is not None:
        # the saved step of the schedule, times the new base: the learning rate the new spec gives there
        base_lrs, at = list(scheduler.base_lrs), meta["scheduler"]["last_epoch"]
        lrs = [base * f(at) for f, base in zip(scheduler.lr_lambdas, base_lrs, strict=True)]
        scheduler.load_state_dict({**meta["scheduler"], "base_lrs": base_lrs, "_last_lr": lrs})
        for group, lr in zip(scheduler.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
    _set_rng_state(torch.load(Path(path) / f"rng-{dist.get_rank()}.pt", weights_only=False))
    return meta
