"""The `rollout` section of the run spec: the vLLM engines, how training and the eval sets sample, and
the sync / async schedule."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from molt.spec.strict import Strict

GREEDY_BELOW = 1e-5   # vLLM decodes greedily below this temperature

# The distribution vLLM reports logprobs of: after temperature/top-k/top-p, what the trainer recomputes.
LOGPROBS_MODE = "processed_logprobs"

class EngineSpec(Strict):
    num_engines: int = Field(1, ge=1, description="vLLM engine actors (the dispatcher spreads requests over "
                             "them)")
    tp_size: int = Field(1, ge=1, description="tensor-parallel GPUs per engine")
    enable_expert_parallel: bool = Field(False, description="MoE: shard experts over the engine's GPUs")
    gpu_memory_utilization: float = Field(0.85, description="fraction of GPU memory vLLM may use")
    kv_cache_gib: float = Field(1.0, description="KV cache size on CPU (VLLM_CPU_KVCACHE_SPACE)")
    enforce_eager: bool = Field(True, description="skip torch.compile and CUDA graphs (faster start)")
    enable_prefix_caching: bool = Field(True, description="reuse the KV cache of shared prompt prefixes")
    max_num_batched_tokens: int | None = Field(None, description="vLLM token budget per scheduler step")
    max_num_seqs: int | None = Field(None, description="vLLM's most concurrent sequences per engine")
    speculative_config: dict[str, Any] | None = Field(
        None, description="vLLM speculative decoding with a model-free drafter (the refit never updates one "
        "with weights), e.g. {method: ngram, num_speculative_tokens: 2, prompt_lookup_max: 4}")
    extra_args: dict[str, Any] = Field(default_factory=dict, description="any other vLLM engine arguments")
    max_restarts: int = Field(
        3, ge=0, description="restarts of each engine after it dies (then the run goes on without it)")
    start_timeout_s: float = Field(
        600.0, gt=0, description="seconds a (re)started engine may take to come up before it counts as dead")

# vLLM engine arguments Molt derives from other keys (molt/rollout/engine_args.py), which
# rollout.engine.extra_args may not override: the plan, prompt fitting and refit read those keys.
OWNED_ENGINE_ARGS = {"model": "model.path", "tensor_parallel_size": "rollout.engine.tp_size",
                     "data_parallel_size": "one vLLM replica per engine actor (more replicas: "
                                           "rollout.engine.num_engines)",
                     "max_model_len": "model.max_model_len",
                     "worker_extension_cls": "Molt's refit (molt/rollout/worker_extension.py)"}

# The sampling a section sets for every request: one dict shape for training (`rollout.request()`) and
# evaluation (`rollout.eval.request()`), which agents see and may override per turn.
REQUEST_DEFAULTS = ("temperature", "top_p", "top_k", "max_tokens")

class EvalSamplingSpec(Strict):
    """How the eval sets are sampled (rollout.eval): greedy unless set."""

    temperature: float = Field(0.0, description="sampling temperature (0 = greedy)")
    top_p: float = Field(1.0, description="nucleus sampling mass (1 = off)")
    top_k: int = Field(-1, description="sample among the k most likely tokens (-1 = off)")
    max_tokens: int = Field(8, ge=1, description="most tokens generated per turn")
    n: int = Field(1, ge=1, description="samples per eval prompt (eval/pass@n)")
    pass_reward: float = Field(1.0, description="a sample with at least this reward counts as correct for "
                               "eval/pass@k (mean@n averages the rewards themselves)")

    def request(self) -> dict[str, Any]:
        """The eval sets' default sampling of a request (`n` is rollouts per prompt, not a request's)."""
        return {key: getattr(self, key) for key in REQUEST_DEFAULTS}

class RolloutSpec(Strict):
    mode: Literal["sync", "async"] = Field(
        "sync", description="sync: generate one batch, then train; async: keep generating while training")
    samples_per_prompt: int = Field(8, ge=1, description="rollouts per prompt: the group size of group "
                                    "estimators")
    max_tokens: int = Field(8, ge=1, description="most tokens sampled per turn")
    temperature: float = Field(1.0, description="sampling temperature; the trainer scores logits/temperature")
    top_p: float = Field(1.0, description="nucleus sampling mass (1 = off)")
    top_k: int = Field(-1, description="sample among the k most likely tokens (-1 = off)")
    groups_in_flight: int = Field(16, ge=1, description="async: prompt groups kept generating while training")
    partial_rollout: bool = Field(
        True, description="a refit pauses the engines and keeps in-flight requests, which go on with the "
        "new weights (false: the refit waits until the in-flight requests finish)")
    max_staleness: int = Field(1, ge=0, description="most policy versions between sampling a token and "
                               "training it")
    handout: Literal["freshest", "oldest"] = Field(
        "freshest", description="async: which finished groups a batch takes first: the freshest (least lag) "
        "or the oldest within rollout.max_staleness (first in, first out: tokens really reach that lag when "
        "rollout.groups_in_flight >= train.prompts_per_step x (1 + max_staleness); a staleness test)")
    prompt_too_long: Literal["truncate", "reject"] = Field(
        "reject", description="a prompt with no room for one token: fail the rollout or keep its tail")
    refit_chunk_mb: float = Field(
        256.0, gt=0, description="a refit streams the weights to the engines in chunks of at most this "
        "size; a larger tensor is gathered, cast and sent a range of rows (of experts) at a time")
    engine: EngineSpec = Field(default_factory=EngineSpec, description="the vLLM engines")
    eval: EvalSamplingSpec = Field(default_factory=EvalSamplingSpec,
                               description="sampling of the eval set (train.eval_every)")

    def request(self) -> dict[str, Any]:
        """Training's default sampling of a request; a turn may override it (rollout/sampling.py checks)."""
        return {key: getattr(self, key) for key in REQUEST_DEFAULTS}

    @field_validator("temperature")
    @classmethod
    def _samples(cls, value: float) -> float:
        # a greedy token has no sampling probability to correct against (and scoring it divides by 0)
        if value < GREEDY_BELOW:
            raise ValueError(f"rollout.temperature={value} does not sample (vLLM is greedy below "
                             f"{GREEDY_BELOW}); training needs sampled tokens. Greedy decoding is for "
                             "evaluation: rollout.eval.temperature=0")
        return value

    @model_validator(mode="after")
    def _engine_args(self) -> RolloutSpec:
        extra = self.engine.extra_args
        mode = extra.get("logprobs_mode", LOGPROBS_MODE)
        if mode != LOGPROBS_MODE:
            raise ValueError(f"rollout.engine.extra_args.logprobs_mode={mode}: the trainer recomputes "
                             f"{LOGPROBS_MODE} (the distribution tokens are sampled from); another mode "
                             "would make every importance weight and mismatch/* wrong")
        owned = sorted(set(extra) & set(OWNED_ENGINE_ARGS))
        if owned:
            raise ValueError(f"rollout.engine.extra_args.{owned[0]}: Molt sets this engine argument from "
                             f"{OWNED_ENGINE_ARGS[owned[0]]}, which the placement, prompt fitting and refit "
                             "rely on; set it there")
        if extra.get("async_scheduling") and self.partial_rollout and self.mode == "async":
            raise ValueError("rollout.engine.extra_args.async_scheduling=true with rollout.partial_rollout="
                             "true in async mode: a batch scheduled ahead with the old weights could still "
                             "be out after a refit and its tokens would be labelled with the new policy "
                             "version; set rollout.partial_rollout=false")
        return self
