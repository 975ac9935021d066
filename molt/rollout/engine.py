"""A vLLM engine as a Ray actor: token ids in, token ids + logprobs + policy versions out.

Policy versions are ints (0 = the initial weights). vLLM stamps every output token with the engine's
current weight version label, so a request that lives across a refit reports exactly where the
weights changed; `generate` expands those spans into one version per generated token.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import os
import queue
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import ray

from molt.inputs.vision import collapse, decode
from molt.plan.cores import FreeCores
from molt.rollout.engine_args import actor_options, check_lora, engine_kwargs, on_cpu
from molt.rollout.routes import from_wire
from molt.rollout.sampling import sampling_params
from molt.spec import ModelSpec, RolloutSpec
from molt.trajectory import AgentError, Sample


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if not future.done():   # (a caller that was cancelled no longer waits)
        future.set_result(result) if error is None else future.set_exception(error)


def per_token_versions(spans: list[Any] | None, n: int, fallback: int) -> list[int]:
    """Expand vLLM's `[start, end)` weight-version spans into one int per output token."""
    versions = [fallback] * n
    for span in spans or []:
        versions[span.start:span.end] = [int(span.version)] * (span.end - span.start)
    return versions


@ray.remote
class EngineActor:
    """vLLM's `LLMEngine` with its engine core in this process, driven by one thread of its own. vLLM's
    asyncio engine (`AsyncLLM`) always runs its core in a child process, which imports vLLM a
    second time: in-process an engine starts 2.4x sooner for 2.4x less CPU and a round of requests runs
    1.45x faster on CPU (bench/RESULTS.md `engine_modes`). Only the engine thread (`_serve`) touches
    `self.llm`; the actor's asyncio methods hand it calls (`_on_engine`) and await its results.
    """

    def __init__(self, model_path: str, rollout: RolloutSpec, model: ModelSpec, seed: int = 0,
                 index: int = 0, sleeps: bool = False, threads: int | None = None) -> None:
        from vllm import EngineArgs

        self.index, self.free = index, FreeCores(threads)   # threads: None but with cpu_threads null on CPU
        self.partial_rollout = rollout.partial_rollout
        self.prompt_too_long = rollout.prompt_too_long
        self.max_model_len = model.max_model_len
        self.router_replay = model.router_replay
        self.engine_args = EngineArgs(**engine_kwargs(model_path, rollout, model, seed + index, sleeps))
        self.llm: Any = None                       # vLLM's LLMEngine, built by the engine thread
        self.built: concurrent.futures.Future = concurrent.futures.Future()
        self.calls: queue.SimpleQueue = queue.SimpleQueue()   # (function, future, drain) for the thread
        self.finals: dict[str, asyncio.Future] = {}            # request id -> its final output
        self.loop: asyncio.AbstractEventLoop | None = None
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
        self.lora = model.lora.model_dump() if model.lora.served_as_adapter() else None
        self.adapter: Any = None                   # the LoRARequest new requests get
        self.adapter_users: dict[Any, int] = {}    # loaded adapters -> requests in flight on each
        self.adapter_dir = tempfile.mkdtemp(prefix="molt-lora-", dir="/dev/shm" if os.path.isdir(
            "/dev/shm") else None) if self.lora else None
        # the engine is built while the driver sets itself up (the caller awaits `ready`)
        threading.Thread(target=self._serve, name="molt-engine", daemon=True).start()

    async def ready(self) -> int:
        self.loop = asyncio.get_running_loop()   # (the engine thread needs it only for calls: after this)
        await asyncio.wrap_future(self.built)
        self.image_token = getattr(self.llm.model_config.hf_config, "image_token_id", None)  # VLMs only
        await self._on_engine(lambda: self.llm.set_weight_version("0"))
        if self.router_replay:
            self.capture = on_cpu()
            method = "molt_routes_start" if self.capture else "molt_moe_layers"
            self.moe_layers = (await self._on_engine(lambda: self.llm.collective_rpc(method)))[0]
        return self.index

    async def _on_engine(self, function: Callable[[], Any], drain: bool = False) -> Any:
        """Run `function` on the engine thread, between two engine steps; with `drain`, only once no
        request is left in the engine (requests that arrive meanwhile wait behind it)."""
        future = self.loop.create_future()
        self.calls.put((function, future, drain))
        return await future

    def _serve(self) -> None:
        """The engine thread: build vLLM's engine, run the calls handed over, step the engine while it holds
        requests, and pass each finished request's output to the actor's loop. An exception from a step
        means vLLM's engine is broken: the actor exits, which Ray reports to every caller as a dead actor,
        the one failure the dispatcher handles (and restarts).

        Built on another thread, the same engine stepped here ran 1.15x slower on 2 cores (30M model,
        32 x 128 tokens: bench/engine_modes.py mode inproc_other_thread): OpenMP keeps a thread team per
        thread that computes, and the builder's idle team let this one's workers sleep between regions."""
        from vllm.v1.engine.llm_engine import LLMEngine

        try:
            self.llm = LLMEngine.from_engine_args(self.engine_args)
        except Exception as err:   # noqa: BLE001 - raised by `ready`
            self.built.set_exception(err)
            return
        self.built.set_result(None)
        waiting: collections.deque = collections.deque()
        try:
            while not self.closing:
                if not waiting and not self.llm.has_unfinished_requests():
                    waiting.append(self.calls.get())   # idle: sleep until a call comes
                while not self.calls.empty():
                    waiting.append(self.calls.get_nowait())
                while waiting and not (waiting[0][2] and self.llm.has_unfinished_requests()):
                    function, future, _ = waiting.popleft()
                    try:
                        self.loop.call_soon_threadsafe(_settle, future, function(), None)
                    except Exception as err:   # noqa: BLE001 - the caller's failure, raised in the caller
                        self.loop.call_soon_threadsafe(_settle, future, None, err)
                if self.llm.has_unfinished_requests():
                    self.free.set_threads()   # the planned threads, less the cores other work keeps busy
                    finals = [out for out in self.llm.step() if out.finished]
                    if finals:
                        self.loop.call_soon_threadsafe(self._finished, finals)
        except BaseException as err:   # noqa: BLE001
            if not self.closing:
                print(f"molt: engine {self.index}: vLLM's engine failed ({type(err).__name__}: {err}); "
                      "exiting the engine actor", flush=True)
                os._exit(1)

    def _finished(self, finals: list[Any]) -> None:
        for out in finals:
            if out.request_id in self.finals:   # (not when its caller was cancelled meanwhile)
                _settle(self.finals.pop(out.request_id), out, None)

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

        request_id = request_id or uuid.uuid4().hex
        if request_id in self.finals:
            raise AgentError(f"request id {request_id} is already in flight on engine {self.index}")
        prompt = self._prompt(prompt_ids, images, request_id)
        version_at_start, adapter = self.version, self.adapter
        self._enter(adapter)
        done = self.finals[request_id] = self.loop.create_future()
        try:
            # With images the expanded length is known only once vLLM has processed them.
            params = sampling_params(sampling, max(1, min(sampling["max_tokens"], self.max_model_len - len(
                prompt["prompt_token_ids"]))))
            await self._on_engine(lambda: self.llm.add_request(request_id, prompt, params,
                                                               lora_request=adapter))
            final = await done
        except VLLMClientError as err:
            # vLLM's own verdict that the request is at fault (e.g. an image prompt that expands past
            # max_model_len): that rollout fails, the run goes on. (Only the message crosses Ray.)
            raise AgentError(f"vLLM refused the request: {err}") from None
        except asyncio.CancelledError:   # the caller gave up (a chat client disconnected): free the engine
            self.calls.put((lambda: self.llm.abort_request([request_id]), self.loop.create_future(), False))
            raise
        finally:
            self.finals.pop(request_id, None)
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
            routes = from_wire((await self.collective_rpc("molt_routes", (request_id, length)))[0])
        return np.ascontiguousarray(routes[:length, self.moe_layers])

    async def capture_routes(self, token_ids: list[list[int]]) -> list[np.ndarray]:
        """Fallback for segments that came without routes: re-score each under the current weights.

        One prefill-only request per sequence (its last token is never an input, so it is left out);
        the routes are only right for tokens the current weights sampled.
        """
        outs = await asyncio.gather(*[self.generate(ids[:-1], {"max_tokens": 1, "temperature": 1.0})
                                      for ids in token_ids])
        return [out["routed_experts"] for out in outs]

    def _reload(self, version: int) -> None:
        """On the engine thread, so no step runs meanwhile: receive the trainer's broadcast through the
        workers' reload path, drop cached KV and label later tokens `version` (the core's pause first:
        it synchronizes the device). Cached KV was computed by the old weights (a prefix hit
        would mix two policies); the reset also preempts kept requests, so their KV is recomputed."""
        core = self.llm.engine_core.engine_core
        core.pause_scheduler(mode="keep", clear_cache=False)
        try:
            self.llm.collective_rpc("molt_refit_receive")
            if not self.llm.reset_prefix_cache(reset_running_requests=True):
                raise RuntimeError("vLLM refused to reset the prefix cache after a weight update")
            self.llm.set_weight_version(str(version))
        finally:
            core.resume_scheduler()

    def refit_workers(self) -> int:
        """Workers of this engine: each one joins the refit group."""
        par = self.llm.vllm_config.parallel_config
        return par.world_size * par.data_parallel_size

    async def join_refit(self, host: str, port: int, rank_offset: int, world_size: int) -> list[int]:
        """Every worker joins the refit group (`molt.refit`) at ranks rank_offset, rank_offset+1, ..."""
        return await self.collective_rpc("molt_refit_join", (host, port, rank_offset, world_size))

    async def update_weights(self, version: int) -> float:
        """Receive the weights the trainer broadcasts now and switch to `version`; returns the seconds.

        With partial rollouts requests in flight are kept across the load; without, the engine drains
        them first (requests that arrive meanwhile wait), so every request is sampled by one policy.
        Then later tokens are labelled `version`. With LoRA a new adapter instead (`_load_adapter`).
        """
        if self.lora:
            return await self._load_adapter(version)
        start = time.perf_counter()
        await self._on_engine(lambda: self._reload(version), drain=not self.partial_rollout)
        self.version = version
        return time.perf_counter() - start

    async def _load_adapter(self, version: int) -> float:
        """LoRA refit: receive the adapter into a new folder, load it as a new adapter and give it to new
        requests as `version`; returns the seconds. Nothing pauses: requests in flight keep the adapter
        they started with, and prefix-cache entries are keyed by adapter, so none goes stale. Adapters
        that no request uses any more are unloaded (and their folders removed), so memory stays bounded.
        """
        from vllm.lora.request import LoRARequest

        start = time.perf_counter()
        serial = max((a.lora_int_id for a in self.adapter_users), default=0) + 1   # unique per load
        folder = os.path.join(self.adapter_dir, str(serial))
        adapter = LoRARequest(f"molt-{serial}", serial, folder)
        await self.collective_rpc("molt_refit_receive_adapter", (folder, self.lora))
        await self._on_engine(lambda: self.llm.add_lora(adapter))
        self.adapter, self.version = adapter, version
        self.adapter_users[adapter] = 0
        for old in [a for a, users in self.adapter_users.items() if users == 0 and a != adapter]:
            del self.adapter_users[old]
            await self._on_engine(lambda old=old: self.llm.remove_lora(old.lora_int_id))
            shutil.rmtree(old.lora_path, ignore_errors=True)
        return time.perf_counter() - start

    async def sleep(self, level: int) -> None:
        """Free the GPU for a colocated trainer (parallel.colocate) once no request is in flight: vLLM's
        sleep, level 1 (weights to host memory) or 2 (weights dropped; the next refit restores them); the
        KV cache goes either way. On CPU vLLM's sleep frees nothing: the same calls, cores shared."""
        await self._on_engine(lambda: self.llm.sleep(level), drain=True)

    async def wake_up(self) -> None:
        """Take the GPU back for generation (after a level-2 sleep its weights are garbage until the refit
        that follows); the prefix cache was emptied by the sleep."""
        await self._on_engine(self.llm.wake_up)

    async def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list:
        return await self._on_engine(lambda: self.llm.collective_rpc(method, args=args, kwargs=kwargs))

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

    async def shutdown(self) -> None:
        """Stop the engine thread and vLLM's engine (its workers, on a GPU its memory)."""
        if self.llm is not None and self.loop is not None:
            await self._on_engine(self._stop)
        elif self.llm is not None:   # built, never ready: the engine thread waits for calls, idle
            self._stop()
        if self.adapter_dir:
            shutil.rmtree(self.adapter_dir, ignore_errors=True)

    def _stop(self) -> None:
        self.closing = True
        self.llm.engine_core.shutdown()


