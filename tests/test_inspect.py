"""The rollout inspector: the trainer's side of the dump, and the page in a real headless browser.

One short real run (the tiny model, a two-turn ChatAgent through the OpenAI SDK, 2 sync steps) writes its
dumps; its trainer side is checked against hand computations (GRPO advantages from the dumped rewards, the
importance weight from the two logprobs, the entropy from a plain transformers forward of the same ids),
then one headless Chromium session (Debian's package, driven by Playwright) opens its page, clicks to a
rollout and reads the decoded tokens and the mismatch numbers from the DOM against the dump.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from molt.algo import filter_drops
from molt.driver.compose import compose
from molt.driver.inspect import HEADLESS_CHROMIUM_ARGS, build_page
from molt.driver.metrics import TRAINER_KEY, load_rollouts
from molt.spec import CorrectionSpec
from molt.trainer.token_record import CLIPPED, KEPT, MASKED, NOT_TRAINED, TokenRecord

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"   # Debian's package (install.sh)
RUN = ["agent=chat_minimal", "+agent.options.turns=2", "agent.max_turns=2", "model.max_model_len=512",
       "train.steps=2", "train.prompts_per_step=2", "rollout.samples_per_prompt=4", "rollout.max_tokens=8",
       "train.micro_batch_size=4", "train.save_every=0", "train.eval_every=0", "rollout.temperature=0.8",
       "algo.correction.level=token", "logging.plots=false", "logging.progress=false",
       "logging.wandb.mode=disabled", "rollout.engine.kv_cache_gib=0.25"]


@pytest.fixture(scope="module")
def run(tmp_path_factory, ray_session) -> tuple[Path, str]:
    """The run's directory (with its spec.yaml, as the command writes it) and what it printed."""
    from molt.driver.loop import train
    from molt.spec.config import spec_yaml

    spec = compose(RUN)
    spec.run.dir = str(tmp_path_factory.mktemp("inspect_run"))
    (Path(spec.run.dir) / "spec.yaml").write_text(spec_yaml(spec))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        train(spec)
    return Path(spec.run.dir), printed.getvalue()


@pytest.fixture(scope="module")
def run_dir(run) -> Path:
    return run[0]


def dumped(run_dir: Path, step: int) -> list[dict]:
    path = run_dir / "rollouts" / f"step_{step:06d}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_dump_holds_the_trainer_side_of_every_trained_token(run_dir, tiny_model_path):
    """Step 1 (the initial weights, which sampled every token): ids and mask as the engine's, logprobs within
    1e-5 of the engine's, GRPO advantages as computed by hand from the dumped rewards, the weight equal to
    exp(trainer − engine) (token-level correction, nothing outside the band), the entropy of a plain
    forward."""
    from transformers import AutoModelForCausalLM

    from molt.trainer.model import token_logprobs

    records = dumped(run_dir, 1)
    assert load_rollouts(run_dir / "rollouts" / "step_000001.jsonl")   # the trainer key is left out
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    groups: dict[str, list[float]] = {}
    for r in records:
        groups.setdefault(r["group_id"], []).append(r["reward"])
    multi_turn = 0
    for r in records:
        side = r[TRAINER_KEY]
        assert side["decision"] == "kept" and side["version"] == 0
        rewards = torch.tensor(groups[r["group_id"]])
        advantage = float((r["reward"] - rewards.mean()) / (rewards.std() + 1e-6))
        (seg,), (trained,) = r["segments"], side["segments"]
        assert trained["segment_index"] == seg["segment_index"]
        assert trained["input_ids"] == seg["token_ids"] and trained["loss_mask"] == seg["loss_mask"]
        ids = torch.tensor([seg["token_ids"]])
        with torch.no_grad():
            _, entropy = token_logprobs(model(ids).logits, ids, torch.ones_like(ids), 0.8, entropy=True)
        sampled = [t for t, m in enumerate(seg["loss_mask"]) if m]
        gaps = [trained["logprobs"][t] - seg["logprobs"][t] for t in sampled]
        assert max(map(abs, gaps)) <= 1e-5
        for t, gap in zip(sampled, gaps, strict=True):
            assert trained["advantages"][t] == pytest.approx(advantage, abs=1e-5)
            assert trained["weights"][t] == pytest.approx(math.exp(gap), rel=1e-6)
            assert trained["decisions"][t] == KEPT
            assert trained["entropy"][t] == pytest.approx(float(entropy[0, t]), abs=1e-4)
        assert all(trained["decisions"][t] == NOT_TRAINED for t, m in enumerate(seg["loss_mask"]) if not m)
        # two sampled turns with the user's message between them (mask 0)
        multi_turn += len(seg["turns"]) == 2 and 0 in seg["loss_mask"][seg["turns"][1][1] - 1:]
    assert multi_turn


