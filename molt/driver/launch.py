"""Run spec → placement plan → the loop. The only place that turns config into running actors."""

from __future__ import annotations

import logging
import os

from molt.spec import RunSpec, spec_warnings
from molt.spec.agent import TOOLS_KEY

log = logging.getLogger("molt")


def describe_plan(spec: RunSpec, nodes: list[dict] | None = None, agent_kind: str | None = None) -> str:
    """What the launcher places where, in words (printed by `run.dry_run=true` and at every start);
    `nodes` (the bound Ray nodes) adds each plan node's address, `agent_kind` (check_inputs') the agent's."""
    from molt.plan import memory
    from molt.plan.placement import describe

    p, e = spec.parallel, spec.rollout.engine
    unit = "GPU" if p.device == "cuda" else "CPU process"
    where = f"attach to Ray at {spec.ray.address}" if spec.ray.address else "start Ray locally"
    names = [f"{n['NodeManagerAddress']} {n['NodeID'][:8]}" for n in nodes] if nodes else None
    # AutoModel's parallelizer returns a single rank's model as it is: FSDP2 shards only from two ranks on
    sharding = "FSDP2" if p.world_size > 1 else "unsharded (one rank: no FSDP2)"
    lines = [
        f"run '{spec.run.name}' -> {spec.run.dir or '(dry run: no run directory)'}",
        f"ray: {where}",
        f"engines: {e.num_engines} x vLLM (tp={e.tp_size}, expert_parallel={e.enable_expert_parallel}) = "
        f"{e.num_engines * e.tp_size} {unit}(s)",
        f"policy trainer: {p.world_size} rank(s) [dp={p.dp_size} cp={p.cp_size} tp={p.tp_size} "
        f"ep={p.ep_size}] {sharding} on {p.device}, offload={p.offload}",
    ]
    if spec.model.critic:
        lines.append(f"critic: {p.world_size} rank(s), same layout")
    if spec.model.reference:
        lines.append(f"reference: {p.world_size} rank(s), frozen ({spec.model.reference})")
    lines += [f"placement: {line}" for line in describe(spec, names)]
    lines.append(f"data: train {spec.data.train_path}; eval {', '.join(map(str, spec.data.eval)) or 'none'}")
    lines += [f"memory: {line}" for line in memory.describe(spec)]
    if spec.train.objective == "sft":
        lines[2] = "engines: none (train.objective=sft samples nothing)"
        return "\n".join([*lines, f"sft: {spec.train.steps} steps x {spec.train.prompts_per_step} "
                                   "conversations"])
    lines += [
        f"agent: {agent_kind + ' from ' if agent_kind else ''}{spec.agent.module}",
        f"loop: {spec.rollout.mode}, {spec.train.steps} steps x {spec.train.prompts_per_step} prompts x "
        f"{spec.rollout.samples_per_prompt} samples, estimator={spec.algo.estimator}",
    ]
    return "\n".join(lines)


def check_inputs(spec: RunSpec) -> str | None:
    """Load the data files, import the algorithm plugins and the agent module, and refuse `model.lora` on a
    model the engines cannot serve adapters for, so a bad path, name or model fails before anything starts.
    Returns the agent's kind (its runner's: env or chat), None for SFT (no agent runs)."""
    from molt.agents import load_agent_runner
    from molt.algo import load_plugins
    from molt.driver.sft_data import load_conversations
    from molt.inputs.data import PromptDataset, load_eval_sets

    load_plugins(spec)
    check_expert_dispatch(spec)

    if spec.train.objective == "sft":   # conversations; no agent runs
        for path in (spec.data.train_path, *spec.data.eval):
            load_conversations(path, spec.data)
        return None
    PromptDataset(spec.data.train_path, spec.data)
    load_eval_sets(spec.data)
    kind = load_agent_runner(spec.agent).kind
    # The loop starts its engines one by one (start_engine), which skips start_engines' check_lora; the
    # guard keeps a run without LoRA (a dry run too) from resolving, and so building, the model here.
    if spec.model.lora.served_as_adapter():
        from molt.plan.models import model_path
        from molt.rollout.engine_args import check_lora

        check_lora(model_path(spec), spec.model)
    return kind


# Without DeepEP, AutoModel's MoE dispatcher all-gathers every token of the expert-parallel group onto every
# rank: memory and traffic per MoE layer grow with ep_size (30-60 GB per layer at DeepSeek-V3's shape and
# ep 256). Up to one node's 8 GPUs (NVLink) it is AutoModel's own default; beyond, DeepEP is required.
EP_WITHOUT_DEEPEP = 8


