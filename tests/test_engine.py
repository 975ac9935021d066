"""The engine actor on a real vLLM CPU engine: token identity, refit, partial rollouts across a refit."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import ray
import torch

PROMPTS = [[1, 40, 41, 42, 43], [1, 7, 8], list(range(3, 163))]  # the last spans several KV blocks
SAMPLED = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 12}
GREEDY = {"temperature": 0.0, "max_tokens": 12}


def perturbed_state_dict(path: str, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """The model's weights plus seeded noise: a stand-in for one optimizer step."""
    from safetensors.torch import load_file

    gen = torch.Generator().manual_seed(1)
    sd = load_file(f"{path}/model.safetensors")
    return {k: v + scale * v.std().nan_to_num(0.0) * torch.randn(v.shape, generator=gen)
            for k, v in sd.items()}


def perturbed_checkpoint(path: str, folder) -> tuple[dict[str, torch.Tensor], str]:
    """(state dict, checkpoint folder) of the perturbed model; the folder is a complete HF checkpoint."""
    import shutil
    from pathlib import Path

    from safetensors.torch import save_file

    sd = perturbed_state_dict(path)
    for src in Path(path).iterdir():
        if src.suffix != ".safetensors":
            shutil.copy(src, folder / src.name)
    save_file(sd, str(folder / "model.safetensors"))
    return sd, str(folder)


@pytest.fixture(scope="module")
def new_weights(tiny_model_path, tmp_path_factory):
    return perturbed_checkpoint(tiny_model_path, tmp_path_factory.mktemp("w1"))


@ray.remote(num_cpus=0.01)
def direct_vllm(paths: list[str], spec: dict, prompts: list[list[int]], samplings: list[dict]) -> list:
    """Plain `vllm.LLM` on each checkpoint in turn, without any molt code in the sampling path."""
    import os

    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND="nobind")
    from vllm import LLM, SamplingParams, TokensPrompt

    results = []
    for path in paths:
        llm = LLM(model=path, dtype="float32", max_model_len=spec["max_model_len"], enforce_eager=True,
                  kv_cache_memory_bytes=2**28, seed=0, distributed_executor_backend="uni")
        per_path = []
        for s in samplings:
            params = SamplingParams(**s, logprobs=0)
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
            comps = [o.outputs[0] for o in outs]
            per_path.append([(list(c.token_ids),
                              [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs, strict=True)])
                             for c in comps])
        results.append(per_path)
        llm.llm_engine.engine_core.shutdown()
        del llm
    return results


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    """(initial folder, perturbed state dict, perturbed folder) of a tiny model with its own lm_head."""
    from molt.inputs.tiny import tiny_model_path

    path = str(tiny_model_path(tie_word_embeddings=0))
    sd, folder = perturbed_checkpoint(path, tmp_path_factory.mktemp("untied"))
    assert "lm_head.weight" in sd
    return path, sd, folder


@pytest.fixture(scope="module")
def direct(ray_session, tiny_model_path, new_weights, engine_spec):
    """Direct-engine outputs: [weights][sampling][prompt] → (ids, logprobs); weights = initial, perturbed.

    A Ray reference, so the reference engines start while the shared engine does (tests list it first).
    """
    samplings = [{**SAMPLED, "seed": 7}, GREEDY]
    return direct_vllm.remote([tiny_model_path, new_weights[1]], engine_spec.model.model_dump(),
                              PROMPTS, samplings)


@pytest.fixture(scope="module", autouse=True)
def own_engines(ray_session, untied, engine_spec, tiny_model_path):
    """The engines two tests need for themselves (tensor-parallel on the untied model; bfloat16), started
    with this module: each start is mostly imports on one core, so they load while the first tests run.
    {name: (engine, its `ready` call)}; each test waits for its engine and stops it."""
    from molt.rollout.engine import start_engine

    tp2, bf16 = engine_spec.model_copy(deep=True), engine_spec.model_copy(deep=True)
    tp2.rollout.engine.tp_size = 2
    bf16.model.dtype = "bfloat16"
    engines = {"tp2": start_engine(tp2, untied[0], 0), "bf16": start_engine(bf16, tiny_model_path, 0)}
    yield {name: (e, e.ready.remote()) for name, e in engines.items()}
    for e in engines.values():
        ray.kill(e)   # a test that failed before stopping its engine


