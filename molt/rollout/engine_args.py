"""The one place where the run spec becomes vLLM engine arguments.

Every performance flag a user may want is either an `EngineSpec` field mapped here or goes through
`rollout.engine.extra_args`, which is passed to `AsyncEngineArgs` unchanged and wins over the mapped
values, so a new vLLM flag never needs a code change.
"""

from __future__ import annotations

from typing import Any

from molt.vision import is_vision_model

WORKER_EXTENSION = "molt.rollout.worker.MoltWorkerExtension"
LOGPROBS_MODE = "processed_logprobs"


def on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def engine_kwargs(model_path: str, rollout: dict[str, Any], model: dict[str, Any],
                  seed: int) -> dict[str, Any]:
    """`AsyncEngineArgs(**kwargs)` for one engine; `rollout`/`model` are the spec sections as dicts."""
    eng = rollout["engine"]
    kwargs: dict[str, Any] = dict(
        model=model_path,
        dtype=model["dtype"],
        max_model_len=model["max_model_len"],
        trust_remote_code=model["trust_remote_code"],
        seed=seed,
        tensor_parallel_size=eng["tp_size"],
        data_parallel_size=eng["dp_size"],
        enable_expert_parallel=eng["enable_expert_parallel"],
        enforce_eager=eng["enforce_eager"],
        enable_prefix_caching=eng["enable_prefix_caching"],
        max_num_batched_tokens=eng["max_num_batched_tokens"],
        max_num_seqs=eng["max_num_seqs"],
        speculative_config=eng["speculative_config"],
        worker_extension_cls=WORKER_EXTENSION,
        disable_log_stats=True,
        # Behaviour logprobs of the distribution each token is sampled from (after temperature, top-k,
        # top-p), which the trainer recomputes; vLLM's default is the raw model distribution.
        logprobs_mode=LOGPROBS_MODE,
    )
    if is_vision_model(model_path, model["trust_remote_code"]):
        # Images only (the contract has no video). On CPU, vLLM's own Qwen-VL code imports torchvision,
        # which has no CPU build for the torch vLLM's CPU build pins: the transformers backend runs the
        # same Hugging Face model class without it.
        kwargs["limit_mm_per_prompt"] = {"video": 0}
        if on_cpu():
            kwargs["model_impl"] = "transformers"
    if on_cpu():
        # vLLM's CPU backend sizes the KV cache from an explicit byte budget, not a memory fraction.
        kwargs["kv_cache_memory_bytes"] = int(eng["kv_cache_gib"] * 2**30)
        if eng["tp_size"] * eng["dp_size"] == 1:
            kwargs["distributed_executor_backend"] = "uni"
    else:
        kwargs["gpu_memory_utilization"] = eng["gpu_memory_utilization"]
        if model["router_replay"]:
            # The engine's own route capture (needs Model Runner V2, GPU only); on CPU molt.rollout.routes
            # captures them instead.
            kwargs["enable_return_routed_experts"] = True
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    return {**kwargs, **eng["extra_args"]}
