"""LoRA (model.lora): AutoModel's adapters on the policy, refit as an adapter into vLLM's LoRA serving.

The trainer test runs one rank in this process and checks the adapter by hand: only lora_A / lora_B move
and only they are in the optimizer, and the export is W + alpha / rank * B @ A. The loop test runs the
loop's own steps (pool → learn → refit) against an engine serving adapters and compares what the engine
samples with the merged model the trainer exports.
"""

from __future__ import annotations

import asyncio
import os

import pytest
import ray
import torch
from test_trainer import batch_of
from trainerlib import one_rank

from molt.spec import RunSpec

pytestmark = pytest.mark.timeout(300)   # a broken refit or version label hangs the pool instead
RANK, ALPHA = 8, 16.0


def lora_spec(path: str | None = None, **sections) -> RunSpec:
    data = {"model": {"path": path, "max_model_len": 128, "lora": {"rank": RANK, "alpha": ALPHA}},
            "rollout": {"samples_per_prompt": 4, "max_tokens": 8, "temperature": 0.7,
                        "engine": {"kv_cache_gib": 0.1}},
            "train": {"prompts_per_step": 2, "micro_batch_size": 8, "lr": 1e-2, "steps": 2},
            "logging": {"progress": False, "dump_rollouts": False, "plots": False}}
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value}
    return RunSpec.model_validate(data)


def adapter_bytes(model_path: str) -> int:
    """fp32 bytes of rank-8 adapters on every *_proj layer, from the model's config alone."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_path)
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    shapes = [(c.hidden_size, q), (c.hidden_size, kv), (c.hidden_size, kv), (q, c.hidden_size),
              (c.hidden_size, c.intermediate_size), (c.hidden_size, c.intermediate_size),
              (c.intermediate_size, c.hidden_size)]
    return c.num_hidden_layers * sum(RANK * (i + o) for i, o in shapes) * 4


def hf_forward(folder: str, batch: dict, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs, greedy next-token ids) of a plain transformers forward of an exported folder."""
    from transformers import AutoModelForCausalLM

    from molt.trainer.model import token_logprobs

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logp = token_logprobs(logits, batch["input_ids"], batch["attention_mask"], temperature)[0]
    return logp, logits.argmax(-1)


def test_only_the_adapter_trains_and_the_export_merges_it(tiny_model_path, tmp_path) -> None:
    from safetensors.torch import load_file

    from molt.trainer.weights import adapter_chunks

    with one_rank(lora_spec(tiny_model_path)) as worker:
        before = {n: p.detach().clone() for n, p in worker.model.named_parameters()}
        adapter = {n for n in before if ".lora_A." in n or ".lora_B." in n}
        held = {id(p) for g in worker.optimizer.param_groups for p in g["params"]}
        assert held == {id(p) for n, p in worker.model.named_parameters() if n in adapter} and held
        b = batch_of(7)
        worker.update(b)
        after = {n: p.detach().clone() for n, p in worker.model.named_parameters()}
        assert max(float((after[n] - before[n]).abs().max()) for n in before if n not in adapter) == 0.0
        assert min(float((after[n] - before[n]).abs().max()) for n in adapter if ".lora_B." in n) > 1e-4
        trained = worker.forward(b)
        [chunk] = adapter_chunks(worker.model, 1 << 30, torch.float32, worker.device, worker.device)
        worker.export_hf(str(tmp_path / "hf"))
    assert sorted(chunk) == sorted(f"base_model.model.{n}" for n in adapter)
    assert sum(t.numel() * t.element_size() for t in chunk.values()) == adapter_bytes(tiny_model_path)

    exported = load_file(str(next((tmp_path / "hf").glob("*.safetensors"))))
    assert not any("lora" in n for n in exported)
    for name, weight in exported.items():   # W + alpha / rank * B @ A, by hand
        owner = name.removesuffix(".weight")
        want = after[name]
        if f"{owner}.lora_A.weight" in after:
            want = want + ALPHA / RANK * after[f"{owner}.lora_B.weight"] @ after[f"{owner}.lora_A.weight"]
        assert torch.allclose(weight, want, atol=1e-6), name
    gap = (hf_forward(str(tmp_path / "hf"), b, 0.7)[0] - trained)[b["loss_mask"] > 0]   # sampled ones scored
    assert float(gap.abs().max()) < 1e-5


