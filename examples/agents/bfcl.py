"""BFCL's multi-turn environments (the Berkeley Function Calling Leaderboard's `bfcl-eval`) as an Env.

A row (`examples/data/make_bfcl.py` writes them from BFCL's own files) is one BFCL entry: its first user
turn as `messages`, the functions of its API classes as `tools` (BFCL's function docs as OpenAI function
schemas, which the runner renders through the chat template), its ground-truth calls per user turn as
`label`, and under `bfcl` the later user turns, the classes and their initial state.

Each rollout builds two fresh sets of BFCL's own API classes (GorillaFileSystem, TwitterAPI, TradingBot,
...: in-memory simulations in plain Python, imported from bfcl_eval), each loaded with a deep copy of the
row's initial state: one the model's calls run on, one the ground truth's. The calls agent.tool_parser
read in a reply run on the first set, and their results, formatted as BFCL formats them, come back as
tool messages. A reply without calls ends the user turn: the ground truth's calls of that turn run on the
second set, the turn is scored, and the next user turn follows (the episode ends after the last).

Reward, on the reply that ends user turn u of the row's U (the replies with calls before it get 0):

    r_u = (0.5 * state_u + 0.5 * calls_u) / U

- state_u: BFCL's state check (bfcl_eval's `state_checker`): every public attribute of every instance
  equals the ground truth's.
- calls_u: BFCL's response check, graded: of the ground truth's results in turn u, how many the model's
  results so far hold (a multiset, as bfcl_eval's `_is_subsequence_unordered` counts them), over the
  larger of that number and the calls the model made in turn u; 0 when the turn has ground-truth calls
  and the model made none, 1 when neither called.

A rollout that does everything right gets 1, and one that gets 1 passes BFCL. The converse does not hold:
BFCL passes extra calls that change no state (a repeated read), and does not check the turns whose ground
truth is empty (miss_param, miss_func: the model should not call there); the reward counts both against
the turn. NeMo-RL weighs state and calls 0.5 / 0.5 as well.

`info`: `bfcl_valid`, BFCL's own verdict on the rollout as its `multi_turn_checker` reaches it (every user
turn served within BFCL's 20 calling steps per turn, a call in every turn whose ground truth calls, the
state check and the ungraded response check after each such turn), whose mean over a set is BFCL's
multi-turn accuracy; `state` and `calls`, the means of state_u and calls_u over the row's U turns (a turn
not reached counts 0). Options: `max_steps_per_turn` (default BFCL's 20: one step more ends the rollout,
as BFCL force-terminates an entry).
"""

from __future__ import annotations

import ast
import copy
import importlib
import inspect
import json
from typing import Any

# bfcl-eval is installed without its dependencies (docs/install.md): these modules need only the standard
# library (and mpmath, for MathAPI)
from bfcl_eval.constants.default_prompts import MAXIMUM_STEP_LIMIT
from bfcl_eval.constants.executable_backend_config import CLASS_FILE_PATH_MAPPING, STATELESS_CLASSES
from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import (
    _is_subsequence_unordered,
    state_checker,
)

from molt.agents import Env, Result, State, StepEnvRunner
from molt.trajectory import AgentError

BLOCKED = ("kill", "exit", "quit", "remove", "unlink", "popen", "Popen", "run")   # BFCL refuses these names


def result_text(value: Any) -> str:
    """A call's result as BFCL shows it to the model and compares it: a string as is, a dict as JSON."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        try:
            return json.dumps(value)
        except (TypeError, ValueError):
            return str(value)
    return str(value)


class Instances:
    """One set of the row's API class instances, loaded with its initial state; runs calls by name."""

    def __init__(self, bfcl: dict[str, Any]) -> None:
        self.objects, self.methods = {}, {}
        for name in bfcl["involved_classes"]:
            obj = getattr(importlib.import_module(CLASS_FILE_PATH_MAPPING[name]), name)()
            if name not in STATELESS_CLASSES:
                # a deep copy: the instance keeps (and changes) the dicts it is given, and the row is shared
                # by the rollouts of its group
                obj._load_scenario(copy.deepcopy(bfcl["initial_config"].get(name, {})),
                                   long_context=bfcl["long_context"])
            self.objects[name] = obj
            # a method name maps to the last class that has it, as in BFCL's executor
            self.methods.update({m: f for m, f in inspect.getmembers(obj, inspect.ismethod) if m[0] != "_"})

    def call(self, name: str, args: list | None = None, kwargs: dict | None = None) -> str:
        """Run one call; what fails is its result text, worded as BFCL's executor words it."""
        try:
            if name in BLOCKED:
                raise Exception(f"Function call {name} is not allowed.")
            if name not in self.methods:
                raise NameError(f"name '{name}' is not defined")
            return result_text(self.methods[name](*(args or []), **(kwargs or {})))
        except Exception as err:
            return f"Error during execution: {err}"


