"""SFT: the assistant-token mask through real chat templates, and the SFT loss of real FSDP2 trainer ranks
against a single-process reference. (The `python -m molt.sft` command end to end: tests/test_sft_rl.py.)"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from molt.agents.render import encode, render
from molt.driver.sft_data import load_conversations, sft_batch, tokenize_conversation, tokenize_rows
from molt.spec import DataSpec, RunSpec

TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
CALL = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2+3"}}}


def targets(tok, example) -> list[str]:
    """The trained text, one string per contiguous run of mask-1 tokens."""
    runs, current = [], []
    for t, m in zip(example.token_ids, example.loss_mask, strict=True):
        if m:
            current.append(t)
        elif current:
            runs.append(tok.decode(current))
            current = []
    return runs + ([tok.decode(current)] if current else [])


def qwen3_style(tok):
    """The tiny tokenizer with vLLM's shipped MiniCPM-V 4.5 template: Qwen3's, which drops the <think>
    blocks of assistant turns before the last user message. Its first line forces enable_thinking=false
    (an empty <think> in every generation prompt); without it the template behaves as Qwen3's default."""
    import vllm

    path = Path(vllm.__file__).parent / "transformers_utils" / "chat_templates" / "template_minicpmv45.jinja"
    first, rest = path.read_text().split("\n", 1)
    assert "enable_thinking" in first and "last_query_index" in rest
    copy = tok.__class__.from_pretrained(tok.name_or_path)
    copy.chat_template = rest
    return copy


def test_chatml_tools_mask_is_exactly_the_assistant_turns(tok) -> None:
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"},
            {"role": "assistant", "content": "", "tool_calls": [CALL]}, {"role": "tool", "content": "5"},
            {"role": "assistant", "content": "ANSWER: 5"}, {"role": "user", "content": "And 1+1?"},
            {"role": "assistant", "content": "2"}]
    [example] = tokenize_conversation(tok, conv, TOOLS)   # the tiny ChatML template is append-only
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>'
    # targets end at <|im_end|> (the engine stops there); the tiny template's generation prompt ends
    # before the newline, so the model writes it
    assert targets(tok, example) == [f"\n{call}<|im_end|>", "\nANSWER: 5<|im_end|>", "\n2<|im_end|>"]
    full = render(tok, conv, TOOLS, generation_prompt=False)
    assert tok.decode(example.token_ids) == full
    first = example.loss_mask.index(1)   # the context is the engine's prompt, tokenized as the agents do
    assert example.token_ids[:first] == encode(tok, render(tok, conv[:2], TOOLS))


def test_qwen3_style_template_splits_where_the_history_is_re_rendered(tok) -> None:
    qwen = qwen3_style(tok)
    conv = [{"role": "user", "content": "What is 2+3?"},
            {"role": "assistant", "content": "<think>\nadd\n</think>\n\n5"},
            {"role": "user", "content": "And 1+1?"},
            {"role": "assistant", "content": "<think>\nagain\n</think>\n\n2"}]
    one, two = tokenize_conversation(qwen, conv)
    assert targets(qwen, one) == ["<think>\nadd\n</think>\n\n5<|im_end|>"]
    assert targets(qwen, two) == ["<think>\nagain\n</think>\n\n2<|im_end|>"]
    # the second turn is trained in the context the model sees then: the first turn's <think> dropped
    context = two.token_ids[:two.loss_mask.index(1)]
    assert context == encode(qwen, render(qwen, conv[:3])) and "add" not in qwen.decode(context)
    # a tool call inside one user query keeps the reasoning of earlier turns: one example
    tool_turns = [conv[0],
                  {"role": "assistant", "content": "<think>\nuse it\n</think>\n\n", "tool_calls": [CALL]},
                  {"role": "tool", "content": "5"},
                  {"role": "assistant", "content": "<think>\nok\n</think>\n\n5"}]
    [example] = tokenize_conversation(qwen, tool_turns, TOOLS)
    assert [t.split("</think>")[0] for t in targets(qwen, example)] == ["<think>\nuse it\n", "<think>\nok\n"]


