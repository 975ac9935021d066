"""BFCL's multi-turn environments (examples/agents/bfcl.py, rows from examples/data/make_bfcl.py): the
ground truth replayed through the Env scores full reward on every user turn of every base entry, and BFCL's
own checker agrees with the Env's verdict; a wrong argument, a skipped call or an extra call scores less;
rollouts never share state; the converter's rows; the engine path through agent.tool_parser; and the CPU
twin of the GPU recipe for 2 steps (a path check)."""

from __future__ import annotations

import asyncio
import copy
import importlib
import inspect
import json
import sys
import uuid
from pathlib import Path

import pytest

from molt.agents import State, load_agent_runner
from molt.agents.tools import make_parser, parse_reply, tool_request
from molt.spec import AgentSpec
from molt.trajectory import AgentError

pytest.importorskip("bfcl_eval", reason="needs bfcl-eval (bash install.sh installs it, docs/install.md)")

from bfcl_eval.constants.executable_backend_config import CLASS_FILE_PATH_MAPPING  # noqa: E402
from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import multi_turn_checker  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples" / "data"))
import make_bfcl  # noqa: E402

RUNNER = load_agent_runner(AgentSpec(module=str(REPO / "examples" / "agents" / "bfcl.py")))
BFCL = sys.modules[RUNNER.env_cls.__module__]
BASE = make_bfcl.rows("base")


def hermes(instances, texts: list[str]) -> str:
    """The ground truth's calls of one reply ("sort('report.pdf')", ...) as a model writes them in Hermes
    markup, the arguments by name."""
    out = ""
    for text in texts:
        name, args, kwargs = BFCL.parse_call(text)
        bound = inspect.signature(instances.methods[name]).bind(*args, **kwargs).arguments
        out += "<tool_call>" + json.dumps({"name": name, "arguments": bound}) + "</tool_call>"
    return out


def written(call: dict) -> str:
    """A call as BFCL's decoder writes what a model called ("name(key=repr(value),...)")."""
    args = json.loads(call["function"]["arguments"])
    return f"{call['function']['name']}(" + ",".join(f"{k}={v!r}" for k, v in args.items()) + ")"


def play(row: dict, turns: list[list[list[dict]]], env=None) -> tuple[list[float], dict, list]:
    """Drive one rollout through the Env's `step`: per user turn, one step per list of calls, then a reply
    without calls. Returns the rewards of every step, the last step's info and the calls as BFCL's checker
    reads them."""
    async def steps(env):
        return [await env.step(State("", "", [], "stop", row["label"], 0, [], {}, row, row["tools"], calls))
                for calls in [c for turn in turns for c in [*turn, []]]]
    results = asyncio.run(steps(env or BFCL.BfclEnv({})))
    decoded = [[[written(c) for c in calls] for calls in turn] for turn in turns]
    return [r.reward for r in results], results[-1].info if results else {}, decoded


def truth(row: dict, per_call: bool, tok) -> list[list[list[dict]]]:
    """The ground truth's calls of each user turn, all in one reply or one call per reply, written in Hermes
    markup, tokenized and read back by vLLM's hermes parser (agent.tool_parser) against the row's tools,
    as the runner reads a sampled reply."""
    instances, parser = BFCL.Instances(row["bfcl"]), make_parser(tok, "hermes")
    request = tool_request(row["tools"])
    out = []
    for texts in row["label"]:
        replies = [[t] for t in texts] if per_call else ([texts] if texts else [])
        out.append([parse_reply(parser, tok, tok.encode(hermes(instances, reply), add_special_tokens=False),
                                request)[1] for reply in replies])
        assert [len(calls) for calls in out[-1]] == [len(reply) for reply in replies], row["id"]
    return out


def bfcl_verdict(row: dict, decoded: list) -> bool:
    """BFCL's own multi_turn_checker on the calls (a fresh model name: its executor keeps instances in module
    globals by name, which is why the Env builds its own)."""
    entry = {"id": row["id"], "initial_config": row["bfcl"]["initial_config"],
             "involved_classes": row["bfcl"]["involved_classes"]}
    model = f"m{uuid.uuid4().hex}"
    return multi_turn_checker(decoded, row["label"], entry, "multi_turn_base", model)["valid"]


def test_replaying_the_ground_truth_scores_full_reward_on_every_user_turn_of_the_base_set(tok):
    """Every one of the 200 base entries, its ground truth replayed (every other entry one call per reply):
    each user turn's closing reply gets exactly 1/U and every reply with calls 0, the rollout 1, BFCL's
    verdict valid, and BFCL's own checker agrees on the same calls."""
    assert len(BASE) == 200
    replay_all(BASE, tok)


@pytest.mark.parametrize("category", ["long_context", "miss_func", "miss_param"])
def test_replaying_the_ground_truth_of_the_other_categories(category, tok):
    """The same for the 200 entries of each other multi-turn category: the long-context state, the held-out
    functions shown in a later user turn, the turns whose ground truth is empty."""
    replay_all(make_bfcl.rows(category), tok)


