"""What the engines hold and who may sample it: policy versions, sampling sessions, and samples.

The engines hold one set of weights at a time. Each `refit` makes them a new policy version (0 is the base
model). A sampler samples one version (a snapshot: the base model, or one save_weights_for_sampler), or the
latest of one training model (inflight); a sample of a version the engines no longer hold is refused rather
than served other weights. Samples wait while a refit runs and a refit waits for the samples in flight, so
every token of a sample comes from one version (checked on the versions the engine stamps on each token).
"""

from __future__ import annotations

import asyncio
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from tinker import types

from molt.driver.fleet import Fleet
from molt.rollout.sampling import request_seed
from molt.tinker import Refused
from molt.tinker.datums import SampledRecord
from molt.tinker.futures import Futures
from molt.tinker.wire import write_sample_response


@dataclass
class Sampler:
    id: str
    path: str | None            # the sampler weights' tinker:// path (None: the base model or unnamed)
    version: int | None         # the policy version it samples (None: inflight, the model's latest)
    model_id: str | None        # the training model it follows (inflight)


class Gate:
    """Samples share it; a refit has it alone, after the samples in flight and before any later one."""

    def __init__(self) -> None:
        self.cond = asyncio.Condition()
        self.sharing = 0
        self.waiting = 0   # refits waiting: later samples queue behind them

    @asynccontextmanager
    async def shared(self):
        async with self.cond:
            await self.cond.wait_for(lambda: not self.waiting)
            self.sharing += 1
        try:
            yield
        finally:
            async with self.cond:
                self.sharing -= 1
                self.cond.notify_all()

    @asynccontextmanager
    async def alone(self):
        async with self.cond:
            self.waiting += 1
            await self.cond.wait_for(lambda: not self.sharing)
        try:
            yield
        finally:
            async with self.cond:
                self.waiting -= 1
                self.cond.notify_all()


class Engines:
    def __init__(self, fleet: Fleet, base_model: str, max_model_len: int, futures: Futures) -> None:
        self.fleet, self.base_model, self.futures = fleet, base_model, futures
        self.max_model_len = max_model_len
        self.version = 0                          # the policy version the engines hold
        self.version_model: str | None = None     # the training model whose weights those are (None: base)
        self.samplers: dict[str, Sampler] = {}
        self.paths: dict[str, int] = {}           # sampler weights path -> its version
        self.sampled = SampledRecord()            # what the engines sampled with the weights they hold
        self.gate = Gate()

    async def refit(self, model_id: str) -> float:
        """The trainer's weights (the fleet's connected policy) to the engines as the next version; returns
        the seconds."""
        async with self.gate.alone():
            version = self.version + 1
            seconds = await self.fleet.refit(version)
            self.version, self.version_model = version, model_id
            self.sampled.clear()
        return seconds

    def new_sampler(self, path: str | None, version: int | None, model_id: str | None) -> Sampler:
        sampler = Sampler(f"sampler-{uuid.uuid4().hex[:12]}", path, version, model_id)
        self.samplers[sampler.id] = sampler
        return sampler

    def create_sampler(self, request: types.CreateSamplingSessionRequest) -> str:
        if request.model_path is None:
            if request.base_model != self.base_model:
                raise Refused(f"base_model={request.base_model!r} is not served; this service serves "
                              f"{self.base_model!r}")
            return self.new_sampler(None, 0, None).id
        if request.model_path not in self.paths:
            raise Refused(f"model_path={request.model_path!r} is not sampler weights this service saved "
                          "(save_weights_for_sampler; training-state paths are not sampled)")
        return self.new_sampler(request.model_path, self.paths[request.model_path], None).id

    def sampler(self, sampler_id: str | None) -> Sampler:
        if sampler_id not in self.samplers:
            raise Refused(f"sampling session {sampler_id} is unknown")
        return self.samplers[sampler_id]

    def info(self, sampler_id: str) -> types.GetSamplerResponse:
        sampler = self.sampler(sampler_id)
        return types.GetSamplerResponse(sampler_id=sampler.id, base_model=self.base_model,
                                        model_path=sampler.path)

    def _check_held(self, sampler: Sampler) -> None:
        if sampler.version is None:
            if self.version_model != sampler.model_id:
                raise Refused(f"the engines no longer hold weights of model {sampler.model_id}")
        elif sampler.version != self.version:
            what = sampler.path or ("the base model" if sampler.version == 0 else
                                    f"version {sampler.version}")
            raise Refused(f"this sampler samples {what}, but the engines now hold policy version "
                          f"{self.version} (they hold one set of weights: the latest "
                          "save_weights_for_sampler); sample from a sampler of the latest weights")

    def sample(self, request: types.SampleRequest) -> tuple[str, list[str]]:
        """Start a sample request; returns its request id and one sequence id per sample."""
        sampler = self.sampler(request.sampling_session_id)
        prompt, sampling = check_sample(request, self.max_model_len)
        self._check_held(sampler)
        keys = [uuid.uuid4().hex for _ in range(request.num_samples)]
        # a seeded request repeats, and its samples differ from each other: one derived seed per sample
        per_sample = [sampling if "seed" not in sampling else
                      {**sampling, "seed": request_seed(sampling["seed"], 0, "sample", i)}
                      for i in range(len(keys))]
        return self.futures.start(self._sample(sampler, prompt, per_sample, keys,
                                               request.prompt_logprobs_last_n)), keys

    async def _sample(self, sampler: Sampler, prompt: list[int], sampling: list[dict[str, Any]],
                      keys: list[str], last_n: int | None) -> bytes:
        async with self.gate.shared():
            self._check_held(sampler)
            version = self.version
            outs = await asyncio.gather(*[self.fleet.dispatcher.generate(prompt, params, key)
                                          for params, key in zip(sampling, keys, strict=True)])
        sequences = []
        for key, out in zip(keys, outs, strict=True):
            self.fleet.dispatcher.release(key)
            if any(v != version for v in out["versions"]) or out["finish_reason"] not in ("stop", "length"):
                raise RuntimeError(f"a sample came back {out['finish_reason']} or from versions "
                                   f"{sorted(set(out['versions']))}, not {version}")
            self.sampled.add(out["token_ids"], out["logprobs"])
            sequences.append((out["finish_reason"], out["token_ids"], out["logprobs"]))
        prompt_logprobs = outs[0].get("prompt_logprobs")
        if prompt_logprobs is not None and last_n is not None:
            prompt_logprobs = [None] * (len(prompt_logprobs) - last_n) + prompt_logprobs[-last_n:]
        return write_sample_response(sequences, prompt_logprobs)


