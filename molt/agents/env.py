"""The `Env` path: the framework owns the LLM loop, the user's `step()` owns the reward.

Gymnasium-style: the chat template is rendered once for the prompt, with the rollout's tools
(agent.tools, then the row's `tools`) shown the way the template shows them; each turn the engine
samples, the turn is read with vLLM's tool parser (agent.tool_parser, as on the chat server), and the
user's `step()` sees the decoded action and its tool calls and returns a `Result`; a further observation
(a user turn, or tool messages: `Env.call_tools` runs the calls against `Env.tools`) is appended as tokens
with loss mask 0 until the episode terminates, is truncated, or a turn/token budget runs out (the
template's text after the reply, from two renders a turn: the rendering before it is kept). A template
that renders earlier turns differently once the observation follows (Qwen3 drops old `<think>` blocks)
seals the segment and the next one starts from the re-rendered conversation.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from molt.agents.render import continuation, encode, render, text_of
from molt.agents.runner import Runner, agent_code, prompt_messages
from molt.agents.tools import ERROR_PREFIX, make_parser, offered_tools, parse_reply, tool_request
from molt.agents.trace import Trace, as_finite, mark_context_cut
from molt.inputs.vision import normalize
from molt.spec import RunSpec
from molt.trajectory import AgentError, Rollout, Sampler


@dataclass
class Result:
    reward: float
    # next input: text (a user turn), a whole message dict (its content may hold image parts,
    # molt.inputs.vision), or a list of messages (the tool messages `Env.call_tools` returns)
    observation: str | dict | list[dict] | None = None
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
    tools: list[dict] = field(default_factory=list)       # the tool schemas the prompt showed
    # the calls agent.tool_parser read in the action, OpenAI shape: {"id", "type": "function",
    # "function": {"name", "arguments": JSON text}}; [] when no tools are offered
    tool_calls: list[dict] = field(default_factory=list)


class Env:
    """Subclass and implement `step`; one instance per rollout, built with the agent's options.

    `tools` maps a tool's name to the function that runs it: called with the call's arguments as keywords,
    it returns the text the model reads (sync functions run in a thread; what goes wrong because of the
    call should come back as text starting with "error:", an exception fails the rollout).
    `self.tokenizer` is the policy's tokenizer (set by the runner), for rewards over token ids;
    `self.judge` the LLM judge of agent.judge (None without one), for `await self.judge.p_yes(messages)`.
    """

    tokenizer: Any = None
    judge: Any = None
    tools: ClassVar[dict[str, Callable[..., Any]]] = {}

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        self.options = dict(options or {})

    async def step(self, state: State) -> Result:
        raise NotImplementedError

    async def call_tools(self, state: State) -> list[dict]:
        """One tool message per call in `state.tool_calls`, in order. A tool the prompt did not offer or
        this Env does not run, or arguments that are not a JSON object its function accepts, is answered
        with an "error: ..." message the model reads, as a tool's own failure is."""
        offered = [t["function"]["name"] for t in state.tools if t["function"]["name"] in self.tools]
        out = []
        for call in state.tool_calls:
            name, text = call["function"]["name"], call["function"].get("arguments") or "{}"
            content = None
            if name not in offered:
                known = ", ".join(offered) or "none"
                content = f"{ERROR_PREFIX} unknown tool {name!r}; the tools are: {known}"
            else:
                try:
                    args = json.loads(text)
                    inspect.signature(self.tools[name]).bind(**args)
                except (ValueError, TypeError) as err:   # not JSON, not an object, or not its parameters
                    content = f"{ERROR_PREFIX} bad arguments for {name!r}: {err}"
            if content is None:
                run = self.tools[name]
                content = await run(**args) if inspect.iscoroutinefunction(run) else \
                    await asyncio.to_thread(run, **args)   # a thread: other rollouts' loop keeps going
            out.append({"role": "tool", "tool_call_id": call.get("id", ""), "name": name,
                        "content": str(content)})
        return out


