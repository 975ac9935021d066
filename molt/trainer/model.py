"""Load a role's model and shard it with FSDP2 through NeMo AutoModel's parallelizer.

CPU: transformers loads the checkpoint (AutoModel's loader asserts CUDA), then AutoModel's
`parallelize_model` shards it over a gloo mesh in fp32. GPU: AutoModel's own loader builds the model
directly on the mesh (meta-device init, sharded load, its kernels) in the configured dtype with fp32
gradient reduction. The critic is a token-classification model with one label (a value head on the
same backbone), loaded with transformers on both devices and sharded the same way.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from molt.inputs.vision import is_vision_model
from molt.plan.memory import AUTO_CHUNK_BYTES, chunk_tokens  # noqa: F401 (the trainer's names)
from molt.spec import RunSpec
from molt.trainer.context_parallel import CP_ATTENTION
from molt.trainer.fp8 import checkpoint_fp8
from molt.trainer.lora import apply_lora, check_adapted, peft_config
from molt.trainer.packing import VARLEN
from molt.trainer.router_replay import freeze_router, install_replay

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TRUNCATION_ROWS = 256   # positions per top-k / top-p sort: bounds its memory at large vocabularies


def autocast_dtype(spec: RunSpec) -> torch.dtype | None:
    """The dtype the worker's forward autocasts to over fp32 weights, or None (FSDP2 casts, or fp32).

    FSDP2's MixedPrecisionPolicy casts parameters to `model.dtype` only where `fully_shard` runs, and
    AutoModel skips it on a single-rank world (`fsdp2_sharding_enabled` in nemo_automodel's fsdp2.py);
    on CPU the policy is kept fp32. Everywhere else the worker's autocast must apply `model.dtype`.
    """
    fsdp_casts = spec.parallel.device == "cuda" and spec.parallel.world_size > 1
    return None if fsdp_casts or spec.model.dtype == "float32" else DTYPES[spec.model.dtype]


def distributed_setup(spec: RunSpec) -> Any:
    """AutoModel's mesh + FSDP2 policy for `spec.parallel` (needs the default process group)."""
    from nemo_automodel.components.distributed.config import DistributedSetup, FSDP2Config
    from nemo_automodel.components.distributed.mesh import ParallelismSizes
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    par = spec.parallel
    cuda = par.device == "cuda"
    # Where the worker autocasts (CPU; a single rank) the policy computes in fp32, so one cast applies.
    compute = torch.float32 if autocast_dtype(spec) is not None else DTYPES[spec.model.dtype]
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
    # the mesh's cp axis groups the ranks that split a micro-batch's positions (context_parallel.py); FSDP2
    # shards over dp x cp, which also sums the cp ranks' gradients
    sizes = ParallelismSizes(dp_size=par.dp_size, tp_size=par.tp_size, cp_size=par.cp_size,
                             ep_size=par.ep_size)
    return DistributedSetup.build(strategy=strategy, parallelism_sizes=sizes, world_size=par.world_size,
                                  activation_checkpointing=par.activation_checkpointing)


def attention_implementation(spec: RunSpec) -> str:
    """The attention models are loaded with: context parallel's (split sequences need it; it runs the
    packing's per-sequence attention too), the packing's (packed rows need theirs), else sdpa."""
    if spec.parallel.cp_size > 1:
        return CP_ATTENTION
    return VARLEN if spec.train.micro_batch_tokens else "sdpa"


def build_model(spec: RunSpec, role: str, path: str, setup: Any) -> nn.Module:
    """The sharded model of `role` (policy | reference | critic), loaded from `path` (resolved by
    the driver: molt.plan.models), on `distributed_setup(spec)`'s mesh, ready for forward on this rank."""
    from nemo_automodel.components.distributed.model_parallelizer import parallelize_model

    cuda = spec.parallel.device == "cuda"
    adapted = role == "policy" and spec.model.lora.rank > 0
    # fp32 master weights everywhere; model.dtype is FSDP2's cast or the worker's autocast (autocast_dtype)
    common = dict(dtype=torch.float32, trust_remote_code=spec.model.trust_remote_code)
    attention = attention_implementation(spec)
    if role == "critic":
        model = _critic(spec, path, attention, common)
    elif cuda:
        import nemo_automodel

        # AutoModel's loader parallelizes while loading; replay/freeze hooks attach to the sharded modules.
        auto = nemo_automodel.NeMoAutoModelForImageTextToText if is_vision_model(
            path, spec.model.trust_remote_code) else nemo_automodel.NeMoAutoModelForCausalLM
        model = auto.from_pretrained(path, distributed_setup=setup, **automodel_kwargs(spec, role, path))
        if adapted:
            check_adapted(model, spec)
        _prepare(model, spec, role)
        return model
    else:
        import transformers

        auto = transformers.AutoModelForImageTextToText if is_vision_model(
            path, spec.model.trust_remote_code) else transformers.AutoModelForCausalLM
        model = auto.from_pretrained(path, attn_implementation=attention, **common)
        if checkpoint_fp8(path) is not None:
            # transformers dequantized the block-FP8 checkpoint as it loaded (no FP8 kernel on CPU) and
            # recorded it: reverting that record would re-quantize what the refit and the export convert
            # back to checkpoint names. The weights are plain from here (a refit to an FP8 engine
            # quantizes them itself, molt/trainer/fp8.py): revert as for a model built without a record.
            model._weight_conversions = None
    if adapted:
        apply_lora(model, spec)   # before sharding: FSDP2 then shards adapters and frozen weights alike
    if cuda and spec.parallel.world_size == 1:
        # One rank is not sharded (AutoModel returns it as is): it moves whole. With more ranks the model
        # stays on the host: TP's distribute and FSDP2's fully_shard move each unit's shard to the mesh's
        # device as they wrap it, so no GPU holds a whole critic (120 GB in fp32 at 30B).
        model.to(torch.device("cuda", torch.cuda.current_device()))
    _prepare(model, spec, role)
    whole = model.state_dict() if role == "critic" and spec.parallel.world_size > 1 else None
    model = parallelize_model(model, setup.mesh_context)
    if whole is not None:
        _shards_from_rank0(model, whole, spec)
    return model


def _shards_from_rank0(model: nn.Module, whole: dict[str, torch.Tensor], spec: RunSpec) -> None:
    """Fill a sharded model that ranks other than 0 built on the meta device from rank 0's `whole` state
    dict (taken before sharding: its tensors are rank 0's loaded weights): each rank keeps its shards.
    Buffers are broadcast too: the non-persistent ones (rotary frequencies) are in no state dict."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    cuda = spec.parallel.device == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if dist.get_rank() > 0:
        model.to_empty(device="cpu" if spec.parallel.offload == "full" or not cuda else device)
        whole = {}
    set_model_state_dict(model, whole, options=StateDictOptions(full_state_dict=True,
                                                                broadcast_from_rank0=True))
    for buffer in model.buffers():
        sent = buffer.detach().to(device)
        dist.broadcast(sent, src=0)
        buffer.data.copy_(sent)


def _critic(spec: RunSpec, path: str, attention: str, common: dict[str, Any]) -> nn.Module:
    """The critic: a token-classification model with one label, a value head on the policy's backbone (the
    head is new: rank 0 initializes it). Only rank 0 reads the checkpoint into host memory (a whole fp32
    critic: 120 GB at 30B); other ranks build it on the meta device and take their shards from rank 0
    once it is sharded (`_shards_from_rank0`)."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    if is_vision_model(path, spec.model.trust_remote_code):
        raise ValueError("model.critic: a value model of a vision-language model is not supported "
                         "(use an estimator without a critic, e.g. algo=grpo)")
    # no dropout on the value head: the critic's forward must be deterministic like the policy's. Set on the
    # config object: transformers 5 drops `classifier_dropout` given to from_pretrained for a config class
    # without that field (Qwen3's), and the head then defaults to dropout 0.1
    config = AutoConfig.from_pretrained(path, num_labels=1, trust_remote_code=spec.model.trust_remote_code)
    config.classifier_dropout = 0.0
    auto = AutoModelForTokenClassification
    if spec.parallel.world_size > 1 and dist.get_rank() > 0:
        with torch.device("meta"):
            return auto.from_config(config, attn_implementation=attention, **common)
    return auto.from_pretrained(path, config=config, attn_implementation=attention, **common)


