"""The run, model, parallel, rollout, agent, data, logging and ray sections of the run spec
(molt/spec.py composes them, with molt/spec_algo.py's algo and train sections, into RunSpec)."""

from __future__ import annotations

from pathlib import PurePath
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from molt.spec_algo import Strict

GREEDY_BELOW = 1e-5   # vLLM decodes greedily below this temperature
# The distribution vLLM reports logprobs of: after temperature/top-k/top-p, what the trainer recomputes.
LOGPROBS_MODE = "processed_logprobs"


def _power_of_two(name: str, value: int) -> None:
    if value < 1 or value & (value - 1):
        raise ValueError(f"{name}={value} must be a power of two")


class RunSection(Strict):
    name: str = Field("tiny", description="names the run directory, the sweep directory and the W&B run")
    seed: int = Field(0, description="seed of the prompt order and of the engines' sampling")
    dir: str | None = Field(None, description="run directory; the launcher fills it from Hydra's output dir")
    resume: str | None = Field(
        None, description="'auto': continue the newest run of this experiment that has a checkpoint (none: "
                          "start fresh); or a run dir or a checkpoint dir")
    dry_run: bool = Field(False, description="validate, print the placement plan and exit; starts nothing")


class LoRASpec(Strict):
    rank: int = Field(
        0, ge=0, le=512, description="LoRA adapter rank: > 0 trains adapters on the frozen policy and refits "
                                     "only them into the engines; 0 = full fine-tuning")
    alpha: float = Field(16.0, gt=0, description="adapter scale numerator: a layer adds alpha / rank * B @ A")
    dropout: float = Field(
        0.0, ge=0, lt=1, description="dropout on the adapter's input in training (the engine has none)")
    target_modules: list[str] = Field(
        default_factory=lambda: ["*_proj"], min_length=1,
        description="linear layers that get adapters: module-name patterns ('*' wildcards; '*_proj' = the "
                    "attention and MLP projections of Qwen / Llama models)")


class ModelSpec(Strict):
    path: str | None = Field(None, description="Hugging Face folder or hub id; null builds the tiny model")
    tiny: dict[str, int] = Field(
        default_factory=lambda: dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                                     vocab_size=320),
        description="molt.tiny options (sizes, experts, seed; the rest: molt.tiny's defaults)")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="compute dtype of engines and trainer (master weights stay float32; CPU: "
        "the trainer under CPU autocast); float16 is refused: the trainer has no loss scaling")
    max_model_len: int = Field(256, description="context length in tokens: the prompt plus every turn")
    reference: str | None = Field(
        None, description="frozen reference / teacher model (any size, the policy's tokenizer); 'policy' = "
        "a frozen copy of the start; 'tiny' = built offline from reference_tiny")
    reference_tiny: dict[str, int] = Field(
        default_factory=dict, description="molt.tiny options of the reference when reference=tiny (e.g. a "
        "larger teacher to distill from)")
    critic: bool = Field(False, description="train a value model beside the policy (gae needs one; "
                         "only gae uses it)")
    router_replay: bool = Field(False, description="MoE: replay the engine's routed experts in training")
    freeze_router: bool = Field(False, description="MoE: do not train the router weights")
    freeze_vision: bool = Field(False, description="VLM: train the language model only, not the vision tower")
    trust_remote_code: bool = Field(False, description="run the model repository's own Python code")
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="variables of the chat template wherever Molt renders it (agent "
        "prompts and turns, chat sessions, SFT rows); e.g. Qwen3's {enable_thinking: false}")
    lora: LoRASpec = Field(default_factory=LoRASpec, description="LoRA adapters instead of full fine-tuning")
    arch: dict[str, int] = Field(
        default_factory=dict, description="architecture numbers of a hub model for the memory estimate "
        "(molt/arch.py Arch: hidden_size, num_layers, ...; copied from its config.json); a local folder's "
        "config.json and the tiny model's options are read instead")

    @field_validator("arch")
    @classmethod
    def _arch_keys(cls, value: dict[str, int]) -> dict[str, int]:
        from molt.arch import ARCH_KEYS

        unknown = sorted(set(value) - set(ARCH_KEYS))
        if unknown:
            raise ValueError(f"model.arch.{unknown[0]}: unknown; the keys are {', '.join(ARCH_KEYS)}")
        missing = [f for f in ARCH_KEYS[:7] if value and f not in value]
        if missing:
            raise ValueError(f"model.arch needs {', '.join(missing)} (from the model's config.json)")
        return value