def test_model_chat_template_kwargs_render_the_rows(tok) -> None:
    """model.chat_template_kwargs reach the template (sft/loop.py passes them): with Qwen3's
    enable_thinking=false its generation prompt holds the empty think block, which becomes context."""
    qwen = qwen3_style(tok)
    conv = [{"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": "5"}]
    [default] = tokenize_conversation(qwen, conv)
    [off] = tokenize_conversation(qwen, conv, None, {"enable_thinking": False})
    assert targets(qwen, default) == ["<think>\n\n</think>\n\n5<|im_end|>"]
    assert targets(qwen, off) == ["5<|im_end|>"]
    assert qwen.decode(off.token_ids[:off.loss_mask.index(1)]).endswith("<think>\n\n</think>\n\n")


def test_bad_conversations_fail_naming_file_and_line(tmp_path: Path, tok) -> None:
    data = DataSpec()
    path = tmp_path / "sft.jsonl"
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    for bad, why in (({"messages": [{"role": "user", "content": "hi"}]}, "no assistant message"),
                     ({"messages": [{"role": "assistant", "content": "yo"}]}, "starts with an assistant"),
                     ({"prompt": "hi"}, "must be a list of"),
                     ({**good, "tools": "calc"}, "list of tool schemas")):
        path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
        with pytest.raises(ValueError, match=f"sft.jsonl:2: malformed row: .*{why}"):
            load_conversations(path, data)
    path.write_text(json.dumps(good) + "\n")
    with pytest.raises(ValueError, match="row 0 renders to .* tokens, above model.max_model_len=4"):
        tokenize_rows(load_conversations(path, data), tok, data, 4, str(path))


def test_sft_step_equals_single_process_nll(ray_session, tiny_model_path, tok) -> None:
    """One SFT step of 2 FSDP2 ranks with micro-batches of 2 = the token-mean NLL of the assistant tokens
    and one AdamW step of a plain single-process model (fp32, 1e-5). rollout.temperature=0.5 and a seq
    loss norm in the spec must not change SFT (the model's own distribution, a token mean)."""
    from trainerlib import full_weights
    from transformers import AutoModelForCausalLM

    from molt.trainer import TrainerRanks

    rng = random.Random(0)
    convs = [[{"role": "user", "content": f"What is {a}+{b}?"},
              {"role": "assistant", "content": str(a + b) * n}]
             for a, b, n in ((rng.randrange(50), rng.randrange(50), rng.randint(1, 4)) for _ in range(7))]
    examples = [e for c in convs for e in tokenize_conversation(tok, c)]
    batch = sft_batch(examples, tok.pad_token_id, 2)
    spec = RunSpec.model_validate({
        "model": {"path": tiny_model_path}, "parallel": {"dp_size": 2},
        "rollout": {"temperature": 0.5}, "algo": {"loss": {"norm": "seq"}},
        "train": {"objective": "sft", "micro_batch_size": 2, "lr": 1e-4, "prompts_per_step": 7}})
    group = TrainerRanks(spec)
    try:
        metrics = group.update(batch)
        weights = full_weights(group)
    finally:
        group.shutdown()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    mask = batch["loss_mask"][:, 1:]
    loss = -(logp * mask).sum() / mask.sum()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), spec.train.grad_clip)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=spec.train.betas, weight_decay=0.0)
    opt.step()
    assert metrics["train/loss"] == pytest.approx(float(loss.detach()), abs=1e-5)
    assert metrics["train/nll"] == pytest.approx(float(loss.detach()), abs=1e-5)
    assert metrics["train/tokens"] == float(mask.sum())
    ref = dict(model.named_parameters())
    assert max(float((weights[k] - ref[k].detach()).abs().max()) for k in weights) <= 1e-5


