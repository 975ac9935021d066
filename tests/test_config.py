"""Foundation: experiments compose and validate; bad config fails clearly; validated print; sweep preview."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from agentlib import COUNTING_AGENT, executions

import molt.__main__ as cli
from molt.driver.compose import compose
from molt.spec import RunSpec, SpecError

REPO = Path(__file__).resolve().parents[1]
EXPERIMENTS = sorted(p.stem for p in (REPO / "experiments").glob("*.yaml"))


def test_experiment_group_is_reachable():
    assert (REPO / "conf" / "experiment").resolve() == (REPO / "experiments").resolve()
    assert {"tiny", "qwen3_4b_math", "qwen30b_tools", "dsv3_ep256"} <= set(EXPERIMENTS)


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_composes_and_validates(name):
    spec = compose([f"+experiment={name}"])
    assert spec.run.name == name


def test_default_is_tiny():
    assert compose([]) == compose(["+experiment=tiny"])


def test_the_spec_defaults_are_the_default_run():
    # One source of defaults: a spec built in Python (tests, benchmarks) runs what `python -m molt` runs.
    assert RunSpec() == compose([])


def test_qwen30b_tools_matches_its_description():
    spec = compose(["+experiment=qwen30b_tools"])
    assert spec.parallel.nodes == 2 and spec.parallel.trainer_nodes == 1 and spec.parallel.world_size == 8
    assert spec.parallel.ep_size == 1  # replay hooks HF MoE classes, which AutoModel's EP does not shard
    assert spec.rollout.mode == "async" and not spec.rollout.partial_rollout   # refused with GPU replay
    assert (spec.algo.correction.level, spec.algo.correction.mode) == ("geo", "mask")
    assert (spec.algo.correction.low, spec.algo.correction.high) == (0.99, 1.01)
    # rows of up to 32K tokens, logprobs in chunks, the AdamW state in host memory: the memory plan fits
    assert spec.model.router_replay and spec.model.max_model_len == spec.agent.max_total_tokens == 32768
    assert spec.parallel.offload == "optimizer" and spec.train.logprob_chunk_tokens is None   # auto chunks


@pytest.mark.parametrize("override", ["parallel.ep_sise=8", "+parallel.ep_sise=8"])
def test_typo_names_the_nearest_key(override):
    with pytest.raises(SpecError, match=r"parallel\.ep_size"):
        compose([override])


def test_typo_inside_a_config_file_is_caught(tmp_path):
    from molt.spec import validate_spec

    data = compose([]).model_dump(mode="json")
    data["rollout"]["engine"]["kv_cache_gb"] = 2
    data["train"]["lrr"] = 1.0
    with pytest.raises(SpecError) as err:
        validate_spec(data)
    message = str(err.value)
    assert "2 error(s)" in message  # every problem at once
    assert "rollout.engine.kv_cache_gib" in message and "train.lr" in message


def test_bad_type_is_reported_with_key_and_value():
    with pytest.raises(SpecError, match=r"train\.lr: .*valid number.*'abc'"):
        compose(["train.lr=abc"])


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["parallel.tp_size=3"], "power of two"),
        (["parallel.ep_size=4"], "ep_size=4 must divide"),
        (["train.prompts_per_step=3", "parallel=cpu2", "rollout.samples_per_prompt=1"], "divisible"),
        (["algo=gae"], "needs a critic"),
        # no loss scaling in the trainer: float16 gradients underflow (bfloat16 is accepted on both)
        (["model.dtype=float16"], "float16 on parallel.device=cpu: the trainer computes without loss"),
        (["+experiment=qwen3_4b_math", "model.dtype=float16"], "float16 on parallel.device=cuda"),
        # settings that used to be accepted and then did nothing, or the wrong thing
        (["model.critic=true"], "model.critic=true with algo.estimator=grpo: it reads no critic values"),
        (["algo.loss.dual_clip=1.0"], r"dual_clip=1.0 must be > 1"),
        (["algo.loss.dual_clip=0.5"], r"dual_clip=0.5 must be > 1"),
        (["algo=on_policy_distill", "model.reference=policy", "algo.kl.coef=0.1", "algo.kl.in_reward=true"],
         "applied nowhere; set algo.kl.in_reward=false"),
        (["algo.correction.low=1.5", "algo.correction.high=1.0"], "must be below"),
        # layouts the trainer cannot run, refused with the reason (docs/parallelism.md)
        (["parallel=cpu2", "parallel.ep_size=2"], "ep_size > 1 needs parallel.device=cuda"),
        (["parallel.cp_size=3"], r"cp_size=3 must divide the policy's attention heads per tensor-parallel "
                                 r"rank \(4 / tp_size=1\)"),
        (["+experiment=qwen30b_tools", "model.router_replay=false", "parallel.ep_size=8",
          "parallel.cp_size=2"], "cp_size > 1 with ep_size > 1"),
        (["+experiment=qwen30b_tools", "parallel.ep_size=8"], "router_replay with parallel.ep_size=8"),
        # vLLM's GPU capture keeps a kept request's pre-refit routes (docs/generator.md)
        (["+experiment=qwen30b_tools", "rollout.partial_rollout=true"],
         "router_replay=true with rollout.partial_rollout=true on parallel.device=cuda"),
        (["parallel.offload=full"], r"offload=full needs world_size = dp_size\*cp_size\*tp_size > 1"),
        (["parallel.nodes=2", "parallel.trainer_nodes=2"], "trainer_nodes=2 must leave the engines"),
        # combinations peers refuse
        (["+rollout.engine.speculative_config={method: ngram, num_speculative_tokens: 2}"],
         "speculative_config with enable_prefix_caching=true"),
        (["model=tiny_moe", "rollout.engine.enable_prefix_caching=false",
          "+rollout.engine.speculative_config={method: ngram, num_speculative_tokens: 2}"],
         "speculative_config with model.router_replay"),
        # parallel.colocate: one GPU, one rank, one engine, taking turns (docs/parallelism.md#colocation)
        (["parallel=gpu1", "rollout.mode=async", "algo=tis"], "colocate=true with rollout.mode=async"),
        (["parallel=gpu1", "parallel.dp_size=2"], "colocate=true with 2 trainer rank"),
        (["parallel=gpu1", "rollout.engine.num_engines=2"], "colocate=true with 2 engine"),
        (["parallel=gpu1", "parallel.engine_sleep_level=2", "model.lora.rank=8"],
         "engine_sleep_level=2 with model.lora"),
        # a refit never updates a drafter's own weights (an MTP layer, EAGLE): it would go stale
        (["rollout.engine.enable_prefix_caching=false",
          "+rollout.engine.speculative_config={method: mtp, num_speculative_tokens: 1}"],
         "method=mtp: a drafter with weights of its own"),
        (["algo=grpo", "rollout.samples_per_prompt=1"], "grpo compares samples of one prompt"),
        (["algo=rloo", "rollout.samples_per_prompt=1"], "rloo compares samples of one prompt"),
        # a 24-GPU plan on a 16-GPU layout
        (["+experiment=qwen30b_tools", "rollout.engine.num_engines=16"],
         r"needs 24 GPUs \(policy 8 \+ 16 engines x 1\) but parallel.nodes x gpus_per_node = 2 x 8 = 16"),
        (["+experiment=qwen30b_tools", "algo.estimator=gae", "model.critic=true",
          "parallel.trainer_nodes=null"], "needs 24 GPUs"),
        (["+experiment=qwen3_4b_math", "rollout.engine.tp_size=16"], "does not fit on one node"),
        # greedy tokens have no sampling logprob (used to validate, then train on NaN); eval may be greedy
        (["rollout.temperature=0"], r"temperature=0.0 does not sample.*rollout.eval.temperature=0"),
        (["rollout.temperature=-0.5"], "does not sample"),
        # the trainer recomputes processed logprobs: the engine must report those
        (["+rollout.engine.extra_args.logprobs_mode=raw_logprobs"], "trainer recomputes processed_logprobs"),
        # engine arguments the plan and refit read from other keys; combinations that kill or mislabel
        (["+rollout.engine.extra_args.max_model_len=64"], "from model.max_model_len"),
        (["+rollout.engine.extra_args.tensor_parallel_size=2"], "from rollout.engine.tp_size"),
        (["rollout.mode=async", "algo=tis", "+rollout.engine.extra_args.async_scheduling=true"],
         "set rollout.partial_rollout=false"),
        (["+rollout.engine.extra_args.enable_chunked_prefill=true"], "kills the engine core"),
        (["+experiment=qwen30b_tools", "model.router_replay=false", "parallel.ep_size=8", "algo=gae",
          "model.critic=true"], "critic with parallel.ep_size=8"),
        # settings that would silently train nothing, or on cut responses
        (["model.max_model_len=1024", "rollout.max_tokens=300"], "max_tokens=300 cannot be reached"),
        (["+experiment=qwen3_4b_math", "agent.max_total_tokens=256"], "max_tokens=4096 cannot be reached"),
        (["algo=reinforce_pp", "rollout.samples_per_prompt=1", "algo.filters.drop_equal_rewards=true"],
         "a group of one"),
        (["rollout.mode=async", "rollout.groups_in_flight=4"], "raise rollout.groups_in_flight"),
        (["model.reference=policy", "algo.kl.coef=0.1", "algo.kl.estimator=k1"], "zero-mean gradient"),
        (["algo=on_policy_distill", "model.reference=policy", "algo.reward.clip=1"], "do not use the reward"),
        (["algo.filters.score_range=[0.8,0.2]"], "low must not exceed high"),
        (["train.objective=sft", "train.prompts_per_step=2", "train.minibatches=4"], "more than the 2 rows"),
        # a best_metric no evaluation logs used to fail at the first evaluation, losing the unsaved steps
        (["train.best_metric=eval/repeat_eval/pass@3", "rollout.eval.n=4"], r"repeat_eval/\{mean@4"),
        (["train.best_metric=eval/repeat_eval/loss"], "train.objective=rl"),
        # ranges: a value that would zero or flip the gradients, loop forever or divide by zero
        (["train.grad_clip=0"], "grad_clip: Input should be greater than 0"),
        (["algo.loss.eps_high=-0.1"], "eps_high: Input should be greater than or equal to 0"),
        (["rollout.max_staleness=-1"], "max_staleness: Input should be greater than or equal to 0"),
        (["rollout.engine.num_engines=0"], "num_engines: Input should be greater than or equal to 1"),
        (["parallel.dp_size=0"], "dp_size: Input should be greater than"),
        (["ray.address=auto", "ray.num_cpus=8"], "unset ray.num_cpus"),
        (["agent.judge.engine.max_restarts=2"], "judge engines are not restarted"),
        # a VLM the trainer cannot load that way: refused before Ray and the engines start
    ],
)
def test_cross_field_rules(overrides, fragment):
    with pytest.raises(SpecError, match=fragment):
        compose(overrides)


@pytest.mark.parametrize("overrides", [
    ["model.dtype=bfloat16"], ["+experiment=qwen3_4b_math", "model.dtype=bfloat16"],
    ["algo=gae", "model.critic=true"], ["algo.loss.dual_clip=3"],
    ["algo=on_policy_distill", "model.reference=policy", "algo.kl.coef=0.1", "algo.kl.in_reward=false"],
    ["algo=grpo", "model.reference=policy", "algo.kl.coef=0.1", "algo.kl.in_reward=true"],
    ["model.reference=policy", "algo.kl.coef=0.1", "algo.kl.estimator=k1", "algo.kl.in_reward=true"],
    ["model.reference=policy", "algo.kl.coef=0.1", "algo.kl.estimator=k2"],
    ["model.max_model_len=1024", "rollout.max_tokens=300", "agent.max_total_tokens=512"],
    ["algo=reinforce_pp", "rollout.samples_per_prompt=1"],
    ["rollout.mode=async", "rollout.groups_in_flight=8"],
    ["+rollout.engine.extra_args.dtype=bfloat16"],
    ["rollout.partial_rollout=false", "+rollout.engine.extra_args.async_scheduling=true"],
    ["+rollout.engine.extra_args.async_scheduling=true"],   # a sync refit has nothing in flight
    ["train.objective=sft", "train.prompts_per_step=2", "train.minibatches=2"],
    ["train.objective=sft", "rollout.samples_per_prompt=1"],   # SFT samples nothing
    ["train.best_metric=eval/repeat_eval/pass@4", "rollout.eval.n=4"],
    ["train.best_metric=eval/repeat_eval/mean@1"],
    ["parallel=gpu1", "parallel.engine_sleep_level=2", "model.reference=policy", "algo.kl.coef=0.1"],
    ["parallel=gpu1", "model.lora.rank=8"], ["parallel.colocate=true"],   # colocated on cpu: cores shared
    ["rollout.engine.enable_prefix_caching=false",
     "+rollout.engine.speculative_config={method: ngram, num_speculative_tokens: 2}"],
])
def test_the_working_neighbours_of_each_refusal_validate(overrides):
    compose(overrides)


def test_a_best_metric_without_a_set_is_the_first_eval_sets():
    spec = compose(["train.best_metric=pass@1", "data.eval=[examples/data/math_eval.jsonl,"
                    "examples/data/repeat_eval.jsonl]"])
    assert spec.train.best_metric == "eval/math_eval/pass@1"
    assert compose(["+experiment=tool_rl"]).train.best_metric == "eval/tool_products_eval/pass@1"
    with pytest.raises(SpecError, match="none configured"):
        compose(["train.best_metric=pass@1", "data.eval=[]"])


def test_missing_experiment_fails():
    with pytest.raises(SpecError, match="unknown experiment 'nope'; available: decision_chain, "
                                        "decision_choice, .*, qwen30b_tools"):
        compose(["+experiment=nope"])


def test_yaml_off_is_the_string_off():
    assert compose(["algo.correction.level=off"]).algo.correction.level == "off"


def _molt(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "molt", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def test_cli_typo_fails_before_anything_starts():
    proc = _molt("parallel.ep_sise=8")
    assert proc.returncode != 0 and "parallel.ep_size" in proc.stderr


# `python -m molt` with Ray, the plan's nodes and the loop stood in for: what reaches the loop, per job
STUBBED_MOLT = """
import json, sys
import molt.driver.loop as loop, molt.plan.placement as placement
from molt.__main__ import main
placement.init_ray, placement.bind = (lambda spec: None), (lambda spec, roles=None: [])
loop.train = lambda spec, inputs: print("reached", json.dumps([spec.run.dir, type(inputs.runner).__name__]))
sys.argv = ["molt", *sys.argv[1:]]
main()
"""


def test_multirun_writes_one_resolved_spec_per_job(tmp_path):
    """Each job writes its resolved spec and logs the async warning in its run log, and the loop gets the
    inputs built before the first job started: the agent module executed once per job, never again."""
    (tmp_path / "counting.py").write_text(COUNTING_AGENT)
    proc = subprocess.run([sys.executable, "-c", STUBBED_MOLT, "-m", "algo=grpo,rloo,reinforce_pp",
                           "rollout.mode=async", f"agent.module={tmp_path / 'counting.py'}",
                           f"hydra.sweep.dir={tmp_path / 'sweep'}"], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    reached = [json.loads(line[8:]) for line in proc.stdout.splitlines() if line.startswith("reached ")]
    assert [kind for _, kind in reached] == ["StepEnvRunner"] * 3
    assert len(executions(tmp_path / "counting.py")) == 3    # one per job, in the one process
    specs = sorted((tmp_path / "sweep").glob("*/spec.yaml"))
    assert [str(p.parent) for p in specs] == sorted(run_dir for run_dir, _ in reached)
    assert len(specs) == 3
    loaded = [yaml.safe_load(p.read_text()) for p in specs]
    assert sorted(s["algo"]["estimator"] for s in loaded) == ["grpo", "reinforce_pp", "rloo"]
    for path, spec in zip(specs, loaded, strict=True):
        assert spec["run"]["dir"] == str(path.parent)           # resolved, not ${...}
        assert spec["logging"]["wandb"]["group"] == "sweep"   # one W&B group per sweep
        assert spec["logging"]["wandb"]["job_type"] == spec["algo"]["estimator"]
        assert "algo.correction.level=off" in (path.parent / "__main__.log").read_text()


def test_multirun_dry_run_prints_each_plan_and_writes_nothing(tmp_path):
    proc = _molt("-m", "algo=grpo,rloo", "run.dry_run=true", f"hydra.sweep.dir={tmp_path / 'sweep'}")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("placement: total:") == 2
    assert "estimator=grpo" in proc.stdout and "estimator=rloo" in proc.stdout
    assert not (tmp_path / "sweep").exists()


def test_an_old_key_fails_like_any_unknown_key():
    """Keys the spec no longer has (renamed, or now derived from others) get no compatibility layer: the
    unknown-key message with the nearest valid key, on the command line and in a config file."""
    from molt.spec import validate_spec

    with pytest.raises(SpecError, match=r"unknown key 'parallel.offload_optimizer' \(did you mean "
                                        r"'parallel.offload'\?\)"):
        compose(["parallel.offload_optimizer=true"])
    data = compose([]).model_dump(mode="json")
    data["parallel"]["world_size"] = 1   # an old config file
    with pytest.raises(SpecError, match=r"parallel.world_size: unknown key"):
        validate_spec(data)


def test_micro_batch_size_is_an_upper_bound():
    assert compose(["train.prompts_per_step=2", "train.micro_batch_size=64"]).train.micro_batch_size == 64


def test_async_without_correction_warns():
    from molt.spec import spec_warnings

    assert not spec_warnings(compose(["rollout.mode=async", "algo=tis"]))
    assert "algo.correction.level=off" in spec_warnings(compose(["rollout.mode=async"]))[0]
    # several updates per batch on top of async staleness: (max_staleness + 1) x updates - 1 steps behind
    stacked = spec_warnings(compose(["rollout.mode=async", "algo=decoupled_ppo", "rollout.max_staleness=4",
                                     "train.minibatches=2", "train.epochs=2"]))
    assert len(stacked) == 1 and "4 updates per batch" in stacked[0]
    assert "up to 19 optimizer steps" in stacked[0]
    assert not spec_warnings(compose(["rollout.mode=async", "algo=decoupled_ppo"]))
    assert not spec_warnings(compose(["algo=decoupled_ppo", "train.minibatches=2"]))   # sync: lag 0
    sft = spec_warnings(compose(["rollout.mode=async", "train.objective=sft"]))   # nothing samples
    assert len(sft) == 1 and "rollout.mode set" in sft[0]


def test_clips_that_cannot_act_and_sft_restarts_warn():
    from molt.driver.compose import warnings
    from molt.spec import spec_warnings

    # one update per batch: every ratio is 1, so DAPO's clip-higher would never act
    assert "algo.loss.eps_high=0.28 with one update per batch" in spec_warnings(compose(["algo=dapo"]))[0]
    # dro's penalty (logp - old_logp)^2 is 0 and has no gradient at ratio 1 too
    dro = compose(["algo.loss.policy=dro", "algo.loss.dro_beta=0.2"])
    assert "algo.loss.dro_beta=0.2 with one update per batch" in spec_warnings(dro)[0]
    assert not spec_warnings(compose(["algo=dapo", "train.minibatches=2"]))
    assert not spec_warnings(compose(["algo=grpo"]))
    assert "an SFT run stops" in spec_warnings(compose(["train.objective=sft",
                                                        "train.max_trainer_restarts=5"]))[0]
    assert not spec_warnings(compose(["train.max_trainer_restarts=5"]))
    assert "algo, rollout.mode set" in spec_warnings(compose(["train.objective=sft", "algo=rloo",
                                                              "rollout.mode=async"]))[0]
    assert not spec_warnings(compose(["+experiment=rg_sft"]))
    # grpo whitens each group (its registration says so): a batch normalization before it changes nothing
    assert "the advantages do not change" in warnings(compose(["algo.reward.normalize=batch"]))[0]
    assert not warnings(compose(["algo=rloo", "algo.reward.normalize=batch"]))
    assert not warnings(compose(["algo=reinforce_pp", "algo.gamma=0.9", "algo.reward.normalize=batch"]))


PLANS = {
    "tiny": ["node 0: policy rank 0, engine 0",
             "total: 1 trainer rank(s) and 1 engine(s) on 1 node(s) (CPU: cores are shared)"],
    "qwen3_4b_math": ["node 0: policy ranks 0-3, engines 0-1 | 8/8 GPUs", "total: 8 of 1 x 8 = 8 GPUs"],
    "qwen3_4b_bfcl": ["node 0: policy ranks 0-3, engines 0-1 | 8/8 GPUs", "total: 8 of 1 x 8 = 8 GPUs"],
    "qwen30b_tools": ["node 0: policy ranks 0-7 | 8/8 GPUs", "node 1: engines 0-7 | 8/8 GPUs",
                      "total: 16 of 2 x 8 = 16 GPUs"],
    "dsv3_ep256": ["nodes 0-31: policy ranks 0-255 | 8/8 GPUs each",
                   "nodes 32-63: engines 0-31 | 8/8 GPUs each", "total: 512 of 64 x 8 = 512 GPUs"],
    "qwen_vl_geo3k": ["node 0: policy ranks 0-7 | 8/8 GPUs", "node 1: engines 0-7 | 8/8 GPUs",
                      "total: 16 of 2 x 8 = 16 GPUs"],
    "tiny_vlm_geo": ["node 0: policy rank 0, engine 0",
                     "total: 1 trainer rank(s) and 1 engine(s) on 1 node(s) (CPU: cores are shared)"],
    "decision_choice": ["node 0: policy rank 0, engine 0",
                        "total: 1 trainer rank(s) and 1 engine(s) on 1 node(s) (CPU: cores are shared)"],
    "decision_chain": ["node 0: policy rank 0, engine 0",
                       "total: 1 trainer rank(s) and 1 engine(s) on 1 node(s) (CPU: cores are shared)"],
    "decision_recovery": ["node 0: policy rank 0, engine 0",
                          "total: 1 trainer rank(s) and 1 engine(s) on 1 node(s) (CPU: cores are shared)"],
    "decision_sft": ["node 0: policy rank 0",
                     "total: 1 trainer rank(s) and 0 engine(s) on 1 node(s) (CPU: cores are shared)"],
    "distill_tiny": ["node 0: policy rank 0, reference rank 0, engine 0",
                     "total: 2 trainer rank(s) and 1 engine(s) on 1 node(s) (CPU: cores are shared)"],
    "rg_rl": ["node 0: policy rank 0, engine 0",
              "total: 1 trainer rank(s) and 1 engine(s) on 1 node(s) (CPU: cores are shared)"],
    "rg_sft": ["node 0: policy rank 0",
               "total: 1 trainer rank(s) and 0 engine(s) on 1 node(s) (CPU: cores are shared)"],
    "tiny_bfcl": ["node 0: policy rank 0, engine 0",
                  "total: 1 trainer rank(s) and 1 engine(s) on 1 node(s) (CPU: cores are shared)"],
    "tiny_tools": ["node 0: policy rank 0, engine 0",
                   "total: 1 trainer rank(s) and 1 engine(s) on 1 node(s) (CPU: cores are shared)"],
    "tool_rl": ["node 0: policy rank 0, engine 0",
                "total: 1 trainer rank(s) and 1 engine(s) on 1 node(s) (CPU: cores are shared)"],
    "tool_sft": ["node 0: policy rank 0",
                 "total: 1 trainer rank(s) and 0 engine(s) on 1 node(s) (CPU: cores are shared)"],
}


def test_every_shipped_experiment_has_its_plan_checked():
    assert sorted(PLANS) == sorted(EXPERIMENTS)


def test_qwen_vl_geo3k_matches_its_description():
    spec = compose(["+experiment=qwen_vl_geo3k"])
    assert spec.model.max_model_len == 32768 and spec.model.freeze_vision
    assert (spec.train.prompts_per_step, spec.rollout.samples_per_prompt) == (4, 4)
    assert spec.parallel.world_size == 8 and spec.rollout.engine.num_engines == 8


# The GPU recipes' data is generated, not committed (their headers); their CPU twins' rows have the same form.
GENERATED = {"qwen30b_tools": ["data.train_path=examples/data/tool_flagship_train.jsonl",
                               "data.eval=[examples/data/tool_flagship_eval.jsonl]"],
             "qwen3_4b_bfcl": ["data.train_path=examples/data/bfcl_multi_turn_base_train.jsonl",
                               "data.eval=[examples/data/bfcl_multi_turn_base_eval.jsonl]"],
             # the SFT export their header names (the placeholder is refused): the tiny model stands in
             "rg_rl": ["model.path=null"], "tool_rl": ["model.path=null"]}


def decision_data(name: str, folder: Path) -> list[str]:
    """The decision recipes' rows, generated (not committed) as their header says, into `folder`."""
    if not name.startswith("decision_"):
        return []
    from test_tool_use import load

    # the writer puts examples/agents/ first on sys.path, where math_verify.py would shadow the library
    path, sizes = list(sys.path), ["--train", "8", "--eval", "4", "--sft", "4", "--sft-eval", "2"]
    try:
        load("decision_env").main([str(folder), *sizes])
    finally:
        sys.path[:] = path
    if name == "decision_sft":
        return [f"data.train_path={folder}/decision_sft.jsonl",
                f"data.eval=[{folder}/decision_sft_eval.jsonl]"]
    task = name.removeprefix("decision_")
    # the SFT export their header names (the placeholder is refused): the tiny model stands in
    return ["model.path=null", f"data.train_path={folder}/decision_{task}_train.jsonl",
            f"data.eval=[{folder}/decision_{task}_eval.jsonl,{folder}/decision_{task}_eval_off.jsonl]"]


