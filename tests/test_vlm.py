"""Vision-language RL on the tiny Qwen2.5-VL: images through the contract, engine vs trainer, frozen tower."""

from __future__ import annotations

import asyncio
import io

import pytest
import torch
from trainerlib import full_weights, one_rank

from molt.inputs.vision import collapse, data_url, normalize, pixel_inputs, processor
from molt.trajectory import Segment


def png(size: tuple[int, int], seed: int) -> bytes:
    """A small drawing (a triangle on a tinted background), different for each seed and size."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", size, (255 - 20 * seed, 240, 230))
    w, h = size
    ImageDraw.Draw(image).polygon([(4, h - 4), (w - 4, h - 4), (w // 3 + seed, 4)], outline=(0, 0, 0))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def test_tiny_vlm_folder_loads_offline(vlm_path) -> None:
    """molt.inputs.tiny's VLM folder: transformers' auto classes load model and processor (Pillow images, no
    torchvision), and the chat template renders an image part as one vision placeholder."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(vlm_path)
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    proc = processor(vlm_path, True)
    messages, images = normalize([{"role": "user", "content": [
        {"type": "image", "image": png((60, 50), 0)}, {"type": "text", "text": "What is the angle?"}]}])
    text = proc.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.count("<|vision_start|><|image_pad|><|vision_end|>") == 1
    grid = pixel_inputs(proc, images)["image_grid_thw"]
    assert grid.tolist() == [[1, 4, 4]]   # 60x50 -> 56x56 (4 merged tiles, the minimum) -> 4 tokens


def test_images_in_rows_become_data_urls(tmp_path) -> None:
    """A row's image may be a path (relative to the dataset file), bytes or any of the wire shapes; all
    load as data URLs of the same bytes, and a missing file fails naming the row."""
    import json

    from molt.inputs.data import PromptDataset
    from molt.spec import DataSpec

    raw = png((40, 30), 1)
    (tmp_path / "a.png").write_bytes(raw)
    url = data_url(raw)
    rows = [{"messages": [{"role": "user", "content": [{"type": "image", "image": "a.png"}]}], "label": 1},
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}],
             "label": 2},
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {
                "type": "base64", "media_type": "image/png", "data": url.split(",")[1]}}]}], "label": 3}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    items = PromptDataset(tmp_path / "d.jsonl", DataSpec())
    assert [i["messages"][0]["content"] for i in items] == [[{"type": "image", "image": url}]] * 3
    import pyarrow as pa
    import pyarrow.parquet as pq

    parts = [{"type": "image", "image": raw, "text": None}, {"type": "text", "image": None, "text": "q"}]
    pq.write_table(pa.Table.from_pylist([{"messages": [{"role": "user", "content": parts}], "label": "1"}]),
                   tmp_path / "d.parquet")
    [row] = PromptDataset(tmp_path / "d.parquet", DataSpec())
    assert row["messages"][0]["content"][0] == {"type": "image", "image": url}
    rows[0]["messages"][0]["content"][0]["image"] = "missing.png"
    (tmp_path / "d.jsonl").write_text(json.dumps(rows[0]) + "\n")
    with pytest.raises(ValueError, match=r"d.jsonl:1: .*image file not found: 'missing.png'"):
        PromptDataset(tmp_path / "d.jsonl", DataSpec())


def test_placeholder_count_must_match_the_images(vlm_path) -> None:
    """The trainer refuses a segment whose expanded placeholders are not what its images expand to."""
    from molt.trainer import make_batch
    from molt.trainer.batch import add_images

    proc = processor(vlm_path, True)
    pad = proc.image_token_id
    ids = [1, 5, pad, pad, pad, 7, 9]    # one image of 4 tokens, but only 3 placeholders
    seg = Segment(ids, [0] * 6 + [1], [0.0] * 6 + [-1.0], [-1] * 6 + [0], "r", "g",
                  images=[data_url(png((60, 50), 0))])
    with pytest.raises(ValueError, match="3 image placeholder tokens, but its 1 image"):
        add_images(make_batch([seg]), [seg], proc)
    assert collapse([1, pad, pad, 3, pad, 4], pad) == [1, pad, 3, pad, 4]