def generate_all(engine, sampling: dict) -> list[dict]:
    return ray.get([engine.generate.remote(p, sampling) for p in PROMPTS])


@functools.cache
def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_logprobs(path: str, prompt: list[int], ids: list[int]) -> list[float]:
    """Sampled-token logprobs from a plain transformers forward in fp32."""
    model = hf_model(path)
    seq = torch.tensor([prompt + ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(seq).logits[0].float(), dim=-1)
    return [logp[len(prompt) + j - 1, t].item() for j, t in enumerate(ids)]


def test_token_identity_against_direct_engine(direct, engine):
    got = generate_all(engine, {**SAMPLED, "seed": 7})
    for out, (ids, logprobs), prompt in zip(got, ray.get(direct)[0][0], PROMPTS, strict=True):
        assert out["prompt_ids"] == prompt
        assert out["token_ids"] == ids
        assert out["logprobs"] == logprobs          # exactly what the engine's sampler reported
        assert out["versions"] == [0] * len(ids)
        assert out["finish_reason"] == "length"


def test_logprobs_match_transformers_fp32(engine, tiny_model_path):
    out = ray.get(engine.generate.remote(PROMPTS[0], {**SAMPLED, "max_tokens": 24, "seed": 3}))
    ref = hf_logprobs(tiny_model_path, PROMPTS[0], out["token_ids"])
    diff = torch.tensor(out["logprobs"]) - torch.tensor(ref)
    assert diff.abs().max().item() <= 1e-5


# Per-turn sampling overrides, as an Env's Result.sampling_params or a chat request would set them.
TURNS = [{"temperature": 0.7}, {"temperature": 0.7, "top_p": 0.8},
         {"temperature": 1.3, "top_k": 20, "top_p": 0.9}, {"temperature": 0.5, "top_k": 5}]


def test_trainer_scores_the_distribution_each_turn_was_sampled_from(engine, tiny_model_path):
    """Invariant 3 away from temperature 1: the engine reports processed logprobs (after temperature,
    top-k, top-p), each turn records what it was sampled with, and the trainer's scoring of the batch
    reproduces every sampled token's logprob (fp32, max over tokens)."""
    from molt.agents.trace import Trace
    from molt.trainer import make_batch
    from molt.trainer.model import token_logprobs

    segments = []
    for i, prompt in enumerate(PROMPTS[:2]):
        trace = Trace(f"r{i}", "g")
        trace.extend_prompt(prompt)
        for j, turn in enumerate(TURNS):
            sampling = {**turn, "max_tokens": 16, "seed": 10 * i + j}
            out = ray.get(engine.generate.remote(list(trace.ids), sampling))
            trace.add_sample(out)
            trace.extend_prompt([5, 6])          # an observation between turns
        segments += trace.rollout(1.0).segments
    batch = make_batch(segments)
    assert [s[1:] for s in segments[0].sampling] == [
        [t["temperature"], t.get("top_p", 1.0), t.get("top_k", -1)] for t in TURNS]
    with torch.no_grad():
        logits = hf_model(tiny_model_path)(input_ids=batch["input_ids"],
                                           attention_mask=batch["attention_mask"]).logits
    sampled = batch["loss_mask"] > 0
    logp, _ = token_logprobs(logits, batch["input_ids"], batch["attention_mask"], batch["temperature"],
                             batch["top_p"], batch["top_k"])
    assert (logp - batch["behaviour_logp"])[sampled].abs().max().item() <= 1e-5
    # the comparison has teeth: scoring at temperature 1 without truncation (the raw model) is far off
    raw, _ = token_logprobs(logits, batch["input_ids"], batch["attention_mask"], 1.0)
    assert (raw - batch["behaviour_logp"])[sampled].abs().max().item() > 0.1


def initial_weights(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(f"{path}/model.safetensors")


def test_refit_equals_fresh_engine_and_needs_cache_reset(direct, engine, new_weights, tiny_model_path,
                                                          push_weights):
    direct = ray.get(direct)
    w1_greedy = direct[1][1]
    before = generate_all(engine, GREEDY)            # fills the prefix cache with initial-weight KV
    assert [o["token_ids"] for o in before] == [ids for ids, _ in direct[0][1]]
    try:
        # Load the new weights through the worker path alone, without the cache reset update_weights
        # does: the long prompt hits stale cached KV, so its output matches neither model.
        push_weights([engine], new_weights[0], None)
        stale = generate_all(engine, GREEDY)
        assert stale[2]["logprobs"] != pytest.approx(w1_greedy[2][1], abs=1e-3)
        for out, (_, logprobs) in zip(stale[:2], w1_greedy[:2], strict=True):   # shorter than a block:
            assert out["logprobs"] == pytest.approx(logprobs, abs=1e-5)          # no hit, new weights
        # The tied model: its stream has no lm_head, the engine ties it back (64 KiB chunks: ~20 of them)
        [seconds] = push_weights([engine], new_weights[0], 1)
        assert seconds > 0
        after = generate_all(engine, GREEDY)
        for out, (ids, logprobs) in zip(after, w1_greedy, strict=True):
            assert out["token_ids"] == ids
            assert max_gap(out["logprobs"], logprobs) <= 1e-5
            assert out["versions"] == [1] * len(ids)
    finally:  # the engine is shared: restore the initial weights as version 0
        push_weights([engine], initial_weights(tiny_model_path), 0)
    assert [o["token_ids"] for o in generate_all(engine, GREEDY)] == [ids for ids, _ in direct[0][1]]


def test_a_colocated_engine_sleeps_wakes_and_takes_a_shared_refit(direct, engine, new_weights,
                                                                  tiny_model_path, push_weights):
    """parallel.colocate's engine side on CPU: the engine sleeps (level 2) and wakes, and a refit over the
    shared transport (each payload a /dev/shm file the worker copies out; CUDA IPC on a GPU) gives the
    greedy tokens and logprobs of a fresh engine on the new weights. On CPU vLLM's sleep frees nothing (the
    same calls run); on a GPU it is GPU-only (docs/parallelism.md#colocation)."""
    direct = ray.get(direct)
    try:
        ray.get(engine.sleep.remote(2))
        ray.get(engine.wake_up.remote())
        [seconds] = push_weights([engine], new_weights[0], 1, shared=True)
        assert seconds > 0
        for out, (ids, logprobs) in zip(generate_all(engine, GREEDY), direct[1][1], strict=True):
            assert out["token_ids"] == ids and max_gap(out["logprobs"], logprobs) <= 1e-5
            assert out["versions"] == [1] * len(ids)
    finally:  # the engine is shared: restore the initial weights as version 0
        push_weights([engine], initial_weights(tiny_model_path), 0)
    assert not list(Path("/dev/shm").glob(f"molt-refit-{os.getpid()}-*"))   # every payload freed


def test_engine_refuses_an_empty_or_partial_reload(engine, new_weights, tiny_model_path, push_weights):
    """A refit stream with no tensor, or without one tensor of the checkpoint, fails the engine's
    update_weights with an error naming what is missing, and the engine's version does not move (vLLM's
    own reload only logs what it did not load). An empty one leaves the weights as they were."""
    before = generate_all(engine, GREEDY)
    partial = {k: v for k, v in new_weights[0].items() if k != "model.norm.weight"}
    try:
        with pytest.raises(ray.exceptions.RayTaskError, match="refusing an empty reload"):
            push_weights([engine], {}, 3)
        assert ray.get(engine.stats.remote())["version"] == 0
        assert [o["token_ids"] for o in generate_all(engine, GREEDY)] == [o["token_ids"] for o in before]
        with pytest.raises(ray.exceptions.RayTaskError, match="lacked 1 of .*model.norm.weight"):
            push_weights([engine], partial, 3)
        assert ray.get(engine.stats.remote())["version"] == 0
    finally:  # the engine is shared: restore the initial weights as version 0
        push_weights([engine], initial_weights(tiny_model_path), 0)
    after = generate_all(engine, GREEDY)
    assert [o["token_ids"] for o in after] == [o["token_ids"] for o in before]


def max_gap(a: list[float], b: list[float]) -> float:
    return float((torch.tensor(a) - torch.tensor(b)).abs().max())


def test_refit_untied_tp2_equals_the_new_weights(untied, own_engines, push_weights):
    """An untied model (its lm_head is in the stream) on an engine with two tensor-parallel worker
    processes: both workers join the refit group and load their shards, and the engine then samples as a
    transformers forward of the new checkpoint does (greedy ids, logprobs within 1e-5)."""
    sd = untied[1]
    engine, loading = own_engines["tp2"]
    ray.get(loading, timeout=600)
    try:
        assert ray.get(engine.refit_workers.remote()) == 2
        initial = generate_all(engine, GREEDY)
        push_weights([engine], sd, 1, chunk_bytes=1 << 30)   # one chunk: the whole (tiny) model
        after = generate_all(engine, GREEDY)
    finally:
        ray.get(engine.shutdown.remote())
        ray.kill(engine)
    assert [o["token_ids"] for o in initial] != [o["token_ids"] for o in after]   # the refit changed them
    model = hf_model(untied[2])   # a transformers forward of the perturbed checkpoint is the reference
    for out, prompt in zip(after, PROMPTS, strict=True):
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([prompt + out["token_ids"]])).logits[0], dim=-1)
        rows = logp[len(prompt) - 1:-1]   # the distributions each generated token was taken from
        assert out["token_ids"] == rows.argmax(-1).tolist()   # greedy: the reference's choices
        sampled = rows.gather(1, torch.tensor(out["token_ids"])[:, None])[:, 0]
        assert max_gap(out["logprobs"], sampled.tolist()) <= 1e-5


