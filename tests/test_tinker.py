"""molt.tinker: the Tinker API through the pinned `tinker` SDK, over HTTP, against the session's vLLM engine
and trainer ranks the service starts per training model (docs/tinker.md).

One service for the module (a thread of this process, the session's engine); its engine goes back to the
initial weights as version 0 at the end. The service trains one model at a time: `Clients` closes the
last client before it opens the next.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
import tinker
import torch
from safetensors.torch import load_file
from tinker import types

os.environ.setdefault("TINKER_API_KEY", "tml-local")   # the SDK wants one; the service checks none
os.environ.setdefault("TINKER_TELEMETRY", "0")

pytestmark = pytest.mark.timeout(600)


class Clients:
    """The live ServiceClient and its training client; opening another closes it (and releases its model)."""

    def __init__(self, url: str, base_model: str) -> None:
        self.url, self.base_model, self.service, self.training, self.lora = url, base_model, None, None, None

    def open(self, rank: int, **flags) -> tinker.TrainingClient:
        if self.training is not None and (rank, flags) == self.lora:
            return self.training
        self.close()
        self.service = tinker.ServiceClient(base_url=self.url)
        self.training = self.service.create_lora_training_client(self.base_model, rank=rank, seed=0,
                                                                 **flags).result()
        self.lora = (rank, flags)
        return self.training

    def from_state(self, path: str) -> tinker.TrainingClient:
        self.close()
        self.service = tinker.ServiceClient(base_url=self.url)
        self.training = self.service.create_training_client_from_state_with_optimizer(path).result()
        self.lora = (self.training.get_info().lora_rank or 0, {})
        return self.training

    def close(self) -> None:
        if self.service is not None:
            self.service.close("success").result()
        self.service, self.training, self.lora = None, None, None


@pytest.fixture(scope="module")
def served(ray_session, engine, engine_spec, tmp_path_factory, push_weights, tiny_model_path):
    from molt.tinker.serve import served_spec, serving, start_service

    spec = engine_spec.model_copy(update={"run": engine_spec.run.model_copy(update={
        "dir": str(tmp_path_factory.mktemp("tinker"))})})
    service = start_service(served_spec(spec), engines=[engine])
    clients = None
    try:
        with serving(service) as url:
            clients = Clients(url, service.base_model)
            yield service, clients
            clients.close()
    finally:
        push_weights([engine], load_file(f"{tiny_model_path}/model.safetensors"), 0)


def rollout_datums(prompt: types.ModelInput, result: types.SampleResponse,
                   advantages: list[float]) -> list[types.Datum]:
    """A cookbook RL datum per sample: input = prompt + sample[:-1], targets shifted by one, the prompt's
    positions with a placeholder target, sampling logprob 0 and advantage 0."""
    ob = prompt.length - 1
    return [types.Datum(
        model_input=prompt.append(types.EncodedTextChunk(tokens=s.tokens[:-1])),
        loss_fn_inputs={"target_tokens": [0] * ob + s.tokens, "logprobs": [0.0] * ob + s.logprobs,
                        "advantages": [0.0] * ob + [a] * len(s.tokens)})
        for s, a in zip(result.sequences, advantages, strict=True)]


def logprobs_of(output: types.ForwardBackwardOutput) -> list[np.ndarray]:
    return [np.asarray(o["logprobs"].data, dtype=np.float64) for o in output.loss_fn_outputs]


def test_capabilities_info_and_tokenizer(served) -> None:
    from molt.spec.user_modules import REPO_ROOT

    # the SDK these tests drive is the version the service serves (pyproject.toml's tinker extra)
    pinned = re.search(r'"tinker==([0-9.]+)"', (REPO_ROOT / "pyproject.toml").read_text())[1]
    assert tinker.__version__ == pinned
    service, clients = served
    [model] = tinker.RestClient(base_url=clients.url).get_server_capabilities().result().supported_models
    assert model.model_name == service.base_model and model.trainable and model.sampleable
    # the tiny model ties its output head to its embeddings: an adapter on the head alone is refused
    with pytest.raises(Exception, match="tie_word_embeddings"):
        clients.open(4)
    training = clients.open(4, train_unembed=False)
    info = training.get_info()
    assert (info.is_lora, info.lora_rank, info.model_data.model_name) == (True, 4, service.base_model)
    assert training.get_tokenizer().decode(training.get_tokenizer().encode("repeat the letter")) == \
        "repeat the letter"


@pytest.fixture(scope="module")
def rollout(served):
    """A LoRA model's first sampler (its weights refit as a new version) and four seeded samples of it."""
    service, clients = served
    training = clients.open(4, train_unembed=False)
    prompt = types.ModelInput.from_ints(training.get_tokenizer().encode("repeat the letter: a"))
    sampler = training.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=3)
    result = sampler.sample(prompt, 4, params, include_prompt_logprobs=True).result()
    return training, sampler, prompt, params, result


