"""The reasoning-gym adapter with the real library: the rows it writes, and rewards equal to the task's own
scorer. (Training on it end to end: tests/test_sft_rl.py.)"""

from __future__ import annotations

import asyncio
import json

import pytest
import reasoning_gym

from molt.agents.env import State
from molt.driver.sft_data import load_conversations
from molt.inputs.data import PromptDataset
from molt.spec import DataSpec
from molt.tasks.reasoning_gym import ReasoningGymEnv, main, task_rows

CONFIG = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+", "-"],
          "allow_parentheses": False, "allow_negation": False}


def reward(row: dict, action: str) -> float:
    state = State(observation="", action=action, action_ids=[], finish_reason="stop", label=row["label"],
                  turn=0, messages=[], sampling_params={}, item=row)
    return asyncio.run(ReasoningGymEnv().step(state)).reward


@pytest.mark.parametrize("task", ["basic_arithmetic", "spell_backward", "leg_counting"])
def test_rewards_are_the_task_scorer(task: str) -> None:
    for row in task_rows(task, 5, 3, CONFIG if task == "basic_arithmetic" else {}):
        entry = row["entry"]
        score = reasoning_gym.get_score_answer_fn(task)
        assert reward(row, f" {entry['answer']}\n") == 1.0
        assert reward(row, f"thinking... <answer>{entry['answer']}</answer>") == 1.0
        for wrong in ("", "no idea", entry["answer"] + "0"):
            assert reward(row, wrong) == score(wrong, entry)   # e.g. partial credit where the task gives it
    with pytest.raises(ValueError, match="no reasoning-gym 'entry'"):
        reward({"label": "3", "messages": []}, "3")


def test_an_answer_the_scorer_cannot_read_scores_zero_and_is_counted() -> None:
    """prime_factorization's scorer raises on text it cannot parse as integers: the answer is wrong (0,
    info/unscorable 1), not a failed rollout; a readable answer keeps the scorer's own score. The flagship's
    Env (examples/agents/tool_env.py) scores it the same way."""
    from test_tool_use import load

    row = task_rows("prime_factorization", 1, 1, {})[0]
    state = lambda action: State("", action, [], "stop", row["label"], 0, [], {}, row)  # noqa: E731
    for action, expected, unscorable in (("<answer>not a number</answer>", 0.0, 1.0),
                                         (f"<answer>{row['label']}</answer>", 1.0, 0.0)):
        for env in (ReasoningGymEnv(), load("tool_env").ToolEnv()):
            result = asyncio.run(env.step(state(action)))
            assert (result.reward, result.info["unscorable"]) == (expected, unscorable), type(env).__name__


def test_written_rows_load_as_prompts_and_conversations(tmp_path) -> None:
    held, sft = tmp_path / "held.jsonl", tmp_path / "sft.jsonl"
    main(["basic_arithmetic", str(held), "--size", "40", "--seed", "1", "--unique",
          "--config", json.dumps(CONFIG)])
    main(["basic_arithmetic", str(sft), "--size", "200", "--seed", "2", "--sft", "--exclude", str(held),
          "--config", json.dumps(CONFIG)])
    prompts = PromptDataset(held, DataSpec())
    questions = [row["messages"][0]["content"] for row in prompts]
    assert len(set(questions)) == len(questions) == len(prompts) > 10
    conversations = load_conversations(sft, DataSpec())
    assert conversations and not {c["messages"][0]["content"] for c in conversations} & set(questions)
    assert all(c["messages"][1] == {"role": "assistant", "content": c["label"]} for c in conversations)