@pytest.mark.parametrize("name", sorted(PLANS))
def test_shipped_experiments_plan_totals_and_inputs(name, tmp_path):
    from datalib import with_local_hub

    from molt.driver.compose import EP_WITHOUT_DEEPEP, prepare
    from molt.driver.launch import describe_plan

    dry = [f"+experiment={name}", "run.dry_run=true", *GENERATED.get(name, []),
           *decision_data(name, tmp_path)]
    spec = compose(dry)
    lines = [line.removeprefix("placement: ") for line in describe_plan(spec).splitlines()
             if line.startswith("placement: ")]
    assert lines == PLANS[name]
    if spec.parallel.ep_size > EP_WITHOUT_DEEPEP:   # no DeepEP on the CPU install: refused before a start
        problems = [str(p) for p in prepare(spec).problems]
        assert [p for p in problems if "parallel.ep_size=256 needs DeepEP (the deep_ep module)" in p]
        spec = compose([*dry, f"parallel.ep_size={EP_WITHOUT_DEEPEP}"])
    prepare(with_local_hub(spec, tmp_path)).or_raise()  # data loads (hub sets: local copies), agent imports


def test_large_expert_parallel_on_cuda_needs_deep_ep(tmp_path, monkeypatch):
    from molt.driver.compose import check_expert_dispatch

    dsv3 = compose(["+experiment=dsv3_ep256"])
    with pytest.raises(ValueError, match=r"parallel.ep_size=256 needs DeepEP .* or use parallel.ep_size<=8"):
        check_expert_dispatch(dsv3)
    check_expert_dispatch(compose(["+experiment=qwen30b_tools"]))   # ep 8: AutoModel's own dispatcher
    (tmp_path / "deep_ep").mkdir()   # an installed DeepEP (it builds only with nvcc: a stand-in module)
    (tmp_path / "deep_ep" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    check_expert_dispatch(dsv3)


def test_an_agent_option_sets_its_data_and_the_plan_names_it():
    from molt.driver.launch import describe_plan

    spec = compose(["agent=tools"])
    assert (spec.data.train_path, spec.data.eval) == ("examples/data/tool_flagship_train.jsonl",
                                                      ["examples/data/tool_flagship_eval.jsonl"])
    assert ("data: train examples/data/tool_flagship_train.jsonl; "
            "eval examples/data/tool_flagship_eval.jsonl") in describe_plan(spec)
    # the command line (or an experiment) still picks other rows; an agent without data keeps the default
    assert compose(["agent=tools", "data.eval=[]"]).data.eval == []
    assert "; eval none" in describe_plan(compose(["agent=tools", "data.eval=[]"]))
    assert compose(["agent=chat_minimal"]).data == RunSpec().data


def test_the_plan_says_fsdp2_only_where_it_shards():
    from molt.driver.launch import describe_plan

    plan = describe_plan(compose([]))
    assert "1 rank(s) [dp=1 cp=1 tp=1 ep=1] unsharded (one rank: no FSDP2) on cpu" in plan
    assert "] FSDP2 on cpu" in describe_plan(compose(["parallel=cpu2"]))


def test_the_dry_run_builds_the_inputs_and_reports_every_problem():
    """One dry run, three bad inputs: each is reported (the checks go on after the first), as the exception
    a run would raise."""
    from molt.driver.compose import prepare

    problems = prepare(compose(["data.train_path=nope.jsonl", "data.eval=[nope_eval.jsonl]",
                                "agent.module=nope.py"])).problems
    assert [type(p) for p in problems] == [ImportError, FileNotFoundError, FileNotFoundError]
    assert "agent.module='nope.py' could not be loaded" in str(problems[0])
    assert "dataset file not found: 'nope.jsonl'" in str(problems[1])
    assert "dataset file not found: 'nope_eval.jsonl'" in str(problems[2])


GPU_RECIPES = ["dsv3_ep256", "qwen30b_tools", "qwen3_4b_bfcl", "qwen3_4b_math", "qwen_vl_geo3k"]


def test_a_dry_run_of_every_gpu_recipe_prints_its_memory_plan_then_its_problems(monkeypatch, capsys):
    """Offline (the tests' HF_HUB_OFFLINE), a GPU recipe's hub data and hub model cannot be read: the dry
    run still prints the whole plan, every role's memory line included, then each problem as one line,
    and exits 2 (a missing hub dataset used to stop it before the memory lines)."""
    assert sorted(n for n in EXPERIMENTS if compose([f"+experiment={n}"]).parallel.device == "cuda") == \
        GPU_RECIPES
    for name in GPU_RECIPES:
        code, out, err = _main(monkeypatch, capsys, f"+experiment={name}", "run.dry_run=true")
        memory = [line for line in out.splitlines() if line.startswith("memory: ")]
        roles = [line.split(":")[1].split()[:2] for line in memory[1:3]]
        assert roles == [["policy", "rank"], ["engine", "GPU"]], (name, out)
        assert "no estimate" not in out and "loop: " in out, name
        problems = [line for line in err.splitlines()
                    if line.startswith("molt: ") and "not checked" not in line]
        assert (code, bool(problems)) in ((0, False), (2, True)), (name, code, err)


def test_cli_dry_run_writes_nothing_and_over_subscription_fails_before_ray():
    runs = REPO / "runs" / "qwen30b_tools"   # where its run would go (other tests may write beside it)
    before = sorted(runs.rglob("*")) if runs.exists() else []
    ok = _molt("+experiment=qwen30b_tools", "run.dry_run=true", *GENERATED["qwen30b_tools"])
    assert ok.returncode == 0, ok.stderr
    assert "total: 16 of 2 x 8 = 16 GPUs" in ok.stdout and "no run directory" in ok.stdout
    bad = _molt("+experiment=qwen30b_tools", "run.dry_run=true", "rollout.engine.num_engines=16")
    assert bad.returncode != 0 and "needs 24 GPUs" in bad.stderr
    assert "Ray" not in bad.stderr and not bad.stdout  # failed at validation: nothing placed, nothing started
    assert (sorted(runs.rglob("*")) if runs.exists() else []) == before


def _main(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str
          ) -> tuple[int | str | None, str, str]:
    """`python -m molt ARGS` in this process (the print / preview paths start nothing)."""
    monkeypatch.setattr("sys.argv", ["molt", *args])
    code: int | str | None = 0
    try:
        cli.main()
    except SystemExit as done:
        code = done.code
    out, err = capsys.readouterr()
    return code, out, err


def test_a_run_dir_override_is_refused_not_replaced(monkeypatch, capsys):
    """The launcher writes to Hydra's output directory: run.dir=X used to be replaced by it without a word."""
    code, out, err = _main(monkeypatch, capsys, "run.dir=/tmp/elsewhere", "run.dry_run=true")
    assert code == 2 and "set hydra.run.dir=/tmp/elsewhere" in err and not out


def test_cli_print_config_is_the_validated_spec(monkeypatch, capsys):
    code, out, _ = _main(monkeypatch, capsys, "+experiment=qwen30b_tools", "--cfg", "job", "--resolve")
    assert code == 0
    printed = yaml.safe_load(out)
    assert printed["parallel"]["dp_size"] == 8 and "world_size" not in printed["parallel"]   # derived
    assert printed["logging"]["wandb"]["job_type"] == "grpo_seq_mask_tis"   # filled as the launcher does
    assert printed["run"]["dir"].startswith(str(Path.cwd() / "runs" / "qwen30b_tools"))
    assert printed["rollout"]["engine"]["kv_cache_gib"] == 1.0                 # a schema default, included
    assert compose(["+experiment=qwen30b_tools"]).model_dump(mode="json")["algo"] == printed["algo"]


def test_cli_print_refuses_an_invalid_spec_as_a_run_does(monkeypatch, capsys):
    code, out, err = _main(monkeypatch, capsys, "parallel.dp_size=3", "--cfg", "job")
    assert out == "" and code == 2 and err.startswith("molt: invalid run spec: ") and err.count("\n") == 1
    proc = _molt("parallel.dp_size=3")
    assert proc.returncode == 2 and proc.stderr == err


def test_sweep_preview_prints_every_job_and_creates_nothing(tmp_path, monkeypatch, capsys):
    sweep = tmp_path / "sweep"
    code, out, _ = _main(monkeypatch, capsys, "-m", "algo=grpo,icepop", "train.lr=1e-6,1e-5", "train.steps=3",
                         "--cfg", "job", f"hydra.sweep.dir={sweep}")
    assert code == 0 and not sweep.exists()
    docs = list(yaml.safe_load_all(out))
    names = ["algo=grpo,train.lr=1e-06", "algo=grpo,train.lr=1e-05", "algo=icepop,train.lr=1e-06",
             "algo=icepop,train.lr=1e-05"]
    assert [d["logging"]["wandb"]["name"] for d in docs] == names            # the swept choices only
    assert [d["run"]["dir"] for d in docs] == [str(sweep / f"{i}_{n}") for i, n in enumerate(names)]
    assert {d["logging"]["wandb"]["group"] for d in docs} == {"sweep"}       # one W&B group per sweep
    assert [d["logging"]["wandb"]["job_type"] for d in docs] == ["grpo", "grpo", "icepop", "icepop"]
    assert {d["train"]["steps"] for d in docs} == {3}
    assert [line for line in out.splitlines() if line.startswith("# sweep job")][2] == \
        "# sweep job 2: algo=icepop,train.lr=1e-06"
    # a time-stamped sweep directory is one directory for every job (as Hydra's sweeper keeps it)
    code, out, _ = _main(monkeypatch, capsys, "-m", "algo=grpo,rloo,icepop", "--cfg", "job",
                         f"hydra.sweep.dir={tmp_path}/s_${{now:%H-%M-%S-%f}}")
    assert code == 0 and len({Path(d["run"]["dir"]).parent for d in yaml.safe_load_all(out)}) == 1


def test_an_invalid_sweep_job_fails_before_any_job_starts(tmp_path, monkeypatch, capsys):
    code, _, err = _main(monkeypatch, capsys, "-m", "algo=grpo,gae", f"hydra.sweep.dir={tmp_path / 's'}")
    assert code == 2 and err.startswith("molt: sweep job 1 (algo=gae")
    assert "needs a critic" in err and not (tmp_path / "s").exists()


@pytest.mark.parametrize("overrides, threads", [
    # the default (null), sync: generation and training take turns, so each takes the node's 8 cores (split
    # over its ranks)
    ([], {"engine": 8, "policy": 8, "critic": 8}),   # a role the spec does not plan: alone on its node
    (["parallel.cpu_threads=1"], {"engine": 1, "policy": 1}),
    (["parallel.cpu_threads=null", "parallel=cpu2"], {"engine": 8, "policy": 4}),
    (["parallel=cpu2", "parallel.cpu_threads=null", "rollout.engine.num_engines=2"],
     {"engine": 4, "policy": 4}),
    # null, async: the engines and the policy's ranks compute at once and split the cores
    (["parallel.cpu_threads=null", "rollout.mode=async", "algo=tis"], {"engine": 4, "policy": 4}),
    (["parallel=cpu2", "parallel.cpu_threads=null", "rollout.mode=async", "algo=tis",
      "rollout.engine.num_engines=2"], {"engine": 2, "policy": 2}),
    (["rollout.mode=async", "algo=tis", "parallel.cpu_threads=3"], {"engine": 3, "policy": 3}),
])
def test_cpu_threads_follow_the_spec(overrides, threads, monkeypatch):
    from molt.plan.placement import cpu_threads
    from molt.rollout.engine_args import actor_options
    from molt.trainer.worker import TrainerWorker

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    spec = compose(overrides)
    assert {role: cpu_threads(spec, role, 0) for role in threads} == threads
    # while the engines are idle (async mode), a rank takes its node's cores, split over its role's ranks
    ranks = 2 if "parallel=cpu2" in overrides else 1
    idle = threads["policy"] if spec.parallel.cpu_threads or spec.rollout.mode == "sync" else 8 // ranks
    assert cpu_threads(spec, "policy", 0, engines_idle=True) == idle
    assert cpu_threads(spec, "engine", 0, engines_idle=True) == threads["engine"]
    # what the processes are given: the engine's OpenMP environment, the trainer rank's torch threads
    env = actor_options(spec.rollout.engine, "cpu", cpu_threads(spec, "engine", 0))["runtime_env"]
    assert env["env_vars"]["OMP_NUM_THREADS"] == str(threads["engine"])
    before = torch.get_num_threads()
    try:
        TrainerWorker(spec, "policy", 0, "(no model is loaded before setup)")
        assert torch.get_num_threads() == threads["policy"]
    finally:
        torch.set_num_threads(before)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0})   # never below one thread
    assert cpu_threads(spec, "engine", 0) == (spec.parallel.cpu_threads or 1)