def test_samples_carry_the_engines_logprobs_and_prompt_logprobs(rollout) -> None:
    training, sampler, prompt, params, result = rollout
    assert [len(s.tokens) for s in result.sequences] == [len(s.logprobs) for s in result.sequences]
    assert len({tuple(s.tokens) for s in result.sequences}) > 1   # one seed, four different samples
    assert result.prompt_logprobs[0] is None and len(result.prompt_logprobs) == prompt.length
    assert sampler.sample(prompt, 4, params).result().sequences[2].tokens == result.sequences[2].tokens
    scored = sampler.compute_logprobs(prompt).result()
    assert np.allclose(scored[1:], result.prompt_logprobs[1:], atol=1e-6)


def test_a_forward_scores_the_engines_tokens_with_the_gap_measured(rollout) -> None:
    """The trainer scores the engine's tokens with the weights the engine sampled them with: invariant 3,
    measured on exactly those tokens (the sampled ones, not the prompt's placeholder targets)."""
    training, sampler, prompt, params, result = rollout
    data = rollout_datums(prompt, result, [1.0, -1.0, 0.5, 0.0])
    out = training.forward(data, "importance_sampling").result()
    ob = prompt.length - 1
    for got, s in zip(logprobs_of(out), result.sequences, strict=True):
        assert np.abs(got[ob:] - np.asarray(s.logprobs)).max() < 1e-5
    assert out.metrics["mismatch/tokens:sum"] == sum(len(s.tokens) for s in result.sequences)
    assert out.metrics["mismatch/max_abs:max"] < 1e-5


