"""Sampling parameters for `EngineActor.generate`: what training accepts, request seeds, and vLLM's
`SamplingParams` for a request (the spec's defaults are `RolloutSpec.request()`)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

from molt.spec import GREEDY_BELOW
from molt.trajectory import AgentError, Sample


def check_trainable(sampling: dict[str, Any]) -> None:
    """Refuse a training request whose tokens the trainer could not score under the distribution they were
    sampled from. Temperature, top-p and top-k (per turn too) are recomputed exactly; greedy decoding and
    constrained decoding are not (evaluation may use both)."""
    temperature = sampling.get("temperature", 1.0)
    if temperature < GREEDY_BELOW:
        raise AgentError(f"a training rollout asked for temperature={temperature}, i.e. greedy decoding: its "
                         "tokens have no sampling probability to train on (greedy is for evaluation)")
    if sampling.get("structured_outputs"):
        raise AgentError("a training rollout asked for constrained decoding (structured_outputs, e.g. a "
                         "forced tool_choice): the engine samples from a grammar-masked distribution the "
                         "trainer cannot recompute, so its logprobs would be off-policy (evaluation only)")


def request_seed(run_seed: int, version: int, key: str, call: int) -> int:
    """The sampling seed of a rollout's `call`-th request, from the run seed, the policy version and the
    rollout id: reruns sample the same tokens, different requests draw independent streams."""
    digest = hashlib.blake2b(f"{run_seed}/{version}/{key}/{call}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1   # a non-negative int64


class TrainingSampler:
    """What training rollouts sample through: `check_trainable` on every request, then the dispatcher, with a
    seed from `request_seed` unless the request brings its own (`version` reads the current policy)."""

    def __init__(self, dispatcher: Any, run_seed: int, version: Callable[[], int]) -> None:
        self.dispatcher, self.run_seed, self.version = dispatcher, run_seed, version
        self.calls: dict[str, int] = {}     # requests so far, per rollout

    async def generate(self, prompt_ids: list[int], sampling: dict, key: str,
                       images: list[str] | None = None) -> Sample:
        check_trainable(sampling)
        call = self.calls[key] = self.calls.get(key, -1) + 1
        seed = request_seed(self.run_seed, self.version(), key, call)
        return await self.dispatcher.generate(prompt_ids, {"seed": seed, **sampling}, key, images)

    def release(self, key: str) -> None:
        """Forget rollout `key` (it ended; `Runner.run` calls this)."""
        self.calls.pop(key, None)
        self.dispatcher.release(key)


# The sampling keys a request may carry. None of the others (min_p, penalties, logit biases, min_tokens,
# stop strings) is passed on: each would change the distribution the tokens are drawn from in a way the
# trainer's logprob recomputation (temperature, top-p, top-k) does not reproduce, or needs the detokenized
# text; a request with one fails (AgentError) rather than be sampled without it.
REQUEST_KEYS = ("temperature", "top_p", "top_k", "max_tokens", "stop_token_ids", "seed", "ignore_eos",
                 "structured_outputs", "prompt_logprobs")


def sampling_params(sampling: dict[str, Any], max_tokens: int):
    """vLLM `SamplingParams` asking for the sampled token's logprob and only the final output. A key outside
    `REQUEST_KEYS`, or a value vLLM refuses, is an `AgentError`: it fails the request's rollout."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMClientError
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    unknown = sorted(set(sampling) - set(REQUEST_KEYS))
    if unknown:
        raise AgentError(f"sampling parameters {unknown} are not supported: the trainer could not score the "
                         f"tokens they change (or they need text); use {', '.join(REQUEST_KEYS)} "
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
