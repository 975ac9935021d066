"""The spec's own rules: every rule across sections, and the warnings, in one place. A key's rule on its own
value lives beside it (its `Field` constraint, or its section's validator); what needs more than the spec
(algo/'s registries, the agent module, the data, the plans, the installed environment) is the second and
last stage, molt/driver/compose.py. `RunSpec` calls `check` when it validates.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from molt.spec.agent import AgentSpec
from molt.spec.algo import AlgoSpec, LossSpec
from molt.spec.data import eval_names, pass_ks
from molt.spec.train import TrainSpec

if TYPE_CHECKING:
    from molt.spec.run import RunSpec


def check(spec: RunSpec) -> None:
    """Raise ValueError at the first cross-section rule `spec` breaks, naming the keys and what to set."""
    _batch_and_context(spec)
    _models(spec)
    _check_eval_keys(spec)
    _moe_with_expert_parallel(spec)
    _route_capture(spec)
    _speculative_decoding(spec)
    _updates(spec)
    _packing(spec)
    _rollout_settings(spec)
    _colocation(spec)


def _batch_and_context(spec: RunSpec) -> None:
    samples = spec.train.prompts_per_step * spec.rollout.samples_per_prompt
    if samples % spec.parallel.dp_size:
        raise ValueError(f"train.prompts_per_step*rollout.samples_per_prompt = {samples} must be "
                         f"divisible by parallel.dp_size={spec.parallel.dp_size}")
    if spec.rollout.max_tokens >= spec.model.max_model_len:
        raise ValueError(f"rollout.max_tokens={spec.rollout.max_tokens} must be below "
                         f"model.max_model_len={spec.model.max_model_len}")


def _models(spec: RunSpec) -> None:
    # What an estimator needs (a critic, a reference) is its registration's: molt.driver.compose checks it.
    if spec.algo.kl.coef > 0 and not spec.model.reference:
        raise ValueError(f"algo.kl.coef={spec.algo.kl.coef} needs model.reference (a path, or 'policy')")
    if spec.model.reference_tiny and spec.model.reference != "tiny":
        raise ValueError(f"model.reference_tiny is set but model.reference={spec.model.reference}: set "
                         "model.reference=tiny to build the reference from these options")
    if spec.model.dtype == "float16":
        # The trainer has no loss scaling (GradScaler) under FSDP2's mixed precision (cuda) or CPU
        # autocast: float16 gradients below ~6e-8 flush to 0, where bfloat16 keeps float32's range.
        raise ValueError(f"model.dtype=float16 on parallel.device={spec.parallel.device}: the trainer "
                         "computes without loss scaling, so small gradients underflow to 0 in float16; "
                         "set model.dtype=bfloat16 (or float32)")


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
    """Accepted but risky settings; the launcher logs each one loudly (console and the run's log), with
    those that need algo/'s registries (molt.driver.compose.warnings)."""
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
