"""MoE router replay: capture the engine's routed experts, force them in the training forward.

A token's expert choice is a discrete top-k over router logits, so a tiny numeric gap between the
engine and the trainer can send it to different experts and make the two forwards disagree by far more
than the gap. Replaying the engine's choices removes that source of mismatch (invariant 3).

Engine side: vLLM's own capture needs Model Runner V2 (Triton) and does not run on CPU, so
`RouterCapture` is a vLLM worker extension (a base of the engine actor's `MoltWorkerExtension`) that
hooks every MoE gate and records top-k ids of the router logits. Tokens map to requests by running ONE
request at a time as a prefill-only pass (max_tokens=1) over prompt+response with prompt_logprobs
(which bypasses the prefix cache, so every token is computed): the rows the gates see are then exactly
that request's tokens, in order. On GPU the same pass reads vLLM's own returned routes instead.
Trainer side: `replay_routes` overrides the top-k of each Hugging Face MoE router with given ids while
keeping the routing weights differentiable (softmax of the live logits gathered at the given ids).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import torch
from torch import nn


def _is_gate(name: str, module: nn.Module) -> bool:
    # vLLM names the MoE router `<layer>.mlp.gate` (GateLinear); shared-expert gates are named otherwise.
    return name.endswith("mlp.gate")


class RouterCapture:
    """vLLM worker extension (`worker_extension_cls`); methods are called through `collective_rpc`."""

    def molt_capture_start(self, top_k: int) -> int:
        """Hook every MoE gate; returns the number of hooked layers."""
        self.molt_capture_stop()
        self._molt_rows: list[list[torch.Tensor]] = []
        self._molt_hooks = []
        gates = [m for n, m in self.model_runner.model.named_modules() if _is_gate(n, m)]
        for layer, gate in enumerate(gates):
            self._molt_rows.append([])

            def hook(_mod: nn.Module, _args: Any, out: Any, layer: int = layer) -> None:
                logits = out[0] if isinstance(out, tuple) else out
                # softmax is monotonic: top-k of the logits is the engine's top-k of the probabilities
                self._molt_rows[layer].append(logits.float().topk(top_k, dim=-1).indices.to(torch.int16))

            self._molt_hooks.append(gate.register_forward_hook(hook))
        return len(gates)

    def molt_capture_take(self) -> list[list[list[int]]]:
        """Ids recorded since the last take, as plain lists [tokens][layers][top_k]; clears the buffer."""
        per_layer = [torch.cat(rows) if rows else torch.empty(0, 0, dtype=torch.int16)
                     for rows in self._molt_rows]
        for rows in self._molt_rows:
            rows.clear()
        if not per_layer:
            return []
        return torch.stack(per_layer, dim=1).tolist()  # lists: tensors do not cross the engine's RPC

    def molt_capture_stop(self) -> None:
        for handle in getattr(self, "_molt_hooks", []):
            handle.remove()
        self._molt_hooks = []


async def capture_sequences(generate: Callable[[list[int], Any], Awaitable[Any]],
                            rpc: Callable[..., Awaitable[list]], token_ids: list[list[int]],
                            top_k: int) -> tuple[list, list[list[float]]]:
    """Routed experts [len][layers][top_k] and the engine's logprobs of every token, one sequence at a time.

    The per-sequence logic every engine kind shares: `generate(ids, params)` returns the engine's
    `RequestOutput` and `rpc(method, *args)` its workers' results. The caller must hold the engine
    exclusively (no other request may run meanwhile), or other rows would enter the capture. When the
    engine returns routed experts itself (vLLM's `enable_return_routed_experts`, GPU), those are used
    and the gate hooks are not needed. Logprob of token 0 is reported as 0.0, like the trainer's.
    """
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
    await rpc("molt_capture_start", top_k)
    routes, logps = [], []
    try:
        for ids in token_ids:
            out = await generate(ids, params)
            taken = (await rpc("molt_capture_take"))[0]
            given = out.outputs[0].routed_experts
            if given is not None:
                taken = given[: len(ids)].tolist()
            if len(taken) != len(ids):
                raise RuntimeError(f"captured {len(taken)} routed tokens for a {len(ids)}-token sequence")
            routes.append(taken)
            pairs = zip(out.prompt_logprobs[1:], ids[1:], strict=True)
            logps.append([0.0] + [lp[t].logprob for lp, t in pairs])
    finally:
        await rpc("molt_capture_stop")
    return routes, logps


def capture_routes(llm: Any, token_ids: list[list[int]], top_k: int) -> tuple[list, list[list[float]]]:
    """`capture_sequences` on a plain `vllm.LLM` started with `worker_extension_cls=
    "molt.trainer.router_replay.RouterCapture"` (or the engine actor's `MoltWorkerExtension`)."""
    from vllm.inputs import TokensPrompt

    async def generate(ids: list[int], params: Any) -> Any:
        return llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]

    async def rpc(method: str, *args: Any) -> list:
        return llm.collective_rpc(method, args=args)

    return asyncio.run(capture_sequences(generate, rpc, token_ids, top_k))


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
    """Register the replay hook on every router once; inert until `replay_routes` sets ids."""
    routers = _routers(model)
    for router in routers:
        router._molt_route = None
        router.register_forward_hook(_replay_hook)
    return len(routers)


@contextlib.contextmanager
def replay_routes(model: nn.Module, routed_experts: torch.Tensor | None) -> Iterator[None]:
    """Force the routers to the given ids [B, T, layers, top_k] for forwards inside the block."""
    routers = _routers(model)
    if routed_experts is not None:
        if routed_experts.shape[2] != len(routers):
            raise ValueError(f"routed_experts has {routed_experts.shape[2]} layers, the model {len(routers)}")
        flat = routed_experts.long().flatten(0, 1)  # the MoE block flattens [B, T] into rows
        for layer, router in enumerate(routers):
            router._molt_route = flat[:, layer].contiguous()
    try:
        yield
    finally:
        for router in routers:
            router._molt_route = None