def test_partial_rollout_across_refit(engine, new_weights, tiny_model_path, push_weights):
    """Seeded requests kept across a refit; their KV is recomputed on resume. 24 requests of > 100 tokens
    at the refit need more than vLLM's 2048-token step budget to recompute: with chunked prefill the last
    one's recomputation is split, and vLLM's CPU sampler cannot rewind its seeded generator (the engine
    core died with "CPU Generator does not use offset"), so CPU engines run without chunked prefill."""
    n, prompt = 24, PROMPTS[0]
    long = {**SAMPLED, "max_tokens": 200, "ignore_eos": True}
    refs = [engine.generate.remote(prompt, {**long, "seed": 100 + i}, f"partial-{i}") for i in range(n)]
    # A request sent after them returns once the batch has taken 100 decode steps, so the refit lands
    # after the long requests sampled > 100 tokens on version 0 and well before their end.
    ray.get(engine.generate.remote(prompt, {**SAMPLED, "max_tokens": 100, "ignore_eos": True, "seed": 0}))
    try:
        push_weights([engine], new_weights[0], 1)
        outs = ray.get(refs)
    finally:
        push_weights([engine], initial_weights(tiny_model_path), 0)
    switched = 0
    for out in outs:
        assert out["finish_reason"] == "length" and len(out["token_ids"]) == 200   # none dropped or cut
        k = out["versions"].count(0)
        assert out["versions"] == [0] * k + [1] * (200 - k)
        switched += 0 < k < 200
        # each token keeps the logprob of the policy that sampled it
        old = hf_logprobs(tiny_model_path, prompt, out["token_ids"])
        new = hf_logprobs(new_weights[1], prompt, out["token_ids"])
        ref = torch.tensor(old[:k] + new[k:])
        assert (torch.tensor(out["logprobs"]) - ref).abs().max().item() <= 1e-5
    assert switched == n
    # the tokens before the swap are exactly what version 0 samples for the same seed: nothing repeated
    replay = ray.get(engine.generate.remote(prompt, {**long, "seed": 100}))
    k0 = outs[0]["versions"].count(0)
    assert replay["token_ids"][:k0] == outs[0]["token_ids"][:k0]