def test_sft_spec_plan_inputs_and_refusals() -> None:
    from molt.driver.compose import compose, prepare
    from molt.driver.launch import describe_plan
    from molt.spec import SpecError

    spec = compose(["+experiment=rg_sft"])
    plan = describe_plan(spec)
    assert "engines: none" in plan and "sft: 300 steps x 32 conversations" in plan and "engine 0" not in plan
    inputs = prepare(spec).or_raise()   # conversations, tokenized, not prompts: no agent is imported
    assert inputs.runner is None and len(inputs.train) >= 100
    assert sorted(inputs.eval_sets) == ["rg_arith_sft_eval"]
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        prepare(compose(["+experiment=rg_sft", "data.eval=[nope.jsonl]"])).or_raise()
    for bad, why in ((["model.critic=true"], "trains the policy alone"),
                     (["train.best_metric=eval/nope/loss"], "NAME the stem of a data.eval file"),
                     (["train.best_metric=eval/rg_arith_sft_eval/loss", "train.eval_every=0"],
                      "eval_every > 0"),
                     (["data.eval_path=x.jsonl"], "unknown key 'data.eval_path'")):
        with pytest.raises(SpecError, match=why):
            compose(["+experiment=rg_sft", *bad])


REMOTE_TOKENIZER = ("from transformers import PreTrainedTokenizerFast\n\n\n"
                    "class RemoteTokenizer(PreTrainedTokenizerFast):\n    pass\n")


def test_trust_remote_code_reaches_the_sft_tokenizer(tmp_path: Path, tiny_model_path) -> None:
    """A model whose tokenizer is the repository's own code (its config names a model type transformers
    lacks, as custom models do) loads only with model.trust_remote_code: the driver's tokenizer then passes,
    and the SFT run goes on to its next check (run.resume), still before any trainer starts."""
    import shutil

    from molt.driver.compose import prepare
    from molt.driver.sft_loop import train

    model = tmp_path / "remote"
    model.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(Path(tiny_model_path) / name, model / name)
    (model / "config.json").write_text(json.dumps({"model_type": "molt_remote"}))
    (model / "remote_tokenizer.py").write_text(REMOTE_TOKENIZER)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="RemoteTokenizer",
                  auto_map={"AutoTokenizer": [None, "remote_tokenizer.RemoteTokenizer"]})
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    rows = tmp_path / "sft.jsonl"
    rows.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "yo"}]}) + "\n")

    def spec(trust: bool) -> RunSpec:
        return RunSpec.model_validate({
            "model": {"path": str(model), "trust_remote_code": trust},
            "train": {"objective": "sft", "eval_every": 0}, "data": {"train_path": str(rows), "eval": []},
            "run": {"dir": str(tmp_path / "run"), "resume": str(tmp_path / "nowhere")}})

    untrusted = [str(p) for p in prepare(spec(False)).problems]
    assert len(untrusted) == 2 and "contains custom code" in untrusted[1]
    with pytest.raises(FileNotFoundError, match="run.resume=.*nowhere: no checkpoint there"):
        train(spec(True))   # the only problem left


def test_arith_sft_rows_are_the_tokens_the_cookbook_recipe_samples_from(tmp_path: Path) -> None:
    """examples/data/make_arith_sft.py: its base folder's template renders the cookbook's qwen3_instruct
    text (a newline after each <|im_end|> and role, which the tiny template omits; checked token for token
    against the cookbook's renderer when the example was written), and SFT trains exactly the answers."""
    import importlib.util

    from transformers import AutoTokenizer

    path = Path(__file__).resolve().parents[1] / "examples" / "data" / "make_arith_sft.py"
    loaded = importlib.util.spec_from_file_location("make_arith_sft", path)
    writer = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(writer)
    writer.write_base(tmp_path / "base")
    tok = AutoTokenizer.from_pretrained(tmp_path / "base")
    [example] = tokenize_conversation(tok, writer.conversation(47, 38)["messages"])
    assert tok.decode(example.token_ids) == (
        "<|im_start|>user\nWhat is 4 + 5?<|im_end|>\n<|im_start|>assistant\n9<|im_end|>\n"
        "<|im_start|>user\nWhat is 47 + 38?<|im_end|>\n<|im_start|>assistant\n85<|im_end|>\n")
    assert targets(tok, example) == ["9<|im_end|>", "85<|im_end|>"]
