"""What the training loop calls on any agent: `setup`, `run`, `close`.

`run` never raises for an agent's fault: an exception in its code, a timeout (agent.timeout_s), a missing
or malformed `Result`, a non-finite reward, an untrainable request or an engine that died under it comes
back as a `Rollout` with `error` set, which the loop counts against agent.max_failure_rate and never
trains on. Only the user's code is wrapped (`agent_code`): an exception in Molt's own code is a bug and
propagates, so the run stops with its traceback instead of counting failures.

The sampler is anything with `generate(prompt_ids, sampling, key)` (the key is the rollout id); one
that also has `release(key)` (the dispatcher: it pins a rollout to an engine) is told when the rollout ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from molt.agents.trace import Trace, failed_rollout
from molt.spec import DataSpec, RunSpec
from molt.trajectory import AgentError, EngineDiedError, Rollout, Sampler


@contextmanager
def agent_code() -> Iterator[None]:
    """Around the user's code (env, agent, tools): whatever it raises fails the rollout as an AgentError
    that names the original exception ("RuntimeError: boom")."""
    try:
        yield
    except AgentError:
        raise
    except Exception as err:
        raise AgentError(f"{type(err).__name__}: {err}") from err


class Runner:
    kind = ""

    def __init__(self) -> None:
        self.tokenizer: Any = None
        self.spec: RunSpec | None = None
        self.judge: Any = None

    def setup(self, tokenizer: Any, spec: RunSpec, judge: Any = None) -> None:
        """Ready to `run`; `judge`: the LLM judge of agent.judge (molt.agents.judge), which the driver starts
        with its engines (molt.driver.judge_engines.start_judge) and `close` shuts down. Without one, a
        judge at agent.judge.url is connected here; judge engines of the run are refused, naming the call."""
        self.tokenizer, self.spec = tokenizer, spec
        if judge is not None:
            self.judge = judge
        elif spec.agent.judge.path:
            from molt.agents.judge import Judge

            self.judge = Judge.start(spec)
        # The run's sampling defaults; a turn may override them (Result.sampling_params, request fields).
        self.sampling = spec.rollout.request()

    async def run(self, item: dict, rollout_id: str, group_id: str, sampler: Sampler,
                  sampling: dict | None = None) -> Rollout:
        """One rollout of `item`. `sampling` is its default sampling, where turns start and what the agent
        is shown (State, ChatContext): the run's training defaults unless given (evaluation passes
        rollout.eval's), so rollouts of both kinds can be in flight on one runner."""
        if self.spec is None:
            raise RuntimeError(f"{type(self).__name__}.setup(tokenizer, spec) must be called before run()")
        trace, defaults = Trace(rollout_id, group_id), dict(self.sampling if sampling is None else sampling)
        try:
            return await asyncio.wait_for(self._run(item, trace, sampler, defaults),
                                          self.spec.agent.timeout_s)
        except TimeoutError:
            error = f"agent timed out after {self.spec.agent.timeout_s}s"
        except AgentError as err:   # its message names what the agent did ("RuntimeError: boom")
            # An engine's refusal arrives as Ray's RayTaskError(AgentError): keep the message, not the
            # remote traceback (which names a pid, so equal failures would not read as equal).
            error = str(getattr(err, "cause", None) or err)
        except EngineDiedError as err:   # the pool restarts the group
            error = f"{type(err).__name__}: {err}"
        finally:
            if hasattr(sampler, "release"):
                sampler.release(rollout_id)
        return failed_rollout(rollout_id, group_id, self.label_of(item), error)

    async def _run(self, item: dict, trace: Trace, sampler: Sampler, defaults: dict) -> Rollout:
        raise NotImplementedError

    def close(self) -> None:
        if self.judge is not None:
            self.judge.shutdown()
            self.judge = None

    def messages_of(self, item: dict) -> list[dict]:
        return prompt_messages(item, self.spec.data)

    def label_of(self, item: dict) -> Any:
        return item.get(self.spec.data.label_key)


def prompt_messages(item: dict, data: DataSpec) -> list[dict]:
    """A dataset row's conversation: its messages (copied), or its prompt string as one user message."""
    if item.get(data.messages_key):   # messages win over a prompt string, as in molt.inputs.data
        return [dict(m) for m in item[data.messages_key]]
    if item.get(data.prompt_key) is not None:
        return [{"role": "user", "content": str(item[data.prompt_key])}]
    raise AgentError(f"dataset row has neither '{data.prompt_key}' nor '{data.messages_key}' "
                     f"(keys: {sorted(item)})")