def automodel_kwargs(spec: RunSpec, role: str, path: str) -> dict[str, Any]:
    """What the GPU trainer asks of AutoModel's loader besides the mesh (it shards as it loads, so whatever
    must hold before sharding goes in here; the CPU path does the same before `parallelize_model`)."""
    vision = is_vision_model(path, spec.model.trust_remote_code)
    kwargs: dict[str, Any] = dict(
        dtype=torch.float32, trust_remote_code=spec.model.trust_remote_code,
        # Replay and freeze act on Hugging Face MoE routers, so those switches ask for the HF classes
        # (which AutoModel's expert parallel does not shard: the spec refuses them with ep_size > 1).
        force_hf=spec.model.router_replay or spec.model.freeze_router,
        # AutoModel's Qwen3-MoE gate adds router_aux_loss_coef x its load-balancing loss to the gradient
        # (backward scale 1, summed over ranks) beside Molt's normalized RL loss: the RL loss alone trains.
        config={"router_aux_loss_coef": 0.0},
    )
    if spec.parallel.cp_size > 1:
        # split sequences need the Hugging Face classes, which call the attention registered for them
        kwargs.update(force_hf=True, attn_implementation=CP_ATTENTION)
    if vision and (spec.model.freeze_vision or role == "reference"):
        # AutoModel makes a frozen tower one FSDP unit, gathered by every rank; frozen after sharding, it
        # is wrapped per block and a rank whose micro-batch holds no image would skip the gathers its
        # peers wait in. The same tower `_prepare` freezes (on CPU, before parallelize_model).
        kwargs["freeze_config"] = {"freeze_modules": [{"path": "model.visual"}]}
    if role == "policy" and spec.model.lora.rank > 0:
        # LoRA: AutoModel's loader applies the adapters itself, before it shards (molt/trainer/lora.py)
        kwargs["peft_config"] = peft_config(spec)
    return kwargs