def parse_call(text: str) -> tuple[str, list, dict]:
    """A ground-truth call as BFCL writes it ("mv(source='a', destination='b')") -> name, args, kwargs."""
    node = ast.parse(text, mode="eval").body
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
        raise ValueError(f"not a function call: {text!r}")
    return (node.func.id, [ast.literal_eval(a) for a in node.args],
            {k.arg: ast.literal_eval(k.value) for k in node.keywords})


class BfclEnv(Env):
    def __init__(self, options: dict | None = None) -> None:
        super().__init__(options)
        self.max_steps = int(self.options.get("max_steps_per_turn", MAXIMUM_STEP_LIMIT))
        self.model: Instances | None = None   # built from the row at the first step: one set per rollout
        self.truth: Instances | None = None
        self.turn = self.steps = 0            # the user turn, and its replies with calls so far
        self.turn_calls = 0                   # calls the model made in this user turn
        self.results: list[str] = []          # every result of the model's calls, all turns
        self.states: list[float] = []         # state_u, calls_u and BFCL's verdict of each turn scored
        self.calls: list[float] = []
        self.passed: list[bool] = []

    async def step(self, state: State) -> Result:
        bfcl, truth_calls = state.item.get("bfcl"), state.label
        if self.model is None:
            if not isinstance(bfcl, dict) or not isinstance(truth_calls, list) or \
                    len(bfcl.get("turns", ())) + 1 != len(truth_calls):
                raise AgentError("the row is not a BFCL entry (a `bfcl` field, and a label with the calls of "
                                 "each user turn): write rows with examples/data/make_bfcl.py")
            self.model, self.truth = Instances(bfcl), Instances(bfcl)
        if state.tool_calls:
            self.steps += 1
            messages = [self._run(call) for call in state.tool_calls]
            # past BFCL's step limit the entry is force-terminated: the turns left score 0
            ended = self.steps > self.max_steps
            return Result(reward=0.0, observation=None if ended else messages, terminated=ended,
                          info=self._info(len(truth_calls)))
        reward = self._score(truth_calls[self.turn], len(truth_calls))
        self.turn, self.steps, self.turn_calls = self.turn + 1, 0, 0
        info = self._info(len(truth_calls))
        if self.turn == len(truth_calls):
            return Result(reward=reward, info=info)
        return Result(reward=reward, observation=bfcl["turns"][self.turn - 1], terminated=False, info=info)

    def _run(self, call: dict) -> dict:
        """One of the model's calls on its instances, answered with a tool message."""
        name, text = call["function"]["name"], call["function"].get("arguments") or "{}"
        try:
            kwargs = json.loads(text)
            result = self.model.call(name, kwargs=kwargs) if isinstance(kwargs, dict) else \
                f"Error during execution: arguments must be a JSON object, got {text[:100]}"
        except ValueError as err:
            result = f"Error during execution: arguments are not JSON: {err}"
        self.results.append(result)
        self.turn_calls += 1
        return {"role": "tool", "tool_call_id": call.get("id", ""), "name": name, "content": result}

    def _score(self, truth_calls: list[str], turns: int) -> float:
        """r_u of the user turn that just ended (module docstring), after running its ground truth."""
        expected = [self.truth.call(*parse_call(text)) for text in truth_calls]
        state = state_checker(self.model.objects, self.truth.objects)["valid"]
        missing = _is_subsequence_unordered(expected, self.results)[1]
        if not self.turn_calls:
            calls = 0.0 if expected else 1.0
        else:
            calls = (len(expected) - len(missing)) / max(len(expected), self.turn_calls)
        self.states.append(float(state))
        self.calls.append(calls)
        # BFCL checks only the turns whose ground truth calls: a call made, the state, no result missing
        self.passed.append(not truth_calls or (bool(self.turn_calls) and state and not missing))
        return (0.5 * state + 0.5 * calls) / turns

    def _info(self, turns: int) -> dict[str, float]:
        return {"bfcl_valid": float(len(self.passed) == turns and all(self.passed)),
                "state": sum(self.states) / turns, "calls": sum(self.calls) / turns}


AgentRunner = StepEnvRunner(BfclEnv)