class ParallelSpec(Strict):
    device: Literal["cpu", "cuda"] = Field(
        "cpu", description="where trainer ranks and engines run: cpu (gloo) or cuda (NCCL)")
    nodes: int = Field(1, ge=1, description="Ray nodes the run uses (the placement plan, molt/placement.py)")
    gpus_per_node: int = Field(8, ge=1, description="cuda: GPUs on each node; the plan must fit nodes x this")
    trainer_nodes: int | None = Field(
        None, description="K: nodes 0..K-1 train, the others generate; null: all roles share every node")
    world_size: int = Field(1, ge=1, description="trainer ranks; equals dp_size*tp_size*cp_size")
    dp_size: int = Field(1, ge=1, description="data-parallel ranks (FSDP2 shards over them)")
    tp_size: int = Field(1, ge=1, description="tensor-parallel ranks (a power of two)")
    cp_size: int = Field(1, ge=1, description="context-parallel ranks (a power of two; > 1 is refused)")
    ep_size: int = Field(1, ge=1, description="MoE expert-parallel ranks; divides dp_size*cp_size (power "
                         "of 2)")
    offload: Literal["none", "optimizer", "full"] = Field(
        "none", description="host memory: optimizer (AdamW state) or full (parameters, gradients, state)")
    activation_checkpointing: bool = Field(False, description="recompute activations in the backward pass")
    gpu_memory_gib: float = Field(
        80.0, gt=0, description="cuda: memory of one GPU; the plan is refused when a role's estimate "
        "(molt/memory.py, shown by run.dry_run=true) exceeds it")
    cpu_threads: int | None = Field(
        None, ge=1, description="cpu: torch threads per trainer rank and engine worker; null: the stage that "
        "runs takes the node's cores (sync: each in turn; async: engines and ranks split them, and the ranks "
        "take them all while no rollout generates); 1 where other jobs keep the cores busy")

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
        _check_parallel(self)
        return self


class EngineSpec(Strict):
    num_engines: int = Field(1, ge=1, description="vLLM engine actors (the dispatcher spreads requests over "
                             "them)")
    tp_size: int = Field(1, ge=1, description="tensor-parallel GPUs per engine")
    dp_size: int = Field(1, description="vLLM replicas inside one engine: 1 (more: num_engines)")
    enable_expert_parallel: bool = Field(False, description="MoE: shard experts over the engine's GPUs")
    gpu_memory_utilization: float = Field(0.85, description="fraction of GPU memory vLLM may use")
    kv_cache_gib: float = Field(1.0, description="KV cache size on CPU (VLLM_CPU_KVCACHE_SPACE)")
    enforce_eager: bool = Field(True, description="skip torch.compile and CUDA graphs (faster start)")
    enable_prefix_caching: bool = Field(True, description="reuse the KV cache of shared prompt prefixes")
    max_num_batched_tokens: int | None = Field(None, description="vLLM token budget per scheduler step")
    max_num_seqs: int | None = Field(None, description="vLLM's most concurrent sequences per engine")
    speculative_config: dict[str, Any] | None = Field(
        None, description="vLLM speculative decoding, e.g. {method: mtp, num_speculative_tokens: 1}")
    extra_args: dict[str, Any] = Field(default_factory=dict, description="any other vLLM engine arguments")
    max_restarts: int = Field(
        3, ge=0, description="restarts of each engine after it dies (then the run goes on without it)")
    start_timeout_s: float = Field(
        600.0, gt=0, description="seconds a (re)started engine may take to come up before it counts as dead")

    @field_validator("dp_size")
    @classmethod
    def _one_replica(cls, value: int) -> int:
        # vLLM runs data-parallel replicas as engine cores in processes of their own; Molt's engine actor
        # keeps its one engine core in-process (molt/rollout/engine.py).
        if value != 1:
            raise ValueError(f"dp_size={value}: an engine actor runs one vLLM replica; for more replicas "
                             "raise rollout.engine.num_engines (the dispatcher balances requests over them)")
        return value


