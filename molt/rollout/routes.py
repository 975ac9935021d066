"""MoE routed experts of every request, captured inside the engine while it generates (CPU).

vLLM returns each request's routed experts itself (`enable_return_routed_experts`) only with Model
Runner V2, which needs Triton on the device, so on CPU `RouteCapture` (a vLLM worker extension, a base
of `MoltWorkerExtension`) does the same job: it hands vLLM's own capture callback to every MoE router
(the ids the engine really routed to, after any grouping or bias) and files each forward's rows by the
KV-cache slot the token's KV is written to (the forward context's slot mapping). Routes thus live
beside the KV they belong to: a prefix-cache hit reuses both, a recomputation (preemption, the cache
reset of a refit) overwrites both. A request's routes are read through its block table, in the same
layout the GPU engine returns: [prompt + output - 1 tokens][layers][top_k], the last sampled token
never having been an input. Python callbacks do not run inside a compiled graph, so capture needs an
eager engine (`rollout.engine.enforce_eager=true`).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np
import torch

# Routes of finished requests wait here until the engine actor reads them; a request the actor never
# reads (aborted) is dropped after this many others. It bounds what the actor can have in flight.
_KEPT_FINISHED = 10_000


def _as_wire(routes: torch.Tensor) -> tuple[bytes, str, list[int]]:
    # numpy arrays do not survive vLLM's RPC encoding; raw bytes do
    array = routes.numpy()
    return array.tobytes(), array.dtype.str, list(array.shape)


def from_wire(wire: tuple[bytes, str, list[int]]) -> np.ndarray:
    data, dtype, shape = wire
    return np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape)


class RouteCapture:
    """Worker-extension methods, called through `collective_rpc`."""

    def molt_moe_layers(self) -> list[int]:
        """Layer index of each MoE layer (the layers a routes array keeps), in order."""
        return sorted(router.layer_id for router in self._molt_moe_runners())

    def _molt_moe_runners(self) -> list[Any]:
        from vllm.model_executor.layers.fused_moe.layer import MoERunner

        runners = [m for m in self.model_runner.get_model().modules() if isinstance(m, MoERunner)]
        if not runners:
            raise RuntimeError("model.router_replay=true but the engine's model has no MoE layer")
        return runners

    def molt_routes_start(self) -> list[int]:
        """Install the capture on every MoE router; returns `molt_moe_layers()`."""
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

        if not self.model_config.enforce_eager:
            raise RuntimeError("MoE route capture on CPU needs an eager engine (a compiled graph skips the "
                               "capture callback): set rollout.engine.enforce_eager=true")
        mc = self.model_config
        slots = self.model_runner.kv_cache_config.num_blocks * self.cache_config.block_size
        dtype = torch.uint8 if mc.get_num_experts() <= 256 else torch.int16
        self._molt_table = torch.zeros(slots, mc.get_total_num_hidden_layers(), mc.get_num_experts_per_tok(),
                                       dtype=dtype)
        self._molt_finished: OrderedDict[str, torch.Tensor] = OrderedDict()
        for runner in self._molt_moe_runners():
            if not isinstance(runner.router, BaseRouter):
                raise RuntimeError(f"cannot capture routes of router {type(runner.router).__name__}")
            runner.router.set_capture_fn(lambda ids, layer=runner.layer_id: self._molt_capture(layer, ids))
        # A finished request leaves the runner before the next forward, which may reuse its KV blocks:
        # keep its routes at that moment.
        model_runner = self.model_runner
        removed = model_runner._on_request_state_removed

        def keep_routes(req_id: str, state: Any) -> None:
            if state is not None:
                self._molt_finished[req_id] = self._molt_read(state.block_ids[0])
                while len(self._molt_finished) > _KEPT_FINISHED:
                    self._molt_finished.popitem(last=False)
            removed(req_id, state)

        model_runner._on_request_state_removed = keep_routes
        return self.molt_moe_layers()

    def _molt_capture(self, layer: int, topk_ids: torch.Tensor) -> None:
        from vllm.forward_context import get_forward_context

        slots = next(iter(get_forward_context().slot_mapping.values()))
        if slots.shape[0] != topk_ids.shape[0]:
            raise RuntimeError(f"route capture: {topk_ids.shape[0]} routed rows for {slots.shape[0]} slots")
        filled = slots >= 0  # padding rows have no slot
        self._molt_table[slots[filled], layer] = topk_ids[filled].to(self._molt_table.dtype)

    def _molt_read(self, block_ids: list[int], length: int | None = None) -> torch.Tensor:
        size = self.cache_config.block_size
        positions = torch.arange(len(block_ids) * size if length is None else length)
        slots = torch.tensor(block_ids)[positions // size] * size + positions % size
        return self._molt_table[slots]

    def molt_routes(self, request_id: str, length: int) -> tuple[bytes, str, list[int]]:
        """Routes [length][all layers][top_k] of the request whose tokens 0..length-1 the engine computed.

        `request_id` is the caller's id; vLLM runs the request under that id plus a suffix.
        """
        def ours(req_id: str) -> bool:
            return req_id == request_id or req_id.startswith(request_id + "-")

        done = next((r for r in self._molt_finished if ours(r)), None)
        if done is not None:
            routes = self._molt_finished.pop(done)[:length]
        else:
            live = next((s for r, s in self.model_runner.requests.items() if ours(r)), None)
            if live is None:
                raise RuntimeError(f"no routes kept for request {request_id}")
            routes = self._molt_read(live.block_ids[0], length)
        if routes.shape[0] != length:
            raise RuntimeError(f"request {request_id}: {routes.shape[0]} routed tokens, {length} asked for")
        return _as_wire(routes)