def test_token_record_decisions_follow_the_correction():
    """The correction's decision per token, against the band by hand: token-level mask rejects rho outside
    [0.9, 1.1]; clip changes the weight of those; padding and unsampled tokens are not trained."""
    behaviour = torch.tensor([[0.0, -1.0, -1.0, -1.0, 0.0]])
    old = torch.tensor([[0.0, -1.0, -0.5, -1.05, 0.0]])   # rho 1, e^0.5, e^-0.05
    mb = {"input_ids": torch.tensor([[5, 6, 7, 8, 0]]), "loss_mask": torch.tensor([[0.0, 1, 1, 1, 0]]),
          "behaviour_logp": behaviour, "advantages": torch.full((1, 5), 0.5),
          "attention_mask": torch.tensor([[1, 1, 1, 1, 0]])}
    for mode, expected in (("mask", [NOT_TRAINED, KEPT, MASKED, KEPT]),
                           ("clip", [NOT_TRAINED, KEPT, CLIPPED, KEPT])):
        record = TokenRecord(1, 5).part(1)
        record.add(mb, old, None, CorrectionSpec(level="token", mode=mode, low=0.9, high=1.1))
        out = record.tensors()
        assert out["decisions"][0, :4].tolist() == expected and "entropy" not in out
        assert out["weights"][0, 2].item() == pytest.approx(0.0 if mode == "mask" else 1.1)
        assert out["input_ids"][0].tolist() == [5, 6, 7, 8, 0]   # the padding position stays 0


def test_filter_drops_names_the_filter_that_dropped_each_rollout():
    from molt.spec import AlgoSpec

    algo = AlgoSpec.model_validate({"filters": {"drop_truncated": True, "drop_equal_rewards": True}})
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 0.2, 0.7, 0.9])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3])
    truncated = torch.tensor([False, False, False, False, True, False, False])
    assert filter_drops(rewards, rewards, groups, truncated, algo) == [
        None, None, "drop_equal_rewards", "drop_equal_rewards", "drop_truncated", "drop_equal_rewards",
        "drop_equal_rewards"]


def copy_run(run_dir: Path, out: Path, trainer_side: bool = True) -> Path:
    """A copy of the run; without `trainer_side` its dumps are as runs before it was recorded wrote them."""
    shutil.copytree(run_dir, out, ignore=shutil.ignore_patterns("inspect.html", "checkpoints"))
    for path in (out / "rollouts").glob("step_*.jsonl") if not trainer_side else ():
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        path.write_text("".join(json.dumps({k: v for k, v in r.items() if k != TRAINER_KEY}) + "\n"
                                for r in lines))
    return out


def vlm_dump(root: Path, spec, path: str) -> tuple[Path, str, int]:
    """A run folder of the tiny VLM with one dumped rollout whose prompt holds an image (4 placeholders)."""
    import base64

    from PIL import Image
    from transformers import AutoConfig

    from molt.spec.config import spec_yaml
    from molt.trajectory import Rollout, Segment

    image_token = AutoConfig.from_pretrained(path).image_token_id
    png = io.BytesIO()
    Image.new("RGB", (4, 4), (200, 30, 30)).save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    ids = [5, 6, *[image_token] * 4, 7, 8, 9, 10]
    mask = [0] * 7 + [1] * 3
    segment = Segment(ids, mask, [-1.0 * m for m in mask], [0 if m else -1 for m in mask], "r0", "g0",
                      prompt_len=7, images=[url])
    (root / "rollouts").mkdir(parents=True)
    (root / "spec.yaml").write_text(spec_yaml(spec))
    rollout = Rollout("r0", "g0", [segment], 1.0)
    (root / "rollouts" / "step_000001.jsonl").write_text(
        json.dumps(dataclasses.asdict(rollout), default=lambda a: a.tolist()) + "\n")
    return root, url, ids.index(image_token)