# vLLM engine arguments Molt derives from other keys (molt/rollout/engine_args.py), which
# rollout.engine.extra_args may not override: the plan, prompt fitting and refit read those keys.
OWNED_ENGINE_ARGS = {"model": "model.path", "tensor_parallel_size": "rollout.engine.tp_size",
                     "data_parallel_size": "rollout.engine.dp_size", "max_model_len": "model.max_model_len",
                     "worker_extension_cls": "Molt's refit (molt/rollout/worker.py)"}


class SamplingSpec(Strict):
    """How the eval sets are sampled (rollout.eval): greedy unless set."""

    temperature: float = Field(0.0, description="sampling temperature (0 = greedy)")
    top_p: float = Field(1.0, description="nucleus sampling mass (1 = off)")
    top_k: int = Field(-1, description="sample among the k most likely tokens (-1 = off)")
    max_tokens: int = Field(8, ge=1, description="most tokens generated per turn")
    n: int = Field(1, ge=1, description="samples per eval prompt (eval/pass@n)")
    pass_reward: float = Field(1.0, description="a sample with at least this reward counts as correct for "
                               "eval/pass@k (mean@n averages the rewards themselves)")


class RolloutSpec(Strict):
    mode: Literal["sync", "async"] = Field(
        "sync", description="sync: generate one batch, then train; async: keep generating while training")
    samples_per_prompt: int = Field(8, ge=1, description="rollouts per prompt: the group size of group "
                                    "estimators")
    max_tokens: int = Field(8, ge=1, description="most tokens sampled per turn")
    temperature: float = Field(1.0, description="sampling temperature; the trainer scores logits/temperature")
    top_p: float = Field(1.0, description="nucleus sampling mass (1 = off)")
    top_k: int = Field(-1, description="sample among the k most likely tokens (-1 = off)")
    groups_in_flight: int = Field(16, ge=1, description="async: prompt groups kept generating while training")
    partial_rollout: bool = Field(
        True, description="a refit pauses the engines and keeps in-flight requests, which go on with the "
        "new weights (false: the refit waits until the in-flight requests finish)")
    max_staleness: int = Field(1, ge=0, description="most policy versions between sampling a token and "
                               "training it")
    prompt_too_long: Literal["truncate", "reject"] = Field(
        "reject", description="a prompt with no room for one token: fail the rollout or keep its tail")
    refit_chunk_mb: float = Field(
        256.0, gt=0, description="a refit streams the weights to the engines in chunks of at most this "
        "size; a larger tensor is gathered, cast and sent a range of rows (of experts) at a time")
    engine: EngineSpec = Field(default_factory=EngineSpec, description="the vLLM engines")
    eval: SamplingSpec = Field(default_factory=SamplingSpec,
                               description="sampling of the eval set (train.eval_every)")

    @field_validator("temperature")
    @classmethod
    def _samples(cls, value: float) -> float:
        # a greedy token has no sampling probability to correct against (and scoring it divides by 0)
        if value < GREEDY_BELOW:
            raise ValueError(f"rollout.temperature={value} does not sample (vLLM is greedy below "
                             f"{GREEDY_BELOW}); training needs sampled tokens. Greedy decoding is for "
                             "evaluation: rollout.eval.temperature=0")
        return value

    @model_validator(mode="after")
    def _engine_args(self) -> RolloutSpec:
        extra = self.engine.extra_args
        mode = extra.get("logprobs_mode", LOGPROBS_MODE)
        if mode != LOGPROBS_MODE:
            raise ValueError(f"rollout.engine.extra_args.logprobs_mode={mode}: the trainer recomputes "
                             f"{LOGPROBS_MODE} (the distribution tokens are sampled from); another mode "
                             "would make every importance weight and mismatch/* wrong")
        owned = sorted(set(extra) & set(OWNED_ENGINE_ARGS))
        if owned:
            raise ValueError(f"rollout.engine.extra_args.{owned[0]}: Molt sets this engine argument from "
                             f"{OWNED_ENGINE_ARGS[owned[0]]}, which the placement, prompt fitting and refit "
                             "rely on; set it there")
        if extra.get("async_scheduling") and self.partial_rollout and self.mode == "async":
            raise ValueError("rollout.engine.extra_args.async_scheduling=true with rollout.partial_rollout="
                             "true in async mode: a batch scheduled ahead with the old weights could still "
                             "be out after a refit and its tokens would be labelled with the new policy "
                             "version; set rollout.partial_rollout=false")
        return self


