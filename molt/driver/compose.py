"""The second and last stage of the checks: what the spec alone cannot tell (molt/spec/rules.py is the first).

    to_spec(cfg)    the composed config validated by the spec, then checked against algo/'s registries
                    (the estimator's needs: a critic, a reference, samples per prompt, per-turn returns)
                    and, on CUDA, the placement and memory plans
    prepare(spec)   the run's inputs, checked by building them once: the model's folder and tokenizer, the
                    checkpoint run.resume names, the train and eval sets, the agent module, the tools, the
                    context each prompt leaves for its response, and what the installed environment lacks;
                    the loop starts from what it built (`Inputs`), and a dry run is the same call, stopped

Every problem `prepare` finds is kept (`Inputs.problems`), so a dry run prints its whole plan and then every
problem; a run refuses to start on the first. Nothing here starts Ray or writes a file.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import DictConfig

from molt.algo import ESTIMATOR_NEEDS, POLICY_LOSSES, load_plugins
from molt.plan import memory
from molt.plan.arch import arch_of
from molt.plan.placement import plan
from molt.spec import RunSpec, SpecError
from molt.spec.config import compose_config, validate_config
from molt.spec.strict import did_you_mean

log = logging.getLogger("molt")
T = TypeVar("T")
# What a user's input raises when it is wrong (a file, a module, a value); anything else is a Molt bug.
REFUSALS = (OSError, ImportError, TypeError, ValueError)


def to_spec(cfg: DictConfig) -> RunSpec:
    """Validate a composed config, then check it against algo/'s registries (`algo.plugins` imported
    first) and, on CUDA, the placement plan and its memory estimate, so an over-subscribed layout or one
    that cannot fit a GPU fails before Ray starts (CPU devices are time-shared: nothing to total). A dry
    run reports the memory refusal after its plan (`prepare`) instead."""
    spec = validate_config(cfg)
    try:
        check_algorithm(spec)
        check_context_parallel(spec)
        if spec.parallel.device == "cuda":
            plan(spec)
            if not spec.run.dry_run:
                memory.check(spec)
    except ValueError as err:
        raise SpecError(f"invalid run spec: {err}") from None
    return spec


def check_context_parallel(spec: RunSpec) -> None:
    """Context parallel splits the attention heads of each tensor-parallel rank over the cp ranks
    (molt/trainer/context_parallel.py): refused when cp_size does not divide them, for every trainer role
    whose architecture the plan knows (a hub id without model.arch is checked when the trainer loads it)."""
    par = spec.parallel
    if par.cp_size == 1:
        return
    roles = ["policy"] + (["reference"] if spec.model.reference else [])
    for role in roles:
        a = arch_of(spec, role)
        if a is not None and (a.num_heads % par.tp_size or a.num_heads // par.tp_size % par.cp_size):
            raise ValueError(f"parallel.cp_size={par.cp_size} must divide the {role}'s attention heads per "
                             f"tensor-parallel rank ({a.num_heads} / tp_size={par.tp_size}): context "
                             "parallel splits them over the cp ranks")


def compose(overrides: Sequence[str] = ()) -> RunSpec:
    """Compose conf/ with Hydra overrides (e.g. ["+experiment=qwen30b_tools", "train.lr=1e-5"]) and check
    the spec as a run would."""
    return to_spec(compose_config(overrides))


def check_algorithm(spec: RunSpec) -> None:
    """Import `algo.plugins` (each once per process) and check the algorithm's names against the registries
    and what the estimator needs of the run (molt.algo.EstimatorNeeds) against the spec; ValueError names
    the key and what to set."""
    algo, rl = spec.algo, spec.train.objective == "rl"
    load_plugins(spec)
    for key, value, registry in (("algo.estimator", algo.estimator, ESTIMATOR_NEEDS),
                                 ("algo.loss.policy", algo.loss.policy, POLICY_LOSSES)):
        if value not in registry:
            raise ValueError(f"unknown {key.split('.')[-1]} '{value}'{did_you_mean(value, registry)}; "
                             f"registered: {', '.join(sorted(registry))} (a plugin of your own: "
                             "algo.plugins=[module or file.py])")
    needs, name = ESTIMATOR_NEEDS[algo.estimator], f"algo.estimator={algo.estimator}"
    if needs.needs_critic and not spec.model.critic:
        raise ValueError(f"{name} needs a critic: set model.critic=true")
    if spec.model.critic and not needs.needs_critic:
        critics = ", ".join(sorted(n for n, e in ESTIMATOR_NEEDS.items() if e.needs_critic))
        raise ValueError(f"model.critic=true with {name}: it reads no critic values and returns no value "
                         f"targets to train one on (estimators that do: {critics}); set model.critic=false")
    if needs.needs_reference and not spec.model.reference:
        raise ValueError(f"{name} needs model.reference (a path, or 'policy')")
    if rl and needs.group_baseline and spec.rollout.samples_per_prompt < 2:   # SFT samples nothing
        raise ValueError(f"{name} compares samples of one prompt, and rollout.samples_per_prompt=1 makes "
                         "every advantage 0; use >= 2 samples, or a batch-baseline estimator (reinforce_pp)")
    if algo.turn_credit == "turn" and not needs.turn_credit:
        takers = ", ".join(sorted(n for n, e in ESTIMATOR_NEEDS.items() if e.turn_credit))
        raise ValueError(f"algo.turn_credit=turn with {name}: per-turn returns feed only the estimators that "
                         f"take them: {takers}; use one of those, or algo.turn_credit=rollout")


def warnings(spec: RunSpec) -> list[str]:
    """Accepted but risky settings that need algo/'s registries (beside molt.spec.spec_warnings)."""
    algo, out = spec.algo, []
    needs = ESTIMATOR_NEEDS.get(algo.estimator)
    # a whitening estimator undoes any affine map of the rewards (undiscounted: the same shift everywhere)
    if spec.train.objective == "rl" and algo.reward.normalize == "batch" and needs and needs.whitens and \
            algo.gamma == 1 and not (algo.kl.in_reward and algo.kl.coef):
        out.append(f"algo.reward.normalize=batch with algo.estimator={algo.estimator}: the estimator whitens "
                   "the rewards itself, which undoes a batch normalization before it; the advantages do not "
                   "change")
    return out


