"""Third-party agent frameworks, unmodified, through the loopback server against the shared engine.

Each framework's example agent (examples/agents/) runs a group of rollouts with the framework's own loop
and client; every trajectory is checked against the engine's sampled ids (recorded at the sampler) and
the trainer's logprobs of them against the engine's (tests/agentlib.py). A random-init policy never
writes tool-call markup by itself, so tool-using agents force their calls (`tool_choice`), which the
server honours by constrained decoding: evaluation's feature, which training refuses. Training these
agents, unforced and through the loop's TrainingSampler, is tests/test_agents_train.py.
"""

from __future__ import annotations

import json
import re

import pytest
from agentlib import Runners, check_trainer_scores
from test_agents import EXAMPLES, Recorder, assert_exact, chat_ids, encode, run_all

from molt.agents.tools import forced_call_regex

pytest.importorskip("agents", reason="needs the agents extra: pip install molt[agents]")

QUESTION = {"messages": [{"role": "user", "content": "What is 2+3?"}], "label": "5"}
SQUARE_QUESTION = {"messages": [{"role": "user", "content": "What is 3 squared?"}], "label": "9"}
# LangChain's schema of the example's `add` tool, as the chat template shows it.
ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
    "type": "object"}}}


@pytest.fixture()
def sampler(engine):
    return Recorder(engine)


@pytest.fixture()
def runners(tok):
    started = Runners(tok)
    yield started
    started.close()


def calls_of(sampler, rollout) -> list[dict]:
    return [c for c in sampler.calls if c["key"] == rollout.rollout_id]


def sampled_text(tok, ids: list[int]) -> str:
    return tok.decode(ids[:-1] if ids and ids[-1] == tok.eos_token_id else ids, skip_special_tokens=False)


def test_openai_agents_sdk_over_the_responses_api(tok, sampler, runners, trainer):
    square = {"type": "function", "function": {"name": "square", "description": "The square of an integer.",
                                                "parameters": {
        "properties": {"x": {"title": "X", "type": "integer"}}, "required": ["x"], "title": "square_args",
        "type": "object", "additionalProperties": False}, "strict": True}}
    options = {"tool_choice": "square", "follow_up": "And now?"}
    rollouts = []
    # Constrained decoding may spell a forced call byte by byte (72 tokens with a 6-digit x, and a 12-digit
    # tool output): a 500-token budget once cut the second call short, so the budget is 900.
    for stream in (False, True):
        runner = runners("openai_agents_sdk.py", {"max_turns": 2, "max_total_tokens": 900,
                                                  "options": {**options, "stream": stream}}, max_tokens=96)
        rollouts += run_all(runner, [SQUARE_QUESTION] * 2, sampler, group="sdk")
    system = {"role": "system", "content": "Use the square tool."}
    first_prompt = chat_ids(tok, [system, SQUARE_QUESTION["messages"][0]], [square])
    for r in rollouts:
        [calls] = assert_exact(r, calls_of(sampler, r))
        assert len(calls) == 2 and r.info == {"tool_calls": 2.0}
        first, second = calls
        assert first["prompt_ids"] == first_prompt
        # Each run is one forced call whose output the SDK takes as the answer. The second run sent the
        # first run's items back (function_call, function_call_output) plus the follow-up question: the
        # server appended them after the exact sampled ids as the template's tool and user turns.
        text = sampled_text(tok, first["out"]["token_ids"])
        assert re.fullmatch(forced_call_regex(square), text)
        x = json.loads(text[11:-12])["arguments"]["x"]   # inside <tool_call>...</tool_call>
        end = "" if first["out"]["token_ids"][-1] == tok.eos_token_id else "<|im_end|>"
        glue = encode(tok, f"{end}<|im_start|>tool\n{x * x}<|im_end|>"
                           "<|im_start|>user\nAnd now?<|im_end|><|im_start|>assistant")
        assert second["prompt_ids"] == first["prompt_ids"] + first["out"]["token_ids"] + glue
        last = json.loads(sampled_text(tok, second["out"]["token_ids"])[11:-12])["arguments"]["x"]
        assert r.reward == float("9" in str(last * last))
    check_trainer_scores(trainer, rollouts, tok, sampler.calls)