def start_engine(spec: Any, model_path: str, index: int, slot: Any = None, rollout: RolloutSpec | None = None,
                 model: ModelSpec | None = None, threads: int | None = None) -> Any:
    """Engine actor `index` on its plan node (molt/plan/placement.py: `spec` is the run's, which places it),
    or on `slot`'s; it serves `model` with `rollout`'s engine and sampling settings (the run's policy
    engine's when None: a judge's engine passes its own) on `threads` threads (None: the plan's). Call
    `ready` on it before use."""
    from molt.plan.placement import cluster_nodes, colocated, cpu_threads, gpu_share, node_selector, plan

    rollout, model = rollout or spec.rollout, model or spec.model
    ids = [n["NodeID"] for n in cluster_nodes(spec)]
    slot = slot or next(s for s in plan(spec) if s.role == "engine" and s.index == index)
    threads = threads or cpu_threads(spec, "engine", index)
    share = gpu_share(spec) if colocated(spec, slot.role) else 1.0
    options = dict(actor_options(rollout.engine, spec.parallel.device, threads, share),
                   label_selector=node_selector(ids[slot.node]))
    follow = threads if spec.parallel.device == "cpu" and spec.parallel.cpu_threads is None else None
    return EngineActor.options(**options).remote(model_path, rollout, model, spec.run.seed, index,
                                                 colocated(spec, slot.role), follow)


def start_engines(spec: Any, model_path: str, slots: list | None = None, rollout: RolloutSpec | None = None,
                  model: ModelSpec | None = None, threads: int | None = None) -> list:
    """Start the engine actors of `rollout.engine.num_engines` (on `slots`' nodes, if given; the other
    arguments as `start_engine`'s) and wait until they are ready."""
    rollout, model = rollout or spec.rollout, model or spec.model
    check_lora(model_path, model)
    slots = slots or [None] * rollout.engine.num_engines
    engines = [start_engine(spec, model_path, i, slot, rollout, model, threads)
               for i, slot in enumerate(slots)]
    ray.get([e.ready.remote() for e in engines], timeout=rollout.engine.start_timeout_s)
    return engines
