"""Load a role's model and shard it with FSDP2 through NeMo AutoModel's parallelizer.

CPU: transformers loads the checkpoint (AutoModel's loader asserts CUDA), then AutoModel's
`parallelize_model` shards it over a gloo mesh in fp32. GPU: AutoModel's own loader builds the model
directly on the mesh (meta-device init, sharded load, its kernels) in the configured dtype with fp32
gradient reduction. The critic is a token-classification model with one label (a value head on the
same backbone), loaded with transformers on both devices and sharded the same way.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from molt.spec import RunSpec
from molt.trainer.router_replay import freeze_router, install_replay

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def model_path(spec: RunSpec, role: str) -> str:
    """The checkpoint a role starts from: the reference may name its own, everything else the policy's."""
    if role == "reference" and spec.model.reference not in (None, "policy"):
        return spec.model.reference
    if spec.model.path is not None:
        return spec.model.path
    from molt.tiny import tiny_model_path

    return str(tiny_model_path(**spec.model.tiny))


def distributed_setup(spec: RunSpec) -> Any:
    """AutoModel's mesh + FSDP2 policy for `spec.parallel` (needs the default process group)."""
    from nemo_automodel.components.distributed.config import DistributedSetup, FSDP2Config
    from nemo_automodel.components.distributed.mesh import ParallelismSizes
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    par = spec.parallel
    cuda = par.device == "cuda"
    compute = DTYPES[spec.model.dtype] if cuda else torch.float32  # CPU trains in fp32 (spec rule)
    # offload=full is FSDP2's CPU offload: sharded params, grads and optimizer state live on the host
    # (offload=optimizer is the optimizer's business: molt/trainer/offload.py). pin_memory needs an
    # accelerator; on CPU the policy is a no-op kept for the same code path.
    offload = CPUOffloadPolicy(pin_memory=cuda) if par.offload == "full" else None
    strategy = FSDP2Config(
        mp_policy=MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32,
                                       output_dtype=torch.float32),
        offload_policy=offload,
        activation_checkpointing=par.activation_checkpointing,
    )
    sizes = ParallelismSizes(dp_size=par.dp_size, tp_size=par.tp_size, cp_size=par.cp_size,
                             ep_size=par.ep_size)
    return DistributedSetup.build(strategy=strategy, parallelism_sizes=sizes, world_size=par.world_size,
                                  activation_checkpointing=par.activation_checkpointing)


def build_model(spec: RunSpec, role: str, setup: Any) -> nn.Module:
    """The sharded model of `role` (policy | reference | critic) on `distributed_setup(spec)`'s mesh,
    ready for forward on this rank."""
    from nemo_automodel.components.distributed.model_parallelizer import parallelize_model

    path = model_path(spec, role)
    cuda = spec.parallel.device == "cuda"
    # fp32 master weights everywhere; on GPU the FSDP2 policy computes in model.dtype (bf16).
    common = dict(dtype=torch.float32, trust_remote_code=spec.model.trust_remote_code)
    if role == "critic":
        from transformers import AutoConfig, AutoModelForTokenClassification

        # no dropout on the value head: the critic's forward must be deterministic like the policy's
        config = AutoConfig.from_pretrained(path, num_labels=1, classifier_dropout=0.0,
                                            trust_remote_code=spec.model.trust_remote_code)
        model = AutoModelForTokenClassification.from_pretrained(path, config=config, **common)
    elif cuda:
        from nemo_automodel import NeMoAutoModelForCausalLM

        # AutoModel's loader parallelizes while loading; replay/freeze hooks attach to the sharded modules.
        # Replay and freeze act on Hugging Face MoE routers, so those switches ask for the HF classes
        # (which AutoModel's expert parallel does not shard: the spec refuses them with ep_size > 1).
        moe_switch = spec.model.router_replay or spec.model.freeze_router
        model = NeMoAutoModelForCausalLM.from_pretrained(path, distributed_setup=setup, force_hf=moe_switch,
                                                         **common)
        _prepare(model, spec, role)
        return model
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", **common)
    if cuda:
        model.to(torch.device("cuda", torch.cuda.current_device()))
    _prepare(model, spec, role)
    return parallelize_model(model, setup.mesh_context)


def _prepare(model: nn.Module, spec: RunSpec, role: str) -> None:
    if role == "reference":
        model.requires_grad_(False)
    if spec.model.freeze_router and not freeze_router(model):
        raise ValueError("model.freeze_router=true but the model has no MoE router")
    if spec.model.router_replay and not install_replay(model):
        raise ValueError("model.router_replay=true but the model has no MoE router")
    if spec.parallel.activation_checkpointing and spec.parallel.world_size == 1:
        # AutoModel returns a single rank's model unwrapped, without its checkpointing wrappers
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   temperature: float, entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logp[b, t] = log π(token t | tokens < t) on logits / temperature (as the engine samples), and the
    per-token entropy of the same distribution (only if asked); both 0 at t = 0 and on padding.

    logsumexp instead of a full log_softmax keeps one [B, T, V] temporary fewer alive.
    """
    scaled = logits[:, :-1].float() / temperature
    lse = torch.logsumexp(scaled, dim=-1)
    picked = scaled.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    mask = attention_mask[:, 1:].to(scaled.dtype)
    logp = torch.nn.functional.pad((picked - lse) * mask, (1, 0))
    if not entropy:
        return logp, None
    probs = torch.softmax(scaled, dim=-1)
    entropy = torch.nn.functional.pad((lse - (probs * scaled).sum(-1)) * mask, (1, 0))
    return logp, entropy