def check_expert_dispatch(spec: RunSpec) -> None:
    """Refuse `parallel.ep_size` above EP_WITHOUT_DEEPEP on cuda unless DeepEP (`deep_ep`) is importable.
    Checked here, with the inputs, because it is a fact of the installed environment, not of the spec."""
    import importlib.util

    ep = spec.parallel.ep_size
    if spec.parallel.device == "cuda" and ep > EP_WITHOUT_DEEPEP and not importlib.util.find_spec("deep_ep"):
        raise ValueError(
            f"parallel.ep_size={ep} needs DeepEP (the deep_ep module) above {EP_WITHOUT_DEEPEP}: without it "
            "AutoModel's MoE dispatcher all-gathers every token onto every expert-parallel rank. Build it "
            "against the installed torch (`pip install --no-build-isolation deep-ep`, needs nvcc and "
            f"NVSHMEM; docs/install.md#gpu), or use parallel.ep_size<={EP_WITHOUT_DEEPEP}")


# Rows per set the dry run renders: a prompt set of any size is measured in seconds; the plan says when it
# measured fewer rows than a set has.
LONGEST_ROWS = 2000


def longest_prompt(spec: RunSpec) -> str:
    """The dry run's line on context: the longest first prompt of the train and eval rows, rendered through
    the chat template with the tools a rollout offers (agent.tools + the row's), against model.max_model_len.
    Tool schemas are rendered into the prompt, so two of them can take most of a small context; a prompt
    that leaves no room for a reply fails its rollouts only once the run is under way."""
    from transformers import AutoTokenizer

    from molt.agents.render import encode, render
    from molt.inputs.data import PromptDataset, load_eval_sets
    from molt.plan.models import model_path

    data, ctx, kwargs = spec.data, spec.model.max_model_len, spec.model.chat_template_kwargs
    try:   # a dry run downloads nothing: a hub model not in the local cache is planned without this line
        tokenizer = AutoTokenizer.from_pretrained(model_path(spec), local_files_only=True,
                                                  trust_remote_code=spec.model.trust_remote_code)
    except OSError:
        return f"data: longest prompt not measured ({model_path(spec)}: its tokenizer is not on this machine)"
    longest, where, partial = 0, "", False
    for name, rows in {"train": PromptDataset(data.train_path, data), **load_eval_sets(data)}.items():
        partial |= len(rows) > LONGEST_ROWS
        for i, row in zip(range(LONGEST_ROWS), rows, strict=False):
            messages = row.get(data.messages_key) or [{"role": "user", "content": str(row[data.prompt_key])}]
            tools = list(spec.agent.tools) + list(row.get(TOOLS_KEY) or [])
            n = len(encode(tokenizer, render(tokenizer, messages, tools, True, kwargs)))
            if n > longest:
                longest, where = n, f"{name} row {i}"
    where += f"; the first {LONGEST_ROWS} rows of each set" if partial else ""
    line = f"data: longest prompt {longest} tokens with its tools ({where}) of model.max_model_len={ctx}"
    if longest >= ctx:
        log.warning(f"{line}: no room for a reply; raise model.max_model_len or shorten the prompt or its "
                    "tools")
    return line


def dry_run(spec: RunSpec) -> str:
    """`run.dry_run=true`: log the spec's warnings, check its inputs and return its plan; writes nothing
    (`python -m molt` answers a dry run without Hydra's app, which would create the run directory)."""
    for warning in spec_warnings(spec):
        log.warning(warning)
    kind = check_inputs(spec)
    return describe_plan(spec, agent_kind=kind) + (f"\n{longest_prompt(spec)}" if kind else "")


def launch(spec: RunSpec) -> dict[str, float]:
    """Validate-time checks done; place everything and run the loop. Returns the last step's metrics."""
    if spec.run.dry_run:
        print(dry_run(spec))
        return {}
    for warning in spec_warnings(spec):
        log.warning(warning)  # console and the run directory's log file
    agent_kind = check_inputs(spec)
    import ray

    from molt.driver.loop import train as train_rl
    from molt.driver.sft_loop import train as train_sft
    from molt.plan.placement import bind, init_ray

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    init_ray(spec)
    try:
        print(describe_plan(spec, bind(spec), agent_kind))   # the cluster holds the plan: actors may start
        return (train_sft if spec.train.objective == "sft" else train_rl)(spec)
    finally:
        ray.shutdown()
