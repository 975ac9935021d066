"""A vLLM engine as a Ray actor: token ids in, token ids + logprobs + policy versions out.

Policy versions are ints (0 = the initial weights). vLLM stamps every output token with the engine's
current weight version label, so a request that lives across a refit reports exactly where the
weights changed; `generate` expands those spans into one version per generated token.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
import uuid
from typing import Any

import numpy as np
import ray

from molt.rollout.engine_args import actor_options, check_lora, engine_kwargs, on_cpu
from molt.rollout.routes import from_wire
from molt.spec import ModelSpec, RolloutSpec
from molt.trajectory import AgentError, Sample
from molt.vision import collapse, decode

ENGINE_POLL_S = 0.5   # how often an engine actor checks that vLLM's engine core is alive


# The sampling keys a request may carry. None of the others (min_p, penalties, logit biases, min_tokens,
# stop strings) is passed on: each would change the distribution the tokens are drawn from in a way the
# trainer's logprob recomputation (temperature, top-p, top-k) does not reproduce, or needs the detokenized
# text; a request with one fails (AgentError) rather than be sampled without it.
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "max_tokens", "stop_token_ids", "seed", "ignore_eos",
                 "structured_outputs", "prompt_logprobs")


def sampling_params(sampling: dict[str, Any], max_tokens: int):
    """vLLM `SamplingParams` asking for the sampled token's logprob and only the final output. A key outside
    `SAMPLING_KEYS`, or a value vLLM refuses, is an `AgentError`: it fails the request's rollout."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMClientError
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    unknown = sorted(set(sampling) - set(SAMPLING_KEYS))
    if unknown:
        raise AgentError(f"sampling parameters {unknown} are not supported: the trainer could not score the "
                         f"tokens they change (or they need text); use {', '.join(SAMPLING_KEYS)} "
                         "(stop_token_ids in place of stop strings)")
    # Constrained decoding ({"regex": ...}): how the agents' chat server honours a forced tool call.
    constrained = sampling.get("structured_outputs")
    try:
        return SamplingParams(
            temperature=sampling.get("temperature", 1.0), top_p=sampling.get("top_p", 1.0),
            top_k=sampling.get("top_k", -1), max_tokens=max_tokens,
            stop_token_ids=sampling.get("stop_token_ids"), seed=sampling.get("seed"),
            ignore_eos=sampling.get("ignore_eos", False),
            structured_outputs=StructuredOutputsParams(**constrained) if constrained else None,
            logprobs=0, prompt_logprobs=sampling.get("prompt_logprobs"), detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
    except (ValueError, VLLMClientError) as err:   # e.g. an Env's Result.sampling_params={"top_p": 0}
        raise AgentError(f"vLLM refused the sampling parameters {sampling}: {err}") from None


def per_token_versions(spans: list[Any] | None, n: int, fallback: int) -> list[int]:
    """Expand vLLM's `[start, end)` weight-version spans into one int per output token."""
    versions = [fallback] * n
    for span in spans or []:
        versions[span.start:span.end] = [int(span.version)] * (span.end - span.start)
    return versions


@ray.remote
class EngineActor:
    def __init__(self, model_path: str, rollout: RolloutSpec, model: ModelSpec, seed: int = 0,
                 index: int = 0) -> None:
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.index = index
        self.partial_rollout = rollout.partial_rollout
        self.prompt_too_long = rollout.prompt_too_long
        self.max_model_len = model.max_model_len
        self.router_replay = model.router_replay
        args = AsyncEngineArgs(**engine_kwargs(model_path, rollout, model, seed + index))
        self.llm = AsyncLLM.from_engine_args(args)
        self.image_token = getattr(self.llm.model_config.hf_config, "image_token_id", None)  # VLMs only
        self.version = 0
        self.in_flight = 0
        self.generated = 0
        self.busy = 0.0
        self.busy_since: float | None = None
        self.last_stats = time.monotonic()
        self.moe_layers: list[int] | None = None  # with router replay: the layers whose routes are kept
        self.capture = False                       # routes come from our capture (CPU), not from vLLM
        self.closing = False
        # LoRA (model.lora): each refit is a new adapter; version 0 is the base model (no adapter)
        self.lora = model.lora.model_dump() if model.lora.rank else None
        self.adapter: Any = None                   # the LoRARequest new requests get
        self.adapter_users: dict[Any, int] = {}    # loaded adapters -> requests in flight on each
        self.adapter_dir = tempfile.mkdtemp(prefix="molt-lora-", dir="/dev/shm" if os.path.isdir(
            "/dev/shm") else None) if self.lora else None

    async def ready(self) -> int:
        self.watchdog = asyncio.create_task(self._exit_when_engine_dies())
        await self.llm.update_weight_version("0")
        if self.router_replay:
            self.capture = on_cpu()
            method = "molt_routes_start" if self.capture else "molt_moe_layers"
            self.moe_layers = (await self.llm.collective_rpc(method))[0]
        return self.index

    async def _exit_when_engine_dies(self) -> None:
        """vLLM's engine-core runs in a child process; when it dies (an OOM kill) this actor would live on
        with every call raising or waiting on a dead engine. Exiting turns it into a dead actor, which Ray
        reports to every caller at once: the one failure the dispatcher handles (and restarts)."""
        while not self.llm.errored:
            await asyncio.sleep(ENGINE_POLL_S)
        self._exit()

    def _exit(self) -> None:
        if not self.closing:   # (`shutdown` stops the engine core on purpose)
            print(f"molt: engine {self.index}: vLLM's engine core died; exiting the engine actor", flush=True)
            os._exit(1)

    def _enter(self, adapter: Any) -> None:
        if self.in_flight == 0:
            self.busy_since = time.monotonic()
        self.in_flight += 1
        if adapter is not None:
            self.adapter_users[adapter] += 1

    def _leave(self, adapter: Any) -> None:
        if adapter is not None:
            self.adapter_users[adapter] -= 1
        self.in_flight -= 1
        if self.in_flight == 0 and self.busy_since is not None:
            self.busy += time.monotonic() - self.busy_since
            self.busy_since = None

    def _fit(self, prompt_ids: list[int]) -> list[int]:
        """Apply `rollout.prompt_too_long` to a prompt that leaves no room for one generated token."""
        room = self.max_model_len - 1
        if len(prompt_ids) <= room:
            return list(prompt_ids)
        if self.prompt_too_long == "reject":
            raise AgentError(f"prompt of {len(prompt_ids)} tokens does not fit model.max_model_len="
                             f"{self.max_model_len} (rollout.prompt_too_long=reject)")
        return list(prompt_ids[-room:])    # keep the most recent context; returned as prompt_ids

    def _prompt(self, prompt_ids: list[int], images: list[str] | None, request_id: str) -> Any:
        """vLLM's prompt: the ids (fitted), or, with images, the ids with one placeholder per image (vLLM
        expands each to the image's patch count itself; a prompt sent already expanded is collapsed).

        Each request's images get ids of their own: vLLM 0.32 shares one encoder-cache entry between
        concurrent requests with the same image, and under a group's concurrent samples that entry was
        freed before a request had read it ("Encoder cache miss", which kills the engine)."""
        from vllm.inputs import TokensPrompt

        if not images:
            return TokensPrompt(prompt_token_ids=self._fit(prompt_ids))
        if self.image_token is None:
            raise AgentError("this request has images but the engine's model is not a vision-language model")
        if len(prompt_ids) > self.max_model_len - 1:   # cutting a prompt could cut an image in half
            raise AgentError(f"prompt of {len(prompt_ids)} tokens with images does not fit "
                             f"model.max_model_len={self.max_model_len}")
        return TokensPrompt(prompt_token_ids=collapse(list(prompt_ids), self.image_token),
                            multi_modal_data={"image": [decode(u) for u in images]},
                            multi_modal_uuids={"image": [f"{request_id}/{k}" for k in range(len(images))]})

    async def generate(self, prompt_ids: list[int], sampling: dict, request_id: str | None = None,
                       images: list[str] | None = None) -> Sample:
        """One completion. Keys of `sampling`: temperature, top_p, top_k, max_tokens, and optionally
        stop_token_ids, seed, ignore_eos, structured_outputs, prompt_logprobs (0: also return the logprob
        of each prompt token, None for the first). `max_tokens` shrinks to what fits in `max_model_len`.
        The result's `sampling` is the [temperature, top_p, top_k] vLLM applied. `images` (data URLs, in
        order) fill the prompt's image placeholders; the result's `prompt_ids` are the ids the engine read,
        image placeholders expanded."""
        from vllm.exceptions import VLLMClientError
        from vllm.v1.engine.exceptions import EngineDeadError

        request_id = request_id or uuid.uuid4().hex
        prompt = self._prompt(prompt_ids, images, request_id)
        version_at_start, adapter = self.version, self.adapter
        final = None
        self._enter(adapter)
        try:
            # With images the expanded length is known only once vLLM has processed them.
            params = sampling_params(sampling, max(1, min(sampling["max_tokens"], self.max_model_len - len(
                prompt["prompt_token_ids"]))))
            async for out in self.llm.generate(prompt, params, request_id, lora_request=adapter):
                final = out
        except EngineDeadError:
            self._exit()   # before answering: the caller must see a dead engine, not a failed request
            raise
        except VLLMClientError as err:
            # vLLM's own verdict that the request is at fault (e.g. an image prompt that expands past
            # max_model_len): that rollout fails, the run goes on. (Only the message crosses Ray.)
            raise AgentError(f"vLLM refused the request: {err}") from None
        finally:
            self._leave(adapter)
        comp = final.outputs[0]
        prompt = list(final.prompt_token_ids)
        ids = list(comp.token_ids)
        self.generated += len(ids)
        if self.image_token is not None and self.image_token in ids:
            # The trainer's model would read a sampled placeholder as an image slot without an image.
            raise AgentError("the model sampled the image placeholder token; a rollout holding it cannot be "
                             "trained on (the rollout fails)")
        result: Sample = {
            "token_ids": ids,
            "logprobs": [lp[t].logprob for t, lp in zip(ids, comp.logprobs or [], strict=True)],
            # a request keeps its adapter across a LoRA refit: all its tokens are the start's version
            "versions": [version_at_start] * len(ids) if self.lora else
                        per_token_versions(comp.weight_versions, len(ids), version_at_start),
            "finish_reason": comp.finish_reason or "abort",
            "prompt_ids": prompt,
            "sampling": [params.temperature, params.top_p, params.top_k],   # what the logprobs describe
        }
        if final.prompt_logprobs is not None:   # asked for (an LLM judge scores its verdict words so)
            result["prompt_logprobs"] = [None if lp is None else lp[t].logprob
                                         for t, lp in zip(prompt, final.prompt_logprobs, strict=True)]
        if self.moe_layers is not None:
            result["routed_experts"] = await self._routes(comp, request_id, len(prompt) + len(ids) - 1)
        return result

    async def _routes(self, comp: Any, request_id: str, length: int) -> np.ndarray:
        """[length][MoE layers][top_k] expert ids this request's tokens were routed to (the last sampled
        token was never an input). vLLM returns them itself on GPU; on CPU our capture kept them."""
        routes = comp.routed_experts
        if routes is None:
            if not self.capture:
                raise RuntimeError("model.router_replay: the engine returned no routed experts")
            routes = from_wire((await self.llm.collective_rpc("molt_routes", args=(request_id, length)))[0])
        return np.ascontiguousarray(routes[:length, self.moe_layers])

    async def capture_routes(self, token_ids: list[list[int]]) -> list[np.ndarray]:
        """Fallback for segments that came without routes: re-score each under the current weights.

        One prefill-only request per sequence (its last token is never an input, so it is left out);
        the routes are only right for tokens the current weights sampled.
        """
        outs = await asyncio.gather(*[self.generate(ids[:-1], {"max_tokens": 1, "temperature": 1.0})
                                      for ids in token_ids])
        return [out["routed_experts"] for out in outs]

    async def _pause(self) -> None:
        # With partial rollouts in-flight requests are kept ("keep"); without, the engine drains them
        # first ("wait"), so every request is sampled by one policy. The engine core's own pause:
        # AsyncLLM.pause_generation adds a fixed 20 ms sleep (only for the order in which a caller sees
        # the last outputs; each token's version comes from the core), 40% of a tiny model's refit.
        await self.llm.engine_core.pause_scheduler_async(mode="keep" if self.partial_rollout else "wait",
                                                         clear_cache=False)

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

    def refit_workers(self) -> int:
        """Workers of this engine: each one joins the refit group."""
        par = self.llm.vllm_config.parallel_config
        return par.world_size * par.data_parallel_size

    async def join_refit(self, host: str, port: int, rank_offset: int, world_size: int) -> list[int]:
        """Every worker joins the refit group (`molt.refit`) at ranks rank_offset, rank_offset+1, ..."""
        return await self.llm.collective_rpc("molt_refit_join", args=(host, port, rank_offset, world_size))

    async def update_weights(self, version: int) -> float:
        """Receive the weights the trainer broadcasts now and switch to `version`; returns the seconds.

        Pause (keep or wait) -> load through the workers' reload path -> reset the prefix cache ->
        label later tokens `version` -> resume. With LoRA a new adapter instead (`_load_adapter`).
        """
        from vllm.v1.engine.exceptions import EngineDeadError

        if self.lora:
            return await self._load_adapter(version)
        start = time.perf_counter()
        try:
            await self._pause()
            await self.llm.collective_rpc("molt_refit_receive")
        except EngineDeadError:
            self._exit()
            raise
        except BaseException:
            await self.llm.resume_generation()
            raise
        await self._commit(version)
        return time.perf_counter() - start

    async def _load_adapter(self, version: int) -> float:
        """LoRA refit: receive the adapter into a new folder, load it as a new adapter and give it to new
        requests as `version`; returns the seconds. Nothing pauses: requests in flight keep the adapter
        they started with, and prefix-cache entries are keyed by adapter, so none goes stale. Adapters
        that no request uses any more are unloaded (and their folders removed), so memory stays bounded.
        """
        from vllm.lora.request import LoRARequest
        from vllm.v1.engine.exceptions import EngineDeadError

        start = time.perf_counter()
        serial = max((a.lora_int_id for a in self.adapter_users), default=0) + 1   # unique per load
        folder = os.path.join(self.adapter_dir, str(serial))
        try:
            await self.llm.collective_rpc("molt_refit_receive_adapter", args=(folder, self.lora))
            adapter = LoRARequest(f"molt-{serial}", serial, folder)
            await self.llm.add_lora(adapter)
        except EngineDeadError:
            self._exit()
            raise
        self.adapter, self.version = adapter, version
        self.adapter_users[adapter] = 0
        for old in [a for a, users in self.adapter_users.items() if users == 0 and a != adapter]:
            del self.adapter_users[old]
            await self.llm.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)
        return time.perf_counter() - start

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
        self.closing = True
        self.llm.shutdown()
        if self.adapter_dir:
            shutil.rmtree(self.adapter_dir, ignore_errors=True)


def start_engine(spec: Any, model_path: str, index: int) -> Any:
    """Engine actor `index` on its plan node (molt/placement.py); call `ready` on it before use."""
    from molt.placement import cluster_nodes, cpu_threads, node_selector, plan

    ids = [n["NodeID"] for n in cluster_nodes(spec)]
    [slot] = [s for s in plan(spec) if s.role == "engine" and s.index == index]
    threads = cpu_threads(spec, "engine", index)
    options = dict(actor_options(spec.rollout.engine, spec.parallel.device, threads),
                   label_selector=node_selector(ids[slot.node]))
    return EngineActor.options(**options).remote(model_path, spec.rollout, spec.model, spec.run.seed, index)


def start_engines(spec: Any, model_path: str) -> list:
    """Start `rollout.engine.num_engines` engine actors from a `RunSpec` and wait until they are ready."""
    check_lora(model_path, spec.model)
    engines = [start_engine(spec, model_path, i) for i in range(spec.rollout.engine.num_engines)]
    ray.get([e.ready.remote() for e in engines], timeout=spec.rollout.engine.start_timeout_s)
    return engines