def shown(text: str) -> str:
    """A token's text as the page writes it in a span: line breaks as ↵, the empty string as ∅."""
    if text == "":
        return "∅"
    return text[:-1] + "↵" if text.endswith("\n") else text.replace("\n", "↵\n")


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """One headless Chromium (Debian's package, a fresh profile) for the module's page tests."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("profile")), executable_path=CHROMIUM, headless=True,
            args=list(HEADLESS_CHROMIUM_ARGS), viewport={"width": 1500, "height": 900})
        yield context
        context.close()


def opened(browser, page_file: Path):
    page = browser.new_page()
    page.goto(page_file.resolve().as_uri())
    page.wait_for_function("window.moltReady !== undefined")
    return page


def test_the_page_shows_a_rollouts_tokens_and_their_mismatch(run, run_dir, browser, tmp_path, tok, capsys):
    """The command the run printed writes the page; clicked to a rollout, the DOM holds every token's text
    (the tokenizer's decoding of the dumped id) and, in the mismatch channel, trainer − engine of the dump."""
    from molt.driver.inspect import main

    assert f"python -m molt.inspect {run_dir}" in run[1]   # the end of the run says how to read it
    assert main([str(run_dir)]) == 0
    assert capsys.readouterr().out.strip() == (run_dir / "inspect.html").resolve().as_uri()
    records = dumped(run_dir, 2)
    # the rollout with the most sampled tokens, not the first one the page opens
    pick = max(range(1, len(records)), key=lambda i: sum(records[i]["segments"][0]["loss_mask"]))
    seg, trained = records[pick]["segments"][0], records[pick][TRAINER_KEY]["segments"][0]
    page = opened(browser, run_dir / "inspect.html")
    assert page.locator("#step-title").inner_text().startswith("Step 2")
    page.click(f'.chips button[data-rollout="{pick}"]')
    assert records[pick]["rollout_id"] in page.locator("#rollout-head").inner_text()
    page.click('button[data-channel="gap"]')
    spans = page.eval_on_selector_all("#tokens .t", "els => els.map(e => [+e.dataset.i, e.textContent, "
                                                    "e.dataset.v === undefined ? null : +e.dataset.v])")
    assert [i for i, _, _ in spans] == list(range(len(seg["token_ids"])))
    for i, text, value in spans:
        assert text == shown(tok.decode([seg["token_ids"][i]], skip_special_tokens=False)), i
        if seg["loss_mask"][i]:
            gap = trained["logprobs"][i] - seg["logprobs"][i]
            assert value == pytest.approx(float(f"{gap:.3g}"), rel=1e-6, abs=1e-12), i
        else:
            assert value is None, i
    sampled = seg["loss_mask"].index(1)
    page.hover(f'#tokens .t[data-i="{sampled}"]')
    tip = page.locator("#tip").inner_text()
    assert f"id {seg['token_ids'][sampled]}" in tip
    assert f"logprob {round(seg['logprobs'][sampled], 4)}" in tip
    assert "sampled at temperature 0.8 top_p 1 top_k -1" in tip   # the run's rollout.temperature=0.8
    page.screenshot(path=str(tmp_path / "rollout.png"))
    assert (tmp_path / "rollout.png").stat().st_size > 10_000

    # the keyboard: next rollout, channel 1, the token cursor's numbers in the detail line
    page.locator("#tokens").focus()
    page.keyboard.press("j")
    following = records[min(pick + 1, len(records) - 1)]["rollout_id"]
    assert following in page.locator("#rollout-head").inner_text()
    page.keyboard.press("1")
    assert page.get_attribute('button[data-channel="mask"]', "aria-pressed") == "true"
    page.keyboard.press("ArrowRight")
    assert "position 0" in page.locator("#detail").inner_text()
    page.close()


def test_a_dump_without_the_trainer_side_opens_with_its_channels_greyed(run_dir, browser, tmp_path):
    page = opened(browser, build_page(copy_run(run_dir, tmp_path / "old", trainer_side=False)))
    for channel in ("gap", "adv", "w", "ent"):
        assert page.is_disabled(f'button[data-channel="{channel}"]'), channel
    assert page.is_enabled('button[data-channel="lp"]')
    page.close()


def test_tokens_the_trainer_trained_but_the_engine_did_not_sample_are_flagged(run_dir, browser, tmp_path):
    """A copy of the run whose trainer side trained the user's message between the two turns (mask 1 where
    the engine's is 0, the fault the page exists for, written into the dump: no code path makes it): the
    rollout's header says so and exactly those tokens are dashed in the loss-mask channel."""
    copy = copy_run(run_dir, tmp_path / "bug")
    path = copy / "rollouts" / "step_000002.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    seg, trained = records[0]["segments"][0], records[0][TRAINER_KEY]["segments"][0]
    between = [t for t in range(seg["turns"][0][1], seg["turns"][1][1]) if not seg["loss_mask"][t]]
    for t in between:
        trained["loss_mask"][t] = 1
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    page = opened(browser, build_page(copy))
    assert "the trainer's loss mask differs from the engine's" in page.locator("#rollout-head").inner_text()
    dashed = page.eval_on_selector_all("#tokens .t.bug", "els => els.map(e => +e.dataset.i)")
    assert dashed == between and between
    page.close()


def test_a_vlm_rollout_shows_its_image_at_its_placeholders(browser, tmp_path, vlm_spec, vlm_path):
    vlm, image_url, first_placeholder = vlm_dump(tmp_path / "vlm", vlm_spec, vlm_path)
    page = opened(browser, build_page(vlm))
    assert page.get_attribute("#tokens img", "src") == image_url
    assert int(page.eval_on_selector("#tokens img", "img => img.nextElementSibling.dataset.i")) == \
        first_placeholder
    page.close()


def test_inspect_refuses_a_folder_without_dumps(tmp_path):
    from molt.driver.inspect import main

    with pytest.raises(SystemExit, match="no rollout dumps"):
        main([str(tmp_path)])
    (tmp_path / "rollouts").mkdir()
    with pytest.raises(SystemExit, match=r"no dump of step\(s\) \[3\]"):
        main([str(tmp_path), "--step", "3"])