class ImageSampler:
    """The Dispatcher over the VLM engine, keeping every request's images and the engine's result."""

    def __init__(self, engine) -> None:
        from molt.rollout.dispatch import Dispatcher

        self.dispatcher, self.calls = Dispatcher([engine]), []

    async def generate(self, prompt_ids, sampling, key, images=None) -> dict:
        out = await self.dispatcher.generate(prompt_ids, {**sampling, "seed": len(self.calls)}, key, images)
        self.calls.append({"images": list(images or []), "out": out})
        return out


def test_images_through_both_wires_reach_the_engine(vlm_engine, vlm_spec, vlm_path) -> None:
    """An OpenAI `image_url` part and an Anthropic `image` block (the second one inside a tool result)
    on the loopback server reach the engine with the request; the rollout is one segment holding both
    images, expanded as the engine expanded them."""
    import anthropic
    import openai
    from transformers import AutoTokenizer

    from molt.agents import ChatAgent, ChatAgentRunner, Result

    first, second = data_url(png((60, 50), 0)), data_url(png((90, 70), 2))

    class OpenAIImages(ChatAgent):
        async def run(self, ctx):
            client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key)
            messages = list(ctx.messages)
            reply = await client.chat.completions.create(model=ctx.model_name, messages=messages)
            messages += [reply.choices[0].message.model_dump(exclude_none=True),
                         {"role": "user", "content": [{"type": "image_url", "image_url": {"url": second}}]}]
            await client.chat.completions.create(model=ctx.model_name, messages=messages)
            return Result(reward=1.0)

    class AnthropicImages(ChatAgent):
        async def run(self, ctx):
            client = anthropic.AsyncAnthropic(base_url=ctx.session_url, api_key=ctx.api_key)
            block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                 "data": first.split(",")[1]}}
            messages = [{"role": "user", "content": [block, {"type": "text", "text": "angle?"}]}]
            reply = await client.messages.create(model=ctx.model_name, messages=messages, max_tokens=8)
            text = "".join(b.text for b in reply.content if b.type == "text") or "x"
            block = {**block, "source": {**block["source"], "data": second.split(",")[1]}}
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": [block]}]
            await client.messages.create(model=ctx.model_name, messages=messages, max_tokens=8)
            return Result(reward=1.0)

    tok = AutoTokenizer.from_pretrained(vlm_path)
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    item = {"messages": normalize([{"role": "user", "content": [
        {"type": "image", "image": first}, {"type": "text", "text": "angle?"}]}])[0], "label": None}
    for agent in (OpenAIImages, AnthropicImages):
        spec = vlm_spec.model_copy(deep=True)
        spec.agent.max_turns = 2
        runner, sampler = ChatAgentRunner(agent), ImageSampler(vlm_engine)
        runner.setup(tok, spec)
        try:
            rollout = asyncio.run(runner.run(item, "r0", "g", sampler))
        finally:
            runner.close()
        assert rollout.error is None, rollout.error
        assert [c["images"] for c in sampler.calls] == [[first], [first, second]]
        [segment] = rollout.segments
        assert segment.images == [first, second] and segment.token_ids.count(pad) == 4 + 6
        last = sampler.calls[-1]["out"]
        assert segment.token_ids == last["prompt_ids"] + last["token_ids"]


def run_image_env(vlm_engine, vlm_spec, vlm_path) -> tuple[list, list[dict]]:
    """Two rollouts of a 2-turn Env on the engine: an image prompt, then an observation with a second
    image; returns the rollouts and every engine result."""
    from transformers import AutoTokenizer

    from molt.agents.env import Env, Result, StepEnvRunner
    from molt.rollout.dispatch import Dispatcher

    class LookAgain(Env):
        async def step(self, state):
            if state.turn == 0:
                return Result(0.0, {"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": data_url(png((90, 70), 2))}},
                    {"type": "text", "text": "and now?"}]}, terminated=False)
            return Result(1.0)

    dispatcher, results = Dispatcher([vlm_engine]), []

    class Sampler:
        async def generate(self, prompt_ids, sampling, key, images=None):
            out = await dispatcher.generate(prompt_ids, {**sampling, "seed": len(results)}, key, images)
            results.append(out)
            return out

    spec = vlm_spec.model_copy(deep=True)
    spec.agent.max_turns, spec.rollout.temperature = 2, 0.7
    runner = StepEnvRunner(LookAgain)
    runner.setup(AutoTokenizer.from_pretrained(vlm_path), spec)
    item = {"messages": [{"role": "user", "content": [{"type": "image", "image": png((60, 50), 0)},
                                                      {"type": "text", "text": "What is the angle?"}]}],
            "label": None}

    async def both():
        return [await runner.run(item, f"r{i}", "g", Sampler()) for i in range(2)]
    return asyncio.run(both()), results