class StepEnvRunner(Runner):
    kind = "env"

    def __init__(self, env_cls: type[Env]) -> None:
        super().__init__()
        self.env_cls = env_cls
        self.parser: Any = None   # agent.tool_parser, made on the first rollout that offers tools

    def _parse(self, ids: list[int], tools: list[dict], request: Any) -> tuple[str | None, list[dict], bool]:
        if not tools:
            return None, [], False
        if self.parser is None:
            self.parser = make_parser(self.tokenizer, self.spec.agent.tool_parser)
        return parse_reply(self.parser, self.tokenizer, ids, request)

    async def _run(self, item: dict, trace: Trace, sampler: Sampler, defaults: dict) -> Rollout:
        agent, tok = self.spec.agent, self.tokenizer
        # the conversation's rendering with a generation prompt, kept: the next turn's glue starts from it
        text, messages, images, tools = first_prompt(tok, self.spec, item)
        request = tool_request(tools) if tools else None
        trace.extend_prompt(encode(tok, text), images)
        with agent_code():
            env = self.env_cls(self.spec.agent.options)
        env.tokenizer, env.judge = tok, self.judge
        sampling, observation = dict(defaults), text_of(messages[-1].get("content"))
        score, info, rewards, answered, calls, errors, unreadable = None, {}, [], False, 0, 0, 0
        # A turn's override may ask for fewer tokens than the run's per-turn bound (rollout.max_tokens, or
        # rollout.eval.max_tokens in evaluation), never more, as on the chat server: the overlong penalty
        # and filters measure a response against that bound.
        cap = defaults.get("max_tokens", self.spec.rollout.max_tokens)
        for turn in range(agent.max_turns):
            wanted = min(sampling.get("max_tokens", cap), cap)
            budget = min(wanted, agent.max_total_tokens - len(trace.ids))
            if budget < 1:
                break
            turn_sampling = {**sampling, "max_tokens": budget}
            out = await sampler.generate(list(trace.ids), turn_sampling, trace.rollout_id,
                                         **({"images": list(trace.images)} if trace.images else {}))
            trace.add_sample(mark_context_cut(out, wanted))
            ids = list(out["token_ids"])
            action = tok.decode(ids, skip_special_tokens=True)
            content, tool_calls, malformed = self._parse(ids, tools, request)
            calls, unreadable = calls + len(tool_calls), unreadable + malformed
            messages.append({"role": "assistant", "content": action} if not tool_calls else
                            {"role": "assistant", "content": content or "", "tool_calls": tool_calls})
            with agent_code():
                result = await env.step(State(observation, action, ids, trace.finish_reason,
                                              self.label_of(item), turn, list(messages), turn_sampling, item,
                                              tools, tool_calls))
            if not isinstance(result, Result):
                raise AgentError(f"{self.env_cls.__name__}.step returned {type(result).__name__}, not Result")
            rewards.append(as_finite(result.reward, "reward"))
            score, info = result.score, result.info
            if result.terminated or result.truncated or result.observation is None:
                # an answer: the Env ended the episode after a turn the model finished on its own
                answered = result.terminated and not result.truncated and trace.finish_reason == "stop"
                break
            new = _as_messages(result.observation, self.env_cls.__name__)
            errors += sum(m.get("role") == "tool" and text_of(m.get("content")).startswith(ERROR_PREFIX)
                          for m in new)
            text = self._observe(trace, text, messages, new, tools, bool(ids) and ids[-1] == tok.eos_token_id)
            observation = text_of(new[-1].get("content"))
            # An override holds for the next turn only (as documented); later turns are back on the run's
            # sampling unless their own step asks again.
            sampling = {**defaults, **(result.sampling_params or {})}
        rollout = trace.rollout(sum(rewards), score, info, self.label_of(item))
        rollout.turns, rollout.turn_rewards, rollout.answered = len(rewards), rewards, answered
        rollout.tool_calls, rollout.tool_errors, rollout.tool_parse_errors = calls, errors, unreadable
        return rollout

    def _observe(self, trace: Trace, text: str, messages: list[dict], new: list[dict], tools: list[dict],
                 eos_sampled: bool) -> str:
        """Append the observation's messages `new` to the conversation and, as prompt tokens, to `trace`;
        `text` is the rendering of the conversation before the reply. Returns the rendering now."""
        tok, template_kwargs = self.tokenizer, self.spec.model.chat_template_kwargs
        new, images = normalize(new)   # image parts -> placeholders + data URLs
        glue, text = continuation(tok, text, messages, new, tools, eos_sampled, template_kwargs)
        messages += new
        if glue is None:   # the template re-renders earlier turns (Qwen3 drops old <think> blocks)
            trace.restart(encode(tok, text), normalize(messages)[1])
        else:
            trace.extend_prompt(encode(tok, glue), images)
        return text


def first_prompt(tokenizer: Any, spec: RunSpec, item: dict) -> tuple[str, list[dict], list[str], list[dict]]:
    """How an Env rollout of `item` starts: the chat template's rendering (with a generation prompt) of the
    row's conversation and the tools it shows (agent.tools, then the row's), the conversation with its
    image parts as placeholders, their images, and the tools."""
    tools = offered_tools(spec.agent.tools, item)
    messages, images = normalize(prompt_messages(item, spec.data))
    return render(tokenizer, messages, tools, chat_template_kwargs=spec.model.chat_template_kwargs), \
        messages, images, tools


def prompt_ids(tokenizer: Any, spec: RunSpec, item: dict) -> list[int]:
    """The token ids of `item`'s first prompt (`first_prompt`): what the context must hold before the
    response (a ChatAgent's own system prompt or tools, if it adds any, come on top)."""
    return encode(tokenizer, first_prompt(tokenizer, spec, item)[0])


def _as_messages(observation: str | dict | list, env: str) -> list[dict]:
    """A step's observation as the messages it appends: text is a user turn."""
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}]
    if isinstance(observation, dict):
        return [observation]
    if isinstance(observation, list) and observation and all(isinstance(m, dict) for m in observation):
        return list(observation)
    raise AgentError(f"{env}.step returned an observation that is not text, a message or a non-empty list "
                     f"of messages: {observation!r:.200}")