def check_sample(request: types.SampleRequest, max_model_len: int) -> tuple[list[int], dict[str, Any]]:
    """The prompt ids and the engine's sampling keys of a sample request; what it cannot serve is refused
    by name."""
    refused = {"topk_prompt_logprobs": request.topk_prompt_logprobs,
               "topk_sample_logprobs": request.topk_sample_logprobs,
               "target_prompt_logprobs": request.target_prompt_logprobs,
               "prompt_alt_tokens_k": request.prompt_alt_tokens_k,
               "record_stability_info": request.record_stability_info,
               "model_path (without a sampling session)": request.model_path}
    for name, value in refused.items():
        if value:
            raise Refused(f"{name} is not served")
    try:
        prompt = request.prompt.to_ints()
    except ValueError:
        kinds = sorted({type(c).__name__ for c in request.prompt.chunks})
        raise Refused(f"prompt chunks {kinds}: only token chunks are served (no images or audio)") from None
    if not prompt or request.num_samples < 1:
        raise Refused(f"a sample request needs a prompt and num_samples >= 1 (num_samples="
                      f"{request.num_samples})")
    params = request.sampling_params
    room = max_model_len - len(prompt)   # what the context leaves (the engine would shrink max_tokens)
    if (params.max_tokens is not None and params.max_tokens > room) or room < 1:
        raise Refused(f"a prompt of {len(prompt)} tokens with max_tokens={params.max_tokens} does not fit "
                      f"the context (model.max_model_len={max_model_len})")
    sampling: dict[str, Any] = {"temperature": params.temperature, "top_p": params.top_p,
                                "top_k": params.top_k, "max_tokens": params.max_tokens or room}
    if params.seed is not None:
        sampling["seed"] = params.seed
    stop = params.stop
    if isinstance(stop, str) or (stop and any(isinstance(s, str) for s in stop)):
        raise Refused("SamplingParams.stop as strings is not served (stop on token ids: pass the stop "
                      "tokens' ids)")
    if stop is not None:
        sampling["stop_token_ids"] = list(stop)
        sampling["ignore_eos"] = not stop   # []: no stop token at all, EOS included
    if request.prompt_logprobs:
        sampling["prompt_logprobs"] = 0
        last = request.prompt_logprobs_last_n
        if last is not None and not 1 <= last <= len(prompt) - 1:
            raise Refused(f"prompt_logprobs_last_n={last} must be between 1 and len(prompt) - 1")
    elif request.prompt_logprobs_last_n is not None:
        raise Refused("prompt_logprobs_last_n needs prompt_logprobs")
    return prompt, sampling
