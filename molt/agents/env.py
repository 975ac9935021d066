"""The `Env` path: the framework owns the LLM loop, the user's `step()` owns the reward.

Gymnasium-style: the chat template is rendered once for the prompt; each turn the engine samples, the
user's `step()` sees the decoded action and returns a `Result`; a further observation is appended as
tokens with loss mask 0 until the episode terminates, is truncated, or a turn/token budget runs out. A
template that renders earlier turns differently once the observation follows (Qwen3 drops old `<think>`
blocks) seals the segment and the next one starts from the re-rendered conversation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from molt.agents.render import continuation, encode, render, text_of
from molt.agents.runner import Runner, agent_code
from molt.agents.trace import Trace, as_finite
from molt.trajectory import AgentError, Rollout, Sampler
from molt.vision import normalize


@dataclass
class Result:
    reward: float
    observation: str | dict | None = None   # next input: text (a user turn) or a whole message dict
                                             # (its content may hold image parts, molt.vision)
    terminated: bool = True
    truncated: bool = False
    info: dict[str, float] = field(default_factory=dict)   # scalar diagnostics, logged
    score: float | None = None               # for filters; defaults to the reward
    sampling_params: dict[str, Any] | None = None          # override for the next turn only


@dataclass
class State:
    observation: str                 # the latest observation's text (the prompt on the first turn)
    action: str                      # the text the model just produced (special tokens removed)
    action_ids: list[int]            # its token ids, exactly as sampled
    finish_reason: str               # stop | length
    label: Any
    turn: int
    messages: list[dict]             # the conversation so far, the action included
    sampling_params: dict[str, Any]  # what this action was sampled with
    item: dict                       # the dataset row


class Env:
    """Subclass and implement `step`; one instance per rollout, built with the agent's options.

    `self.tokenizer` is the policy's tokenizer (set by the runner), for rewards over token ids;
    `self.judge` the LLM judge of agent.judge (None without one), for `await self.judge.p_yes(messages)`.
    """

    tokenizer: Any = None
    judge: Any = None

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        self.options = dict(options or {})

    async def step(self, state: State) -> Result:
        raise NotImplementedError


class StepEnvRunner(Runner):
    kind = "env"

    def __init__(self, env_cls: type[Env]) -> None:
        super().__init__()
        self.env_cls = env_cls

    async def _run(self, item: dict, trace: Trace, sampler: Sampler, defaults: dict) -> Rollout:
        agent, tok, template_kwargs = self.spec.agent, self.tokenizer, self.spec.model.chat_template_kwargs
        messages, images = normalize(self.messages_of(item))
        tools = item.get("tools") or None   # the row's tool schemas, rendered as the SFT data path does
        trace.extend_prompt(encode(tok, render(tok, messages, tools, chat_template_kwargs=template_kwargs)),
                            images)
        with agent_code():
            env = self.env_cls(self.spec.agent.options)
        env.tokenizer, env.judge = tok, self.judge
        sampling, observation = dict(defaults), text_of(messages[-1].get("content"))
        reward, score, info = 0.0, None, {}
        # A turn's override may ask for fewer tokens than the run's per-turn bound (rollout.max_tokens, or
        # rollout.eval.max_tokens in evaluation), never more, as on the chat server: the overlong penalty
        # and filters measure a response against that bound.
        cap = defaults.get("max_tokens", self.spec.rollout.max_tokens)
        for turn in range(agent.max_turns):
            budget = min(sampling.get("max_tokens", cap), cap, agent.max_total_tokens - len(trace.ids))
            if budget < 1:
                break
            turn_sampling = {**sampling, "max_tokens": budget}
            out = await sampler.generate(list(trace.ids), turn_sampling, trace.rollout_id,
                                         **({"images": list(trace.images)} if trace.images else {}))
            trace.add_sample(out)
            ids = list(out["token_ids"])
            action = tok.decode(ids, skip_special_tokens=True)
            messages.append({"role": "assistant", "content": action})
            with agent_code():
                result = await env.step(State(observation, action, ids, trace.finish_reason,
                                              self.label_of(item), turn, list(messages), turn_sampling, item))
            if not isinstance(result, Result):
                raise AgentError(f"{self.env_cls.__name__}.step returned {type(result).__name__}, not Result")
            reward += as_finite(result.reward, "reward")
            score, info = result.score, result.info
            if result.terminated or result.truncated or result.observation is None:
                break
            message = result.observation if isinstance(result.observation, dict) else \
                {"role": "user", "content": result.observation}
            [message], images = normalize([message])   # image parts -> placeholders + data URLs
            glue = continuation(tok, messages[:-1], messages[-1], [message], tools,
                                bool(ids) and ids[-1] == tok.eos_token_id, template_kwargs)
            messages.append(message)
            if glue is None:   # the template re-renders earlier turns (Qwen3 drops old <think> blocks)
                trace.restart(encode(tok, render(tok, messages, tools, chat_template_kwargs=template_kwargs)),
                              normalize(messages)[1])
            else:
                trace.extend_prompt(encode(tok, glue), images)
            observation = text_of(message.get("content"))
            # An override holds for the next turn only (as documented); later turns are back on the run's
            # sampling unless their own step asks again.
            sampling = {**defaults, **(result.sampling_params or {})}
        return trace.rollout(reward, score, info, self.label_of(item))