def _prepare(model: nn.Module, spec: RunSpec, role: str) -> None:
    # The freeze switches are about what trains, so the frozen reference (maybe a dense teacher) skips them;
    # the replayed routes are the policy engine's picks, so only the policy replays them.
    trained = role != "reference"
    if not trained:
        model.requires_grad_(False)
    if spec.model.freeze_vision and trained:
        tower = getattr(getattr(model, "model", model), "visual", None)   # Qwen-VL's vision encoder
        if tower is None:
            raise ValueError("model.freeze_vision=true but the model has no vision tower (`model.visual`)")
        tower.requires_grad_(False)
    if spec.model.freeze_router and trained and not freeze_router(model):
        raise ValueError("model.freeze_router=true but the model has no MoE router")
    if spec.model.router_replay and role == "policy" and not install_replay(model):
        raise ValueError("model.router_replay=true but the model has no MoE router")
    if spec.parallel.activation_checkpointing and spec.parallel.world_size == 1:
        # AutoModel returns a single rank's model unwrapped, without its checkpointing wrappers
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    used = model.config.get_text_config()._attn_implementation
    if spec.parallel.cp_size > 1 and used != CP_ATTENTION:   # another attention would see local tokens only
        raise ValueError(f"parallel.cp_size > 1 needs the model to run attention {CP_ATTENTION!r}, but it "
                         f"was loaded with {used!r}")


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   temperature: float | torch.Tensor, top_p: float | torch.Tensor = 1.0,
                   top_k: int | torch.Tensor = 0,
                   entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logp[b, t] = log π(token t | tokens < t) under the distribution the engine sampled token t from, and
    the per-token entropy of that distribution (only if asked); both 0 at t = 0 and on padding.

    That distribution is vLLM's "processed" one: logits / temperature, then top-k and top-p truncation,
    renormalized. `temperature`, `top_p`, `top_k` are one number for every token or [B, T] per token
    (position t: what token t was sampled with; top_k <= 0 is off). The position-aligned form, where
    position t scores the token after it: `next_token_logprobs`.
    """
    logp, ent = next_token_logprobs(logits[:, :-1], input_ids[:, 1:], attention_mask[:, 1:],
                                    *(_next(x) for x in (temperature, top_p, top_k)), entropy)
    return to_tokens(logp), to_tokens(ent)


def next_token_logprobs(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor,
                        temperature: float | torch.Tensor, top_p: float | torch.Tensor,
                        top_k: int | torch.Tensor,
                        entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs` with everything aligned at the position that predicts: logits [B, T, V] at t score
    `targets[:, t]` (the token after t) where `mask` [B, T] is set, under the sampling parameters of that
    token (numbers, or [B, T] aligned like `targets`); 0 elsewhere. logsumexp instead of a full log_softmax
    keeps one [B, T, V] temporary fewer alive."""
    mask = mask > 0
    # padding and the inert rows that even out shards may hold 0: give them a harmless temperature
    temp = torch.where(mask, _per_token(temperature, targets), 1.0)
    scaled = _truncate(logits.float() / temp[..., None], targets, mask,
                       _per_token(top_p, targets), _per_token(top_k, targets).long())
    logp, ent = _scored(scaled, targets, entropy)
    weight = mask.to(scaled.dtype)
    return logp * weight, None if ent is None else ent * weight