def test_langgraph_agent_through_langchain_openai(tok, sampler, runners, trainer):
    runner = runners("langgraph_agent.py", {"max_turns": 2, "max_total_tokens": 900,
                                            "options": {"tool_choice": "add"}}, max_tokens=96)
    rollouts = run_all(runner, [QUESTION] * 4, sampler, group="lg")
    for r in rollouts:
        [calls] = assert_exact(r, calls_of(sampler, r))
        assert len(calls) == 2 and r.info["tool_calls"] >= 1.0
        assert calls[0]["prompt_ids"] == chat_ids(tok, QUESTION["messages"], [ADD])
    check_trainer_scores(trainer, rollouts, tok, sampler.calls)


def test_pydantic_ai_agent_structured_output_over_two_runs(tok, engine, runners, trainer):
    # Near-greedy and seeded: a 511-token conversation (agent.max_total_tokens) holds two constrained
    # calls of a few dozen tokens each, and free sampling could pick a longer spelling of one. (Greedy
    # tokens have no sampling probability, so training refuses them.)
    sampler = Recorder(engine, seed=0)
    runner = runners("pydantic_ai_agent.py", {"max_turns": 2, "max_total_tokens": 511}, max_tokens=96,
                     temperature=0.2)
    rollouts = run_all(runner, [QUESTION] * 2, sampler, group="pai")
    for r in rollouts:
        [calls] = assert_exact(r, calls_of(sampler, r))
        # Two agent runs, one request each: the second continues the first's message history, so the
        # server appended only its new messages after the first reply's exact ids.
        # pydantic-ai sends the call back re-serialised ({"value":N}): the same call, so no new segment.
        assert len(calls) == 2
        first, second = calls
        end = "" if first["out"]["token_ids"][-1] == tok.eos_token_id else "<|im_end|>"
        glue = encode(tok, f"{end}<|im_start|>tool\nFinal result processed.<|im_end|><|im_start|>user\n"
                           "Again?<|im_end|><|im_start|>assistant")
        assert second["prompt_ids"] == first["prompt_ids"] + first["out"]["token_ids"] + glue
        for c in calls:
            assert sampled_text(tok, c["out"]["token_ids"]).startswith('<tool_call>{"name": "final_result"')
    check_trainer_scores(trainer, rollouts, tok, sampler.calls)


def test_verifiers_environment_as_a_chat_agent(tok, sampler, runners, trainer):
    pytest.importorskip("verifiers", reason="needs the verifiers extra: pip install molt[verifiers]")
    options = {"env": str(EXAMPLES.parent / "envs" / "vf_square.py"), "env_args": {"max_turns": 2},
               "sampling_args": {"tool_choice": {"type": "function", "function": {"name": "square"}}}}
    runner = runners("verifiers_env.py", {"max_turns": 2, "max_total_tokens": 900, "options": options},
                     max_tokens=96)
    rollouts = run_all(runner, [SQUARE_QUESTION] * 4, sampler, group="vf")
    for r in rollouts:
        [calls] = assert_exact(r, calls_of(sampler, r))
        # verifiers' ToolEnv ran two model turns (its max_turns), each a forced call it executed.
        assert len(calls) == 2 and r.info["total_tool_calls"] == 2.0
        # The rubric's reward: 1 exactly when a tool result contains "9". verifiers runs a call when it
        # builds the next prompt, so only the first turn's call has a result.
        x = json.loads(sampled_text(tok, calls[0]["out"]["token_ids"])[11:-12])["arguments"]["x"]
        assert r.reward == float("9" in str(x * x))
    check_trainer_scores(trainer, rollouts, tok, sampler.calls)