class JudgeSpec(Strict):
    path: str | None = Field(
        None, description="judge model: a Hugging Face folder, or 'policy' (the starting policy); null: "
        "none. With url: the folder of the judge's tokenizer")
    url: str | None = Field(
        None, description="an OpenAI-compatible server that serves the judge (vLLM's, e.g. "
        "http://host:8000/v1) instead of engines of the run's own; its first model answers")
    temperature: float = Field(
        1.0, gt=0, description="verdict sharpness: sigmoid((logp(yes) - logp(no)) / temperature)")
    timeout_s: float = Field(30.0, gt=0, description="seconds one verdict request may take before it is "
                             "retried")
    retries: int = Field(2, ge=0, description="retries of a verdict request that timed out or failed, then "
                         "the rollout fails")
    max_concurrency: int = Field(64, ge=1, description="verdict requests in flight at once (more wait)")
    engine: EngineSpec = Field(default_factory=lambda: EngineSpec(kv_cache_gib=0.25, max_restarts=0),
                               description="the judge's own engine(s), placed like the policy's (molt/"
                               "placement.py); a dead one is not restarted")

    @model_validator(mode="after")
    def _no_restarts(self) -> JudgeSpec:
        # Only the policy's engines have a fleet that restarts them (molt/fleet.py); the judge's dispatcher
        # goes on with the live ones and fails the verdicts once none is left.
        if self.url and not self.path:
            raise ValueError(f"agent.judge.url={self.url} needs agent.judge.path: the folder of the judge's "
                             "tokenizer (or 'policy'), which renders the verdict prompt")
        if self.engine.max_restarts:
            raise ValueError(f"agent.judge.engine.max_restarts={self.engine.max_restarts}: judge engines are "
                             "not restarted (a dead one leaves the others to score, none left fails the "
                             "rollouts); set it to 0 or add judge engines (agent.judge.engine.num_engines)")
        return self


class AgentSpec(Strict):
    module: str = Field("examples/agents/repeat.py",
                        description="dotted module or .py file that exports AgentRunner")
    kind: Literal["env", "chat"] = Field(
        "env", description="env: Molt runs the LLM loop; chat: the agent calls the OpenAI/Anthropic SDK")
    options: dict[str, Any] = Field(default_factory=dict, description="passed to the agent unchanged")
    tool_parser: str = Field("hermes", description="vLLM tool parser reading the policy's tool calls (chat "
                             "server and Env)")
    tools: list[dict[str, Any]] = Field(
        default_factory=list, description="tool schemas (OpenAI function format) an Env shows the model on "
        "every rollout, before the dataset row's own `tools`")
    judge: JudgeSpec = Field(default_factory=JudgeSpec, description="LLM-as-judge rewards (agents.judge)")
    max_turns: int = Field(1, ge=1, description="most LLM calls per rollout")
    max_total_tokens: int = Field(256, ge=2, description="most tokens per rollout: prompt, turns and "
                                  "observations")
    timeout_s: float = Field(60.0, gt=0, description="seconds before a rollout fails as timed out")
    on_failure: Literal["drop_group", "keep_group"] = Field(
        "drop_group", description="a failed rollout drops its whole group, or only itself")
    max_failure_rate: float = Field(0.5, ge=0, le=1, description="stop the run when more of a batch than "
                                    "this fails")
    workers: int = Field(0, ge=0, description="Ray actors that run the training rollouts, each with its own "
                         "event loop, chat server and sandboxes (molt.agents.workers); 0 = in the driver's "
                         "event loop (docs/agents.md, Agent workers)")
    max_worker_restarts: int = Field(3, ge=0, description="agent workers restarted over the run after a "
                                     "death (their in-flight groups rerun whole); one more stops the run")

    @field_validator("tools")
    @classmethod
    def _function_schemas(cls, value: list[dict[str, Any]]) -> list[dict[str, Any]]:
        from molt.agents.tools import check_tools

        check_tools(value, "agent.tools")
        return value