def replay_all(rows: list[dict], tok) -> None:
    for i, row in enumerate(rows):
        turns = truth(row, i % 2 == 1, tok)
        rewards, info, decoded = play(row, turns)
        closes = _closing(turns)
        assert [r for r, c in zip(rewards, closes, strict=True) if c] == [1 / len(row["label"])] * len(turns)
        assert not any(r for r, c in zip(rewards, closes, strict=True) if not c), row["id"]
        assert sum(rewards) == pytest.approx(1.0, abs=1e-12), row["id"]
        assert info == {"bfcl_valid": 1.0, "state": 1.0, "calls": 1.0}, row["id"]
        assert bfcl_verdict(row, decoded), row["id"]


def _closing(turns: list) -> list[bool]:
    """Per step of `play`: whether it is the reply that closes a user turn."""
    return [closes for steps in turns for closes in [False] * len(steps) + [True]]


def perturbed(row: dict, kind: str, tok) -> tuple[list, int]:
    """The ground truth with one call changed: `wrong`, the first string argument of the first call that
    has one gets "_x" appended (a name, a path, a symbol: what the call acts on); `skipped`, the first
    call dropped; `extra`, the first user turn with calls repeats its last call. Returns the calls per
    user turn (one reply each) and the turn changed."""
    turns = truth(row, False, tok)
    turn = next(u for u, steps in enumerate(turns)
                if steps and (kind != "wrong" or any(map(_strings, steps[0]))))
    calls = copy.deepcopy(turns[turn][0])
    if kind == "skipped":
        calls = calls[1:]
    elif kind == "extra":
        calls.append({**calls[-1], "id": "again"})
    else:
        call = next(c for c in calls if _strings(c))
        args, key = json.loads(call["function"]["arguments"]), _strings(call)[0]
        call["function"]["arguments"] = json.dumps({**args, key: args[key] + "_x"})
    turns[turn] = [calls] if calls else []
    return turns, turn


def _strings(call: dict) -> list[str]:
    return [k for k, v in json.loads(call["function"]["arguments"]).items() if isinstance(v, str)]


@pytest.mark.parametrize("kind", ["wrong", "skipped", "extra"])
def test_a_perturbed_call_scores_less_and_the_verdict_is_bfcls(kind, tok):
    """On the first 30 base entries: the changed turn's closing reply gets less than 1/U and the rollout
    less than 1, and the Env's bfcl_valid is what BFCL's own checker says of the same calls (an extra call
    that repeats one the ground truth makes changes no state and is still valid by BFCL's definition; the
    reward counts it against the turn)."""
    verdicts = []
    for row in BASE[:30]:
        turns, turn = perturbed(row, kind, tok)
        rewards, info, decoded = play(row, turns)
        closing = [r for r, step in zip(rewards, _closing(turns), strict=True) if step]
        assert closing[turn] < 1 / len(row["label"]) and sum(rewards) < 1 - 1e-9, (row["id"], closing)
        valid = bfcl_verdict(row, decoded)
        assert info["bfcl_valid"] == float(valid), row["id"]
        verdicts.append(valid)
    if kind == "wrong":
        assert sum(verdicts) <= 3     # a changed argument fails BFCL almost always (here at most 3 of 30)
    if kind == "skipped":
        assert not any(verdicts)


def test_rollouts_share_no_state(tok):
    """For an entry of each of BFCL's eight API classes, two rollouts of the row interleaved: after the
    first has run its first user turn (and changed the state), the second's instances are still the row's
    initial state, both score 1 in all, and the row itself (shared by a group's rollouts) and BFCL's
    module-level defaults are unchanged after both."""
    classes = sorted({c for row in BASE for c in row["bfcl"]["involved_classes"]})
    rows = [next(r for r in BASE if name in r["bfcl"]["involved_classes"]) for name in classes]
    defaults = {path: str(vars(importlib.import_module(path)).get("DEFAULT_STATE"))
                for name, path in CLASS_FILE_PATH_MAPPING.items() if name in classes}
    changed = 0
    for row in rows:
        before = json.dumps(row, sort_keys=True)
        first, second, turns = BFCL.BfclEnv({}), BFCL.BfclEnv({}), truth(row, False, tok)
        rewards = play(row, turns[:1], first)[0]
        fresh = BFCL.Instances(row["bfcl"])
        changed += not BFCL.state_checker(first.model.objects, fresh.objects)["valid"]
        rewards += play(row, turns[:1], second)[0]
        assert BFCL.state_checker(second.truth.objects, first.truth.objects)["valid"]   # both one turn in
        rewards += play(row, turns[1:], first)[0] + play(row, turns[1:], second)[0]
        assert sum(rewards) == pytest.approx(2.0) and json.dumps(row, sort_keys=True) == before, row["id"]
    assert changed >= 4   # most first turns change the state (the rest only read)
    for path, text in defaults.items():
        assert str(vars(importlib.import_module(path)).get("DEFAULT_STATE")) == text, path


