"""The run spec: the one validated object the launcher reads.

Hydra composes `conf/` + an experiment into a plain dict; `RunSpec.model_validate` then checks it
strictly. Every section forbids unknown keys, so a typo fails instead of being silently ignored, and
`validate_spec` turns pydantic's errors into one message that lists every problem with the nearest
valid key.
"""

from __future__ import annotations

import difflib
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from molt.spec_checks import check_combinations, check_parallel


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _power_of_two(name: str, value: int) -> None:
    if value < 1 or value & (value - 1):
        raise ValueError(f"{name}={value} must be a power of two")


class RunSection(Strict):
    name: str = "tiny"
    seed: int = 0
    dir: str | None = None          # the run directory; the launcher fills it from Hydra's output dir
    resume: str | None = None       # "auto" (latest checkpoint in dir) or a checkpoint path
    dry_run: bool = False           # print the placement plan and exit


class ModelSpec(Strict):
    path: str | None = None         # a Hugging Face folder or hub id; None builds the tiny model below
    tiny: dict[str, int] = Field(default_factory=dict)  # molt.tiny options (sizes, experts, seed)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    max_model_len: int = 512
    reference: str | None = None    # frozen reference / teacher; "policy" = a frozen copy of the start
    critic: bool = False            # a value model (required by the gae estimator)
    router_replay: bool = False     # MoE: replay the engine's routed experts in the training forward
    freeze_router: bool = False     # MoE: do not train router weights
    trust_remote_code: bool = False


class ParallelSpec(Strict):
    device: Literal["cpu", "cuda"] = "cpu"
    nodes: int = 1                  # Ray nodes the run uses (see molt/placement.py)
    gpus_per_node: int = 8          # cuda: GPUs on each node; the placement plan must fit nodes x this
    trainer_nodes: int | None = None  # K: nodes 0..K-1 train, the others generate; None: all roles share
    world_size: int = 1             # trainer ranks
    dp_size: int = 1
    tp_size: int = 1
    cp_size: int = 1
    ep_size: int = 1
    offload: Literal["none", "optimizer", "full"] = "none"  # host memory: optimizer state, or everything
    activation_checkpointing: bool = False

    @model_validator(mode="after")
    def _sizes(self) -> ParallelSpec:
        for name in ("tp_size", "cp_size", "ep_size"):
            _power_of_two(name, getattr(self, name))
        product = self.dp_size * self.tp_size * self.cp_size
        if product != self.world_size:
            raise ValueError(f"dp_size*tp_size*cp_size = {self.dp_size}*{self.tp_size}*{self.cp_size} = "
                             f"{product} must equal world_size={self.world_size}")
        if (self.dp_size * self.cp_size) % self.ep_size:
            raise ValueError(f"ep_size={self.ep_size} must divide dp_size*cp_size="
                             f"{self.dp_size * self.cp_size} (experts shard over data-parallel ranks)")
        check_parallel(self)
        return self


class EngineSpec(Strict):
    num_engines: int = 1
    tp_size: int = 1
    dp_size: int = 1
    enable_expert_parallel: bool = False
    gpu_memory_utilization: float = 0.85
    kv_cache_gib: float = 1.0       # CPU only (VLLM_CPU_KVCACHE_SPACE)
    enforce_eager: bool = True
    enable_prefix_caching: bool = True
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    speculative_config: dict[str, Any] | None = None   # e.g. {method: mtp, num_speculative_tokens: 1}
    extra_args: dict[str, Any] = Field(default_factory=dict)  # any other vLLM engine argument, as is


class SamplingSpec(Strict):
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    n: int = 1


class RolloutSpec(Strict):
    mode: Literal["sync", "async"] = "sync"
    samples_per_prompt: int = 8
    max_tokens: int = 16            # per turn
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    groups_in_flight: int = 16      # streaming depth: prompt groups kept in flight
    partial_rollout: bool = True    # a refit keeps in-flight requests (pause/keep) instead of dropping them
    max_staleness: int = 1          # max policy versions between sampling a token and training on it
    prompt_too_long: Literal["truncate", "reject"] = "reject"
    engine: EngineSpec = Field(default_factory=EngineSpec)
    eval: SamplingSpec = Field(default_factory=lambda: SamplingSpec(temperature=0.0, n=1))


class TrainSpec(Strict):
    steps: int = 100
    prompts_per_step: int = 8       # groups per optimizer step
    micro_batch_size: int = 16      # sequences per forward/backward, per rank
    lr: float = 5e-4
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    warmup_steps: int = 0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0
    critic_lr: float = 1e-3
    save_every: int = 0             # 0 = only at the end
    eval_every: int = 0             # 0 = never