def test_loop_refits_the_adapter_and_the_engine_serves_the_merged_model(ray_session, tiny_model_path, tok,
                                                                       tmp_path) -> None:
    """Three steps of the loop (pool → learn → refit) on an engine serving adapters; then a greedy request
    is sent with adapter 3 and the trainer steps and refits adapter 4 while it runs: the request keeps
    adapter 3 (its tokens say version 3) and decodes what the merged export of version 3 computes."""
    from molt.agents import load_agent_runner
    from molt.driver.compose import Inputs
    from molt.driver.fleet import Fleet
    from molt.driver.loop import rl_step
    from molt.driver.metrics import RunLogger
    from molt.driver.run import Run
    from molt.inputs.data import PromptDataset
    from molt.rollout.engine import start_engines
    from molt.trainer.batch import make_batch
    from molt.trainer.ranks import TrainerRanks, Trainers
    from molt.trajectory import Segment

    spec = lora_spec(tiny_model_path, run={"dir": str(tmp_path / "run")})
    engines = start_engines(spec, tiny_model_path)
    policy = TrainerRanks(spec, "policy")
    runner = load_agent_runner(spec.agent)
    runner.setup(tok, spec)
    loaded = engines[0].__ray_call__.remote   # the engine's loaded adapters and their folders
    adapters = (lambda self: (len(self.adapter_users), len(os.listdir(self.adapter_dir))))

    async def scenario() -> tuple[list[dict], tuple, dict]:
        fleet = Fleet(spec, tiny_model_path, engines=engines)
        inputs = Inputs(runner=runner, train=PromptDataset(spec.data.train_path, spec.data))
        run = Run(spec, inputs, fleet, Trainers(policy, pad_id=tok.pad_token_id), RunLogger(spec))
        await run.begin(None, refit_engines=False)
        steps = [await rl_step(run) for _ in range(3)]
        await run.pool.close()
        run.logger.close()
        held = await loaded(adapters)
        await asyncio.to_thread(policy.export_hf, str(tmp_path / "hf"))    # version 3, merged
        await asyncio.to_thread(policy.update, batch_of(7))            # the trainer moves on
        # 100 greedy tokens; the refit reaches the engine within its first few (a ping and a call later)
        request = engines[0].generate.remote(PROBE, {"temperature": 0.0, "max_tokens": 100,
                                                     "ignore_eos": True})
        await fleet.refit(4)
        kept = await request
        return steps, (held, await loaded(adapters)), kept

    try:
        steps, held, kept = asyncio.run(scenario())
    finally:
        policy.shutdown()
        for e in engines:
            ray.get(e.shutdown.remote())
            ray.kill(e)

    # a refit moves the adapter alone
    assert [s["refit/bytes"] for s in steps] == [adapter_bytes(tiny_model_path)] * 3
    # steps 2 and 3 trained tokens that adapters sampled: the trainer's logprobs match the engine's
    assert [s["policy/version"] for s in steps] == [1, 2, 3]
    assert all(s["mismatch/stale_frac"] == 0 and s["mismatch/max_abs"] < 1e-4 for s in steps)
    # old adapters are unloaded once no request uses them: after step 3 only the current one is loaded;
    # adapter 3 was still in use when adapter 4 came, so it stayed (until a later refit)
    assert held == ((1, 1), (2, 2))
    # the request that started on adapter 3 decodes greedily what the merged export of version 3 computes
    ids, n = PROBE + kept["token_ids"], len(kept["token_ids"])
    b = make_batch([Segment(ids, [0] * len(PROBE) + [1] * n, [0.0] * len(ids), [0] * len(ids), "r", "g")], 0)
    logp, argmax = hf_forward(str(tmp_path / "hf"), b, 1.0)
    assert kept["versions"] == [3] * n and n == 100
    assert float((logp[0, len(PROBE):] - torch.tensor(kept["logprobs"])).abs().max()) < 1e-4
    assert argmax[0, len(PROBE) - 1:-1].tolist() == kept["token_ids"]


PROBE = [1, 40, 41, 42, 43]


