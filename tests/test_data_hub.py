"""Hugging Face datasets as data.train_path / data.eval (molt/inputs/data_hub.py), read by
`datasets.load_dataset` from local copies in the hub's layout (tests/datalib.py), and the math-verify
reward the math recipes use."""

from __future__ import annotations

import asyncio
import base64
import threading
from pathlib import Path

import pytest
from datalib import RECIPE_DATASETS, png, with_local_hub, write_hub_layout

from molt.driver.compose import compose
from molt.inputs.data import PromptDataset, load_eval_sets
from molt.spec import DataSpec, HubDataset, SpecError
from molt.spec.user_modules import import_user_module

DATA = DataSpec()
EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "agents"
MATH_VERIFY = import_user_module(str(EXAMPLES / "math_verify.py"), "test")
GSM8K = {"train": [{"question": f"train {i}?", "answer": f"so\n#### {i},000"} for i in range(3)],
         "test": [{"question": "test 0?", "answer": "x\n#### 12"},
                  {"question": "test 1?", "answer": "#### 5"}]}


def test_a_hub_layout_config_and_split_are_what_load_dataset_picks(tmp_path):
    root = write_hub_layout(tmp_path / "gsm8k", GSM8K, config="main")
    write_hub_layout(root, {"test": [{"question": "other config", "answer": "#### 0"}]}, config="socratic")
    fields = {"prompt": "question", "label": "answer"}
    source = HubDataset(hub=str(root), config="main", split="test", fields=fields)
    assert list(PromptDataset(source, DATA)) == [{"prompt": "test 0?", "label": "x\n#### 12"},
                                                 {"prompt": "test 1?", "label": "#### 5"}]
    # a transform named like agent.module; a sliced split (load_dataset's syntax)
    source = HubDataset(hub=str(root), config="main", split="train[:2]",
                        transform=f"{EXAMPLES / 'math_verify.py'}:gsm8k_row")
    assert list(PromptDataset(source, DATA)) == [{"prompt": "train 0?", "label": "0000"},
                                                 {"prompt": "train 1?", "label": "1000"}]
    socratic = HubDataset(hub=str(root), config="socratic", split="test", fields=fields)
    assert [row["prompt"] for row in PromptDataset(socratic, DATA)] == ["other config"]


def test_images_become_one_user_message_with_the_stored_bytes(tmp_path):
    red, blue = png((255, 0, 0)), png((0, 0, 255))
    root = write_hub_layout(tmp_path / "geo", {"test": [
        {"images": [red, blue], "problem": "<image>Find x.", "answer": "2\\sqrt{3}", "id": 7}]},
        image_column="images")
    source = HubDataset(hub=str(root), split="test", name="geo",
                        fields={"images": "images", "prompt": "problem", "label": "answer"})
    [row] = load_eval_sets(DataSpec(eval=[source]))["geo"]
    assert row["label"] == "2\\sqrt{3}" and row["id"] == 7 and "problem" not in row and "images" not in row
    [message] = row["messages"]
    *images, text = message["content"]
    assert message["role"] == "user" and text == {"type": "text", "text": "Find x."}
    assert [base64.b64decode(part["image"].split(",", 1)[1]) for part in images] == [red, blue]


def test_bad_hub_sources_fail_with_what_is_wrong(tmp_path):
    root = write_hub_layout(tmp_path / "d", {"train": [{"question": "q", "answer": "a"}]})
    with pytest.raises(ValueError, match=r"fields name columns \['problem'\] it does not have; its columns: "
                                         r"\['question', 'answer'\]"):
        PromptDataset(HubDataset(hub=str(root), fields={"prompt": "problem", "label": "answer"}), DATA)
    with pytest.raises(ValueError, match=r"hub dataset 'nobody/nothing'\[train\] could not be loaded"):
        PromptDataset(HubDataset(hub="nobody/nothing"), DATA)   # HF_HUB_OFFLINE (conftest): not cached
    with pytest.raises(ValueError, match=r"row 0: malformed row: missing label key 'label'"):
        PromptDataset(HubDataset(hub=str(root), fields={"prompt": "question"}), DATA)
    (tmp_path / "rows.py").write_text("def broken(row):\n    return {'prompt': row['missing']}\n")
    with pytest.raises(ValueError, match=r"\[train\]: row 0: transform='.*rows.py:broken' raised KeyError"):
        PromptDataset(HubDataset(hub=str(root), transform=f"{tmp_path / 'rows.py'}:broken"), DATA)
    with pytest.raises(SpecError, match="set fields or transform, not both"):
        compose(["data.train_path={hub: x, fields: {prompt: q}, transform: 'm.py:f'}"])
    with pytest.raises(SpecError, match="eval sets named \\['x'\\] more than once"):
        compose(["data.eval=[{hub: a/x}, examples/data/x.jsonl]"])


def test_a_messages_column_reads_like_a_parquet_file(tmp_path):
    # a struct column gives every message every field (null where absent); they are dropped, as for a file
    chat = [{"role": "user", "content": "hi", "name": "ann"}, {"role": "assistant", "content": "yo"}]
    root = write_hub_layout(tmp_path / "chat", {"train": [{"conversation": chat, "answer": "a"}]})
    [row] = PromptDataset(HubDataset(hub=str(root), fields={"messages": "conversation", "label": "answer"}),
                          DATA)
    assert row == {"messages": chat, "label": "a"}


@pytest.mark.parametrize("name", ["qwen3_4b_math", "qwen_vl_geo3k"])
def test_the_recipes_hub_datasets_load_with_their_columns(name, tmp_path):
    from molt.driver.compose import prepare

    spec = compose([f"+experiment={name}", "run.dry_run=true"])
    sources = [spec.data.train_path, *spec.data.eval]
    assert all(isinstance(s, HubDataset) and s.hub in RECIPE_DATASETS for s in sources)
    local = with_local_hub(spec, tmp_path)
    prepare(local).or_raise()   # loads every set through load_dataset, maps its fields, imports the agent
    rows = list(PromptDataset(local.data.train_path, local.data))
    assert all("label" in row and ("prompt" in row or "messages" in row) for row in rows)


@pytest.mark.parametrize(("response", "label", "correct"), [
    ("so the answer is \\boxed{\\frac{1}{2}}", "0.5", True),             # equal values, unequal strings
    ("x = 2\\sqrt 3, so $x = 2\\sqrt{3}$", "2\\sqrt{3}", True),
    ("It is \\boxed{7}.", "Add: $3+4=\\boxed{7}$", True),                # MATH's worked solution as label
    ("The total is 1000 apples.", "1000", True),                          # GSM8K: a bare number
    ("\\boxed{3}", "2\\sqrt{3}", False),
    ("I think it is 12, no: \\boxed{13}", "12", False),                   # the boxed answer wins
    ("no answer here", "4", False),
])
def test_math_verify_grades_by_value(response, label, correct):
    assert MATH_VERIFY.grade(response, label)[0] is correct


def test_the_math_verify_env_grades_off_the_main_thread():
    # an agent's event loop may run in a thread, where math-verify's own signal-based timeout cannot
    from molt.agents.env import State

    state = State(observation="", action="\\boxed{0.25}", action_ids=[], finish_reason="stop",
                  label="\\frac14", turn=0, messages=[], sampling_params={}, item={})
    results = []
    env = MATH_VERIFY.MathVerifyEnv()
    thread = threading.Thread(target=lambda: results.append(asyncio.run(env.step(state))))
    thread.start()
    thread.join(timeout=60)
    assert results[0].reward == 1.0 and results[0].info == {"answered": 1.0, "grade_timeout": 0.0}