def test_image_prompt_engine_matches_trainer(ray_session, vlm_engine, vlm_spec, vlm_path) -> None:
    """Invariants 1 and 3 with images: the segment's ids are the engine's own expanded prompt + samples
    (each image placeholder expanded to its patch count, checked against the image processor), and the
    trainer's forward on them (pixels from the segment's images) reproduces every sampled token's
    logprob (fp32, max). With model.freeze_vision a train step moves the language model only."""
    from molt.trainer import make_batch
    from molt.trainer.batch import add_images

    rollouts, results = run_image_env(vlm_engine, vlm_spec, vlm_path)
    proc = processor(vlm_path, True)
    pad = proc.image_token_id
    segments = [s for r in rollouts for s in r.segments]
    assert [r.error for r in rollouts] == [None, None] and len(segments) == 2
    for k, seg in enumerate(segments):
        first, second = results[2 * k], results[2 * k + 1]
        assert seg.token_ids[:len(second["prompt_ids"])] == second["prompt_ids"]
        assert seg.token_ids[:len(first["prompt_ids"])] == first["prompt_ids"]
        assert len(seg.images) == 2
        counts = pixel_inputs(proc, seg.images)["image_grid_thw"].prod(-1) // 4
        expanded, k_image = [], 0
        for t in collapse(seg.token_ids, pad):   # an independent expansion by the image processor
            expanded += [t] * (int(counts[k_image]) if t == pad else 1)
            k_image += t == pad
        assert expanded == seg.token_ids and seg.token_ids.count(pad) == int(counts.sum()) == 4 + 6

    batch = make_batch(segments, versions=[[float(v) for v in s.versions] for s in segments])
    add_images(batch, segments, proc)
    sampled = batch["loss_mask"] > 0
    assert not (sampled & (batch["input_ids"] == pad)).any()
    spec = vlm_spec.model_copy(deep=True)
    spec.model.freeze_vision, spec.train.lr = True, 1e-2
    spec.rollout.temperature = 0.7
    with one_rank(spec) as rank:
        logp = rank.forward(batch)
        assert (logp - batch["behaviour_logp"])[sampled].abs().max().item() <= 1e-5
        before = full_weights(rank)
        batch["advantages"] = torch.where(sampled, 1.0, 0.0)
        metrics = rank.update(batch)
        after = full_weights(rank)
    assert metrics["mismatch/max_abs"] <= 1e-5
    visual = [k for k in before if ".visual." in k or k.startswith("visual.")]
    assert visual and all(torch.equal(before[k], after[k]) for k in visual)
    assert any(not torch.equal(before[k], after[k]) for k in before if k not in visual)


def test_three_step_vlm_run_trains_and_its_dump_replays(tmp_path, ray_session) -> None:
    """experiments/tiny_vlm_geo.yaml for 3 steps: every step trains on image prompts with the engine's
    logprobs reproduced after each refit (mismatch max <= 1e-5), the dump keeps the images, and
    replaying step 1's dump on the initial weights reproduces its loss and gradient norm."""
    import json

    from molt.driver.compose import compose
    from molt.driver.loop import train
    from molt.driver.metrics import load_rollouts
    from molt.driver.replay import replay
    from molt.spec.config import spec_yaml

    # A random-init model answers no diagram, so every advantage is 0; the entropy bonus gives the steps
    # a gradient, so the weights move and every refit is checked by the next step's mismatch.
    spec = compose(["+experiment=tiny_vlm_geo", "train.steps=3", "train.eval_every=0", "logging.plots=false",
                    "logging.progress=false", "logging.wandb.mode=disabled", "rollout.temperature=0.7",
                    "algo.loss.entropy_coef=0.01"])
    spec.run.dir = str(tmp_path)
    (tmp_path / "spec.yaml").write_text(spec_yaml(spec))   # as the launcher writes it; replay reads it
    train(spec)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["mismatch/max_abs"] <= 1e-5 and r["tokens/trained"] > 0 and r["train/grad_norm"] > 0
    dumped = load_rollouts(tmp_path / "rollouts" / "step_000001.jsonl")
    assert all(len(s.images) == 1 for r in dumped for s in r.segments)
    replayed = replay(tmp_path, 1)
    for key in ("train/loss", "train/grad_norm", "mismatch/mean_abs", "tokens/trained"):
        assert replayed[key] == pytest.approx(rows[0][key], rel=1e-4, abs=1e-6), key