def test_the_converter_writes_rows_with_openai_tools_and_a_held_out_split(tmp_path):
    from molt.spec.agent import check_tools

    make_bfcl.main([str(tmp_path), "--categories", "base,miss_func", "--eval", "5", "--train", "7"])
    files = {p.name: [json.loads(line) for line in p.read_text().splitlines()] for p in tmp_path.iterdir()}
    assert {n: len(r) for n, r in files.items()} == {
        "bfcl_multi_turn_base_train.jsonl": 7, "bfcl_multi_turn_base_eval.jsonl": 5,
        "bfcl_multi_turn_miss_func_train.jsonl": 7, "bfcl_multi_turn_miss_func_eval.jsonl": 5}
    index = {name: {int(r["id"].rsplit("_", 1)[1]) for r in rows} for name, rows in files.items()}
    assert index["bfcl_multi_turn_base_eval.jsonl"] == index["bfcl_multi_turn_miss_func_eval.jsonl"]
    assert not index["bfcl_multi_turn_base_eval.jsonl"] & index["bfcl_multi_turn_base_train.jsonl"]
    for row in files["bfcl_multi_turn_base_train.jsonl"] + files["bfcl_multi_turn_miss_func_eval.jsonl"]:
        check_tools(row["tools"], row["id"])
        types = {p["type"] for t in row["tools"] for p in t["function"]["parameters"]["properties"].values()}
        assert types <= {"string", "integer", "number", "boolean", "array", "object"}, types
        assert len(row["bfcl"]["turns"]) + 1 == len(row["label"])
    row = make_bfcl.rows("miss_func")[0]   # BFCL holds `sort` out until user turn 3
    assert "sort" not in {t["function"]["name"] for t in row["tools"]}
    shown = row["bfcl"]["turns"][2][0]["content"]
    assert '"name": "sort"' in shown and shown.endswith("What about now?") and row["label"][2] == []
    other = State("", "", [], "stop", "4", 0, [], {}, {"prompt": "2+2?", "label": "4"}, [], [])
    with pytest.raises(AgentError, match="not a BFCL entry .* examples/data/make_bfcl.py"):
        asyncio.run(BFCL.BfclEnv({}).step(other))   # another task's row fails its rollout, saying why


def test_the_cpu_twin_of_the_bfcl_recipe_runs_two_steps(tmp_path, ray_session):
    """experiments/tiny_bfcl.yaml (the GPU recipe's agent, tool parser, turn credit and estimator on the
    tiny random model) for 2 steps through the loop: a path check, not learning. Every rollout's prompt
    shows its row's tools, its per-turn rewards sum to its reward, and a rollout that made no call (the
    random model's) scored what the ground truth says it should: per user turn, half the credit when the
    ground truth's calls so far leave the state as it was, none for calls the turn needed."""
    from transformers import AutoTokenizer

    from molt.driver.compose import compose
    from molt.driver.loop import train
    from molt.driver.metrics import load_rollouts

    spec = compose(["+experiment=tiny_bfcl", "train.steps=2", "train.prompts_per_step=1",
                    "train.eval_every=0", "train.best_metric=null", "train.save_every=0", "agent.max_turns=4",
                    "logging.plots=false", "logging.progress=false", "logging.wandb.mode=disabled",
                    "rollout.engine.kv_cache_gib=0.25"])
    spec.run.dir = str(tmp_path)
    train(spec)
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if line]
    steps = [m for m in steps if "info/bfcl_valid" in m]
    assert [m["step"] for m in steps] == [1, 2] and all("adv/advantage_max" in m for m in steps)
    rows = {r["id"]: r for r in map(json.loads, (REPO / spec.data.train_path).read_text().splitlines())}
    tok = AutoTokenizer.from_pretrained(spec.model.path or str(_tiny(spec)))
    checked = 0
    for step in (1, 2):
        for rollout in load_rollouts(tmp_path / "rollouts" / f"step_{step:06d}.jsonl"):
            row = next(r for r in rows.values() if r["label"] == rollout.label)
            shown = tok.decode(rollout.segments[0].token_ids)
            assert all(f'"name": "{t["function"]["name"]}"' in shown for t in row["tools"])
            assert len(rollout.turn_rewards) == rollout.turns and sum(rollout.turn_rewards) == \
                pytest.approx(rollout.reward)
            if rollout.tool_calls == 0:
                assert rollout.reward == pytest.approx(_no_call_reward(row, rollout.turns)), row["id"]
                checked += 1
    assert checked


def _tiny(spec):
    from molt.inputs.tiny import tiny_model_path

    return tiny_model_path(**spec.model.tiny)


def _no_call_reward(row: dict, replies: int) -> float:
    """The reward of a rollout whose `replies` replies made no call: each closes a user turn."""
    initial, truth, total = BFCL.Instances(row["bfcl"]), BFCL.Instances(row["bfcl"]), 0.0
    for texts in row["label"][:replies]:
        for text in texts:
            truth.call(*BFCL.parse_call(text))
        same = BFCL.state_checker(initial.objects, truth.objects)["valid"]
        total += (0.5 * same + 0.5 * (not texts)) / len(row["label"])
    return total
