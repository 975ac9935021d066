"""Will it fit? An estimate of the device memory of every role the placement plan places, from the spec alone.

`estimate(spec)` gives, per role (policy, reference and critic ranks, the policy's engines, the judge's
engines), the bytes one device holds, split into named parts; `check(spec)` refuses, before Ray starts, a
CUDA plan whose estimate exceeds `parallel.gpu_memory_gib`, naming the role, the estimate and what would
make it fit. The formula, its assumptions and how it compares with measured peaks: docs/parallelism.md#memory.

Model sizes come from the model's architecture numbers (molt/plan/arch.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from molt.plan.arch import (
    Arch,
    arch_of,
    expert_params,
    layer_params,
    moe_layers,
    param_count,
    vision_params,
)

if TYPE_CHECKING:
    from molt.spec import RunSpec

GIB = 2 ** 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# CUDA context, NCCL's buffers and the caching allocator's slack on every trainer rank's GPU: an
# assumption (a CUDA context alone is ~0.5 GiB), not a measurement; vLLM counts its own in its fraction.
CUDA_RESERVE_GIB = 1.5
# [tokens, vocab] fp32 tensors alive at the peak of token_logprobs' forward and backward (molt/trainer/
# model.py): the logits, the temperature-scaled copy, and in the backward the gradients of logsumexp and
# gather with logsumexp's exp temporary; the entropy bonus adds about one more. Measured on CPU (5.0 and
# 5.25 copies at 4 x 1024 tokens x 32000: docs/parallelism.md#memory).
LOGIT_COPIES, ENTROPY_COPIES = 5, 1
# train.logprob_chunk_tokens=null: positions per chunk such that its fp32 logits stay within this many bytes
# (≈ 220 positions at Qwen3's 151,936-token vocabulary; one chunk for the tiny models' 320)
AUTO_CHUNK_BYTES = 128 * 2**20


# -- activations ------------------------------------------------------------------------------------------
def layer_activation_elements(a: Arch, moe: bool) -> int:
    """Elements one token's pass through a decoder layer keeps for the backward (HF Qwen3 / Qwen3-MoE):
    attention: the two norm tensors, the projections' input, q/k before and after their norm, q/k/v and
    the output of attention, o_proj's input (3h + 5q + 4kv); dense MLP: norm, input, gate, act, up, product
    (3h + 4I); MoE: per routed copy the gathered input, 4 expert tensors and the weighted output, plus
    the router's probabilities."""
    h = a.hidden_size
    if a.kv_lora_rank:
        q = kv = a.num_heads * (a.qk_nope_head_dim + a.qk_rope_head_dim)
        attention = 3 * h + 5 * q + 4 * kv + 2 * (a.q_lora_rank + a.kv_lora_rank)
    else:
        q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        attention = 3 * h + 5 * q + 4 * kv
    if moe:
        mlp = 3 * h + a.num_experts_per_tok * (2 * h + 4 * a.moe_intermediate_size) + a.num_experts \
            + a.num_shared_experts * 4 * a.moe_intermediate_size
    else:
        mlp = 3 * h + 4 * a.intermediate_size
    return attention + mlp


def activation_bytes(a: Arch, tokens: int, dtype_bytes: int, checkpointing: bool) -> int:
    """Activations kept for the backward over `tokens` tokens of one micro-batch: every layer's, or with
    activation checkpointing each layer's input plus one layer recomputed at a time; and the embedding,
    final norm and output head's input (4h)."""
    per_layer = [layer_activation_elements(a, False)] * (a.num_layers - moe_layers(a)) + \
        [layer_activation_elements(a, True)] * moe_layers(a)
    kept = a.num_layers * a.hidden_size + max(per_layer) if checkpointing else sum(per_layer)
    return tokens * (kept + 4 * a.hidden_size) * dtype_bytes


def logits_bytes(tokens: int, vocab: int, dtype_bytes: int = 4, entropy: bool = False) -> int:
    """The [tokens, vocab] tensors alive at once while token_logprobs scores `tokens` positions: its fp32
    copies, and below fp32 the output head's own [tokens, vocab] in the compute dtype before the cast."""
    fp32 = 4 * (LOGIT_COPIES + ENTROPY_COPIES * entropy)
    return tokens * vocab * (fp32 + (dtype_bytes if dtype_bytes < 4 else 0))