def autocast_logprobs(path: str, prompt: list[int], ids: list[int]) -> list[float]:
    """Sampled-token logprobs as the CPU trainer computes them for model.dtype=bfloat16: fp32 weights
    under bf16 autocast."""
    model = hf_model(path)
    seq = torch.tensor([prompt + ids])
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        logp = torch.log_softmax(model(seq).logits[0].float(), dim=-1)
    return [logp[len(prompt) + j - 1, t].item() for j, t in enumerate(ids)]


def test_bfloat16_engine_takes_a_bfloat16_refit(own_engines, new_weights, tiny_model_path, push_weights):
    """model.dtype=bfloat16 on CPU: a bf16 engine, refitted with the bf16 tensors the trainer streams,
    samples with the new weights: its logprobs are within bf16 noise of the trainer's autocast forward
    of the weights it holds (max 0.006 measured) and far from the other weights' (mean 0.02), before
    and after the refit. Refitting the old weights instead fails it (max gap 0.056)."""
    engine, loading = own_engines["bf16"]
    ray.get(loading, timeout=600)
    sampling = {**SAMPLED, "max_tokens": 24, "seed": 3}
    try:
        before = generate_all(engine, sampling)
        push_weights([engine], {k: v.to(torch.bfloat16) for k, v in new_weights[0].items()}, 1)
        after = generate_all(engine, sampling)
    finally:
        ray.get(engine.shutdown.remote())
        ray.kill(engine)
    for outs, version, held, other in ((before, 0, tiny_model_path, new_weights[1]),
                                       (after, 1, new_weights[1], tiny_model_path)):
        for out, prompt in zip(outs, PROMPTS, strict=True):
            assert out["versions"] == [version] * len(out["token_ids"])
            engine_logp = torch.tensor(out["logprobs"])
            gap = (engine_logp - torch.tensor(autocast_logprobs(held, prompt, out["token_ids"]))).abs()
            off = (engine_logp - torch.tensor(autocast_logprobs(other, prompt, out["token_ids"]))).abs()
            fp32 = (engine_logp - torch.tensor(hf_logprobs(held, prompt, out["token_ids"]))).abs()
            assert gap.max() <= 0.01 and off.mean() >= 5 * gap.mean(), (gap, off)
            assert fp32.max() > 1e-4    # the engine runs bf16 (an fp32 one is within 1e-5 of this)


