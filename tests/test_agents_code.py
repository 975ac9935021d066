"""The code-execution agent (examples/agents/code_env.py) against the shared engine: the model's Python runs
in the sandbox and its output returns as observation tokens with loss mask 0, over three turns (hint →
code → answer), and the trainer scores the sampled tokens as the engine did. The policy is random, so
`constrain` makes the code and answer turns follow a format (constrained decoding, evaluation only); the
plumbing is what is tested. Training it: tests/test_agents_train.py.
"""

from __future__ import annotations

import ast
import re
import sys

from agentlib import Runners, check_trainer_scores
from test_agents import EXAMPLES, Recorder, assert_exact, chat_ids, run_all, turn_glue

from molt.agents import load_agent_runner
from molt.spec import AgentSpec

ITEM = {"prompt": "What is 12*7?", "label": "84"}


def test_code_agent_runs_the_models_code_and_shows_it_the_output(tok, engine, trainer):
    sampler, runners = Recorder(engine), Runners(tok)
    try:
        # A generous run limit: under the suite's load the example's 2 s wall limit is tight for a sandbox
        # start, and a run cut short shows the model another observation than the output checked here
        # (timeouts have the test below).
        runner = runners("code_env.py", {"max_turns": 3, "options": {"constrain": True, "timeout_s": 30.0}},
                         max_tokens=64)
        rollouts = run_all(runner, [ITEM] * 4, sampler, group="code")
    finally:
        runners.close()
    hint = sys.modules[runner.env_cls.__module__].HINT
    for r in rollouts:
        [calls] = assert_exact(r, [c for c in sampler.calls if c["key"] == r.rollout_id])
        free, code, answer = calls
        assert free["prompt_ids"] == chat_ids(tok, [{"role": "user", "content": ITEM["prompt"]}])
        sampled = [c["out"]["token_ids"] for c in calls]
        glue = turn_glue(tok, sampled[0], "user", hint)
        assert code["prompt_ids"] == free["prompt_ids"] + sampled[0] + glue
        # The program the model wrote, evaluated here independently of the sandbox.
        program = tok.decode(sampled[1], skip_special_tokens=True)
        expression = re.fullmatch(r"```python\nprint\((.*)\)\n```", program).group(1)
        printed = str(eval(compile(ast.parse(expression, mode="eval"), "<expr>", "eval")))
        observation = turn_glue(tok, sampled[1], "user", f"```output\n{printed}\n```")
        assert answer["prompt_ids"] == code["prompt_ids"] + sampled[1] + observation
        number = re.fullmatch(r"ANSWER: (-?[0-9]+)", tok.decode(sampled[2], skip_special_tokens=True))
        assert r.reward == float(int(number.group(1)) == 84) and r.info == {"code_runs": 1.0}
    check_trainer_scores(trainer, rollouts, tok, sampler.calls)


def test_errors_and_timeouts_come_back_as_text():
    runner = load_agent_runner(AgentSpec(module=str(EXAMPLES / "code_env.py")))
    module = sys.modules[runner.env_cls.__module__]
    assert module.execute("print(6 * 7)", 5.0) == "42"
    assert module.execute("1 / 0", 5.0) == "error: ZeroDivisionError: division by zero"
    assert module.execute("while True:\n    pass", 0.5) == "error: timed out after 0.5s"
    assert module.execute("import socket; socket.create_connection(('1.1.1.1', 80), timeout=2)", 5.0) \
        .startswith("error: OSError")
