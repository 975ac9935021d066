"""A vLLM engine as a Ray actor: token ids in, token ids + logprobs + policy versions out.

Policy versions are ints (0 = the initial weights). vLLM stamps every output token with the engine's
current weight version label, so a request that lives across a refit reports exactly where the
weights changed; `generate` expands those spans into one version per generated token.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from typing import Any

import ray

from molt.rollout.engine_args import engine_kwargs, on_cpu
from molt.rollout.transport import load_chunks
from molt.trainer.router_replay import capture_sequences


def sampling_params(sampling: dict[str, Any], max_tokens: int):
    """vLLM `SamplingParams` asking for the sampled token's logprob and only the final output."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    # Constrained decoding ({"regex": ...}): how the agents' chat server honours a forced tool call.
    constrained = sampling.get("structured_outputs")
    return SamplingParams(
        temperature=sampling.get("temperature", 1.0), top_p=sampling.get("top_p", 1.0),
        top_k=sampling.get("top_k", -1), max_tokens=max_tokens,
        stop_token_ids=sampling.get("stop_token_ids"), seed=sampling.get("seed"),
        ignore_eos=sampling.get("ignore_eos", False),
        structured_outputs=StructuredOutputsParams(**constrained) if constrained else None,
        logprobs=0, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY,
    )


def per_token_versions(spans: list[Any] | None, n: int, fallback: int) -> list[int]:
    """Expand vLLM's `[start, end)` weight-version spans into one int per output token."""
    versions = [fallback] * n
    for span in spans or []:
        versions[span.start:span.end] = [int(span.version)] * (span.end - span.start)
    return versions


