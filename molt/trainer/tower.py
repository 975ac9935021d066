"""A vision-language model's tower on several ranks: when FSDP shards it, every rank runs it in every pass.

A trainable tower is wrapped per block, so each of its passes is a sequence of collectives (all-gathers in
the forward, reduce-scatters in the backward). A rank whose micro-batch holds no image would skip them
while its peers wait: NCCL hangs, gloo fails ("collective mismatch"). Such a rank runs the tower on a
placeholder image instead, with weight 0. A frozen tower is left whole on every rank (no collectives).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


@contextmanager
def tower_in_every_forward(model: nn.Module, run: bool) -> Iterator[None]:
    """While open, with `run`, the tower computes one placeholder image (its smallest grid, zeros) as the
    language model starts, and 0 x its output is added to the language model's input: where a real
    image's tower pass runs, so every rank issues its collectives in the same order; the weight 0 leaves
    every value unchanged (and gives the tower gradients of 0)."""
    inner = getattr(model, "model", model)
    if not run:
        yield
        return
    tower, vision = inner.visual, model.config.vision_config
    merge, patch = vision.spatial_merge_size, vision.patch_size
    channels = getattr(vision, "in_channels", getattr(vision, "in_chans", 3))
    width = channels * vision.temporal_patch_size * patch ** 2   # one row of pixel_values per patch
    device = next(tower.parameters()).device

    def placeholder(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        out = tower(torch.zeros(merge * merge, width, device=device),
                    grid_thw=torch.tensor([[1, merge, merge]], device=device))
        total = sum(t.float().sum() for t in torch.utils._pytree.tree_leaves(out)
                    if isinstance(t, torch.Tensor) and t.is_floating_point())
        embeds = kwargs["inputs_embeds"]
        return args, {**kwargs, "inputs_embeds": embeds + 0.0 * total.to(embeds.dtype)}
    hook = inner.language_model.register_forward_pre_hook(placeholder, with_kwargs=True)
    try:
        yield
    finally:
        hook.remove()


def sharded_tower(model: nn.Module) -> bool:
    """Whether a VLM's vision tower takes part in FSDP's collectives (a trainable tower on several ranks:
    AutoModel wraps it per block); a frozen tower is left whole on every rank."""
    from torch.distributed.fsdp import FSDPModule

    tower = getattr(getattr(model, "model", model), "visual", None)
    return tower is not None and any(isinstance(m, FSDPModule) for m in tower.modules())