def test_refit_and_export_names_do_not_see_checkpoint_wrappers(ray_session, tiny_model_path) -> None:
    """With activation checkpointing at world size > 1 AutoModel wraps each layer in torch's
    checkpoint_wrapper, whose name shows in `named_parameters`: the merged full weights a full refit or an
    export writes carry the checkpoint's own names, and the adapter a refit sends PEFT's names of every
    `*_proj` layer (both written out here from the model files, not from the trainer)."""
    from pathlib import Path

    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from molt.trainer.ranks import TrainerRanks

    def names(self) -> tuple[list[str], list[str], bool]:   # on every rank: the gathers are collective
        from molt.trainer import weights

        chunks = [list(stream(self.model, 1 << 30, torch.float32, self.device, self.device))
                  for stream in (weights.hf_chunks, weights.adapter_chunks)]
        wrapped = any("_checkpoint_wrapped_module" in n for n, _ in self.model.named_parameters())
        return *[[n for chunk in c for n in chunk] for c in chunks], wrapped

    group = TrainerRanks(lora_spec(tiny_model_path, parallel={
        "dp_size": 2, "activation_checkpointing": True}))
    try:
        full, adapter, wrapped = ray.get([w.__ray_call__.remote(names) for w in group.workers])[0]
    finally:
        group.shutdown()
    assert wrapped   # the wrappers are there, so the names are tested
    with safe_open(str(next(Path(tiny_model_path).glob("*.safetensors"))), "pt") as stored:
        assert sorted(full) == sorted(stored.keys())
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    layers = [name for name, _ in model.named_modules() if name.endswith("_proj")]
    assert sorted(adapter) == sorted(f"base_model.model.{name}.lora_{ab}.weight" for name in layers
                                     for ab in "AB")


@pytest.mark.parametrize("override, fragment", [
    ({"target_modules": ["nothing_here"]}, "matched no linear layer"),
    ({"target_modules": ["lm_head"]}, "leave the output head"),
    # merged, an adapter on the head is served, but not on this one: the tiny model ties it to its embeddings
    ({"target_modules": ["lm_head"], "refit": "merged"}, "tied to the input embeddings"),
])
def test_bad_targets_are_refused_by_name(tiny_model_path, override, fragment) -> None:
    from transformers import AutoModelForCausalLM

    from molt.trainer.lora import apply_lora

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    spec = lora_spec(tiny_model_path)
    spec.model.lora = spec.model.lora.model_copy(update=override)
    with pytest.raises(ValueError, match=fragment):
        apply_lora(model, spec)


def test_a_merged_refit_folds_every_adapter_into_the_engines_weights(tmp_path) -> None:
    """model.lora.refit=merged: a refit streams the full weights with the adapters folded in (the engines
    serve no LoRA), so any linear layer may be adapted, the untied output head too. The refit's chunks,
    loaded into a plain model, compute the trainer's logprobs."""
    from transformers import AutoModelForCausalLM

    from molt.inputs.tiny import tiny_model_path
    from molt.trainer.weights import refit_chunks

    path = str(tiny_model_path(tie_word_embeddings=0))
    spec = lora_spec(path, model={"lora": {"rank": RANK, "alpha": ALPHA, "refit": "merged",
                                           "target_modules": ["*_proj", "lm_head"]}})
    with one_rank(spec) as worker:
        b = batch_of(7)
        worker.update(b)
        trained = worker.forward(b)
        chunks = list(refit_chunks(worker.model, spec, 1 << 30, worker.device, None))
        head = worker.model.get_output_embeddings()
        folded = head.weight + ALPHA / RANK * head.lora_B.weight @ head.lora_A.weight
    sent = {k: v for chunk in chunks for k, v in chunk.items()}
    assert not any("lora" in n for n in sent) and torch.allclose(sent["lm_head.weight"], folded, atol=1e-6)
    assert float((sent["lm_head.weight"] - sent["model.embed_tokens.weight"]).abs().max()) > 1e-3
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.load_state_dict(sent)
    model.save_pretrained(tmp_path / "merged")
    gap = (hf_forward(str(tmp_path / "merged"), b, 0.7)[0] - trained)[b["loss_mask"] > 0]
    assert float(gap.abs().max()) < 1e-5


def test_moe_and_vision_models_are_refused_before_an_engine_starts(vlm_path) -> None:
    """By start_engines (evaluation, a judge) and by the checks `python -m molt` (and a dry run) makes
    before Ray starts: the loop starts its engines one at a time, without start_engines."""
    from molt.driver.launch import dry_run
    from molt.inputs.tiny import tiny_model_path
    from molt.rollout.engine import start_engines

    moe = str(tiny_model_path(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64))
    for path, kind in ((moe, "a MoE model"), (vlm_path, "a vision-language model")):
        refused = f"model.lora with {kind} is not supported"
        with pytest.raises(ValueError, match=refused):
            start_engines(lora_spec(path), path)
        problems = dry_run(lora_spec(path, run={"dry_run": True}))[1]
        assert [str(p) for p in problems if refused in str(p)], problems