def test_served_losses_are_their_formulas(rollout) -> None:
    """Each served loss against its formula on the returned logprobs (forwards, no step), with sampling
    logprobs moved by -/+0.3 so that the ratios reach outside the clip band; and a custom loss."""
    training, sampler, prompt, params, result = rollout
    data = rollout_datums(prompt, result, [1.0, -1.0, 0.5, 0.0])
    lp = logprobs_of(training.forward(data, "importance_sampling").result())
    shift = [np.where(np.arange(len(p)) % 2, 0.3, -0.3) * (np.asarray(d.loss_fn_inputs["logprobs"].data) != 0)
             for p, d in zip(lp, data, strict=True)]
    q = [np.asarray(d.loss_fn_inputs["logprobs"].data) + s for d, s in zip(data, shift, strict=True)]
    data = [types.Datum(model_input=d.model_input, loss_fn_inputs={**d.loss_fn_inputs, "logprobs": list(x)})
            for d, x in zip(data, q, strict=True)]
    adv = [np.asarray(d.loss_fn_inputs["advantages"].data) for d in data]
    ratio = [np.exp(p - s) for p, s in zip(lp, q, strict=True)]
    expected = {
        "importance_sampling": -sum((r * a).sum() for r, a in zip(ratio, adv, strict=True)),
        "ppo": -sum(np.minimum(r * a, np.clip(r, 0.9, 1.05) * a).sum()
                    for r, a in zip(ratio, adv, strict=True)),
        "cispo": -sum((np.clip(r, 0.9, 1.05) * a * p).sum() for r, a, p in zip(ratio, adv, lp, strict=True)),
        "dro": -sum((a * p - 0.5 * 0.3 * (p - s) ** 2).sum() for a, p, s in zip(adv, lp, q, strict=True)),
    }
    clip = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05}
    for loss, config in [("importance_sampling", None), ("ppo", clip), ("cispo", clip),
                         ("dro", {"beta": 0.3})]:
        got = training.forward(data, loss, config).result().metrics["loss:sum"]
        assert got == pytest.approx(expected[loss], rel=1e-5, abs=1e-5), loss
    ob = prompt.length - 1
    weights = [[0.0] * ob + [1.0] * len(s.tokens) for s in result.sequences]
    ce = [types.Datum(model_input=d.model_input, loss_fn_inputs={
        "target_tokens": d.loss_fn_inputs["target_tokens"], "weights": w})
        for d, w in zip(data, weights, strict=True)]
    assert training.forward(ce, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(
        -sum((p * np.asarray(w)).sum() for p, w in zip(lp, weights, strict=True)), rel=1e-5)

    def squared(batch, logprobs):   # forward_backward_custom: a cross_entropy backward of its gradient
        loss = sum((x ** 2).sum() for x in logprobs)
        return loss, {"custom/squared:sum": float(loss.detach())}
    custom = training.forward_backward_custom(ce, squared).result()
    assert custom.metrics["loss:sum"] == pytest.approx(sum((p ** 2).sum() for p in lp), rel=1e-5)


def test_a_step_and_a_refit_make_a_version_the_old_sampler_may_not_sample(served, rollout) -> None:
    service, clients = served
    training, sampler, prompt, params, result = rollout
    training.forward_backward(rollout_datums(prompt, result, [1.0, -1.0, 0.5, 0.0]), "ppo").result()
    step = training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    assert step.metrics["train/grad_norm"] > 0 and step.metrics["mismatch/max_abs"] < 1e-5
    named = training.save_weights_for_sampler("after-one-step").result()
    assert named.path.endswith("/sampler_weights/after-one-step")
    with pytest.raises(Exception, match="engines now hold policy version"):
        sampler.sample(prompt, 1, params).result()
    fresh = clients.service.create_sampling_client(model_path=named.path).result()
    again = fresh.sample(prompt, 2, params).result()
    moved = logprobs_of(training.forward(rollout_datums(prompt, again, [1.0, 1.0]), "importance_sampling")
                        .result())
    ob = prompt.length - 1
    assert max(np.abs(m[ob:] - np.asarray(s.logprobs)).max()
               for m, s in zip(moved, again.sequences, strict=True)) < 1e-5
    # the service logged the step, with the trainer/engine gap on the engine's tokens
    logged = [json.loads(line) for line in open(f"{service.spec.run.dir}/metrics.jsonl")]
    assert logged[-1]["mismatch/max_abs"] < 1e-5
    assert logged[-1]["train/grad_norm"] == step.metrics["train/grad_norm"]


def test_unsupported_requests_are_refused_by_name(served) -> None:
    service, clients = served
    training = clients.open(4, train_unembed=False)
    tok = training.get_tokenizer()
    ids = tok.encode("repeat the letter: b b")
    datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})
    refusals = [
        (lambda: training.forward([datum], "gspo"), "loss_fn='gspo' is not served"),
        (lambda: training.forward([datum], "ppo", {"clip_epsilon": 0.1}), "'clip_epsilon' is not served"),
        (lambda: training.forward([datum], "dro"), r"needs loss_fn_config\['beta'\]"),
        (lambda: training.forward([datum], "importance_sampling"), r"needs loss_fn_inputs \['advantages'"),
        (lambda: training.forward([types.Datum(model_input=datum.model_input, loss_fn_inputs={
            **datum.loss_fn_inputs, "mask": np.ones(len(ids) - 1, np.float32)})], "cross_entropy"),
         r"\['mask'\] is not served"),
    ]
    sampler = training.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(ids)
    refusals += [
        (lambda: sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2, stop=["\n"])),
         "stop as strings is not served"),
        (lambda: sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2), include_prompt_logprobs=True,
                                topk_prompt_logprobs=2), "topk_prompt_logprobs is not served"),
        (lambda: sampler.sample(prompt, 1, types.SamplingParams(max_tokens=5000)),
         "does not fit the context"),
        (lambda: second.create_lora_training_client(service.base_model, rank=4),
         "one training model at a time"),
        (lambda: clients.service.create_sampling_client(base_model="Qwen/Qwen3-8B").result().sample(
            prompt, 1, types.SamplingParams(max_tokens=2)), "base_model='Qwen/Qwen3-8B' is not served"),
    ]
    second = tinker.ServiceClient(base_url=clients.url)
    for call, message in refusals:
        with pytest.raises(Exception, match=message):
            call().result()
    second.close("success").result()
    # a refused request keeps its place: the requests after it run in order
    assert training.forward([datum], "cross_entropy").result().metrics["loss:sum"] > 0