@dataclass
class Inputs:
    """What a run starts from, built once before anything starts (`prepare`) and handed down to the loop."""
    policy_path: str | None = None
    tokenizer: Any = None
    runner: Any = None                  # RL: agent.module's AgentRunner, not set up yet
    train: Any = None                   # RL: a PromptDataset; SFT: the tokenized examples
    eval_sets: dict[str, Any] = field(default_factory=dict)   # by name, in data.eval's order
    checkpoint: Path | None = None      # what run.resume names (None: a fresh start)
    problems: list[Exception] = field(default_factory=list)   # each one line; a run starts without any
    notes: list[str] = field(default_factory=list)            # what the dry run prints beside the plan

    def or_raise(self) -> Inputs:
        if self.problems:
            raise self.problems[0]
        return self


def prepare(spec: RunSpec, train: bool = True) -> Inputs:
    """The run's inputs, each built once and checked by building it; what cannot be built is a problem
    of the returned `Inputs` (the checks go on, so that all are reported). A dry run reads only this
    machine (a hub model's tokenizer from the local cache, or the context check is skipped, saying so).
    `train=False` (`python -m molt.eval`) leaves the train set out."""
    from molt.driver.checkpoints import find_checkpoint
    from molt.plan.models import check_same_tokenizer, is_hub_id, model_path

    inputs = Inputs()

    def attempt(build: Callable[..., T], *args: Any) -> T | None:
        try:
            return build(*args)
        except REFUSALS as err:
            inputs.problems.append(err)
            return None

    attempt(check_environment, spec)
    inputs.policy_path = path = attempt(model_path, spec)
    inputs.checkpoint = attempt(find_checkpoint, spec)
    if path is not None:
        inputs.tokenizer = attempt(load_tokenizer, spec, path)
    if spec.model.reference not in (None, "policy") and inputs.tokenizer is not None:
        reference = attempt(model_path, spec, "reference")   # a dry run reads no hub model's files
        if reference is not None and not (spec.run.dry_run and is_hub_id(reference)):
            attempt(check_same_tokenizer, spec)
    if spec.train.objective == "sft":
        _prepare_sft(spec, inputs, attempt)
    else:
        _prepare_rl(spec, inputs, attempt, train)
    return inputs