def test_eval_sampling_uses_eval_params(direct, engine, engine_spec):
    spec = engine_spec.rollout.model_copy(update={"eval": engine_spec.rollout.eval.model_copy(
        update={"temperature": 0.0, "max_tokens": 5, "n": 3})})
    sampling = spec.eval.request()
    assert "n" not in sampling and spec.request()["temperature"] == 1.0
    out = ray.get(engine.generate.remote(PROMPTS[1], sampling))
    assert out["token_ids"] == ray.get(direct)[0][1][1][0][:5]      # greedy, 5 tokens


def test_engine_runs_in_its_actor_with_the_planned_threads(engine, engine_spec):
    """vLLM's engine core and its worker run in the engine actor's own process (no child process: one
    vLLM import per engine), with the threads `molt.plan.placement.cpu_threads` plans (the rule itself
    and the trainer's side: tests/test_config.py)."""
    from molt.plan.placement import cpu_threads

    def layout(actor) -> tuple:
        import psutil

        return (type(actor.llm.engine_core).__name__, os.environ.get("OMP_NUM_THREADS"),
                [p.name() for p in psutil.Process().children(recursive=True)],
                os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"))

    client, omp, children, nccl = ray.get(engine.__ray_call__.remote(layout))
    assert client == "InprocClient" and omp == str(cpu_threads(engine_spec, "engine", 0))
    assert nccl == "1"   # a dead NCCL peer ends the collective (molt.plan.placement.NCCL_ENV)
    assert not [name for name in children if "EngineCore" in name], children
