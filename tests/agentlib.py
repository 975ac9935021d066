"""Helpers of the agent-integration tests: start chat/env runners from example modules, check the
trainer's scores of their tokens and train one step."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import torch
from test_agents import EXAMPLES, make_spec

from molt.agents import load_agent_runner
from molt.driver.judge_engines import start_judge

# An agent module that notes each execution of itself (its import), by process, in `<its path>.executions`:
# a run executes it once per process (checked by tests/test_config.py and tests/faults/test_bad_input.py).
COUNTING_AGENT = """
import os
with open(__file__ + ".executions", "a") as f:
    f.write(f"{os.getpid()}\\n")
from molt.agents import Env, Result, StepEnvRunner

class Noop(Env):
    async def step(self, state):
        return Result(reward=0.0)

AgentRunner = StepEnvRunner(Noop)
"""


def executions(module: Path) -> list[int]:
    """The process ids that executed `module` (a COUNTING_AGENT), one per execution."""
    return [int(pid) for pid in Path(f"{module}.executions").read_text().split()]


class Runners:
    """Starts runners of example agents (each chat runner with its own loopback server); `close` ends all."""

    def __init__(self, tok) -> None:
        self.tok, self.started = tok, []

    def __call__(self, module: str, agent: dict | None = None, **rollout):
        agent = {"module": str(EXAMPLES / module), **(agent or {})}
        spec = make_spec(agent, **rollout)
        runner = load_agent_runner(spec.agent)
        runner.setup(self.tok, spec, start_judge(spec))   # as the driver sets runners up (None: no judge)
        self.started.append(runner)
        return runner

    def close(self) -> None:
        for runner in self.started:
            runner.close()


def check_trainer_scores(trainer, rollouts: list, tok, calls: list[dict]) -> None:
    """The trainer's logprob of every sampled token, from the engine's weights, against the engine's
    (`calls`: the Recorder's): equal on a free turn; on a turn the server constrained (a forced tool call,
    an output format: evaluation only) the engine reports the logprob under the constraint, renormalised
    over the allowed tokens, so never below the trainer's. A token or logprob misplaced would break either.
    """
    from molt.trainer.batch import make_batch

    trainer.load(trainer.initial)
    segments = [s for r in rollouts for s in r.segments]
    trained = trainer.logprobs(make_batch(segments, tok.pad_token_id))
    for row, seg in enumerate(segments):
        for c in calls:
            start, out = len(c["prompt_ids"]), c["out"]
            if c["key"] != seg.rollout_id or seg.token_ids[:start + len(out["token_ids"])] != \
                    c["prompt_ids"] + out["token_ids"]:
                continue
            mine = trained[row, start:start + len(out["token_ids"])]
            engine = torch.tensor(out["logprobs"])
            if "structured_outputs" in c["sampling"]:
                assert bool((engine >= mine - 1e-3).all()), (engine - mine).min()
            else:
                assert float((engine - mine).abs().max()) < 1e-3, (engine - mine).abs().max()


def train_one_step(trainer, rollouts: list, sampler, tok) -> dict:
    """One optimizer step of the loop's own `learn` on rollouts sampled as a run samples training rollouts
    (`sampler`: a `Recorder(engine, training=True)`, i.e. through TrainingSampler), from the engine's
    weights: the trainer scores every sampled token as the engine did (`check_trainer_scores`), exactly
    the sampled tokens are trained, with a finite loss and gradient norm."""
    from molt.driver.loop import learn
    from molt.spec import RunSpec
    from molt.trainer.ranks import Trainers

    assert sampler.training, "train only on rollouts sampled through the TrainingSampler, as a run does"
    check_trainer_scores(trainer, rollouts, tok, sampler.calls)
    spec = RunSpec.model_validate({"train": {"micro_batch_size": 8}})
    metrics = asyncio.run(learn(spec, rollouts, Trainers(trainer, pad_id=tok.pad_token_id), 0))
    assert "train/skipped" not in metrics and metrics["rollout/failed"] == 0
    assert metrics["tokens/trained"] == sum(sum(s.loss_mask) for r in rollouts for s in r.segments)
    assert math.isfinite(metrics["train/loss"]) and math.isfinite(metrics["train/grad_norm"])
    return metrics