def _prepare_rl(spec: RunSpec, inputs: Inputs, attempt: Callable[..., Any], train: bool) -> None:
    from molt.agents import load_agent_runner
    from molt.inputs.data import PromptDataset, load_eval_sets

    inputs.runner = attempt(load_agent_runner, spec.agent)
    inputs.train = attempt(PromptDataset, spec.data.train_path, spec.data) if train else None
    inputs.eval_sets = attempt(load_eval_sets, spec.data) or {}
    sets = {"data.train_path": inputs.train} if inputs.train is not None else {}
    sets |= {f"data.eval ({name})": rows for name, rows in inputs.eval_sets.items()}
    for where, rows in sets.items():
        attempt(check_row_tools, rows, where)
    if inputs.tokenizer is not None and attempt(check_chat_template, spec, inputs.tokenizer):
        for where, rows in sets.items():
            note = attempt(check_context, spec, inputs.tokenizer, rows, where)
            inputs.notes += [note] if note else []


def _prepare_sft(spec: RunSpec, inputs: Inputs, attempt: Callable[..., Any]) -> None:
    """Conversations, tokenized once (no agent runs); a conversation longer than the context is refused."""
    from molt.driver.sft_data import load_conversations, load_examples
    from molt.spec import eval_names

    if inputs.tokenizer is None or not attempt(check_chat_template, spec, inputs.tokenizer):
        for source in (spec.data.train_path, *spec.data.eval):   # what can be checked without one
            attempt(load_conversations, source, spec.data)
        return
    inputs.train = attempt(load_examples, spec, inputs.tokenizer, spec.data.train_path)
    for name, source in zip(eval_names(spec.data.eval), spec.data.eval, strict=True):
        examples = attempt(load_examples, spec, inputs.tokenizer, source)
        if examples is not None:
            inputs.eval_sets[name] = examples