def to_tokens(scores: torch.Tensor | None) -> torch.Tensor | None:
    """Scores aligned at the predicting position [B, T'] -> aligned at the token they score: one step to the
    right, 0 at t = 0 (a first token has no prefix)."""
    return None if scores is None else torch.nn.functional.pad(scores, (1, 0))


def _next(value: float | torch.Tensor) -> float | torch.Tensor:
    """A per-token [B, T] field seen from the position that predicts each token (its last column dropped)."""
    return value[:, 1:] if isinstance(value, torch.Tensor) else value


def _scored(scaled: torch.Tensor, targets: torch.Tensor,
            entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(scaled)[target] and, if asked, the entropy of softmax(scaled), over the last dim."""
    lse = torch.logsumexp(scaled, dim=-1)
    logp = scaled.gather(-1, targets[..., None]).squeeze(-1) - lse
    if not entropy:
        return logp, None
    probs = torch.softmax(scaled, dim=-1)
    finite = scaled.masked_fill(scaled == -torch.inf, 0.0)   # 0 * -inf would be NaN
    return logp, lse - (probs * finite).sum(-1)


def chunkable(model: nn.Module, par: Any) -> bool:
    """Whether `chunked_token_logprobs` may call the model's output head itself: not with tensor parallel
    (hidden states are DTensors there), nor for a model that changes its logits after the head.
    On several ranks every rank makes the same calls of the sharded head (`shared_chunk_count`)."""
    config = model.config.get_text_config()
    head = model.get_output_embeddings()
    # (AutoModel's LoRA linear fails on the empty slice `head_input` gives the head: an adapted head, under
    # model.lora.refit=merged, computes its logits in the model's forward)
    return par.tp_size == 1 and head is not None and not hasattr(head, "lora_A") and not any(
        getattr(config, k, None) for k in ("final_logit_softcapping", "logit_scale"))


@contextmanager
def head_input(head: nn.Module | None) -> Iterator[list[torch.Tensor]]:
    """While open, the output head's forward gets an empty slice of its input and the input (the last
    hidden states) is kept in the yielded list: the model's own forward then computes no [tokens, vocab]
    logits (`chunked_token_logprobs` does, in chunks). With `head` None nothing changes."""
    kept: list[torch.Tensor] = []

    def keep(module: nn.Module, args: tuple) -> tuple:
        kept.append(args[0])
        return (args[0][..., :0, :], *args[1:])
    hook = None if head is None else head.register_forward_pre_hook(keep)
    try:
        yield kept
    finally:
        if hook is not None:
            hook.remove()


def shared_chunk_count(select: torch.Tensor, chunk: int) -> int:
    """The chunks of `chunk` positions that the busiest rank's `select` [B, T] (positions that predict a
    scored token) needs (max over the default process group). Each call of an FSDP-sharded head is a
    collective (weight gather; in the backward the recomputation's gather and the gradient's
    reduce-scatter): ranks that called it a different number of times would wait on each other forever."""
    count = torch.tensor([-(-int((select > 0).sum()) // chunk)], device=select.device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count)


def chunked_token_logprobs(hidden: torch.Tensor, head: nn.Module, input_ids: torch.Tensor,
                           select: torch.Tensor, temperature: float | torch.Tensor,
                           top_p: float | torch.Tensor, top_k: int | torch.Tensor, entropy: bool,
                           chunk: int, calls: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs(head(hidden).float(), ...)` at the tokens `select` [B, T] marks (0 elsewhere),
    without ever holding more than `chunk` positions' logits [chunk, V]. `hidden` [B, T, H] is the output
    head's input; the position-aligned form: `chunked_next_token_logprobs`."""
    logp, ent = chunked_next_token_logprobs(hidden[:, :-1], head, input_ids[:, 1:], select[:, 1:],
                                            *(_next(x) for x in (temperature, top_p, top_k)), entropy,
                                            chunk, calls)
    return to_tokens(logp), to_tokens(ent)


