"""The Env path, the runner contract and the agent loader, against the shared tiny vLLM engine.

Every trajectory is checked against what the engine itself returned (recorded at the sampler): the
sampled ids, logprobs and versions must appear verbatim with loss mask 1, and everything else must be
the chat template's rendering, computed here independently.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import sys
from pathlib import Path

import pytest
import ray
from poollib import FnGroups

from molt.agents import Env, Result, State, StepEnvRunner, load_agent_runner
from molt.rollout.pool import RolloutPool
from molt.spec import AgentSpec, RunSpec
from molt.trajectory import NO_VERSION, AgentError

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "agents"
IM = "<|im_start|>"
END = "<|im_end|>"


class Recorder:
    """The sampler the runners get, with every call and the engine's result kept for checking: the
    generator's Dispatcher over the shared engine (evaluation's path), or with `training=True` the loop's
    TrainingSampler over it (a run's training rollouts: it refuses what the trainer cannot score). `override`
    replaces sampling fields of every request (e.g. greedy decoding, which training rollouts refuse)."""

    def __init__(self, engine, training: bool = False, **override) -> None:
        from molt.rollout.dispatch import Dispatcher
        from molt.rollout.sampling import TrainingSampler

        dispatcher = Dispatcher([engine])
        self.inner = TrainingSampler(dispatcher, 0, lambda: 0) if training else dispatcher
        self.training, self.calls, self.override = training, [], override

    async def generate(self, prompt_ids: list[int], sampling: dict, key: str, images=None) -> dict:
        sampling = {**sampling, **self.override}
        out = await self.inner.generate(list(prompt_ids), sampling, key, images)
        self.calls.append({"key": key, "prompt_ids": list(prompt_ids), "sampling": dict(sampling),
                           "out": out})
        return out

    def release(self, key: str) -> None:
        self.inner.release(key)


def make_spec(agent: dict, **rollout) -> RunSpec:
    return RunSpec.model_validate({"model": {"max_model_len": 256},
                                   "rollout": {"max_tokens": 8, **rollout}, "agent": agent})


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def chat_ids(tok, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    return list(tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True)["input_ids"])


def assert_exact(rollout, calls: list[dict]) -> list[list[dict]]:
    """Each segment = engine calls laid end to end: returns the calls of each segment, in order.

    Checks that every call's prompt is the segment up to that call, its sampled ids follow verbatim with
    mask 1 and the engine's own logprobs and versions, and that no other token has mask 1.
    """
    assert rollout.ok, rollout.error
    per_segment = []
    for index, seg in enumerate(rollout.segments):
        assert seg.segment_index == index and seg.rollout_id == rollout.rollout_id
        mine = [c for c in calls if seg.token_ids[:len(c["prompt_ids"]) + len(c["out"]["token_ids"])]
                == c["prompt_ids"] + c["out"]["token_ids"]]
        mine = sorted(mine, key=lambda c: len(c["prompt_ids"]))
        mask, logprobs, versions = [0] * len(seg.token_ids), [0.0] * len(seg.token_ids), \
            [NO_VERSION] * len(seg.token_ids)
        for c in mine:
            start, out = len(c["prompt_ids"]), c["out"]
            for i, (lp, v) in enumerate(zip(out["logprobs"], out["versions"], strict=True)):
                mask[start + i], logprobs[start + i], versions[start + i] = 1, lp, v
        assert mine and seg.loss_mask == mask and seg.logprobs == logprobs and seg.versions == versions
        assert seg.prompt_len == len(mine[0]["prompt_ids"])
        assert all(not math.isnan(x) for x in seg.logprobs)
        per_segment.append(mine)
    return per_segment


def turn_glue(tok, sampled: list[int], role: str, content: str) -> list[int]:
    """The template's tokens between a sampled turn and the next generation, written out by hand for
    molt.inputs.tiny's ChatML template (its `{%-` tags drop the newlines between turns)."""
    close = "" if sampled and sampled[-1] == tok.eos_token_id else END
    return encode(tok, f"{close}{IM}{role}\n{content}{END}{IM}assistant")


@pytest.fixture()
def sampler(engine):
    return Recorder(engine)


def run_all(runner, items: list[dict], sampler, group: str = "g0") -> list:
    async def main():
        return await asyncio.gather(*[runner.run(item, f"{group}-r{i}", group, sampler)
                                      for i, item in enumerate(items)])
    return asyncio.run(main())


def test_repeat_env_is_token_exact_and_rewards_the_letter(tok, sampler):
    runner = load_agent_runner(AgentSpec(module=str(EXAMPLES / "repeat.py")))
    runner.setup(tok, make_spec({"module": str(EXAMPLES / "repeat.py")}))
    rollouts = run_all(runner, [{"prompt": "c", "label": "c"}] * 4, sampler)
    letter = tok.convert_tokens_to_ids("c")
    for r in rollouts:
        [[call]] = assert_exact(r, [c for c in sampler.calls if c["key"] == r.rollout_id])
        assert call["prompt_ids"] == chat_ids(tok, [{"role": "user", "content": "c"}])
        assert r.segments[0].token_ids == call["prompt_ids"] + call["out"]["token_ids"]
        assert r.reward == r.score == call["out"]["token_ids"].count(letter) / 8
        assert r.label == "c" and r.group_id == "g0"


def test_math_env_single_turn(tok, sampler):
    spec = make_spec({"module": str(EXAMPLES / "math_env.py")})
    runner = load_agent_runner(spec.agent)
    runner.setup(tok, spec)
    [r] = run_all(runner, [{"prompt": "What is 3+4?", "label": "7"}], sampler)
    [[call]] = assert_exact(r, sampler.calls)
    assert call["prompt_ids"] == chat_ids(tok, [{"role": "user", "content": "What is 3+4?"}])
    env = runner.env_cls()
    state = lambda text: State("q", text, [], "stop", "7", 0, [], {}, {})  # noqa: E731
    assert asyncio.run(env.step(state("so it is 7"))).reward == 1.0
    assert asyncio.run(env.step(state("7 or 8"))).reward == 0.0
    assert asyncio.run(env.step(state("no idea"))).info == {"answered": 0.0}


def tool_spec(**agent) -> RunSpec:
    return RunSpec.model_validate({"model": {"max_model_len": 1024}, "rollout": {"max_tokens": 128},
                                   "agent": {"module": str(EXAMPLES / "tool_env.py"), "max_turns": 3,
                                             "max_total_tokens": 1024, **agent}})


def forced(name: str, argument: str, value: str) -> str:
    """A regex that makes every turn a Hermes call of tool `name` with one argument matching `value`."""
    return ('<tool_call>\\{"name": "' + name + '", "arguments": \\{"' + argument + '": "' + value +
            '"\\}\\}</tool_call>')


@pytest.mark.parametrize("module, kind", [("tool_env.py", "env"), ("tool_chat.py", "chat")])
def test_tool_env_renders_its_tools_and_answers_each_call(tok, engine, module, kind):
    """The row's `tools` are in the prompt the engine reads (the template's rendering with `tools=`); every
    turn is forced to call a tool, so each turn's call is parsed by agent.tool_parser and answered by a
    tool message whose tokens are prompt (mask 0); a call of a tool the row does not offer (the Env runs
    `python`, but only the calculator is shown) is answered with an error. Out of turns, none answered.
    The same task through the ChatAgent path (tool_chat.py: the OpenAI SDK against the loopback server)
    gives the same prompts, glue and counts: the two paths are token for token the same rollout."""
    from molt.driver.select import rollout_metrics
    from molt.tasks.tool_use import CALCULATOR

    spec = tool_spec(module=str(EXAMPLES / module), options={"tool_timeout_s": 30.0})
    runner = load_agent_runner(spec.agent)
    runner.setup(tok, spec)
    row = {"messages": [{"role": "user", "content": "What is 12*3?"}], "label": "36", "tools": [CALCULATOR]}
    rollouts = []
    for name, argument, value in (("calculator", "expression", "[1-9][0-9]\\*[1-9]"),
                                  ("python", "code", "print\\(1\\)")):
        sampler = Recorder(engine, structured_outputs={"regex": forced(name, argument, value)})
        [r] = run_all(runner, [row], sampler, group=name)
        [calls] = assert_exact(r, sampler.calls)
        assert len(calls) == 3
        assert calls[0]["prompt_ids"] == chat_ids(tok, row["messages"], [CALCULATOR])
        for before, after in zip(calls, calls[1:], strict=False):
            sampled = before["out"]["token_ids"]
            # (the markup may be sampled as the special tokens or spelled out in plain ones)
            expression = re.search(r'"expression": "([^"]+)"', tok.decode(sampled))
            output = "error: unknown tool 'python'; the tools are: calculator" if name == "python" \
                else str(eval(expression.group(1)))   # the sandbox's answer, computed here
            glue = turn_glue(tok, sampled, "tool", output)
            assert after["prompt_ids"] == before["prompt_ids"] + sampled + glue   # mask 0: assert_exact
        # an Env's step answers the third turn's calls before the turn budget ends the episode; the
        # ChatAgent, out of turns, does not run them (no request would carry their output)
        errors = (3 if kind == "env" else 2) * (name == "python")
        assert (r.turns, r.tool_calls, r.tool_errors, r.answered) == (3, 3, errors, False)
        # each turn's reward (algo.turn_credit=turn): an Env's steps', a ChatAgent's Result on its last reply
        assert r.turn_rewards == [0.0, 0.0, 0.0] and r.reward == 0.0
        assert r.segments[0].turns == [[k, len(c["prompt_ids"])] for k, c in enumerate(calls)]   # turn credit
        rollouts.append(r)
    runner.close()
    metrics = rollout_metrics(spec, rollouts)
    assert {k: metrics[f"agent/{k}"] for k in ("turns", "tool_calls", "tool_errors", "answer_rate")} == \
        {"turns": 3.0, "tool_calls": 3.0, "tool_errors": 1.5 if kind == "env" else 1.0, "answer_rate": 0.0}


def test_tool_env_scores_the_first_reply_without_a_call(tok):
    import reasoning_gym

    runner = load_agent_runner(AgentSpec(module=str(EXAMPLES / "tool_env.py")))
    env = runner.env_cls({"tool_timeout_s": 30.0})
    entry = json.loads(json.dumps(next(iter(reasoning_gym.create_dataset(
        "products", size=1, seed=0, min_terms=2, max_terms=2, min_digits=3, max_digits=3)))))
    state = lambda text, item: State("q", text, [], "stop", entry["answer"], 1, [], {}, item)  # noqa: E731
    for text, reward in ((f"<answer>{entry['answer']}</answer>", 1.0), ("<answer>12</answer>", 0.0)):
        result = asyncio.run(env.step(state(text, {"entry": entry})))
        assert (result.reward, result.terminated, result.info) == \
            (reward, True, {"exact": reward, "unscorable": 0.0})
    assert asyncio.run(env.step(state(f"so {entry['answer']}", {}))).reward == 1.0   # a row without entry


def test_tool_env_calls_the_sandboxed_calculator():
    from molt.tasks.tool_use import CALCULATOR, PYTHON

    runner = load_agent_runner(AgentSpec(module=str(EXAMPLES / "tool_env.py")))
    module = sys.modules[runner.env_cls.__module__]
    # Generous run limits where a result is checked: under the suite's load a sandbox start alone can
    # take longer than the example's 2 s (a rehearsal saw "timed out after 2.0s" for 2+3*4).
    assert module.calculator("2+3*4", timeout_s=30.0) == "14"
    refused = "error: ValueError: only numbers and + - * / // % ** are allowed"
    assert module.calculator("__import__('os').system('true')", timeout_s=30.0) == refused
    assert module.calculator("9**9**9**9", timeout_s=0.5) == "error: timed out after 0.5s"
    env = runner.env_cls({"tool_timeout_s": 30.0})
    call = lambda name, args: {"id": name, "type": "function",  # noqa: E731
                               "function": {"name": name, "arguments": args}}
    calls = [call("calculator", '{"expression": "6*7"}'), call("python", '{"code": "print(2)"}'),
             call("calculator", '{"expr": "1"}'), call("calculator", "[1]"), call("calculator", "6*"),
             call("python", '{"code": "print(3)", "timeout_s": 99}')]
    state = State("q", "", [], "stop", "42", 0, [], {}, {}, [CALCULATOR, PYTHON], calls)
    result = asyncio.run(env.step(state))
    assert not result.terminated and [m["tool_call_id"] for m in result.observation] == \
        ["calculator", "python", "calculator", "calculator", "calculator", "python"]
    out = [m["content"] for m in result.observation]
    assert out[:2] == ["42", "2"] and all(o.startswith("error: bad arguments for ") for o in out[2:]), out
    assert "'expression'" in out[2] and "'timeout_s'" in out[5]
    # a tool the Env runs but the prompt did not offer is unknown to the model
    hidden = asyncio.run(env.call_tools(State("q", "", [], "stop", "", 0, [], {}, {}, [CALCULATOR],
                                              [call("python", '{"code": "print(1)"}')])))
    assert hidden[0]["content"] == "error: unknown tool 'python'; the tools are: calculator"


class Raises(Env):
    async def step(self, state: State) -> Result:
        raise RuntimeError("boom")


class NanReward(Env):
    async def step(self, state: State) -> Result:
        return Result(reward=float("nan"))


class NoResult(Env):
    async def step(self, state: State):
        return 1.0


class Slow(Env):
    async def step(self, state: State) -> Result:
        await asyncio.sleep(300)
        return Result(reward=1.0)


@pytest.mark.parametrize("env_cls, message", [(Raises, "RuntimeError: boom"),
                                              (NanReward, "reward must be a finite number"),
                                              (NoResult, "returned float, not Result"),
                                              (Slow, "timed out after 4.0s")])
def test_a_failing_env_gives_an_error_rollout(tok, sampler, env_cls, message):
    runner = StepEnvRunner(env_cls)
    runner.setup(tok, make_spec({"timeout_s": 4.0}))  # generation (< 0.1 s) must fit on a loaded machine
    [r] = run_all(runner, [{"prompt": "a", "label": "a"}], sampler)
    assert not r.ok and message in r.error and r.segments == [] and r.label == "a"


class BrokenSampler:
    """A bug on Molt's side of the seam: the sampler returns fewer logprobs than tokens."""

    async def generate(self, prompt_ids: list[int], sampling: dict, key: str, **kwargs) -> dict:
        return {"token_ids": [5, 6], "logprobs": [0.0], "versions": [0, 0]}


def test_a_bug_in_molt_stops_the_run_instead_of_failing_a_rollout(tok):
    # Only the agent's side is caught: a Molt bug counted as "agent failures" would hide until
    # agent.max_failure_rate tripped. The pool hands it to the loop rather than hanging on the group.
    runner = StepEnvRunner(Raises)
    runner.setup(tok, make_spec({}))
    row = {"prompt": "a", "label": "a"}
    with pytest.raises(ValueError, match="sampler returned 2 tokens, 1 logprobs") as raised:
        asyncio.run(runner.run(row, "r0", "g0", BrokenSampler()))
    assert not isinstance(raised.value, AgentError)

    async def one_batch() -> None:
        pool = RolloutPool(iter([row]), FnGroups(lambda item, group, i: runner.run(
            item, f"{group}-{i}", group, BrokenSampler()), 2), 1, 0, refill_during_batch=False)
        await asyncio.wait_for(pool.next_batch(1), 60)

    with pytest.raises(ValueError, match="sampler returned 2 tokens"):
        asyncio.run(one_batch())


class NextTurnSampling(Env):
    """Three turns; the first result overrides the second turn's sampling (only) with the row's `next`."""

    async def step(self, state: State) -> Result:
        if state.turn == 1:
            self.second_turn_max_tokens = state.sampling_params["max_tokens"]
        if state.turn < 2:
            return Result(reward=0.0, observation="again", terminated=False,
                          sampling_params=state.item["next"] if state.turn == 0 else None)
        return Result(reward=1.0, info={"second_turn_max_tokens": self.second_turn_max_tokens})


def test_training_rollouts_record_per_turn_sampling_or_refuse_what_cannot_be_scored(tok, engine):
    """Through the loop's TrainingSampler: a per-turn temperature / top-k override holds for the next turn
    only and is recorded for the trainer to match, a max_tokens override is capped at the run's; greedy
    decoding, constrained decoding, keys the trainer cannot reproduce (min_p, penalties, stop strings) and
    values vLLM refuses fail the rollout with the reason (the engine's refusal crosses Ray as an
    AgentError) instead of stopping the run or being ignored."""
    from molt.rollout.dispatch import Dispatcher
    from molt.rollout.sampling import TrainingSampler, check_trainable

    runner = StepEnvRunner(NextTurnSampling)
    runner.setup(tok, make_spec({"max_turns": 3}, temperature=0.7))
    sampler = TrainingSampler(Dispatcher([engine]), 0, lambda: 0)
    rows = [{"prompt": "a", "label": "a", "next": n} for n in (
        {"temperature": 1.3, "top_k": 7}, {"temperature": 0.0}, {"min_p": 0.3, "repetition_penalty": 1.2},
        {"stop": ["b"]}, {"top_p": 0.0}, {"max_tokens": 1000})]
    ok, greedy, penalised, stop, refused, longer = run_all(runner, rows, sampler)
    assert ok.ok and [span[1:] for span in ok.segments[0].sampling] == [[0.7, 1.0, -1], [1.3, 1.0, 7],
                                                                        [0.7, 1.0, -1]]
    # an override may shorten a turn, not lengthen it past rollout.max_tokens (8 here)
    assert longer.ok and longer.info["second_turn_max_tokens"] == 8
    assert not greedy.ok and "temperature=0.0, i.e. greedy decoding" in greedy.error
    assert not penalised.ok and penalised.error.startswith(
        "sampling parameters ['min_p', 'repetition_penalty'] are not supported")   # not Ray's traceback
    assert not stop.ok and stop.error.startswith("sampling parameters ['stop'] are not supported")
    assert not refused.ok and refused.error.startswith("vLLM refused the sampling parameters") \
        and "top_p must be in (0, 1]" in refused.error
    with pytest.raises(AgentError, match="not a vision-language model"):   # the type survives Ray
        ray.get(engine.generate.remote([1, 2, 3], {"max_tokens": 1}, images=["data:image/png;base64,"]))
    with pytest.raises(ValueError, match="constrained decoding"):
        check_trainable({"temperature": 1.0, "structured_outputs": {"regex": "a+"}})
    # every request got its own seed, and the same rollout id and turn get the same one again
    again = run_all(runner, rows[:1], TrainingSampler(Dispatcher([engine]), 0, lambda: 0))[0]
    assert again.segments[0].token_ids == ok.segments[0].token_ids


def test_loader_finds_every_configured_agent():
    from molt.driver.compose import compose

    for path in sorted((Path(__file__).resolve().parents[1] / "conf" / "agent").glob("*.yaml")):
        agent = compose([f"agent={path.stem}"]).agent   # an option sets only what differs from the spec
        assert load_agent_runner(agent).kind in ("env", "chat"), path.name   # the agent's kind: its runner's


def test_a_relative_agent_module_is_found_as_a_data_file_is(tmp_path, monkeypatch):
    """A relative agent.module is looked for in the current directory, then the repository root, as data
    files are: `python -m molt` run from a folder of the checkout (docs/) read the default data and then
    refused the default agent, examples/agents/repeat.py. A file in the current directory comes first."""
    monkeypatch.chdir(tmp_path)
    assert load_agent_runner(AgentSpec()).kind == "env"   # the default module, from the repository root
    (tmp_path / "examples" / "agents").mkdir(parents=True)
    (tmp_path / "examples" / "agents" / "repeat.py").write_text("x = 1\n")
    with pytest.raises(ImportError, match="does not export AgentRunner"):
        load_agent_runner(AgentSpec())


def test_loader_errors_are_clear(tmp_path, monkeypatch):
    with pytest.raises(ImportError, match="could not be loaded.*no such file"):
        load_agent_runner(AgentSpec(module=str(tmp_path / "missing.py")))
    (tmp_path / "broken.py").write_text("import not_a_module_anywhere\n")
    with pytest.raises(ImportError, match="broken.py.*not_a_module_anywhere"):
        load_agent_runner(AgentSpec(module=str(tmp_path / "broken.py")))
    (tmp_path / "empty_agent.py").write_text("x = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError, match="'empty_agent' does not export AgentRunner"):
        load_agent_runner(AgentSpec(module="empty_agent"))
    (tmp_path / "not_runner.py").write_text("AgentRunner = object()\n")
    with pytest.raises(TypeError, match="not a StepEnvRunner or ChatAgentRunner"):
        load_agent_runner(AgentSpec(module="not_runner"))


def test_example_data_rows_are_well_formed():
    data = Path(__file__).resolve().parents[1] / "examples" / "data"
    rows = [json.loads(line) for line in (data / "repeat_train.jsonl").read_text().splitlines()]
    assert {r["prompt"] for r in rows} == set("abcdefgh") and all(r["prompt"] == r["label"] for r in rows)


def test_trace_follows_a_prompt_the_engine_shortened():
    from molt.agents.trace import Trace

    # rollout.prompt_too_long=truncate: the engine reports the prompt it actually read.
    trace = Trace("r", "g")
    trace.extend_prompt([1, 2, 3, 4])
    trace.add_sample({"token_ids": [9, 2], "logprobs": [-0.5, -0.1], "versions": [3, 3],
                      "finish_reason": "stop", "prompt_ids": [3, 4]})
    [seg] = trace.rollout(1.0).segments
    assert seg.token_ids == [3, 4, 9, 2] and seg.loss_mask == [0, 0, 1, 1] and seg.prompt_len == 2
    assert seg.logprobs == [0.0, 0.0, -0.5, -0.1] and seg.versions == [NO_VERSION, NO_VERSION, 3, 3]