def chunk_tokens(spec: RunSpec, vocab: int) -> int:
    """Positions per chunk of the logprob pass: `train.logprob_chunk_tokens`, or automatically as many as
    keep one chunk's fp32 logits within AUTO_CHUNK_BYTES (at least 64)."""
    chosen = spec.train.logprob_chunk_tokens
    return chosen if chosen is not None else max(64, AUTO_CHUNK_BYTES // (4 * vocab))


def scored_tokens(spec: RunSpec, role: str, tokens: int, vocab: int) -> int:
    """Positions whose logits are alive at once: one chunk (`chunk_tokens`) for the policy and reference,
    which score in chunks (molt/trainer/model.py `chunkable`: not under tensor parallel); the
    whole micro-batch for the critic's value head and those layouts."""
    par = spec.parallel
    if role == "critic" or par.tp_size > 1:
        return tokens
    return min(tokens, chunk_tokens(spec, vocab))


def rank_tokens(spec: RunSpec) -> int:
    """Tokens of the largest micro-batch one rank computes: context parallel splits each micro-batch's
    positions over its cp ranks (padded to a multiple of 2 x cp_size: molt/trainer/context_parallel.py)."""
    cp = spec.parallel.cp_size
    return -(-micro_batch_tokens(spec) // (2 * cp)) * 2 if cp > 1 else micro_batch_tokens(spec)


def micro_batch_tokens(spec: RunSpec) -> int:
    """Tokens of the largest micro-batch a rank runs: the packing budget, or micro_batch_size rows (at most
    a rank's rows per update) of the longest row, which model.max_model_len and (RL) agent.max_total_tokens
    bound (a micro-batch is trimmed to its longest row)."""
    train, par = spec.train, spec.parallel
    if train.micro_batch_tokens is not None:
        return train.micro_batch_tokens
    row = spec.model.max_model_len
    samples = 1
    if train.objective == "rl":
        row, samples = min(row, spec.agent.max_total_tokens), spec.rollout.samples_per_prompt
    rows = max(1, train.prompts_per_step * samples // par.dp_size // train.minibatches)
    return min(train.micro_batch_size, rows) * row


# -- per role ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Estimate:
    role: str
    parts: dict[str, float]     # name -> bytes on one device
    note: str = ""              # how the parts were sized (the layout, the micro-batch)

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    def line(self) -> str:
        parts = " + ".join(f"{k} {v / GIB:.1f}" for k, v in self.parts.items() if v >= GIB / 20)
        return f"{self.role}: {self.total / GIB:.1f} GiB = {parts or 'under 0.1'} ({self.note})"


def trainer_estimate(spec: RunSpec, role: str, a: Arch) -> Estimate:
    """One trainer rank of `role` (policy, reference or critic)."""
    par, cuda = spec.parallel, spec.parallel.device == "cuda"
    c = DTYPE_BYTES[spec.model.dtype]
    trained = role != "reference"
    params, experts = param_count(a)
    shard = par.world_size                # FSDP over dp and TP split every weight; EP splits experts
    on_host = {"none": [], "optimizer": ["optimizer"], "full": ["optimizer", "grads", "params"]}[par.offload]
    # a frozen vision tower has no gradients and no optimizer state
    trainable = params - (vision_params(a) if spec.model.freeze_vision else 0)
    parts = {"params": 4 * params / shard}                                   # fp32 master weights
    if trained:
        parts |= {"grads": 4 * trainable / shard, "optimizer": 8 * trainable / shard}   # fp32, AdamW's 2
    for name in on_host:
        parts.pop(name, None)
    # FSDP all-gathers one unit (a layer, or the output head) in the compute dtype, the next one prefetched,
    # and reduce-scatters its fp32 gradient; experts gather only their ep shard
    moe = bool(moe_layers(a))
    unit = max(layer_params(a, moe) - (expert_params(a) * (1 - 1 / par.ep_size) if moe else 0),
               a.vocab_size * a.hidden_size)
    if par.world_size > 1:
        parts["gathered"] = unit * (2 * c + (4 if trained else 0))
    elif c < 4:   # autocast over fp32 weights caches a compute-dtype copy of each (molt/trainer/model.py)
        parts["gathered"] = params * c
    tokens = rank_tokens(spec)
    checkpointing = par.activation_checkpointing and trained
    # without gradients (the reference) one layer's activations live at a time
    parts["activations"] = activation_bytes(a, tokens, c, checkpointing) if trained else \
        max(layer_activation_elements(a, moe), 4 * a.hidden_size) * tokens * c
    vocab = 1 if role == "critic" else a.vocab_size
    entropy = spec.algo.loss.entropy_coef != 0 and role == "policy"
    parts["logits"] = logits_bytes(scored_tokens(spec, role, tokens, vocab), vocab, c, entropy=entropy)
    if cuda:
        parts["cuda"] = CUDA_RESERVE_GIB * GIB
    del experts   # EP changes where experts live, not how many a rank holds (they shard world_size ways)
    # both settings' activations, so the dry run shows what checkpointing would change
    plain, ckpt = (activation_bytes(a, tokens, c, flag) / GIB for flag in (False, True))
    both = f"; activations {plain:.1f} GiB without checkpointing, {ckpt:.1f} with" if trained else ""
    per = f"{micro_batch_tokens(spec)} tokens per micro-batch" + (
        f", {tokens} on each of its cp={par.cp_size} ranks" if par.cp_size > 1 else "")
    note = (f"{_count(params)} params / {shard} ranks, fp32 weights/grads/AdamW, {spec.model.dtype} compute, "
            f"{per}{', checkpointed' if checkpointing else ''}, offload={par.offload}{both}")
    return Estimate(f"{role} rank", parts, note)


def engine_estimate(spec: RunSpec, role: str, a: Arch) -> tuple[Estimate, float]:
    """One GPU of an engine (`role` engine or judge): its weights and the KV cache its
    gpu_memory_utilization leaves; also the bytes one max_model_len sequence needs in that cache."""
    engine = spec.agent.judge.engine if role == "judge" else spec.rollout.engine
    c = DTYPE_BYTES[spec.model.dtype]
    params, _ = param_count(a)
    weights = params * (a.weight_bits / 8 if a.weight_bits else c) / engine.tp_size
    if a.kv_lora_rank:   # MLA caches the compressed key/value, the same on every TP rank
        kv_token = a.num_layers * (a.kv_lora_rank + a.qk_rope_head_dim) * c
    else:
        kv_token = a.num_layers * 2 * max(1, a.num_kv_heads // engine.tp_size) * a.head_dim * c
    budget = engine.gpu_memory_utilization * spec.parallel.gpu_memory_gib * GIB
    parts = {"weights": weights, "kv_cache": max(budget - weights, 0.0)}
    note = (f"{_count(params)} params / tp {engine.tp_size}"
            f"{' at ' + str(a.weight_bits) + ' bits' if a.weight_bits else ''}, gpu_memory_utilization="
            f"{engine.gpu_memory_utilization} of {spec.parallel.gpu_memory_gib:g} GiB")
    return Estimate(_engine_label(role) + " GPU", parts, note), kv_token * spec.model.max_model_len


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _engine_label(role: str) -> str:
    return "judge engine" if role == "judge" else "engine"


def cpu_engine_estimate(spec: RunSpec, role: str, a: Arch) -> Estimate:
    engine = spec.agent.judge.engine if role == "judge" else spec.rollout.engine
    weights = param_count(a)[0] * DTYPE_BYTES[spec.model.dtype]
    return Estimate(_engine_label(role), {"weights": weights, "kv_cache": engine.kv_cache_gib * GIB},
                    "CPU: kv_cache = rollout.engine.kv_cache_gib")


def estimates(spec: RunSpec) -> tuple[list[Estimate], list[str]]:
    """The estimate of one device of every role the plan places, and the roles left out (no architecture
    numbers: a hub id without model.arch)."""
    from molt.plan.placement import plan

    roles = list(dict.fromkeys(s.role for s in plan(spec) if s.role != "agent"))   # agent workers: no device
    out, unknown = [], []
    for role in roles:
        a = arch_of(spec, "policy" if role in ("policy", "critic", "engine") else role)
        if a is None:
            unknown.append(role)
        elif role in ("engine", "judge"):
            out.append(engine_estimate(spec, role, a)[0] if spec.parallel.device == "cuda"
                       else cpu_engine_estimate(spec, role, a))
        else:
            out.append(trainer_estimate(spec, role, a))
    return out, unknown


def _trainer_fixes(spec: RunSpec, role: str, a: Arch, limit: float) -> list[str]:
    """The single knob changes under which `role`'s rank would fit, each with its estimate."""
    par, train = spec.parallel, spec.train
    tries = []
    if par.offload == "none":
        tries.append(("parallel.offload=optimizer", {"parallel": {"offload": "optimizer"}}))
    if par.offload != "full" and par.world_size > 1:
        tries.append(("parallel.offload=full", {"parallel": {"offload": "full"}}))
    if not par.activation_checkpointing:
        tries.append(("parallel.activation_checkpointing=true",
                      {"parallel": {"activation_checkpointing": True}}))
    size = train.micro_batch_size
    while size > 1 and train.micro_batch_tokens is None:
        size //= 2
        tries.append((f"train.micro_batch_size={size}", {"train": {"micro_batch_size": size}}))
    samples = train.prompts_per_step * (spec.rollout.samples_per_prompt if train.objective == "rl" else 1)
    for factor in (2, 4):
        dp, cp = par.dp_size * factor, par.cp_size * factor
        if not samples % dp:   # the spec needs whole rows per data-parallel rank
            tries.append((f"{par.world_size * factor} ranks (parallel.dp_size={dp})",
                          {"parallel": {"dp_size": dp}}))
        if not a.num_heads // par.tp_size % cp:   # long rows: more ranks split each micro-batch (its heads)
            tries.append((f"{par.world_size * factor} ranks (parallel.cp_size={cp})",
                          {"parallel": {"cp_size": cp}}))
    fixes = []
    for words, change in tries:
        other = spec.model_copy(update={k: getattr(spec, k).model_copy(update=v) for k, v in change.items()})
        total = trainer_estimate(other, role, a).total
        if total <= limit:
            fixes.append(f"{words} ({total / GIB:.1f} GiB)")
            if words.startswith("train.micro_batch_size"):
                tries = [t for t in tries if not t[0].startswith("train.micro")]
    return fixes


def check(spec: RunSpec) -> None:
    """On CUDA, raise ValueError when a role's estimate exceeds parallel.gpu_memory_gib, naming the role,
    the estimate and the settings under which it would fit. CPU devices share host memory: no check."""
    if spec.parallel.device != "cuda":
        return
    limit = spec.parallel.gpu_memory_gib * GIB
    problems = _colocated_problems(spec, limit) if spec.parallel.colocate else []
    for est in estimates(spec)[0]:
        role = {"engine": "engine", "judge": "judge"}.get(est.role.split()[0], est.role.split()[0])
        if role in ("engine", "judge"):
            problems += _engine_problems(spec, role, limit)
        elif spec.parallel.colocate:
            continue   # its rank shares the GPU: checked with the engine, phase by phase, above
        elif est.total > limit:
            a = arch_of(spec, "policy" if role == "critic" else role)
            fixes = "; ".join(_trainer_fixes(spec, role, a, limit) if a else []) or (
                "none of offload, activation checkpointing, a smaller micro-batch or 4x the ranks alone: "
                "combine them, or shorten rows (model.max_model_len, agent.max_total_tokens)")
            problems.append(f"{est.line()} exceeds parallel.gpu_memory_gib={spec.parallel.gpu_memory_gib:g}; "
                            f"would fit with: {fixes}")
    if problems:
        raise ValueError("the memory plan does not fit (estimate, docs/parallelism.md#memory):\n  "
                         + "\n  ".join(problems))


def _engine_problems(spec: RunSpec, role: str, limit: float) -> list[str]:
    engine = spec.agent.judge.engine if role == "judge" else spec.rollout.engine
    key = "agent.judge.engine" if role == "judge" else "rollout.engine"
    if not 0 < engine.gpu_memory_utilization <= 1:
        return [f"{key}.gpu_memory_utilization={engine.gpu_memory_utilization} must lie in (0, 1]"]
    a = arch_of(spec, "policy" if role == "engine" else role)
    est, one_sequence = engine_estimate(spec, role, a)
    budget = engine.gpu_memory_utilization * limit
    if est.parts["weights"] + one_sequence <= budget:
        return []
    return [f"{est.line()}: the weights ({est.parts['weights'] / GIB:.1f} GiB) and the KV cache of one "
            f"model.max_model_len={spec.model.max_model_len} sequence ({one_sequence / GIB:.2f} GiB) exceed "
            f"the {budget / GIB:.1f} GiB vLLM may use; raise {key}.tp_size or {key}.gpu_memory_utilization, "
            "lower model.max_model_len, or set parallel.gpu_memory_gib to a larger GPU's"]


def describe(spec: RunSpec) -> list[str]:
    """The dry run's memory lines: one per role (every rank or engine GPU of a role holds the same); with
    parallel.colocate on cuda, then the shared GPU in each phase."""
    ests, unknown = estimates(spec)
    cuda = spec.parallel.device == "cuda"
    head = (f"per GPU, of parallel.gpu_memory_gib={spec.parallel.gpu_memory_gib:g}" if cuda else
            "per process, host memory (CPU: not checked; processes share the host's RAM)")
    lines = [f"estimate {head}"] + [e.line() for e in ests]
    if cuda and spec.parallel.colocate and not unknown:
        lines += [e.line() for e in colocated_phases(spec)]
    lines += [f"{role}: no estimate (no config.json of its model on this machine, and no model.arch)"
              for role in unknown]
    return lines


# -- colocation (parallel.colocate: the trainer's ranks and the engine on one GPU) ----------------------
# What a sleeping engine still holds on the GPU: its CUDA context and the allocations vLLM's sleep mode does
# not release (level 1 moves the weights to host memory, level 2 drops them; both free the KV cache). An
# assumption, as CUDA_RESERVE_GIB, until the GPU check measures it.
ENGINE_ASLEEP_GIB = 1.0
RESIDENT = ("params", "optimizer")   # what a trainer rank keeps on the GPU between its steps


def colocated_phases(spec: RunSpec) -> list[Estimate]:
    """The shared GPU while the engine generates (its gpu_memory_utilization share beside every trainer
    role's resident state and CUDA context) and while the trainer steps (the engine asleep beside the
    same, plus the largest role's step: grads, gathered units, activations, logits; roles step in turn)."""
    trainers = [e for e in estimates(spec)[0] if not e.role.startswith(("engine", "judge"))]
    engine = spec.rollout.engine.gpu_memory_utilization * spec.parallel.gpu_memory_gib * GIB
    kept = {f"{e.role.removesuffix(' rank')} kept": sum(v for k, v in e.parts.items() if k in RESIDENT)
            for e in trainers}
    steps = {f"{e.role.removesuffix(' rank')} step": sum(
        v for k, v in e.parts.items() if k not in (*RESIDENT, "cuda")) for e in trainers}
    busiest = max(steps, key=steps.get)
    cuda = sum(e.parts.get("cuda", 0.0) for e in trainers)
    note = f"parallel.colocate: {len(trainers)} trainer role(s) and the engine on one GPU"
    return [Estimate("colocated GPU, generating", {"engine": engine, **kept, "cuda": cuda}, note),
            Estimate("colocated GPU, training", {"engine asleep": ENGINE_ASLEEP_GIB * GIB, **kept,
                                                 busiest: steps[busiest], "cuda": cuda},
                     f"{note}; the engine asleep")]


def _colocated_problems(spec: RunSpec, limit: float) -> list[str]:
    """Each phase of the shared GPU that exceeds it, with the single settings under which both fit (the
    largest engine share first)."""
    if estimates(spec)[1]:
        return []   # no architecture numbers: the dry run says so
    over = [e for e in colocated_phases(spec) if e.total > limit]
    if not over:
        return []
    par, share = spec.parallel, spec.rollout.engine.gpu_memory_utilization
    shares = [(f"rollout.engine.gpu_memory_utilization={u:.1f}",
               {"rollout": {"engine": {"gpu_memory_utilization": u}}}) for u in (0.7, 0.6, 0.5, 0.4, 0.3, 0.2)
              if u < share]
    knobs = [(f"parallel.{k}={v}".replace("True", "true"), {"parallel": {k: v}}) for k, v in
             (("offload", "optimizer"), ("activation_checkpointing", True)) if getattr(par, k) != v]
    fits = [words for words, change in shares + knobs
            if all(e.total <= limit for e in colocated_phases(_updated(spec, change)))]
    fits = [w for w in fits if not w.startswith("rollout.engine")] + [w for w in fits if w.startswith(
        "rollout.engine")][:1]
    alone = "; ".join(fits) or ("none of a smaller engine share, optimizer offload or activation "
                                "checkpointing alone: combine them, or use a larger GPU")
    return [f"{e.line()} exceeds parallel.gpu_memory_gib={par.gpu_memory_gib:g}" for e in over] + [
        f"both colocated phases would fit with: {alone}"]


def _updated(spec: RunSpec, change: dict) -> RunSpec:
    """`spec` with nested section values replaced (no validation: the plan's own arithmetic)."""
    def apply(obj, values: dict):
        return obj.model_copy(update={k: apply(getattr(obj, k), v) if isinstance(v, dict) else v
                                      for k, v in values.items()})
    return apply(spec, change)
