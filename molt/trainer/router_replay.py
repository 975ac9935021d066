"""MoE router replay: force the engine's routed experts in the training forward.

A token's expert choice is a discrete top-k over router logits, so a tiny numeric gap between the
engine and the trainer can send it to different experts and make the two forwards disagree by far more
than the gap. Replaying the engine's choices removes that source of mismatch (invariant 3). The routes
come with each generated segment (`molt.rollout.routes` captures them inside the engine); here
`set_routes` overrides the top-k of each Hugging Face MoE router with given ids while keeping the
routing weights differentiable (softmax of the live logits gathered at the given ids).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def _routers(model: nn.Module) -> list[nn.Module]:
    # Hugging Face MoE routers (Qwen3-MoE, Qwen2-MoE, ...) return (logits, top-k weights, top-k ids).
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


def freeze_router(model: nn.Module) -> int:
    """Stop training router weights (call before sharding); returns the number of frozen routers."""
    routers = _routers(model)
    for router in routers:
        router.requires_grad_(False)
    return len(routers)


def _replay_hook(router: nn.Module, _args: Any, out: tuple) -> tuple | None:
    ids = getattr(router, "_molt_route", None)
    if ids is None:
        return None
    logits = out[0]
    weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, ids)
    if getattr(router, "norm_topk_prob", False):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return logits, weights.to(logits.dtype), ids


def install_replay(model: nn.Module) -> int:
    """Register the replay hook on every router once; inert until `set_routes` sets ids."""
    routers = _routers(model)
    for router in routers:
        router._molt_route = None
        router.register_forward_hook(_replay_hook)
    return len(routers)


def set_routes(model: nn.Module, routed_experts: torch.Tensor | None) -> None:
    """Force the routers to the given ids [B, T, layers, top_k] (None: route freely) from now until the
    next call. Not a block around the forward: with activation checkpointing the backward recomputes each
    layer after the forward returned, and the recomputation must replay the same ids (else torch's
    checkpoint raises on the differing saved tensors, or the gradient follows the router's own picks)."""
    routers = _routers(model)
    if routed_experts is None:
        for router in routers:
            router._molt_route = None
        return
    if routed_experts.shape[2] != len(routers):
        raise ValueError(f"routed_experts has {routed_experts.shape[2]} layers, the model {len(routers)}")
    flat = routed_experts.long().flatten(0, 1)  # the MoE block flattens [B, T] into rows
    for layer, router in enumerate(routers):
        router._molt_route = flat[:, layer].contiguous()
