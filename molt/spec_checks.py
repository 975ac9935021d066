"""Rules of the run spec that need a reason: layouts and combinations the code cannot run (refused
when the spec validates) and accepted but risky settings (logged loudly at launch). docs/parallelism.md
lists what each parallel setting does and where it is tested.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from molt.spec import ParallelSpec, RunSpec


def check_parallel(par: ParallelSpec) -> None:
    """Refuse the layouts the trainer cannot run, with the reason (docs/parallelism.md)."""
    if par.cp_size > 1:
        raise ValueError("cp_size > 1 is not supported: the trainer does not shard sequences, and torch's "
                         "context parallel has no CPU path to test it on (aten._scaled_dot_product_flash_"
                         "attention_for_cpu has no sharding strategy)")
    if par.ep_size > 1 and par.device == "cpu":
        raise ValueError("ep_size > 1 needs parallel.device=cuda: AutoModel shards experts only in its own "
                         "MoE model classes, which call torch.cuda.current_device() when built; the CPU "
                         "trainer loads the Hugging Face classes, on which AutoModel's expert parallel "
                         "raises")
    if par.offload == "full" and par.world_size == 1:
        raise ValueError("offload=full needs world_size > 1: with one rank AutoModel does not wrap the model "
                         "in FSDP2, whose CPUOffloadPolicy is what moves parameters to the host; use "
                         "offload=optimizer")
    if par.nodes < 1 or par.gpus_per_node < 1:
        raise ValueError(f"nodes={par.nodes} and gpus_per_node={par.gpus_per_node} must be >= 1")
    if par.trainer_nodes is not None and not 1 <= par.trainer_nodes < par.nodes:
        raise ValueError(f"trainer_nodes={par.trainer_nodes} must leave the engines at least one of the "
                         f"{par.nodes} node(s) (1 <= trainer_nodes < nodes), or be null to share all nodes")


def check_combinations(spec: RunSpec) -> None:
    """Cross-section refusals (the placement plan is checked after validation: molt.config.to_spec)."""
    _moe_with_expert_parallel(spec)
    _route_capture(spec)
    _speculative_decoding(spec)
    _updates(spec)
    _packing(spec)


def _moe_with_expert_parallel(spec: RunSpec) -> None:
    switches = [k for k in ("router_replay", "freeze_router") if getattr(spec.model, k)]
    if switches and spec.parallel.ep_size > 1:
        raise ValueError(f"model.{'/'.join(switches)} with parallel.ep_size={spec.parallel.ep_size}: replay "
                         "and freeze act on Hugging Face MoE routers, and AutoModel's expert parallel shards "
                         "only its own MoE classes (it raises on the Hugging Face ones); use ep_size=1 "
                         "(FSDP2 still shards the experts) or turn the switch off")


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


def _updates(spec: RunSpec) -> None:
    train = spec.train
    rows = train.prompts_per_step * spec.rollout.samples_per_prompt // spec.parallel.dp_size
    if train.minibatches > rows:
        raise ValueError(f"train.minibatches={train.minibatches} is more than the {rows} rows each data-"
                         "parallel rank gets per batch (train.prompts_per_step * rollout.samples_per_prompt"
                         " / parallel.dp_size): some optimizer steps would see no rows")
    if train.critic_warmup_steps and not spec.model.critic:
        raise ValueError("train.critic_warmup_steps trains the critic alone: it needs model.critic=true "
                         "(algo=gae)")


def _packing(spec: RunSpec) -> None:
    if spec.train.micro_batch_tokens is not None and spec.parallel.device == "cuda":
        raise ValueError("train.micro_batch_tokens (sequence packing) needs parallel.device=cpu: packed rows "
                         "run through an attention the trainer registers with transformers, and on cuda the "
                         "model comes from AutoModel's loader, whose model classes are not tested with it; "
                         "use train.micro_batch_size")


def spec_warnings(spec: RunSpec) -> list[str]:
    """Accepted but risky settings; the launcher logs each one loudly (console and the run's log)."""
    out = []
    if spec.rollout.mode == "async" and spec.algo.correction.level == "off":
        out.append("rollout.mode=async with algo.correction.level=off: tokens up to rollout.max_staleness="
                   f"{spec.rollout.max_staleness} policy versions old (and, with partial rollouts, responses "
                   "that span a refit) are trained as if on-policy; set algo.correction (e.g. algo=tis) "
                   "unless this is the ablation you want")
    return out