class HubDataset(Strict):
    """A Hugging Face dataset in place of a data file (molt/data_hub.py loads it: datasets.load_dataset)."""
    hub: str = Field(description="hub id (openai/gsm8k), or a local folder in the hub's layout")
    config: str | None = Field(None, description="the dataset's configuration (subset), e.g. main")
    split: str = Field("train", description="split, e.g. train, test, train[:1000]")
    fields: dict[Literal["prompt", "messages", "label", "images"], str] = Field(
        default_factory=dict, description="Molt field <- the dataset's column (images: an image or a list of "
                                          "them, put before the prompt's text in one user message)")
    transform: str | None = Field(None, description="PATH.py:function or module:function turning a dataset "
                                                    "row into a Molt row (instead of fields)")
    name: str | None = Field(None, description="eval set name (metrics eval/NAME/...); null = the hub id's "
                                               "last part")

    def __str__(self) -> str:   # how the dry-run plan names it
        return f"{self.hub}" + (f" ({self.config})" if self.config else "") + f" [{self.split}]"

    @model_validator(mode="after")
    def _one_mapping(self) -> HubDataset:
        if self.fields and self.transform:
            raise ValueError(f"{self.hub}: set fields or transform, not both (a transform maps whole rows)")
        if self.transform and ":" not in self.transform:
            raise ValueError(f"transform={self.transform!r}: name the function, e.g. "
                             "examples/agents/math_verify.py:gsm8k_row")
        if "images" in self.fields and "prompt" not in self.fields:
            raise ValueError(f"{self.hub}: fields.images needs fields.prompt (the text beside the images)")
        return self


class DataSpec(Strict):
    train_path: str | HubDataset = Field("examples/data/repeat_train.jsonl",
                                         description="training prompts: a jsonl/parquet file or {hub: ...}")
    eval: list[str | HubDataset] = Field(
        default_factory=lambda: ["examples/data/repeat_eval.jsonl"],
        description="eval sets: files (named by file stem) or {hub: ...} (named by name); [] for none")
    prompt_key: str = Field("prompt", description="column holding a prompt string")
    messages_key: str = Field("messages", description="column holding chat messages (wins over prompt_key)")
    label_key: str = Field("label", description="column handed to the agent as the label")
    shuffle: bool = Field(True, description="shuffle the prompts each epoch (seeded by run.seed)")

    @field_validator("eval")
    @classmethod
    def _unique_names(cls, value: list[str | HubDataset]) -> list[str | HubDataset]:
        names = eval_names(value)
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:  # a name is a metric prefix: two sets under one name would overwrite each other's metrics
            raise ValueError(f"eval sets named {twice} more than once (a set is named by its file stem, "
                             "a hub dataset by its name): rename a file or set name")
        return value


def eval_names(sources: list[str | HubDataset]) -> list[str]:
    """The name of each eval set: its file's stem, or a hub dataset's name (metrics are eval/NAME/...)."""
    return [PurePath(s).stem if isinstance(s, str) else s.name or s.hub.rstrip("/").split("/")[-1]
            for s in sources]


def pass_ks(n: int) -> list[int]:
    """The k of each eval/NAME/pass@k an evaluation with rollout.eval.n = n logs: powers of two up to n,
    and n."""
    return sorted({1 << i for i in range(n.bit_length())} | {n})


class WandbSpec(Strict):
    project: str = Field("molt", description="W&B project")
    entity: str | None = Field(None, description="W&B entity (team or user; null = the default)")
    mode: Literal["online", "offline", "disabled", "auto"] = Field(
        "auto", description="auto: online with WANDB_API_KEY, else offline (WANDB_MODE wins)")
    name: str | None = Field(None, description="W&B run name (null = run.name; a sweep job: its choices)")
    group: str | None = Field(None, description="W&B group (null; a sweep sets the sweep directory's name)")
    job_type: str | None = Field(None, description="W&B job type (null = the algo group's choice)")
    tags: list[str] = Field(default_factory=list, description="W&B tags")


class LoggingSpec(Strict):
    wandb: WandbSpec = Field(default_factory=WandbSpec, description="Weights & Biases")
    progress: bool = Field(True, description="show a progress bar with reward, step time and tokens/s")
    dump_rollouts: bool = Field(True, description="write each step's rollouts to rollouts/step_*.jsonl")
    dump_keep_steps: int = Field(100, ge=0, description="keep the rollout dumps of the last N steps (0: all)")
    plots: bool = Field(True, description="write PNG plots into plots/ at the end of the run")


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


def _check_parallel(par: ParallelSpec) -> None:
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