class LossSpec(Strict):
    eps_low: float = 0.2
    eps_high: float = 0.2
    dual_clip: float | None = None  # c > 1 bounds the loss of negative-advantage tokens
    norm: Literal["token", "seq"] = "token"  # global token mean, or per-sequence (Dr.GRPO) constant
    value_clip: float = 0.2
    entropy_coef: float = 0.0


class CorrectionSpec(Strict):
    level: Literal["off", "token", "seq", "geo"] = "off"

    @field_validator("level", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        return "off" if value is False else value  # YAML 1.1 reads a bare `off` as false
    mode: Literal["mask", "clip", "trunc"] = "trunc"
    low: float = 0.0
    high: float = 2.0

    @model_validator(mode="after")
    def _band(self) -> CorrectionSpec:
        if not self.low < self.high:
            raise ValueError(f"correction band low={self.low} must be below high={self.high}")
        return self


class KLSpec(Strict):
    estimator: Literal["k1", "k2", "k3"] = "k3"
    coef: float = 0.0
    in_reward: bool = False         # fold into the reward instead of adding a loss term


class FilterSpec(Strict):
    drop_equal_rewards: bool = False        # dynamic sampling: drop groups with zero reward variance
    score_range: tuple[float, float] | None = None  # keep groups whose mean score lies inside
    drop_truncated: bool = False            # over-long filter: drop responses cut at max_tokens


class AlgoSpec(Strict):
    estimator: str = "reinforce_pp"
    gamma: float = 1.0
    lam: float = 1.0
    distill_coef: float = 1.0
    loss: LossSpec = Field(default_factory=LossSpec)
    correction: CorrectionSpec = Field(default_factory=CorrectionSpec)
    kl: KLSpec = Field(default_factory=KLSpec)
    filters: FilterSpec = Field(default_factory=FilterSpec)

    @field_validator("estimator")
    @classmethod
    def _registered(cls, value: str) -> str:
        from molt.algo import ESTIMATORS  # lazy: molt.algo imports this module's types

        if value not in ESTIMATORS:
            near = difflib.get_close_matches(value, list(ESTIMATORS), n=1, cutoff=0.5)
            hint = f" (did you mean '{near[0]}'?)" if near else ""
            names = ", ".join(sorted(ESTIMATORS))
            raise ValueError(f"unknown estimator '{value}'{hint}; registered: {names}")
        return value


class AgentSpec(Strict):
    module: str = "examples/agents/repeat.py"   # dotted module or .py file exporting AgentRunner
    kind: Literal["env", "chat"] = "env"
    options: dict[str, Any] = Field(default_factory=dict)  # passed to the agent unchanged
    max_turns: int = 1
    max_total_tokens: int = 512
    timeout_s: float = 60.0
    on_failure: Literal["drop_group", "keep_group"] = "drop_group"
    max_failure_rate: float = 0.5   # stop the run when a batch has more failed rollouts than this


class DataSpec(Strict):
    train_path: str = "examples/data/repeat_train.jsonl"
    eval_path: str | None = "examples/data/repeat_eval.jsonl"
    prompt_key: str = "prompt"
    messages_key: str = "messages"
    label_key: str = "label"
    shuffle: bool = True


class WandbSpec(Strict):
    project: str = "molt"
    entity: str | None = None
    mode: Literal["online", "offline", "disabled", "auto"] = "auto"  # auto: online with a key, else offline
    group: str | None = None
    job_type: str | None = None
    tags: list[str] = Field(default_factory=list)


class LoggingSpec(Strict):
    wandb: WandbSpec = Field(default_factory=WandbSpec)
    progress: bool = True
    dump_rollouts: bool = True
    dump_keep_steps: int = Field(100, ge=0)   # rollout dumps of the last N steps are kept; 0 keeps all
    plots: bool = True


class RaySpec(Strict):
    address: str | None = None      # attach to an existing cluster; None starts Ray locally
    num_cpus: int | None = None


class RunSpec(Strict):
    run: RunSection = Field(default_factory=RunSection)
    model: ModelSpec = Field(default_factory=ModelSpec)
    parallel: ParallelSpec = Field(default_factory=ParallelSpec)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    train: TrainSpec = Field(default_factory=TrainSpec)
    algo: AlgoSpec = Field(default_factory=AlgoSpec)
    agent: AgentSpec = Field(default_factory=AgentSpec)
    data: DataSpec = Field(default_factory=DataSpec)
    logging: LoggingSpec = Field(default_factory=LoggingSpec)
    ray: RaySpec = Field(default_factory=RaySpec)

    @model_validator(mode="after")
    def _cross_section(self) -> RunSpec:
        samples = self.train.prompts_per_step * self.rollout.samples_per_prompt
        if samples % self.parallel.dp_size:
            raise ValueError(f"train.prompts_per_step*rollout.samples_per_prompt = {samples} must be "
                             f"divisible by parallel.dp_size={self.parallel.dp_size}")
        if self.rollout.max_tokens >= self.model.max_model_len:
            raise ValueError(f"rollout.max_tokens={self.rollout.max_tokens} must be below "
                             f"model.max_model_len={self.model.max_model_len}")
        if self.algo.estimator == "gae" and not self.model.critic:
            raise ValueError("algo.estimator=gae needs a critic: set model.critic=true")
        if (self.algo.estimator == "on_policy_distill" or self.algo.kl.coef > 0) and not self.model.reference:
            raise ValueError(f"algo.estimator={self.algo.estimator} / algo.kl.coef={self.algo.kl.coef} "
                             "need model.reference (a path, or 'policy')")
        if self.parallel.device == "cpu" and self.model.dtype != "float32":
            raise ValueError("parallel.device=cpu trains in float32: set model.dtype=float32")
        if self.model.router_replay and self.rollout.mode == "async" and self.parallel.device == "cpu":
            # CPU routes come from re-scoring the batch on an engine drained of other requests: in async
            # mode that stalls the pool every step and gives stale tokens the newer policy's routes.
            raise ValueError("model.router_replay=true needs rollout.mode=sync on parallel.device=cpu "
                             "(routes are captured by re-scoring each batch on an otherwise idle engine)")
        return self

    @model_validator(mode="after")
    def _combinations(self) -> RunSpec:
        check_combinations(self)
        return self


class SpecError(ValueError):
    """A config that does not validate; the message lists every problem at once."""


# Keys that were renamed: an old key is an error that names its replacement.
RENAMED = {"parallel.offload_optimizer": "parallel.offload: none | optimizer | full "
                                         "(offload_optimizer=true used to mean full)"}


def _fields_at(loc: tuple[Any, ...]) -> list[str]:
    """Valid field names of the model that holds the key at `loc`."""
    model: Any = RunSpec
    for part in loc[:-1]:
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        model = field.annotation
    return list(getattr(model, "model_fields", {}))


def unknown_key_message(dotted: str) -> str | None:
    """None if `dotted` names a spec key (or lies inside a free-form dict), else an error with a hint."""
    if dotted in RENAMED:
        return f"'{dotted}' was renamed: use {RENAMED[dotted]}"
    model: Any = RunSpec
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        fields = getattr(model, "model_fields", None)
        if fields is None:  # a dict / free-form value: anything below is the user's
            return None
        if part not in fields:
            near = difflib.get_close_matches(part, list(fields), n=1, cutoff=0.5)
            hint = f" (did you mean '{'.'.join(parts[:i] + [near[0]])}'?)" if near else ""
            return f"unknown key '{dotted}'{hint}; valid keys here: {', '.join(fields)}"
        model = fields[part].annotation
    return None


def validate_spec(data: dict[str, Any]) -> RunSpec:
    """Validate a composed config; raise SpecError listing every problem with the nearest valid key."""
    try:
        return RunSpec.model_validate(data)
    except ValidationError as err:
        lines = []
        for e in err.errors():
            loc = tuple(p for p in e["loc"] if not isinstance(p, int))
            dotted = ".".join(str(p) for p in e["loc"])
            if e["type"] == "extra_forbidden" and dotted in RENAMED:
                lines.append(f"  {dotted}: renamed, use {RENAMED[dotted]}")
            elif e["type"] == "extra_forbidden":
                near = difflib.get_close_matches(str(loc[-1]), _fields_at(loc), n=1, cutoff=0.5)
                hint = f" (did you mean '{'.'.join(map(str, loc[:-1] + (near[0],)))}'?)" if near else ""
                lines.append(f"  {dotted}: unknown key{hint}")
            else:
                where = dotted or "spec"
                got = e.get("input")
                shown = "" if isinstance(got, dict) else f" (got {got!r})"
                lines.append(f"  {where}: {e['msg']}{shown}")
        raise SpecError(f"invalid run spec ({len(lines)} error(s)):\n" + "\n".join(lines)) from None