@ray.remote
class EngineActor:
    def __init__(self, model_path: str, rollout: dict, model: dict, seed: int = 0, index: int = 0) -> None:
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.index = index
        self.partial_rollout = rollout["partial_rollout"]
        self.prompt_too_long = rollout["prompt_too_long"]
        self.max_model_len = model["max_model_len"]
        args = AsyncEngineArgs(**engine_kwargs(model_path, rollout, model, seed + index))
        self.llm = AsyncLLM.from_engine_args(args)
        self.version = 0
        self.in_flight = 0
        self.generated = 0
        self.busy = 0.0
        self.busy_since: float | None = None
        self.last_stats = time.monotonic()
        # Route capture holds the engine alone: `open` gates new requests, `idle` says none is in flight.
        self.open, self.idle, self.capture_lock = asyncio.Event(), asyncio.Event(), asyncio.Lock()
        self.open.set()
        self.idle.set()

    async def ready(self) -> int:
        await self.llm.update_weight_version("0")
        return self.index

    def _enter(self) -> None:
        if self.in_flight == 0:
            self.busy_since = time.monotonic()
            self.idle.clear()
        self.in_flight += 1

    def _leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0 and self.busy_since is not None:
            self.busy += time.monotonic() - self.busy_since
            self.busy_since = None
        if self.in_flight == 0:
            self.idle.set()

    def _fit(self, prompt_ids: list[int]) -> list[int]:
        """Apply `rollout.prompt_too_long` to a prompt that leaves no room for one generated token."""
        room = self.max_model_len - 1
        if len(prompt_ids) <= room:
            return list(prompt_ids)
        if self.prompt_too_long == "reject":
            raise ValueError(f"prompt of {len(prompt_ids)} tokens does not fit model.max_model_len="
                             f"{self.max_model_len} (rollout.prompt_too_long=reject)")
        return list(prompt_ids[-room:])    # keep the most recent context; returned as prompt_ids

    async def generate(self, prompt_ids: list[int], sampling: dict, request_id: str | None = None) -> dict:
        """One completion. Keys of `sampling`: temperature, top_p, top_k, max_tokens, and optionally
        stop_token_ids, seed, ignore_eos, structured_outputs. `max_tokens` shrinks to what fits in
        `max_model_len`."""
        from vllm.inputs import TokensPrompt

        await self.open.wait()   # a route capture is running
        prompt = self._fit(prompt_ids)
        max_tokens = min(sampling["max_tokens"], self.max_model_len - len(prompt))
        version_at_start = self.version
        final = None
        self._enter()
        try:
            async for out in self.llm.generate(TokensPrompt(prompt_token_ids=prompt),
                                               sampling_params(sampling, max_tokens),
                                               request_id or uuid.uuid4().hex):
                final = out
        finally:
            self._leave()
        comp = final.outputs[0]
        ids = list(comp.token_ids)
        self.generated += len(ids)
        result = {
            "token_ids": ids,
            "logprobs": [lp[t].logprob for t, lp in zip(ids, comp.logprobs or [], strict=True)],
            "versions": per_token_versions(comp.weight_versions, len(ids), version_at_start),
            "finish_reason": comp.finish_reason or "abort",
            "prompt_ids": prompt,
        }
        if comp.routed_experts is not None:
            # GPU with model.router_replay (vLLM's enable_return_routed_experts): the routes this request
            # was computed with, [tokens the engine ran][layers][top_k]. Nothing consumes them yet.
            result["routed_experts"] = comp.routed_experts.tolist()
        return result

    async def capture_routes(self, token_ids: list[list[int]], top_k: int) -> list:
        """MoE routed experts [len][layers][top_k] of each sequence under the current weights.

        One prefill-only pass per sequence (see `molt.trainer.router_replay`). The capture must see only
        its own rows, so it closes the engine to new requests and waits for in-flight ones to finish
        first; requests that arrive meanwhile wait and start after it.
        """
        from vllm.inputs import TokensPrompt

        async def generate(ids: list[int], params: Any) -> Any:
            final = None
            async for out in self.llm.generate(TokensPrompt(prompt_token_ids=ids), params, uuid.uuid4().hex):
                final = out
            return final

        async def rpc(method: str, *args: Any) -> list:
            return await self.llm.collective_rpc(method, args=args)

        async with self.capture_lock:
            self.open.clear()
            try:
                await self.idle.wait()
                routes, _ = await capture_sequences(generate, rpc, token_ids, top_k)
            finally:
                self.open.set()
        return routes

    async def _pause(self) -> None:
        # With partial rollouts in-flight requests are kept ("keep"); without, the engine drains them
        # first ("wait"), so every request is sampled by one policy.
        await self.llm.pause_generation(mode="keep" if self.partial_rollout else "wait", clear_cache=False)

    async def _commit(self, version: int) -> None:
        """After a load: drop cached KV, label later tokens `version`, resume.

        Cached KV was computed by the old weights, and a prefix hit would mix two policies. The reset
        also preempts the kept requests, so their KV is recomputed with the new weights on resume.
        """
        if not await self.llm.reset_prefix_cache(reset_running_requests=True):
            raise RuntimeError("vLLM refused to reset the prefix cache after a weight update")
        await self.llm.update_weight_version(str(version))
        self.version = version
        await self.llm.resume_generation()

    async def update_weights(self, chunk_refs: list, version: int) -> float:
        """CPU refit: load full weights (HF names, object-store chunks); returns the seconds taken."""
        start = time.perf_counter()
        await self._pause()
        try:
            await load_chunks(self.llm, chunk_refs)
        except BaseException:
            await self.llm.resume_generation()
            raise
        await self._commit(version)
        return time.perf_counter() - start

    # GPU refit: vLLM's NCCL weight transfer, driven from trainer rank 0 by `molt.rollout.nccl`.
    async def nccl_init(self, init_info: dict) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        await self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info))

    async def nccl_start(self) -> None:
        await self._pause()
        await self.llm.start_weight_update()

    async def nccl_receive(self, update_info: dict) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        await self.llm.update_weights(WeightTransferUpdateRequest(update_info=update_info))

    async def nccl_finish(self, version: int) -> None:
        await self.llm.finish_weight_update()
        await self._commit(version)

    async def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list:
        return await self.llm.collective_rpc(method, args=args, kwargs=kwargs)

    async def stats(self) -> dict:
        """Counters since the previous call: busy = at least one request in flight."""
        now = time.monotonic()
        busy = self.busy + (now - self.busy_since if self.busy_since is not None else 0.0)
        window = now - self.last_stats
        out = {"in_flight": self.in_flight, "generated_tokens": self.generated, "busy_s": busy,
               "idle_s": max(window - busy, 0.0), "version": self.version}
        self.generated, self.busy, self.last_stats = 0, 0.0, now
        self.busy_since = now if self.in_flight else None
        return out

    def shutdown(self) -> None:
        self.llm.shutdown()


def actor_options(engine: dict[str, Any]) -> dict[str, Any]:
    """Ray resources of one engine. On CPU a tiny fraction, so engines and trainer ranks share cores.

    On CPU the engine runs its worker inside vLLM's engine process (≈2× faster on few cores than a
    separate worker process) and does not pin OpenMP threads, so several engines can share cores.
    """
    # An async actor serves at most `max_concurrency` calls at once: every in-flight rollout is one.
    if not on_cpu():
        return {"num_cpus": 1, "num_gpus": engine["tp_size"] * engine["dp_size"], "max_concurrency": 10_000}
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind")}
    if engine["tp_size"] * engine["dp_size"] == 1:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"   # lets engine_args' "uni" executor stand on CPU
    return {"num_cpus": 0.01, "runtime_env": {"env_vars": env}, "max_concurrency": 10_000}


def start_engines(spec: Any, model_path: str) -> list:
    """Start `rollout.engine.num_engines` engine actors from a `RunSpec` and wait until they are ready."""
    from molt.placement import cluster_nodes, node_selector, plan

    rollout, model = spec.rollout.model_dump(), spec.model.model_dump()
    opts = actor_options(rollout["engine"])
    ids = [n["NodeID"] for n in cluster_nodes(spec)]   # each engine on its plan node (molt/placement.py)
    engines = [EngineActor.options(**opts, label_selector=node_selector(ids[s.node]))
               .remote(model_path, rollout, model, spec.run.seed, s.index)
               for s in plan(spec) if s.role == "engine"]
    ray.get([e.ready.remote() for e in engines])
    return engines
