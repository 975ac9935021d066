"""The one place where the run spec becomes vLLM engine arguments and the engine actor's Ray options.

Every performance flag a user may want is either an `EngineSpec` field mapped here or goes through
`rollout.engine.extra_args`, which is passed to `EngineArgs` unchanged and wins over the mapped
values, so a new vLLM flag never needs a code change (the spec refuses there the arguments it derives
from other keys: `molt.spec.rollout.OWNED_ENGINE_ARGS`).
"""

from __future__ import annotations

import os
from typing import Any, get_args

from molt.inputs.vision import is_vision_model
from molt.plan.placement import ENGINE_CPUS, NCCL_ENV
from molt.spec import LOGPROBS_MODE, EngineSpec, ModelSpec, RolloutSpec

WORKER_EXTENSION = "molt.rollout.worker_extension.MoltWorkerExtension"
MOE_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")   # expert counts in HF configs


def on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def engine_kwargs(model_path: str, rollout: RolloutSpec, model: ModelSpec, seed: int,
                  sleeps: bool = False) -> dict[str, Any]:
    """`EngineArgs(**kwargs)` for one engine; `sleeps`: it sleeps while a colocated trainer steps
    (parallel.colocate; vLLM's sleep mode exists on GPU only, CPU engines sleep without it)."""
    eng = rollout.engine
    kwargs: dict[str, Any] = dict(
        model=model_path,
        dtype=model.dtype,
        max_model_len=model.max_model_len,
        trust_remote_code=model.trust_remote_code,
        seed=seed,
        tensor_parallel_size=eng.tp_size,
        data_parallel_size=1,   # one replica per engine actor: its one engine core runs in-process
        enable_expert_parallel=eng.enable_expert_parallel,
        enforce_eager=eng.enforce_eager,
        enable_prefix_caching=eng.enable_prefix_caching,
        max_num_batched_tokens=eng.max_num_batched_tokens,
        max_num_seqs=eng.max_num_seqs,
        speculative_config=eng.speculative_config,
        worker_extension_cls=WORKER_EXTENSION,
        disable_log_stats=True,
        # Behaviour logprobs of the distribution each token is sampled from (after temperature, top-k,
        # top-p), which the trainer recomputes; vLLM's default is the raw model distribution.
        logprobs_mode=LOGPROBS_MODE,
    )
    if rollout.partial_rollout and rollout.mode == "async":
        # A refit runs between two engine steps and keeps the requests in flight; with async scheduling
        # (vLLM's default on GPU; CPU engines never schedule ahead) a batch the old weights sampled could
        # still be out, and its tokens would be labelled with the new policy version. A sync run refits
        # with nothing in flight, so it keeps vLLM's scheduling.
        kwargs["async_scheduling"] = False
    if model.lora.served_as_adapter():
        kwargs.update(lora_kwargs(model.lora.rank, rollout.max_staleness))
    if is_vision_model(model_path, model.trust_remote_code):
        # Images only (the contract has no video). On CPU, vLLM's own Qwen-VL code imports torchvision,
        # which has no CPU build for the torch vLLM's CPU build pins: the transformers backend runs the
        # same Hugging Face model class without it.
        kwargs["limit_mm_per_prompt"] = {"video": 0}
        if on_cpu():
            kwargs["model_impl"] = "transformers"
    if on_cpu():
        # vLLM's CPU backend sizes the KV cache from an explicit byte budget, not a memory fraction.
        kwargs["kv_cache_memory_bytes"] = int(eng.kv_cache_gib * 2**30)
        # A seeded request whose prefill is split over steps (a long prompt, or the KV recomputation of
        # requests kept across a refit) makes vLLM rewind its sampler's generator, which a CPU generator
        # cannot do: the engine core dies ("CPU Generator does not use offset"). Never split a prefill.
        kwargs["enable_chunked_prefill"] = False
        if eng.tp_size == 1:
            kwargs["distributed_executor_backend"] = "uni"
    else:
        kwargs["gpu_memory_utilization"] = eng.gpu_memory_utilization
        kwargs["enable_sleep_mode"] = sleeps or None
        if model.router_replay:
            # The engine's own route capture (needs Model Runner V2, GPU only); on CPU molt.rollout.routes
            # captures them instead.
            kwargs["enable_return_routed_experts"] = True
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    return {**kwargs, **eng.extra_args}


def actor_options(engine: EngineSpec, device: str, threads: int = 1, share: float = 1.0) -> dict[str, Any]:
    """Ray resources of one engine on `device` (`parallel.device`: the spec says where engines run, not
    the driver's host, which may have no GPU). On CPU a tiny fraction, so engines and trainer ranks share
    cores.

    On CPU the engine runs its worker inside the actor's process (≈2× faster on few cores than a
    separate worker process) with `threads` OpenMP threads (`molt.plan.placement.cpu_threads`), not pinned,
    so several engines can share cores. `share`: the fraction of each GPU it takes (`placement.gpu_share`).
    """
    # An async actor serves at most `max_concurrency` calls at once: every in-flight rollout is one.
    # vLLM's engine core in the actor's process, which drives it (molt/rollout/engine.py).
    in_process = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **NCCL_ENV}
    if device == "cuda":
        return {"num_cpus": ENGINE_CPUS[device], "num_gpus": engine.tp_size * share,
                "max_concurrency": 10_000, "runtime_env": {"env_vars": in_process}}
    env = {**in_process, "OMP_NUM_THREADS": str(threads),
           "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind")}
    if engine.enforce_eager:
        # An eager engine still torch.compiles one sampler helper (the sampled token's rank, which Molt
        # never reads) on its first request: 3.5-4 s of every engine's start on an idle 2-core host, for no
        # change in any logprob. Compiled mode keeps torch.compile.
        env["TORCH_COMPILE_DISABLE"] = "1"
    return {"num_cpus": ENGINE_CPUS[device], "runtime_env": {"env_vars": env}, "max_concurrency": 10_000}


def lora_kwargs(rank: int, max_staleness: int) -> dict[str, Any]:
    """vLLM's LoRA serving for `model.lora`: each refit loads a new adapter, and requests keep the adapter
    they started with, so up to max_staleness + 1 versions may be sampling at once."""
    from vllm.config.lora import MaxLoRARanks

    ranks = [r for r in get_args(MaxLoRARanks) if r >= rank]   # vLLM sizes its buffers for these only
    return {"enable_lora": True, "max_lora_rank": ranks[0], "max_loras": max_staleness + 1}


def check_lora(model_path: str, model: ModelSpec) -> None:
    """Refuse `model.lora` on a model whose adapters the engines cannot serve (before any engine starts)."""
    from transformers import AutoConfig

    if not model.lora.served_as_adapter():
        return
    config = AutoConfig.from_pretrained(model_path, trust_remote_code=model.trust_remote_code)
    if getattr(config, "vision_config", None) is not None:
        raise ValueError("model.lora with a vision-language model is not supported: its engine runs vLLM's "
                         "transformers backend on CPU, where adapter serving has not been made to work; "
                         "train it without model.lora")
    if any(getattr(config.get_text_config(), key, 0) for key in MOE_KEYS):
        raise ValueError("model.lora with a MoE model is not supported: vLLM serves an adapter on a MoE "
                         "model through its fused MoE LoRA kernels, which need Triton on a GPU (vLLM's CPU "
                         "build fails in them), so no path runs here to test it; train it without model.lora")
