"""The decision tasks (examples/agents/decision_env.py, docs/tool_use.md#decisions): the SFT traces teach the
format and leave each decision to chance; the Env's tools, rewards and decision metrics; and each task's
2-step smoke on the shared engine and trainer (the recipes' learning curves: bench/agentic_learning.py)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from test_agents import Recorder, assert_exact, run_all
from test_tool_use import load

from molt.agents import State, load_agent_runner
from molt.agents.render import render
from molt.agents.tools import make_parser, parse_reply, tool_request
from molt.driver.compose import compose

env = load("decision_env")
TASKS = ("choice", "chain", "recovery")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("decisions")
    env.main([str(out), "--train", "64", "--eval", "8", "--sft", "400", "--sft-eval", "4"])
    return out


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def call(name: str, **args) -> dict:
    return {"id": "c", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def step(agent, row: dict, text: str = "", calls: list[dict] | None = None):
    state = State("", text, [], "stop", row["label"], 0, [], {}, row, row["tools"], calls or [])
    return asyncio.run(agent.step(state))


def test_traces_teach_the_format_and_leave_the_decision_to_chance(data, tok):
    """Every SFT trace, rendered by the template, holds calls the hermes parser reads back, each followed by
    that tool's real output on the row's world (or a failure), and ends by answering its last output; the
    decision in the traces is drawn at random: the right tool in about half the choice traces, a second
    call in a third of the chain traces, a retry in a third of the recovery traces that meet a failure
    (half of them)."""
    parser, rows = make_parser(tok, "hermes"), read(data / "decision_sft.jsonl")
    decided, failed = {task: [] for task in TASKS}, []
    for row in rows:
        tools = env.TOOLS[row["task"]]
        agent = env.DecisionEnv({"busy_rate": 0.0})
        agent.bind(row)
        messages, made = row["messages"], []
        for i, message in enumerate(messages[1:-1], 1):
            if message["role"] == "tool":
                continue
            text = render(tok, messages[:i + 1], row.get("tools"), generation_prompt=False)
            turn = text[len(render(tok, messages[:i], row.get("tools"))):].replace(tok.eos_token, "")
            [parsed] = parse_reply(parser, tok, tok.encode(turn, add_special_tokens=False),
                                   tool_request(tools))[1]
            name, args = parsed["function"]["name"], json.loads(parsed["function"]["arguments"])
            output = messages[i + 1]["content"]
            assert output == agent.tools[name](**args) or (row["task"] == "recovery" and output == env.BUSY)
            made.append((name, args, output))
        if made[-1][2] != env.BUSY:
            assert messages[-1] == {"role": "assistant", "content": f"<answer>{made[-1][2]}</answer>"}
        assert made[0][1] == ({"box": row["n"]} if row["task"] == "chain" else {"item": row["n"]})
        if row["task"] == "chain" and len(made) == 2:   # the second call reads the first's output
            assert made[1][:2] == ("price", {"item": int(made[0][2])})
        if row["task"] == "recovery":
            failed.append(made[0][2] == env.BUSY)
            if not failed[-1]:
                assert len(made) == 1
                continue
        decided[row["task"]].append({"choice": made[0][0] == row["asks"], "chain": len(made) == 2,
                                     "recovery": len(made) == 2}[row["task"]])
    share = {task: sum(v) / len(v) for task, v in decided.items()}
    # binomial: 400 draws at p = 0.5 have sd 0.025, 200 draws at p = 1/3 sd 0.033
    assert len(decided["choice"]) == len(decided["chain"]) == len(failed) == 400
    assert abs(share["choice"] - 0.5) < 0.1 and abs(share["chain"] - 1 / 3) < 0.1
    assert abs(sum(failed) / 400 - 0.5) < 0.1 and abs(share["recovery"] - 1 / 3) < 0.12
    assert 0.5 < sum("tools" not in row for row in rows) / len(rows) < 0.8   # --bare 2/3


def test_eval_sets_and_the_tool_off_control(data):
    for task in TASKS:
        held_out = read(data / f"decision_{task}_eval.jsonl")
        off = read(data / f"decision_{task}_eval_off.jsonl")
        assert off == [{**row, "tool_unavailable": True} for row in held_out[:len(off)]] and len(off) == 8
        assert all(row["tools"] == env.TOOLS[task] and row["task"] == task for row in held_out)
        row, names = off[0], [tool["function"]["name"] for tool in env.TOOLS[task]]
        calls = [call(name, **{"box" if name == "find" else "item": row["n"]}) for name in names]
        result = step(env.DecisionEnv(), row, calls=calls)
        assert [m["content"] for m in result.observation] == [env.UNAVAILABLE] * len(names)


def test_choice_rewards_the_asked_tool_and_reports_the_decision(data):
    row = next(r for r in read(data / "decision_choice_train.jsonl") if r["asks"] == "stock")
    for tool, right in (("stock", 1.0), ("price", 0.0)):
        agent = env.DecisionEnv()
        out = step(agent, row, calls=[call(tool, item=row["n"])])
        [message] = out.observation
        assert message["content"] == str(env.value(row["world"], tool, row["n"]))
        assert (out.reward, out.terminated, out.info) == (0.0, False, {"correct": 0.0, "right_tool": right})
        final = step(agent, row, f"<answer>{message['content']}</answer>")
        assert (final.reward, final.info) == (right, {"correct": right, "right_tool": right})
    assert row["label"] == str(env.value(row["world"], "stock", row["n"]))


def test_chain_rewards_a_right_first_call_at_its_turn_and_reports_completion(data):
    row = read(data / "decision_chain_train.jsonl")[0]
    agent = env.DecisionEnv({"first_call_reward": 0.3})
    first = step(agent, row, calls=[call("find", box=row["n"])])
    item = int(first.observation[0]["content"])
    assert first.reward == 0.3 and first.info == {"correct": 0.0, "first_call": 1.0, "chained": 0.0}
    second = step(agent, row, calls=[call("price", item=item)])
    assert second.reward == 0.0 and second.info["chained"] == 1.0 and second.observation[0]["content"] == \
        row["label"]
    assert step(agent, row, f"<answer>{row['label']}</answer>").reward == 1.0
    wrong = env.DecisionEnv()   # the wrong box first: no intermediate reward
    assert step(wrong, row, calls=[call("find", box=row["n"] + 1)]).reward == 0.0
    stopped = env.DecisionEnv()   # the first call's output answered: not chained, wrong
    step(stopped, row, calls=[call("find", box=row["n"])])
    final = step(stopped, row, f"<answer>{item}</answer>")
    assert (final.reward, final.info["chained"]) == (float(str(item) == row["label"]), 0.0)


def test_recovery_fails_the_same_calls_of_a_row_and_reports_retries(data):
    rows = read(data / "decision_recovery_train.jsonl")
    row = next(r for r in rows if env.busy(r["world"], 0, 0.6) and not env.busy(r["world"], 1, 0.6))
    agent = env.DecisionEnv()
    first = step(agent, row, calls=[call("price", item=row["n"])])
    assert first.observation[0]["content"] == env.BUSY and first.info == {"correct": 0.0, "retried": 0.0}
    again = step(agent, row, calls=[call("price", item=row["n"])])
    assert again.observation[0]["content"] == row["label"] and again.info["retried"] == 1.0
    calm = next(r for r in rows if not env.busy(r["world"], 0, 0.6))
    answered = env.DecisionEnv()
    step(answered, calm, calls=[call("price", item=calm["n"])])
    final = step(answered, calm, f"<answer>{calm['label']}</answer>")
    assert final.info == {"correct": 1.0}   # no failure met: no retry rate
    # 60% of the rows meet a failure on their first call
    assert 0.4 < sum(env.busy(r["world"], 0, 0.6) for r in rows) / len(rows) < 0.8


@pytest.mark.parametrize("task", TASKS)
def test_each_recipe_trains_two_steps_on_the_shared_engine(task, data, tok, engine, trainer):
    """The recipe's agent and rows (experiments/decision_TASK.yaml), each rollout checked against the
    engine's calls, trained for two steps through the loop's `learn` (the smoke of the CI; the random model
    makes no calls: the learning runs are bench/agentic_learning.py's). The choice task also through the
    ChatAgent path (decision_chat.py)."""
    from agentlib import train_one_step

    modules = ["examples/agents/decision_env.py"] + ["examples/agents/decision_chat.py"] * (task == "choice")
    rows = read(data / f"decision_{task}_train.jsonl")
    for module in modules:
        spec = compose([f"+experiment=decision_{task}", "rollout.max_tokens=16", f"agent.module={module}"])
        runner = load_agent_runner(spec.agent)
        runner.setup(tok, spec)
        try:
            for k in range(2):
                sampler = Recorder(engine, training=True)
                rollouts = run_all(runner, [rows[k]] * 2, sampler, group=f"{task}-{module[-8:]}-{k}")
                for r in rollouts:
                    assert_exact(r, [c for c in sampler.calls if c["key"] == r.rollout_id])
                    assert "correct" in r.info
                train_one_step(trainer, rollouts, sampler, tok)
        finally:
            runner.close()


def test_the_dry_run_reports_the_longest_prompt_with_its_tools(data, tok):
    """`run.dry_run=true` renders every prompt with the tools its rollouts offer and names each set's longest
    against the context; a context that leaves no room for a reply is a problem naming the row (two tool
    schemas took a user's trace past a 512-token context)."""
    from molt.agents.render import encode
    from molt.driver.launch import dry_run

    sets = {"data.train_path": read(data / "decision_chain_train.jsonl"),
            "data.eval (decision_chain_eval)": read(data / "decision_chain_eval.jsonl")}
    longest = {where: max(len(encode(tok, render(tok, row["messages"], row["tools"]))) for row in rows)
               for where, rows in sets.items()}
    base = ["+experiment=decision_chain", "model.path=null", "run.dry_run=true",
            f"data.train_path={data}/decision_chain_train.jsonl",
            f"data.eval=[{data}/decision_chain_eval.jsonl]"]
    plan, problems = dry_run(compose(base))
    assert problems == []
    for where, n in longest.items():
        line = f"context: {where}: longest prompt {n} tokens ("
        assert any(shown.startswith(line) for shown in plan.splitlines()), plan
    spec = compose(base)
    short = longest["data.train_path"] + spec.rollout.max_tokens - 1
    _, problems = dry_run(compose([*base, f"model.max_model_len={short}", f"agent.max_total_tokens={short}"]))
    assert any(f"renders to {longest['data.train_path']} tokens" in str(p) for p in problems), problems
