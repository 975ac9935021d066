"""The run spec: the one validated object the launcher reads.

Hydra composes `conf/` + an experiment into a plain dict; `RunSpec.model_validate` then checks it
strictly. Every section forbids unknown keys, so a typo fails instead of being silently ignored, and
`validate_spec` turns pydantic's errors into one message that lists every problem with the nearest
valid key.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, model_validator

from molt.spec.agent import AgentSpec
from molt.spec.algo import AlgoSpec, LossSpec
from molt.spec.data import DataSpec, eval_names, pass_ks
from molt.spec.derived import DERIVED_KEYS, drop_derived_keys
from molt.spec.logging import LoggingSpec
from molt.spec.model import ModelSpec
from molt.spec.parallel import ParallelSpec
from molt.spec.rollout import RolloutSpec
from molt.spec.strict import Strict, did_you_mean
from molt.spec.train import TrainSpec


class RunSection(Strict):
    name: str = Field("tiny", description="names the run directory, the sweep directory and the W&B run")
    seed: int = Field(0, description="seed of the prompt order and of the engines' sampling")
    dir: str | None = Field(None, description="run directory; the launcher fills it from Hydra's output dir")
    resume: str | None = Field(
        None, description="'auto': continue the newest run of this experiment that has a checkpoint (none: "
                          "start fresh); or a run dir or a checkpoint dir")
    dry_run: bool = Field(False, description="validate, print the placement plan and exit; starts nothing")


class RaySpec(Strict):
    address: str | None = Field(None, description="attach to this Ray cluster (null = start Ray locally)")
    num_cpus: int | None = Field(None, ge=1, description="logical CPUs of a local Ray (null = at least 16 on "
                                 "CPU)")

    @model_validator(mode="after")
    def _local_only(self) -> RaySpec:
        if self.num_cpus is not None and self.address:
            raise ValueError(f"ray.num_cpus={self.num_cpus} with ray.address={self.address}: the CPUs of a "
                             "cluster are its nodes' own (ray start --num-cpus); unset ray.num_cpus")
        return self


class RunSpec(Strict):
    run: RunSection = Field(default_factory=RunSection, description="name, seed, directory, resume")
    model: ModelSpec = Field(default_factory=ModelSpec, description="policy model, reference, critic")
    parallel: ParallelSpec = Field(default_factory=ParallelSpec, description="the trainer's parallel layout")
    rollout: RolloutSpec = Field(default_factory=RolloutSpec, description="sampling, streaming, engines")
    train: TrainSpec = Field(default_factory=TrainSpec, description="optimizer, batch, checkpoints, eval")
    algo: AlgoSpec = Field(default_factory=AlgoSpec, description="estimator, loss, correction, KL, filters")
    agent: AgentSpec = Field(default_factory=AgentSpec, description="the agent that produces rollouts")
    data: DataSpec = Field(default_factory=DataSpec, description="prompt datasets")
    logging: LoggingSpec = Field(default_factory=LoggingSpec, description="W&B, progress bar, dumps, plots")
    ray: RaySpec = Field(default_factory=RaySpec, description="the Ray cluster")

    @property
    def response_budget(self) -> int:
        """The most response tokens one rollout can sample: rollout.max_tokens per turn, agent.max_turns
        turns (seq-mean-token-sum-norm divides by it; the overlong penalty's band sits below it)."""
        return self.rollout.max_tokens * self.agent.max_turns

    @model_validator(mode="before")
    @classmethod
    def _derived(cls, data: Any) -> Any:
        return drop_derived_keys(data)

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
        if self.model.reference_tiny and self.model.reference != "tiny":
            raise ValueError(f"model.reference_tiny is set but model.reference={self.model.reference}: set "
                             "model.reference=tiny to build the reference from these options")
        if self.model.dtype == "float16":
            # The trainer has no loss scaling (GradScaler) under FSDP2's mixed precision (cuda) or CPU
            # autocast: float16 gradients below ~6e-8 flush to 0, where bfloat16 keeps float32's range.
            raise ValueError(f"model.dtype=float16 on parallel.device={self.parallel.device}: the trainer "
                             "computes without loss scaling, so small gradients underflow to 0 in float16; "
                             "set model.dtype=bfloat16 (or float32)")
        _check_eval_keys(self)
        if self.model.critic and self.algo.estimator != "gae":
            raise ValueError(f"model.critic=true with algo.estimator={self.algo.estimator}: only gae uses a "
                             "critic's values (others return no value targets to train it on); set "
                             "model.critic=false, or algo=gae")
        return self

    @model_validator(mode="after")
    def _combinations(self) -> RunSpec:
        check_combinations(self)
        return self


def _check_eval_keys(spec: RunSpec) -> None:
    """train.objective=sft trains the policy alone; train.best_metric names an eval set of data.eval."""
    if spec.train.objective == "sft" and (spec.model.critic or spec.model.reference):
        raise ValueError("train.objective=sft trains the policy alone: set model.critic=false and "
                         "model.reference=null")
    metric, names = spec.train.best_metric, eval_names(spec.data.eval)
    if metric is None:
        return
    if "/" not in metric and names:   # a metric alone (pass@1) is the first eval set's, named here once
        spec.train.best_metric = metric = f"eval/{names[0]}/{metric}"
    parts = metric.split("/")
    if len(parts) != 3 or parts[0] != "eval" or parts[1] not in names:
        raise ValueError(f"train.best_metric={metric!r} must be eval/NAME/METRIC with NAME the stem of a "
                         f"data.eval file ({', '.join(names) or 'none configured'}), e.g. eval/NAME/pass@1")
    # the metrics an evaluation logs (molt/driver/eval.py set_metrics; SFT: molt/driver/sft_loop.py
    # eval_losses): an unknown one would only fail at the first evaluation, taking the steps since the
    # last checkpoint with it
    n = spec.rollout.eval.n
    logged = ["loss"] if spec.train.objective == "sft" else [f"mean@{n}", *(f"pass@{k}" for k in pass_ks(n))]
    if parts[2] not in logged:
        raise ValueError(f"train.best_metric={metric!r}: an evaluation of this run logs eval/{parts[1]}/"
                         f"{{{', '.join(logged)}}} (rollout.eval.n={n}, train.objective="
                         f"{spec.train.objective})")
    if not spec.train.eval_every:
        raise ValueError("train.best_metric needs evaluations: set train.eval_every > 0")


def check_combinations(spec: RunSpec) -> None:
    """Cross-section refusals that need a reason (the placement plan is checked after validation:
    molt.driver.compose.to_spec)."""
    _moe_with_expert_parallel(spec)
    _route_capture(spec)
    _speculative_decoding(spec)
    _updates(spec)
    _packing(spec)
    _vision(spec)
    _rollout_settings(spec)
    _colocation(spec)


def _moe_with_expert_parallel(spec: RunSpec) -> None:
    # the critic is always a Hugging Face token-classification model (molt/trainer/model.py)
    switches = [k for k in ("router_replay", "freeze_router", "critic") if getattr(spec.model, k)]
    if switches and spec.parallel.ep_size > 1:
        raise ValueError(f"model.{'/'.join(switches)} with parallel.ep_size={spec.parallel.ep_size}: replay "
                         "and freeze act on Hugging Face MoE routers and the critic is a Hugging Face model, "
                         "but AutoModel's expert parallel shards only its own MoE classes (it raises on the "
                         "Hugging Face ones); use ep_size=1 (FSDP2 still shards the experts) or turn the "
                         "switch off")


def _route_capture(spec: RunSpec) -> None:
    # Each engine returns the routes of every request (docs/generator.md): on CPU through a Python
    # callback in each MoE router (molt/rollout/routes.py), which a torch.compile'd engine never calls;
    # on GPU through vLLM's own capture, which keeps routes per prefix-cache block.
    if not spec.model.router_replay:
        return
    engine = spec.rollout.engine
    if spec.parallel.device == "cpu" and not engine.enforce_eager:
        raise ValueError("model.router_replay=true on parallel.device=cpu needs rollout.engine.enforce_eager="
                         "true: the engine captures routes with a hook that a compiled engine never calls")
    if spec.parallel.device == "cuda" and not engine.enable_prefix_caching:
        raise ValueError("model.router_replay=true on parallel.device=cuda needs rollout.engine."
                         "enable_prefix_caching=true: vLLM's routed-experts capture requires it")
    if spec.parallel.device == "cuda" and spec.rollout.partial_rollout:
        # The refit's cache reset recomputes a kept request's tokens with the new weights, but vLLM's GPU
        # capture returns only the rows from its last token on for a request that already has outputs: the
        # trainer would replay the old policy's routes where the engine used the new one's.
        raise ValueError("model.router_replay=true with rollout.partial_rollout=true on parallel.device="
                         "cuda: "
                         "vLLM's GPU route capture keeps the routes a request's earlier tokens had before a "
                         "refit recomputed them, so replay would not match the engine; set "
                         "rollout.partial_rollout=false (a refit then waits for the requests in flight)")


MODEL_FREE_DRAFTS = ("ngram", "suffix")   # vLLM's speculative methods that hold no weights


def _speculative_decoding(spec: RunSpec) -> None:
    engine = spec.rollout.engine
    if engine.speculative_config is None:
        return
    if spec.model.router_replay:
        raise ValueError("rollout.engine.speculative_config with model.router_replay: tokens accepted from "
                         "a draft are scored in a verification pass, so the engine's routes do not come from "
                         "one pass per sampled token and replaying them is not exact")
    if engine.enable_prefix_caching:
        raise ValueError("rollout.engine.speculative_config with enable_prefix_caching=true: peers measured "
                         "a ~10x larger trainer/engine logprob mismatch with both on; set "
                         "rollout.engine.enable_prefix_caching=false")
    method = engine.speculative_config.get("method")
    if method not in MODEL_FREE_DRAFTS:
        # vLLM refits the target model only; AutoModel's DeepSeek-V3 has no MTP layer to train or send
        raise ValueError(f"rollout.engine.speculative_config method={method}: a drafter with weights of its "
                         "own (an MTP layer, EAGLE, a draft model) is never refit, so it keeps proposing the "
                         "checkpoint's tokens while the policy moves (sampling stays exact, acceptance and "
                         f"speed decay); use a model-free drafter ({' or '.join(MODEL_FREE_DRAFTS)}) or none")


def _updates(spec: RunSpec) -> None:
    train = spec.train
    sft = train.objective == "sft"   # an SFT batch is prompts_per_step conversations
    rows = train.prompts_per_step * (1 if sft else spec.rollout.samples_per_prompt) // spec.parallel.dp_size
    if train.minibatches > rows:
        per = "" if sft else " * rollout.samples_per_prompt"
        raise ValueError(f"train.minibatches={train.minibatches} is more than the {rows} rows each data-"
                         f"parallel rank gets per batch (train.prompts_per_step{per} / parallel.dp_size): "
                         "some optimizer steps would see no rows")
    if train.critic_warmup_steps and not spec.model.critic:
        raise ValueError("train.critic_warmup_steps trains the critic alone: it needs model.critic=true "
                         "(algo=gae)")


def _packing(spec: RunSpec) -> None:
    if spec.train.micro_batch_tokens is not None and spec.parallel.device == "cuda":
        raise ValueError("train.micro_batch_tokens (sequence packing) needs parallel.device=cpu: packed rows "
                         "run through an attention the trainer registers with transformers, and on cuda the "
                         "model comes from AutoModel's loader, whose model classes are not tested with it; "
                         "use train.micro_batch_size")


def _vision(spec: RunSpec) -> None:
    # The trainer loads a VLM's policy with its image inputs unpacked and has no value model for one; caught
    # here, the run stops before Ray and the engines start instead of when the trainer loads.
    if not (spec.model.critic or spec.train.micro_batch_tokens is not None or spec.parallel.cp_size > 1) \
            or not _vlm(spec.model):
        return
    if spec.model.critic:
        raise ValueError("model.critic=true with a vision-language model: a value model of a VLM is not "
                         "supported; use an estimator without a critic (e.g. algo=grpo)")
    if spec.parallel.cp_size > 1:
        raise ValueError("parallel.cp_size > 1 with a vision-language model: context parallel does not split "
                         "image inputs over the cp ranks; use cp_size=1")
    raise ValueError("train.micro_batch_tokens (sequence packing) with a vision-language model: packing does "
                     "not pack image inputs; use train.micro_batch_size")


def _vlm(model: ModelSpec) -> bool:
    """Whether the policy is a vision-language model, as far as the spec can tell without a download: a
    tiny model with a vision tower, or a checkpoint whose config.json (a local folder, or the hub's cached
    copy) has a vision_config. A hub model not downloaded yet is refused by the trainer when it loads."""
    if model.path is None:
        return model.tiny.get("vision_layers", 0) > 0
    config = Path(model.path).expanduser() / "config.json"
    if not config.exists():
        from huggingface_hub import try_to_load_from_cache
        from huggingface_hub.errors import HFValidationError

        try:
            cached = try_to_load_from_cache(model.path, "config.json")
        except HFValidationError:     # not a hub id either: molt.plan.models.model_path says so at launch
            return False
        if not isinstance(cached, str):
            return False
        config = Path(cached)
    return "vision_config" in json.loads(config.read_text(encoding="utf-8"))


def _rollout_settings(spec: RunSpec) -> None:
    rollout, agent = spec.rollout, spec.agent
    if spec.train.objective == "sft":
        return
    # A rollout holds prompt + responses within agent.max_total_tokens: a response could never reach a
    # max_tokens at or above it, and every response would be cut short without a word.
    longest = max(rollout.max_tokens, rollout.eval.max_tokens if spec.train.eval_every else 0)
    if agent.max_total_tokens <= longest:
        key = "rollout.max_tokens" if longest == rollout.max_tokens else "rollout.eval.max_tokens"
        raise ValueError(f"{key}={longest} cannot be reached: agent.max_total_tokens="
                         f"{agent.max_total_tokens} caps a rollout's prompt and responses together; raise "
                         "agent.max_total_tokens (e.g. to model.max_model_len)")
    if spec.algo.filters.drop_equal_rewards and rollout.samples_per_prompt == 1:
        raise ValueError("algo.filters.drop_equal_rewards with rollout.samples_per_prompt=1: a group of one "
                         "always has equal rewards, so every group would be dropped and nothing trained")
    if rollout.mode == "async" and rollout.groups_in_flight < spec.train.prompts_per_step:
        raise ValueError(f"rollout.mode=async with rollout.groups_in_flight={rollout.groups_in_flight} < "
                         f"train.prompts_per_step={spec.train.prompts_per_step}: a batch needs that many "
                         "groups generating at once; raise rollout.groups_in_flight")
    if rollout.engine.extra_args.get("enable_chunked_prefill") and spec.parallel.device == "cpu":
        raise ValueError("rollout.engine.extra_args.enable_chunked_prefill=true on parallel.device=cpu: a "
                         "seeded request whose prefill is split makes vLLM rewind a CPU generator, which "
                         "kills the engine core")


def _colocation(spec: RunSpec) -> None:
    # parallel.colocate: the engine sleeps while the trainer steps, so generation and training take turns
    par, engine = spec.parallel, spec.rollout.engine
    if not par.colocate or spec.train.objective != "rl":
        return
    if spec.rollout.mode == "async":
        raise ValueError("parallel.colocate=true with rollout.mode=async: the colocated engine sleeps while "
                         "the trainer steps, so nothing would generate meanwhile; use rollout.mode=sync")
    if engine.num_engines > 1 or engine.tp_size > 1:
        raise ValueError(f"parallel.colocate=true with {engine.num_engines} engine(s) of tp_size "
                         f"{engine.tp_size}: colocation shares one GPU with one engine "
                         "(rollout.engine.num_engines=1, tp_size=1)")
    if par.engine_sleep_level == 2 and spec.model.lora.rank:
        raise ValueError("parallel.engine_sleep_level=2 with model.lora: level 2 drops the engine's base "
                         "weights, and a LoRA refit sends the adapter alone; use engine_sleep_level=1")


def spec_warnings(spec: RunSpec) -> list[str]:
    """Accepted but risky settings; the launcher logs each one loudly (console and the run's log)."""
    out, rl = [], spec.train.objective == "rl"
    if rl and spec.rollout.mode == "async" and spec.algo.correction.level == "off":
        out.append("rollout.mode=async with algo.correction.level=off: tokens up to rollout.max_staleness="
                   f"{spec.rollout.max_staleness} policy versions old (and, with partial rollouts, responses "
                   "that span a refit) are trained as if on-policy; set algo.correction (e.g. algo=tis) "
                   "unless this is the ablation you want")
    # Versions count batches, not optimizer steps: each extra update per batch moves the weights further
    # from the policy that sampled a stale token (docs/algo.md, "Staleness and decoupled PPO").
    updates = spec.train.minibatches * spec.train.epochs
    if rl and spec.rollout.mode == "async" and updates > 1:
        lag = spec.rollout.max_staleness
        out.append(f"rollout.mode=async with train.minibatches x train.epochs = {updates} updates per "
                   f"batch: a token up to rollout.max_staleness={lag} versions old is trained up to "
                   f"{(lag + 1) * updates - 1} optimizer steps after the weights that sampled it; the clip "
                   "bounds only the steps within this batch, the importance correction (algo.correction, "
                   "e.g. algo=decoupled_ppo) the rest")
    # With one update per batch the old logprobs are the update's own forward: every ratio is 1.
    loss, default = spec.algo.loss, LossSpec()
    clips = [f"{k}={getattr(loss, k)}" for k in ("eps_low", "eps_high", "dual_clip", "value_clip", "dro_beta")
             if getattr(loss, k) != getattr(default, k)]
    if rl and clips and spec.train.minibatches * spec.train.epochs == 1:
        out.append(f"algo.loss.{', '.join(clips)} with one update per batch (train.minibatches x "
                   "train.epochs = 1): the policy's ratio (and the critic's value change) starts at 1 (0) "
                   "and the clip (dro: its penalty, 0 at ratio 1) never acts; raise train.minibatches or "
                   "train.epochs for it to matter")
    # group (grpo) or batch (reinforce_pp, undiscounted) whitening undoes any affine map of the rewards
    algo = spec.algo
    whitened = algo.estimator == "grpo" or (algo.estimator == "reinforce_pp" and algo.gamma == 1)
    if rl and algo.reward.normalize == "batch" and whitened and not (algo.kl.in_reward and algo.kl.coef):
        out.append(f"algo.reward.normalize=batch with algo.estimator={algo.estimator}: the estimator whitens "
                   "the rewards itself, which undoes a batch normalization before it; the advantages do not "
                   "change")
    # SFT trains on conversations with the token-mean NLL: no estimator, loss choice, agent or sampling
    ignored = [name for name, value, default in (("algo", spec.algo, AlgoSpec()), ("agent", spec.agent,
               AgentSpec()), ("rollout.mode", spec.rollout.mode, "sync")) if value != default]
    if not rl and ignored:
        out.append(f"train.objective=sft with {', '.join(ignored)} set: SFT trains on data.train_path's "
                   "conversations with the token-mean NLL, so these settings have no effect")
    if not rl and spec.train.max_trainer_restarts != TrainSpec().max_trainer_restarts:
        out.append("train.max_trainer_restarts with train.objective=sft: an SFT run stops when a trainer "
                   "rank dies (resume it with run.resume=auto); the setting applies to RL runs")
    return out


class SpecError(ValueError):
    """A config that does not validate; the message lists every problem at once."""


# Keys that were renamed: an old key is an error that names its replacement.
RENAMED = {"parallel.offload_optimizer": "parallel.offload: none | optimizer | full "
                                         "(offload_optimizer=true used to mean full)",
           "data.eval_path": "data.eval: [PATH, ...] (eval sets named by file stem; metrics eval/STEM/...)"}


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
    if dotted in DERIVED_KEYS:   # no longer a key: RunSpec accepts the derived value (molt/spec/derived.py)
        return None
    model: Any = RunSpec
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        fields = getattr(model, "model_fields", None)
        if fields is None:  # a dict / free-form value: anything below is the user's
            return None
        if part not in fields:
            hint = did_you_mean(part, fields, prefix="".join(f"{p}." for p in parts[:i]))
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
                hint = did_you_mean(str(loc[-1]), _fields_at(loc), "".join(f"{p}." for p in loc[:-1]))
                lines.append(f"  {dotted}: unknown key{hint}")
            else:
                where = dotted or "spec"
                got = e.get("input")
                shown = "" if isinstance(got, dict) else f" (got {got!r})"
                lines.append(f"  {where}: {e['msg']}{shown}")
        raise SpecError(f"invalid run spec ({len(lines)} error(s)):\n" + "\n".join(lines)) from None
