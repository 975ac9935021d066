"""Learning to use a tool (docs/tool_use.md): the data script's traces, read back as the run reads them, and
a call the parser cannot read, on both agent paths."""

from __future__ import annotations

import asyncio
import importlib.util
import json
from pathlib import Path

import pytest
from test_agents import Recorder, run_all, tool_spec

from molt.agents import State, load_agent_runner
from molt.agents.render import render
from molt.agents.tools import make_parser

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "agents"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_traces_hold_a_call_the_parser_reads_and_the_sandboxs_output(tok, tmp_path: Path) -> None:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    traces, env = load("tool_traces"), load("tool_env")
    traces.main([str(tmp_path / "t"), "--eval", "4", "--sft", "3", "--bare", "1", "--sft-eval", "1",
                 "--train", "3"])
    def read(part: str) -> list[dict]:
        return [json.loads(line) for line in (tmp_path / f"t_{part}.jsonl").read_text().splitlines()]

    held_out = {row["entry"]["question"] for row in read("eval")}
    assert len(held_out) == 4
    assert all(row["tools"] == traces.CALCULATOR for row in read("eval") + read("train"))
    others = {row["entry"]["question"] for part in ("sft", "sft_eval", "train") for row in read(part)}
    assert not held_out & others
    parser = make_parser(tok, "hermes")
    rows = read("sft") + read("sft_eval")
    assert [row.get("tools") for row in rows] == [traces.CALCULATOR] * 3 + [None] + [traces.CALCULATOR]
    for row in rows:
        question, call, tool, final = row["messages"]
        prompt = render(tok, [question], row.get("tools"))
        # the template shows the tool, except in the --bare traces
        assert ('"name": "calculator"' in prompt and '"expression"' in prompt) == ("tools" in row)
        turn = render(tok, [question, call], row.get("tools"), generation_prompt=False)[len(prompt):]
        request = ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [question], "tools": traces.CALCULATOR})
        parsed = parser.extract_tool_calls(turn.replace(tok.eos_token, ""), request)
        expression = row["entry"]["metadata"]["expression"]
        assert parsed.tools_called and [c.function.name for c in parsed.tool_calls] == ["calculator"]
        assert json.loads(parsed.tool_calls[0].function.arguments) == {"expression": expression}
        a, b = map(int, expression.split(" * "))
        assert tool == {"role": "tool", "content": str(a * b)} == \
            {"role": "tool", "content": env.calculator(expression, timeout_s=30.0)}
        assert str(a * b) == row["label"]
        # the final turn is what tool_env rewards
        result = asyncio.run(env.ToolEnv({}).step(State("q", final["content"], [], "stop", row["label"], 1,
                                                          [], {}, row)))
        assert result.reward == 1.0 and result.terminated


def test_tool_env_can_refuse_every_call() -> None:
    """tool_unavailable: every offered tool answers "error: tool unavailable" (the control run)."""
    env, traces = load("tool_env"), load("tool_traces")
    call = {"id": "c0", "type": "function",
            "function": {"name": "calculator", "arguments": json.dumps({"expression": "6*7"})}}
    state = State("q", "", [], "stop", "42", 0, [], {}, {}, tools=traces.CALCULATOR, tool_calls=[call])
    off = asyncio.run(env.ToolEnv({"tool_unavailable": True}).step(state))
    assert [m["content"] for m in off.observation] == ["error: tool unavailable"] and not off.terminated
    on = asyncio.run(env.ToolEnv({}).step(state))
    assert [m["content"] for m in on.observation] == ["42"]


@pytest.mark.parametrize("module", ["tool_env.py", "tool_chat.py"])
def test_a_call_the_parser_cannot_read_is_counted_and_logged_once(tok, engine, module, caplog):
    """A forced call with malformed JSON (a brace short): vLLM's parser reads no call, so the turn is the
    answer; the turn is counted in agent/tool_parse_errors on both paths, the parser's traceback is not
    printed, and Molt's one line about it comes once, not per call."""
    import logging

    from molt.agents import tools
    from molt.driver.select import rollout_metrics
    from molt.tasks.tool_use import CALCULATOR

    spec = tool_spec(module=str(EXAMPLES / module), options={"tool_timeout_s": 30.0})
    runner = load_agent_runner(spec.agent)
    runner.setup(tok, spec)
    row = {"messages": [{"role": "user", "content": "What is 12*3?"}], "label": "36", "tools": [CALCULATOR]}
    malformed = '<tool_call>\\{"name": "calculator", "arguments": \\{"expression": "1"\\}</tool_call>'
    parser_records = []
    hermes = logging.getLogger("vllm.tool_parsers.hermes_tool_parser")
    handler = logging.Handler()
    handler.emit = parser_records.append
    hermes.addHandler(handler)
    tools._CountParseErrors.reported = False
    try:
        with caplog.at_level(logging.WARNING, logger="molt.agents.tools"):
            rollouts = run_all(runner, [row] * 2, Recorder(engine, structured_outputs={"regex": malformed}))
    finally:
        hermes.removeHandler(handler)
        runner.close()
    assert [(r.turns, r.tool_calls, r.tool_parse_errors) for r in rollouts] == [(1, 0, 1)] * 2
    assert rollout_metrics(spec, rollouts)["agent/tool_parse_errors"] == 1.0
    assert parser_records == []
    lines = [r for r in caplog.records if "could not read a call" in r.getMessage()]
    assert len(lines) == 1 and "agent/tool_parse_errors" in lines[0].getMessage()