def test_engine_keys_reach_vllms_arguments(tiny_model_path):
    """Each rollout.engine key the spec maps lands in vLLM's EngineArgs as itself (CPU: the KV cache is a
    byte budget), and extra_args passes any other flag through."""
    from molt.rollout.engine_args import engine_kwargs

    engine = "rollout.engine"
    spec = compose([f"{engine}.kv_cache_gib=0.5", f"{engine}.max_num_seqs=7",
                    f"{engine}.max_num_batched_tokens=4096", f"{engine}.enable_prefix_caching=false",
                    f"+{engine}.extra_args.dtype=bfloat16"])
    kwargs = engine_kwargs(str(tiny_model_path), spec.rollout, spec.model, 3)
    assert kwargs["kv_cache_memory_bytes"] == 2**29 and kwargs["max_num_seqs"] == 7
    assert kwargs["max_num_batched_tokens"] == 4096 and kwargs["enable_prefix_caching"] is False
    assert kwargs["dtype"] == "bfloat16" and kwargs["seed"] == 3 and kwargs["enable_chunked_prefill"] is False


def test_engine_ray_resources_follow_the_specs_device():
    """`parallel.device`, not the driver's host, decides an engine's Ray resources: a driver on a CPU
    machine (this one) still asks for the GPUs of a cuda spec's engines."""
    from molt.plan.placement import gpu_share
    from molt.rollout.engine_args import actor_options

    gpu = compose(["+experiment=qwen30b_tools"])
    engine = gpu.rollout.engine
    assert actor_options(engine, gpu.parallel.device) == {
        "num_cpus": 1, "num_gpus": engine.tp_size, "max_concurrency": 10_000,
        "runtime_env": {"env_vars": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0",   # the core in the actor
                                     "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}}}   # placement.NCCL_ENV
    colocated = compose(["parallel=gpu1", "model.reference=policy", "algo.kl.coef=0.1"])
    share = gpu_share(colocated)   # the policy rank, the reference rank and the engine on one GPU
    assert share == 1 / 3 and actor_options(colocated.rollout.engine, "cuda", 1, share)["num_gpus"] == share
    cpu = actor_options(compose([]).rollout.engine, "cpu", 2)
    assert cpu["num_cpus"] < 1 and "num_gpus" not in cpu
    assert cpu["runtime_env"]["env_vars"]["OMP_NUM_THREADS"] == "2"
    # an eager engine skips torch.compile (its one use there is a sampler helper Molt never reads); a
    # compiled engine keeps it
    assert cpu["runtime_env"]["env_vars"]["TORCH_COMPILE_DISABLE"] == "1"
    compiled = compose(["rollout.engine.enforce_eager=false"]).rollout.engine
    assert "TORCH_COMPILE_DISABLE" not in actor_options(compiled, "cpu", 2)["runtime_env"]["env_vars"]


def test_partial_rollouts_turn_off_async_scheduling(tiny_model_path):
    """A refit with partial rollouts runs between two engine steps and keeps the requests in flight: no
    batch the old weights sampled may still be out (async scheduling, vLLM's default on GPU)."""
    from molt.rollout.engine_args import engine_kwargs

    for partial in (True, False):
        for mode in ("async", "sync"):   # a sync refit has nothing in flight
            spec = compose([f"rollout.partial_rollout={str(partial).lower()}", f"rollout.mode={mode}",
                            "algo=tis"])
            kwargs = engine_kwargs(str(tiny_model_path), spec.rollout, spec.model, 0)
            off = partial and mode == "async"
            assert kwargs.get("async_scheduling", "vLLM's default") == (False if off else "vLLM's default")


def test_the_driver_imports_the_loop_without_the_model_stacks():
    """Start-up: before it asks for the engines the driver imports the loop, but not AutoModel,
    transformers, FSDP or vLLM (seconds each): the trainer's actor class and the tokenizer come after
    the engines are asked for, and only the engine and trainer processes need the rest."""
    heavy = ("nemo_automodel", "transformers", "torch.distributed.fsdp", "vllm")
    code = f"import sys, molt.driver.loop; print(sorted(m for m in sys.modules if m.startswith({heavy})))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