def sft_datums(tok, texts: list[str], mean: bool = False) -> list[types.Datum]:
    """SFT datums of `texts`, every token but the first a target; with `mean` each target weighs 1 / (the
    targets of all texts), the token-mean loss an SFT client takes (the service sums what it is given)."""
    ids = [tok.encode(text) for text in texts]
    weight = 1 / sum(len(x) - 2 for x in ids) if mean else 1.0
    return [types.Datum(model_input=types.ModelInput.from_ints(x[:-1]), loss_fn_inputs={
        "target_tokens": x[1:], "weights": [0.0] + [weight] * (len(x) - 2)}) for x in ids]


def sampler_weights(service, path: str) -> dict[str, torch.Tensor]:
    model, _, name = path.removeprefix("tinker://").split("/")
    return load_file(str(service.checkpoints / model.replace(":", "_") / "sampler_weights" / name /
                         "model-00000.safetensors"))


def test_save_state_then_load_continues_the_loss_curve(served) -> None:
    """Three steps, saved after the first; a new client made from that state (weights and Adam moments)
    takes steps two and three with the same losses."""
    service, clients = served
    training = clients.open(0)
    data = sft_datums(training.get_tokenizer(), ["repeat the letter: c c c c", "answer: 12"])
    adam = types.AdamParams(learning_rate=5e-3)
    losses, saved = [], None
    for step in range(3):
        losses.append(training.forward_backward(data, "cross_entropy").result().metrics["loss:sum"])
        training.optim_step(adam).result()
        if step == 0:
            saved = training.save_state("after-step-1").result().path
    resumed = clients.from_state(saved)
    again = []
    for _ in range(2):
        again.append(resumed.forward_backward(data, "cross_entropy").result().metrics["loss:sum"])
        resumed.optim_step(adam).result()
    assert again == pytest.approx(losses[1:], rel=1e-6)
    assert losses[2] < losses[1] < losses[0]


def test_gradients_accumulate_over_split_calls_until_optim_step(served) -> None:
    """Four datums in one forward_backward, or split over three with a forward and a refit between,
    give the same gradient (<= 1e-6 on every element). Adam's first step is lr * g / (|g| + eps): with
    eps >> |g| it is lr / eps * g, so the weights after one step show the gradient itself, not its sign
    (the step is 100 g, far above the rounding of the weights it is added to; it wrecks the model: this
    test comes last). The loss is the token mean, so the gradient's elements (<= ~1) leave fp32 room."""
    service, clients = served
    training = clients.open(0)   # full fine-tuning: every weight's gradient
    data = sft_datums(training.get_tokenizer(), ["repeat the letter: a a a", "answer: 42",
                                                 "the tool result 7", "user: calculator 3 + 4"], mean=True)
    start = training.save_state("start").result().path
    before = sampler_weights(service, training.save_weights_for_sampler("before").result().path)
    adam = types.AdamParams(learning_rate=1e5, eps=1e3)   # a step of 100 x the gradient

    one = training.forward_backward(data, "cross_entropy").result()
    training.optim_step(adam).result()
    after_one = sampler_weights(service, training.save_weights_for_sampler("one").result().path)

    training.load_state_with_optimizer(start).result()
    parts = [training.forward_backward(data[:1], "cross_entropy").result()]
    training.forward(data, "cross_entropy").result()                         # adds nothing
    training.save_weights_for_sampler("between").result()                     # zeroes nothing
    parts += [training.forward_backward(data[1:3], "cross_entropy").result(),
              training.forward_backward(data[3:], "cross_entropy").result()]
    training.optim_step(adam).result()
    after_split = sampler_weights(service, training.save_weights_for_sampler("split").result().path)

    assert sum(p.metrics["loss:sum"] for p in parts) == pytest.approx(one.metrics["loss:sum"], rel=1e-6)
    gap = {name: float(((after_one[name] - w0) - (after_split[name] - w0)).abs().max()) / 100
           for name, w0 in before.items()}
    largest = max(float((after_one[n] - w0).abs().max()) for n, w0 in before.items()) / 100
    assert 0.01 < largest < 10   # a gradient the steps show, in a range fp32 resolves to 1e-6
    assert max(gap.values()) <= 1e-6, (largest, gap)