@pytest.mark.parametrize("role", ["policy", "reference"])
def test_the_gpu_loader_freezes_the_tower_before_it_shards(vlm_spec, vlm_path, role) -> None:
    """On cuda AutoModel's loader shards as it loads, and makes a frozen tower one FSDP unit only if it is
    frozen by then: the trainer hands it a freeze of the same tower the CPU path freezes before
    `parallelize_model` (model.freeze_vision; the reference's whole model is frozen there). Applied by
    AutoModel's own freezing to the Hugging Face class, it freezes exactly the parameters `_prepare` does
    (all the tower's, nothing else)."""
    from nemo_automodel.components.utils.model_utils import apply_parameter_freezing
    from transformers import AutoModelForImageTextToText

    from molt.trainer.model import _prepare, automodel_kwargs

    spec = vlm_spec.model_copy(deep=True)
    spec.model.freeze_vision = True
    kwargs = automodel_kwargs(spec, role, vlm_path)

    def frozen(model) -> set[str]:
        return {n for n, p in model.named_parameters() if not p.requires_grad}

    gpu = AutoModelForImageTextToText.from_pretrained(vlm_path)
    apply_parameter_freezing(gpu, kwargs["freeze_config"], strict=True)
    cpu = AutoModelForImageTextToText.from_pretrained(vlm_path)
    _prepare(cpu, spec, "policy")
    tower = {n for n, _ in gpu.named_parameters() if n.startswith("model.visual.")}
    assert tower and frozen(gpu) == frozen(cpu) == tower
    spec.model.freeze_vision = False   # a trained tower: nothing frozen before sharding for the policy
    assert ("freeze_config" in automodel_kwargs(spec, role, vlm_path)) == (role == "reference")


def test_a_rank_without_an_image_still_runs_a_sharded_tower_in_order(vlm_path) -> None:
    """A trainable tower on several ranks is sharded per block: a rank whose micro-batch holds no image
    must still run it, or its peers wait in gathers it never joins (gloo fails with "collective mismatch",
    NCCL hangs; seen with 2 CPU ranks before `tower_in_every_forward`). Its placeholder pass runs where a
    real image's does, after the embedding and before the first decoder layer (FSDP's gathers follow that
    order), changes no logit, and gives the tower gradients of exactly 0 (its reduce-scatter runs too).
    The 2-rank step itself: bench/gpu_checks.py item5, run on CPU by the slow test_bench.py test."""
    import sys
    from pathlib import Path

    from transformers import AutoModelForImageTextToText

    from molt.trainer.batch import image_inputs
    from molt.trainer.tower import tower_in_every_forward

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from gpu_smoke_models import image_batch

    model = AutoModelForImageTextToText.from_pretrained(vlm_path, dtype=torch.float32)
    inner = model.model
    order: list[str] = []
    for name, module in (("embed", inner.language_model.embed_tokens), ("tower", inner.visual),
                         ("layer0", inner.language_model.layers[0])):
        module.register_forward_pre_hook(lambda m, a, name=name: order.append(name))
    batch = image_batch(vlm_path)
    keys = ("input_ids", "attention_mask")

    def forward(rows: slice, placeholder: bool) -> torch.Tensor:
        order.clear()
        mb = {k: v[rows] for k, v in batch.items()}
        with tower_in_every_forward(model, placeholder):
            return model(**{k: mb[k] for k in keys}, **image_inputs(mb, model.config.image_token_id)).logits

    forward(slice(0, 2), False)           # rows with an image
    with_image = list(order)
    plain = forward(slice(2, 4), False)   # rows without: the tower is skipped
    assert "tower" not in order
    logits = forward(slice(2, 4), True)
    assert order == with_image == ["embed", "tower", "layer0"]
    assert torch.equal(logits, plain)
    logits.sum().backward()
    grads = [p.grad for p in inner.visual.parameters()]
    assert all(g is not None and not g.any() for g in grads)