def load_tokenizer(spec: RunSpec, path: str) -> Any:
    """The policy's tokenizer. A dry run reads only this machine: a hub model not in the local cache raises
    OSError, which `prepare` reports as the context check skipped, not as a problem."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=spec.model.trust_remote_code,
                                             local_files_only=spec.run.dry_run)
    except OSError as err:
        if spec.run.dry_run:
            log.warning("molt: the context budget is not checked: the tokenizer of model.path=%s is not on "
                        "this machine (a run downloads it)", path)
            return None
        raise OSError(f"model.path={path}: its tokenizer could not be loaded: {err}") from None


def check_environment(spec: RunSpec) -> None:
    """What the installed environment or the model's files must provide: DeepEP beyond one node's expert
    parallelism; LoRA adapters the engines can serve; a policy without image inputs where the trainer
    supports none; on a dry run, the memory plan (a run refuses it at validation)."""
    from molt.plan.models import is_vlm, model_path

    check_expert_dispatch(spec)
    if spec.model.lora.served_as_adapter():
        from molt.rollout.engine_args import check_lora

        check_lora(model_path(spec), spec.model)
    cp = spec.parallel.cp_size > 1
    if (spec.model.critic or spec.train.micro_batch_tokens is not None or cp) and is_vlm(spec):
        # The trainer loads a VLM's policy with its image inputs unpacked and has no value model for one.
        raise ValueError("model.critic=true with a vision-language model: a value model of a VLM is not "
                         "supported; use an estimator without a critic (e.g. algo=grpo)" if spec.model.critic
                         else "parallel.cp_size > 1 with a vision-language model: context parallel does not "
                         "split image inputs over the cp ranks; use cp_size=1" if cp
                         else "train.micro_batch_tokens (sequence packing) with a vision-language model: "
                         "packing does not pack image inputs; use train.micro_batch_size")
    if spec.run.dry_run and spec.parallel.device == "cuda":
        memory.check(spec)


# Without DeepEP, AutoModel's MoE dispatcher all-gathers every token of the expert-parallel group onto every
# rank: memory and traffic per MoE layer grow with ep_size (30-60 GB per layer at DeepSeek-V3's shape and
# ep 256). Up to one node's 8 GPUs (NVLink) it is AutoModel's own default; beyond, DeepEP is required.
EP_WITHOUT_DEEPEP = 8


def check_expert_dispatch(spec: RunSpec) -> None:
    """Refuse `parallel.ep_size` above EP_WITHOUT_DEEPEP on cuda unless DeepEP (`deep_ep`) is importable."""
    ep = spec.parallel.ep_size
    if spec.parallel.device == "cuda" and ep > EP_WITHOUT_DEEPEP and not importlib.util.find_spec("deep_ep"):
        raise ValueError(
            f"parallel.ep_size={ep} needs DeepEP (the deep_ep module) above {EP_WITHOUT_DEEPEP}: without it "
            "AutoModel's MoE dispatcher all-gathers every token onto every expert-parallel rank. Build it "
            "against the installed torch (`pip install --no-build-isolation deep-ep`, needs nvcc and "
            f"NVSHMEM; docs/install.md#gpu), or use parallel.ep_size<={EP_WITHOUT_DEEPEP}")


def check_row_tools(rows: Any, where: str) -> None:
    """Every distinct `tools` list of the rows is a list of OpenAI function schemas whose parameters are
    JSON Schema (a rollout of a bad row would fail; refused here, naming the row)."""
    from molt.spec.agent import TOOLS_KEY, check_tools

    seen = set()
    for i, row in enumerate(rows):
        tools = row.get(TOOLS_KEY)
        if tools is not None and repr(tools) not in seen:
            seen.add(repr(tools))
            check_tools(tools if isinstance(tools, list) else [tools], f"{_place(rows, i, where)}: tools")


def check_chat_template(spec: RunSpec, tokenizer: Any) -> bool:
    """Prompts (and SFT conversations) are rendered with the tokenizer's chat template: refuse one without."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the tokenizer of model.path={spec.model.path or '(the tiny model)'} has no chat "
                         "template: prompts and conversations are rendered with it (both agent kinds); use a "
                         "model whose tokenizer_config.json (or chat_template.jinja) has one")
    return True


# Rows whose prompts the context check renders: the longest by characters (a token count follows them).
CONTEXT_ROWS = 64


def check_context(spec: RunSpec, tokenizer: Any, rows: Any, where: str) -> str:
    """Refuse a set whose longest prompts (rendered as a rollout starts: chat template, agent.tools and the
    row's tools) leave less than the response's budget (rollout.max_tokens; evaluation: rollout.eval's)
    under the context (the smaller of model.max_model_len and agent.max_total_tokens): every response to
    such a row would be cut short. Returns the dry run's line on the longest prompt."""
    from molt.agents.env import prompt_ids

    evaluation = where.startswith("data.eval")
    budget, budget_key = (spec.rollout.eval.max_tokens, "rollout.eval.max_tokens") if evaluation else \
        (spec.rollout.max_tokens, "rollout.max_tokens")
    limit, limit_key = min((spec.model.max_model_len, "model.max_model_len"),
                           (spec.agent.max_total_tokens, "agent.max_total_tokens"), key=lambda c: c[0])
    by_size = sorted(range(len(rows)), key=lambda i: -len(repr(rows[i])))[:CONTEXT_ROWS]
    longest, row = max((len(prompt_ids(tokenizer, spec, rows[i])), i) for i in by_size)
    place = _place(rows, row, where)
    if longest + budget > limit:
        raise ValueError(f"{place}: the prompt renders to {longest} tokens (chat template and tools "
                         f"included): with {budget_key}={budget} that is {longest + budget} tokens, above "
                         f"{limit_key}={limit}, so every response to it would be cut short; raise "
                         f"{limit_key}, lower {budget_key}, or shorten the row")
    return f"context: {where}: longest prompt {longest} tokens ({place}) + {budget_key}={budget} <= " \
           f"{limit_key}={limit}"


def _place(rows: Any, i: int, where: str) -> str:
    """Row `i` of a set, named by its file and line when the set knows them (a PromptDataset does)."""
    places = getattr(rows, "places", None)
    return places[i] if places else f"{where} row {i}"
