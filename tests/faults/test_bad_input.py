"""Bad input to a real `molt.driver.loop.train`: each mistake is one clear message, raised before any
engine or trainer actor starts (the Ray cluster's actor table is the same before and after). Config errors are
caught by composition itself, before `train` is ever called."""

from __future__ import annotations

import pytest
import ray
from faultlib import small_spec

from molt.driver.compose import compose
from molt.driver.loop import train
from molt.spec import SpecError

GOOD_ROW = '{"prompt": "a", "label": "a"}\n'


def live_actor_classes() -> list[str]:
    # Ray's own actor table (the public state API needs the dashboard, which tests run without); an
    # actor asked for but still being created counts as started.
    return sorted(a["ActorClassName"] for a in ray._private.state.actors().values() if a["State"] != "DEAD")


def cases(tmp: object) -> dict[str, tuple[dict, type, str]]:
    (tmp / "syntax_error.py").write_text("def broken(:\n")
    (tmp / "no_runner.py").write_text("from molt.agents import Env\n")
    (tmp / "bad.jsonl").write_text(GOOD_ROW * 2 + '{"prompt": "a"}\n' + GOOD_ROW)
    return {
        "missing model": ({"model": {"path": "/nonexistent/model"}}, FileNotFoundError,
                          "model.path=/nonexistent/model: no such folder"),
        "missing agent": ({"agent": {"module": str(tmp / "missing.py")}}, ImportError,
                          "missing.py' could not be loaded: FileNotFoundError"),
        "unreadable agent": ({"agent": {"module": str(tmp / "syntax_error.py")}}, ImportError,
                             "syntax_error.py' could not be loaded: SyntaxError"),
        "no AgentRunner": ({"agent": {"module": str(tmp / "no_runner.py")}}, ImportError,
                           "no_runner.py' does not export AgentRunner"),
        "malformed row": ({"data": {"train_path": str(tmp / "bad.jsonl")}}, ValueError,
                          f"{tmp / 'bad.jsonl'}:3: malformed row: missing label key 'label'"),
    }


@pytest.mark.parametrize("case", ["missing model", "missing agent", "unreadable agent", "no AgentRunner",
                                  "malformed row"])
def test_bad_input_fails_before_any_actor_starts(ray_session, tmp_path, case):
    sections, error, message = cases(tmp_path)[case]
    spec = small_spec(**sections, run={"dir": str(tmp_path / "run")})
    before = live_actor_classes()
    with pytest.raises(error) as raised:
        train(spec)
    assert message in str(raised.value)
    assert live_actor_classes() == before


SETUP_FAILS = """
from molt.agents import Env, Result, StepEnvRunner

class Noop(Env):
    async def step(self, state):
        return Result(reward=0.0)

class NoKey(StepEnvRunner):
    def setup(self, tokenizer, spec, judge=None):
        raise RuntimeError("agent set-up failed: no API key")

AgentRunner = NoKey(Noop)
"""


@pytest.mark.parametrize("workers", [0, 1])
def test_a_failure_after_the_engines_were_asked_for_stops_them(ray_session, tmp_path, workers):
    """The engines are asked for before the agent's set-up, so that they load while the rest starts
    (`molt.driver.loop.start_run`): a failure then must stop them, not leave them in the caller's cluster.
    With agent workers the set-up that fails is a worker's (the driver's runner is not set up)."""
    (tmp_path / "setup_fails.py").write_text(SETUP_FAILS)
    spec = small_spec({"module": str(tmp_path / "setup_fails.py"), "workers": workers},
                      run={"dir": str(tmp_path / "run")})
    before = live_actor_classes()
    with pytest.raises(Exception, match="agent set-up failed: no API key"):
        train(spec)
    assert live_actor_classes() == before


def test_an_engine_start_time_out_stops_the_ranks_and_closes_the_log(ray_session, tmp_path, monkeypatch):
    """An engine that does not come up in `rollout.engine.start_timeout_s`: the agent, the trainer ranks
    and the run logger were started meanwhile; all of it is stopped and closed, not left behind."""
    from ray.exceptions import GetTimeoutError

    from molt.agents.runner import Runner
    from molt.driver.metrics import RunLogger

    closed = []
    for cls in (Runner, RunLogger):
        close = cls.close
        monkeypatch.setattr(cls, "close", lambda self, close=close: closed.append(type(self)) or close(self))
    spec = small_spec(rollout={"engine": {"start_timeout_s": 0.5}}, run={"dir": str(tmp_path / "run")})
    before = live_actor_classes()
    with pytest.raises(GetTimeoutError):
        train(spec)
    assert live_actor_classes() == before
    assert sorted(c.__name__ for c in closed) == ["RunLogger", "StepEnvRunner"]


@pytest.mark.parametrize("override, message", [
    ("train.stepz=3", "train.steps"),                          # a typo names the nearest key
    ("agent.on_failure=skip", "agent.on_failure"),             # a bad value names key and choices
    ("agent.timeout_s=soon", "agent.timeout_s"),
])
def test_config_errors_are_one_message(override, message):
    with pytest.raises(SpecError, match=message):
        compose([override])
