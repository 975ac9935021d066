"""Bad input: each mistake is one clear line, before anything starts.

`python -m molt` (the table `BAD_INPUTS`): the dry run and a real start print the same one-line `molt:`
error and exit 2, and the real start creates no run folder and starts no Ray. `molt.driver.loop.train`
(the Python API): the same inputs raise before any engine or trainer actor starts (the Ray cluster's actor
table is the same before and after)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import ray
from agentlib import COUNTING_AGENT, executions
from faultlib import small_spec

import molt.__main__ as cli
from molt.driver.compose import compose, prepare
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


# the counting agent, its runner's set-up failing
SETUP_FAILS = COUNTING_AGENT + """
class NoKey(StepEnvRunner):
    def setup(self, tokenizer, spec, judge=None):
        raise RuntimeError("agent set-up failed: no API key")

AgentRunner = NoKey(Noop)
"""


@pytest.mark.parametrize("workers", [0, 1])
def test_a_failure_after_the_engines_were_asked_for_stops_them(ray_session, tmp_path, workers):
    """The engines are asked for before the agent's set-up, so that they load while the rest starts
    (`molt.driver.run.Run.start`): a failure then must stop them, not leave them in the caller's cluster.
    With agent workers the set-up that fails is a worker's (the driver's runner is not set up). The agent
    module executed once per process: checked by `prepare`, the runner it built is the one the run uses
    (handed to `train` as `python -m molt` hands it, so a loop that built its inputs again shows here)."""
    (tmp_path / "setup_fails.py").write_text(SETUP_FAILS)
    spec = small_spec({"module": str(tmp_path / "setup_fails.py"), "workers": workers},
                      run={"dir": str(tmp_path / "run")})
    before = live_actor_classes()
    with pytest.raises(Exception, match="agent set-up failed: no API key"):
        train(spec, prepare(spec))
    assert live_actor_classes() == before
    pids = executions(tmp_path / "setup_fails.py")
    assert len(pids) == len(set(pids)) == 1 + workers and os.getpid() in pids, pids


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


# A user's bad inputs to `python -m molt`, each: the files it needs (written under the test's folder, DIR in
# the overrides), the overrides, and the one line a dry run and a real start print for it (a regex).
ROW = '{"prompt": "a", "label": "a"}\n'
BAD_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}
BAD_INPUTS = {
    # the three the dry run used to accept
    "a missing local model folder": ({}, ["model.path=/some/missing/folder"],
                                     r"model.path=/some/missing/folder: no such folder \(and not a hub id"),
    "run.resume without a checkpoint": ({}, ["run.resume=/some/missing/folder"],
                                        r"run.resume=/some/missing/folder: no checkpoint there"),
    "a context too small for the prompts": ({}, ["model.max_model_len=12"],
                                            r"repeat_train.jsonl:\d+: the prompt renders to 10 tokens .*18 "
                                            r"tokens, above model.max_model_len=12"),
    # those answered well before: they stay one line
    "a malformed JSON row": ({"bad.jsonl": ROW + "{oops\n"}, ["data.train_path=DIR/bad.jsonl"],
                             r"bad.jsonl:2: malformed row: Expecting property name"),
    "a row without prompt or messages": ({"bad.jsonl": '{"text": "a", "label": "a"}\n'},
                                         ["data.train_path=DIR/bad.jsonl"],
                                         r"bad.jsonl:1: malformed row: needs 'messages' .* keys present: "
                                         r"\['label', 'text'\]"),
    "an empty file": ({"empty.jsonl": ""}, ["data.train_path=DIR/empty.jsonl"],
                      r"empty.jsonl: dataset has no rows"),
    "a missing eval file": ({}, ["data.eval=[DIR/nope.jsonl]"], r"dataset file not found: '.*nope.jsonl'"),
    "an agent module with a syntax error": ({"broken.py": "def broken(:\n"}, ["agent.module=DIR/broken.py"],
                                            r"broken.py' could not be loaded: SyntaxError"),
    "a negative temperature": ({}, ["rollout.temperature=-0.5"], r"rollout.temperature=-0.5 does not sample"),
    "steps that are not a number": ({}, ["train.steps=abc"],
                                    r"invalid run spec: train.steps: Input should be a valid integer"),
    "no samples per prompt": ({}, ["rollout.samples_per_prompt=0"],
                              r"invalid run spec: rollout.samples_per_prompt: Input should be greater than"),
    # more
    "an agent module without AgentRunner": ({"no_runner.py": "from molt.agents import Env\n"},
                                            ["agent.module=DIR/no_runner.py"],
                                            r"no_runner.py' does not export AgentRunner"),
    "a missing agent module": ({}, ["agent.module=DIR/missing.py"], r"missing.py' could not be loaded: "
                               r"FileNotFoundError"),
    "a tool schema that is not JSON Schema": ({"tools.jsonl": json.dumps({"prompt": "a", "label": "a",
                                                                         "tools": [BAD_TOOL]}) + "\n"},
                                              ["data.train_path=DIR/tools.jsonl"],
                                              r"tools.jsonl:1: tools\[0\] \(f\): its parameters are not a "
                                              r"valid JSON Schema: at type: 'nope' is not valid"),
    "a ChatAgent on a tokenizer without a chat template": ({}, ["agent=chat_minimal", "model.path=DIR/plain"],
                                                           r"has no chat template"),
    "a data.eval entry that is a folder": ({"folder/x": ""}, ["data.eval=[DIR/folder]"],
                                           r"dataset '.*folder' is a folder .*not a .jsonl or .parquet file"),
    "a negative learning rate": ({}, ["train.lr=-1e-4"], r"train.lr: Input should be greater than 0"),
    "dp_size not dividing the batch": ({}, ["parallel.dp_size=3"],
                                       r"prompts_per_step\*rollout.samples_per_prompt = 64 must be "
                                       r"divisible by parallel.dp_size=3"),
    "a Molt checkpoint as model.path": ({"ckpt/meta.json": "{}"}, ["model.path=DIR/ckpt"],
                                        r"is a Molt checkpoint, not a Hugging Face folder: export it"),
    "an unknown estimator": ({}, ["algo.estimator=grpoo"],
                             r"unknown estimator 'grpoo' \(did you mean 'grpo'"),
    "a key the spec no longer has": ({}, ["parallel.world_size=2"],
                                     r"unknown key 'parallel.world_size' \(did you mean"),
    "a best metric of no eval set": ({}, ["train.best_metric=eval/nope/pass@1"],
                                     r"train.best_metric='eval/nope/pass@1' must be eval/NAME/METRIC"),
    "a critic for a vision-language model": ({}, ["model=tiny_vl", "algo=gae", "model.critic=true"],
                                             r"a value model of a VLM is not supported"),
    "context parallel for a vision-language model": ({}, ["model=tiny_vl", "parallel.cp_size=2"],
                                                      r"cp_size > 1 with a vision-language model"),
}


@pytest.fixture(scope="module")
def plain_model(tiny_model_path, tmp_path_factory):
    """The tiny model with a tokenizer that has no chat template."""
    import shutil

    folder = tmp_path_factory.mktemp("plain")
    shutil.copytree(tiny_model_path, folder, dirs_exist_ok=True)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def molt_lines(monkeypatch, capsys, argv: list[str]) -> tuple[int | str | None, list[str]]:
    """`python -m molt ARGV` in this process: its exit code and the `molt:` lines it printed on stderr."""
    monkeypatch.setattr("sys.argv", ["molt", *argv])
    code = 0
    try:
        cli.main()
    except SystemExit as done:
        code = done.code
    err = capsys.readouterr().err
    return code, [line for line in err.splitlines() if line.startswith("molt: ")]


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_each_bad_input_is_one_line_in_the_dry_run_and_the_real_start(case, tmp_path, plain_model,
                                                                      monkeypatch, capsys):
    """The dry run prints the line and exits 2; a real start prints the same line, exits 2 and starts
    nothing: no run folder, no Ray, the launcher never called."""
    files, overrides, message = BAD_INPUTS[case]
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "plain").symlink_to(plain_model)
    argv = [o.replace("DIR", str(tmp_path)) for o in overrides] + [f"hydra.run.dir={tmp_path / 'run'}"]
    launched = []   # neither the launcher nor Ray may be reached
    monkeypatch.setattr("molt.driver.launch.launch", lambda *args: launched.append(args))
    monkeypatch.setattr("molt.plan.placement.init_ray", lambda *args: launched.append(args))
    dry_code, dry = molt_lines(monkeypatch, capsys, [*argv, "run.dry_run=true"])
    code, real = molt_lines(monkeypatch, capsys, argv)
    assert (dry_code, code) == (2, 2) and dry == real, (dry, real)
    assert [line for line in real if re.search(message, line)], real
    assert not (tmp_path / "run").exists() and not launched


def test_a_refusal_and_an_error_after_the_start_are_one_line_without_hydras_traceback(tmp_path):
    """In a fresh process, through Hydra's app: an error once the run has started (the loop raises) is one
    line naming its type, exit 2, with the traceback in the run folder's error.txt, never Hydra's "Error
    executing job"; HYDRA_FULL_ERROR=1 prints the traceback. (A refusal before the start: the table above.)"""
    def molt(*args: str, **env: str) -> subprocess.CompletedProcess:
        code = ("import sys, molt.driver.loop as loop, molt.plan.placement as placement\n"
                "from molt.__main__ import main\n"
                "placement.init_ray, placement.bind = (lambda spec: None), (lambda spec, roles=None: [])\n"
                "def boom(spec, inputs):\n    raise RuntimeError('boom in the loop')\n"
                "loop.train = boom\nsys.argv = ['molt', *sys.argv[1:]]\nmain()\n")
        return subprocess.run([sys.executable, "-c", code, *args, f"hydra.run.dir={tmp_path / 'run'}"],
                              capture_output=True, text=True, timeout=300, env={**os.environ, **env})

    failed = molt()
    error = tmp_path / "run" / "error.txt"
    assert failed.returncode == 2 and "Traceback" not in failed.stderr, failed.stderr
    assert "Error executing job" not in failed.stderr
    assert failed.stderr.strip().splitlines()[-1] == (f"molt: RuntimeError: boom in the loop (traceback in "
                                                      f"{error}; HYDRA_FULL_ERROR=1 prints the traceback)")
    assert 'in boom\nRuntimeError: boom in the loop' in error.read_text()
    shown = molt(HYDRA_FULL_ERROR="1")
    assert shown.returncode != 0 and "Traceback" in shown.stderr and "boom in the loop" in shown.stderr




@pytest.mark.parametrize("override, message", [
    ("train.stepz=3", "train.steps"),                          # a typo names the nearest key
    ("agent.on_failure=skip", "agent.on_failure"),             # a bad value names key and choices
    ("agent.timeout_s=soon", "agent.timeout_s"),
])
def test_config_errors_are_one_message(override, message):
    with pytest.raises(SpecError, match=message):
        compose([override])