def chunked_next_token_logprobs(hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor,
                                select: torch.Tensor, temperature: float | torch.Tensor,
                                top_p: float | torch.Tensor, top_k: int | torch.Tensor, entropy: bool,
                                chunk: int, calls: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`next_token_logprobs(head(hidden).float(), targets, select, ...)` in chunks of `chunk` selected
    positions.

    The head, temperature, truncation, logsumexp and entropy run per chunk of selected positions; with grad
    each chunk is checkpointed, so the backward recomputes its logits instead of keeping every chunk's
    alive (only hidden rows and [chunk] results are saved). Call it under the forward's autocast: the head
    then computes in the same dtype. `calls` (`shared_chunk_count`) pads the chunks with spare ones on one
    position, in the graph with weight 0, so that every rank runs the head as often in the forward and in
    the backward.
    """
    where = (select > 0).nonzero(as_tuple=True)
    picked = [hidden[where], targets[where], _per_token(temperature, targets)[where],
              _per_token(top_p, targets)[where], _per_token(top_k, targets).long()[where]]
    grad = torch.is_grad_enabled() and hidden.requires_grad
    one = torch.ones(1, device=targets.device)
    spare = [hidden.reshape(-1, hidden.shape[-1])[:1], targets.new_zeros(1), one, one, -one.long()]
    real = -(-picked[0].shape[0] // chunk)
    parts: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    for i in range(max(real, calls)):
        args = [x[i * chunk:(i + 1) * chunk] for x in picked] if i < real else spare
        run = functools.partial(_chunk_logprobs, head, entropy=entropy)
        parts.append(checkpoint(run, *args, use_reentrant=False) if grad else run(*args))
    logp = hidden.new_zeros(targets.shape, dtype=torch.float32)
    ent = logp.clone() if entropy else None
    if real:
        logp = logp.index_put(where, torch.cat([p[0] for p in parts[:real]]))
        if entropy:
            ent = ent.index_put(where, torch.cat([p[1] for p in parts[:real]]))
    if grad and len(parts) > real:   # the spare chunks' backward must run too: a 0-weighted term
        logp = logp + 0.0 * torch.stack([p[0].sum() for p in parts[real:]]).sum()
    return logp, ent


def _chunk_logprobs(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temp: torch.Tensor,
                    top_p: torch.Tensor, top_k: torch.Tensor,
                    entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    logits = head(hidden)
    if isinstance(logits, DTensor):   # tensor parallel: the head is sharded over the vocabulary
        logits = logits.full_tensor()
    every = torch.ones(targets.shape, dtype=torch.bool, device=targets.device)
    scaled = _truncate(logits.float()[None] / temp[None, :, None], targets[None], every[None], top_p[None],
                       top_k[None])[0]
    return _scored(scaled, targets, entropy)


def _per_token(value: float | torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.to(targets.device)   # [B, T] aligned with targets
    return torch.full(targets.shape, float(value), device=targets.device)


def _truncate(scaled: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, top_p: torch.Tensor,
              top_k: torch.Tensor) -> torch.Tensor:
    """`scaled` [B, T-1, V] with the tokens vLLM's top-k / top-p drop set to -inf where they are used."""
    vocab = scaled.shape[-1]
    active = (mask & ((top_p < 1) | ((top_k > 0) & (top_k < vocab)))).nonzero(as_tuple=True)
    if not len(active[0]):
        return scaled
    full = torch.zeros(scaled.shape, dtype=torch.bool, device=scaled.device)
    with torch.no_grad():
        for start in range(0, len(active[0]), TRUNCATION_ROWS):   # the sort needs ~12 bytes per logit
            rows = tuple(a[start:start + TRUNCATION_ROWS] for a in active)
            drop = vllm_truncation(scaled[rows], top_k[rows], top_p[rows])
            # The sampled token was in the engine's kept set; a rounding difference at the boundary must
            # not make its logprob -inf (it then differs by the boundary token's share, seen in mismatch/*).
            full[rows] = drop.scatter_(-1, targets[rows][:, None], False)
    return scaled.masked_fill(full, -torch.inf)


def vllm_truncation(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Tokens that vLLM's sampler drops (`apply_top_k_top_p`), as a bool mask [N, V], for rows of
    temperature-scaled fp32 `logits` [N, V] with per-row `top_k` (<= 0 off) and `top_p` (1 off).

    The same operations in the same order: ascending sort; top-k keeps values >= the k-th largest (ties
    included); top-p renormalizes the survivors, takes the cumulative sum from the smallest and drops
    while it stays <= 1 - p, always keeping the most likely token.
    """
    vocab = logits.shape[-1]
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    ascending, order = logits.sort(dim=-1, descending=False)
    kth = ascending.gather(1, (vocab - k).unsqueeze(1))
    ascending = ascending.masked_fill(ascending < kth, -torch.inf)
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= 1 - top_p.to(logits.dtype).unsqueeze(1)
    drop[:, -1] = False
    drop |= ascending == -torch.inf
    return torch.zeros_like(drop).scatter_(-1, order, drop)
