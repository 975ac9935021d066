"""The `ChatAgent` path: the user owns the loop and talks to the policy through a stock SDK.

Each rollout opens a session on the loopback server; `ChatContext` carries its URLs and key, so
`openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, http_client=ctx.http_client)` and
`anthropic.AsyncAnthropic(base_url=ctx.session_url, api_key=ctx.api_key, http_client=ctx.http_client)`
work unchanged. The server records the token-exact trajectory; the agent only returns a `Result` with
the reward.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx2

from molt.agents.env import Result
from molt.agents.runner import Runner, agent_code
from molt.agents.server import LoopbackServer
from molt.agents.tools import offered_tools
from molt.agents.trace import Trace, as_finite
from molt.trajectory import AgentError, Rollout, Sampler


@dataclass
class ChatContext:
    base_url: str                    # OpenAI SDK base_url (ends in /v1)
    session_url: str                 # Anthropic SDK base_url (no /v1)
    api_key: str                     # this session's key
    model_name: str
    messages: list[dict]             # the dataset row as chat messages
    prompt: str | None               # the row's prompt string, when it has one
    label: Any
    sampling_params: dict[str, Any]  # the defaults (temperature, top_p, top_k, max_tokens): rollout's,
                                     # rollout.eval's in evaluation
    options: dict[str, Any] = field(default_factory=dict)   # agent.options
    # agent.tools, then the row's `tools` (OpenAI function schemas): pass them as the SDK's `tools=`, and
    # the server renders them through the chat template as the Env path does
    tools: list[dict] = field(default_factory=list)
    max_turns: int = 1
    item: dict = field(default_factory=dict)
    judge: Any = None                # the LLM judge (agent.judge), for rewards: `await judge.p_yes(messages)`
    # For the SDKs' `http_client=`: an httpx2 client (what the OpenAI and Anthropic SDKs build on) for this
    # rollout, closed when it ends. An SDK client built without it sets up TLS for itself (≈30–60 ms of CPU).
    http_client: httpx2.AsyncClient | None = None
    # what `reward_turn` recorded, by turn (a turn is one model reply of this rollout, counted from 0)
    turn_rewards: dict[int, float] = field(default_factory=dict)
    _replies: Callable[[], int] = field(default=lambda: 0, repr=False)   # the session's replies so far

    def reward_turn(self, value: float) -> None:
        """Add `value` to the reward of the model's latest reply (this rollout's last chat request), for
        per-turn credit (algo.turn_credit=turn): call it once that reply has arrived, e.g. when its tool
        call has run. The rollout's reward is the sum of these and `Result.reward`, which is the last
        reply's; a reply not rewarded here gets 0."""
        turns = self._replies()
        if turns == 0:
            raise AgentError("reward_turn before the model's first reply: there is no turn to reward yet")
        self.turn_rewards[turns - 1] = self.turn_rewards.get(turns - 1, 0.0) + as_finite(value, "turn reward")


class ChatAgent:
    """Subclass and implement `run`; one instance per rollout, built with the agent's options."""

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        self.options = dict(options or {})

    async def run(self, ctx: ChatContext) -> Result:
        raise NotImplementedError


class ChatAgentRunner(Runner):
    kind = "chat"

    def __init__(self, agent_cls: type[ChatAgent]) -> None:
        super().__init__()
        self.agent_cls = agent_cls
        self.server: LoopbackServer | None = None
        self.tls: ssl.SSLContext | None = None

    def setup(self, tokenizer: Any, spec: Any, judge: Any = None) -> None:
        super().setup(tokenizer, spec, judge)
        model_name = spec.model.path or "molt-tiny"
        self.server = LoopbackServer(tokenizer, model_name, self.sampling, spec.agent.tool_parser,
                                     spec.model.chat_template_kwargs)
        self.server.start()
        # httpx2 builds a TLS context for every client (≈60 ms of certificate loading on CPU); the
        # rollouts' clients share this one, so a rollout's client costs ≈0.1 ms.
        self.tls = httpx2.create_ssl_context()

    async def _run(self, item: dict, trace: Trace, sampler: Sampler, defaults: dict) -> Rollout:
        agent = self.spec.agent
        session = self.server.open(trace, sampler, agent.max_turns, agent.max_total_tokens, defaults)
        prompt, url = item.get(self.spec.data.prompt_key), f"{self.server.url}/s/{session.id}"
        # trust_env=False: a proxy from the environment must never sit between an agent and the loopback
        # server; the timeout is the rollout's own (agent.timeout_s), not httpx2's 5 s.
        http_client = httpx2.AsyncClient(verify=self.tls, trust_env=False, timeout=agent.timeout_s)
        try:
            ctx = ChatContext(
                base_url=f"{url}/v1", session_url=url,
                api_key=session.key, model_name=self.server.model_name,
                messages=_openai_images(self.messages_of(item)),
                prompt=None if prompt is None else str(prompt), label=self.label_of(item),
                sampling_params=dict(defaults), options=dict(agent.options),
                tools=offered_tools(agent.tools, item), max_turns=agent.max_turns,
                item=item, judge=self.judge, http_client=http_client, _replies=lambda: session.turns)
            with agent_code():
                result = await self.agent_cls(agent.options).run(ctx)
        finally:   # a row without messages (AgentError) closes both too
            self.server.close(session)   # later requests with this key get a 404
            await http_client.aclose()   # the agent may have closed it already: that is fine
        if not isinstance(result, Result):
            raise AgentError(f"{self.agent_cls.__name__}.run returned {type(result).__name__}, not Result")
        session.finish()
        turn_rewards = _turn_rewards(ctx.turn_rewards, as_finite(result.reward, "reward"), session.turns)
        rollout = trace.rollout(sum(turn_rewards), result.score, result.info, self.label_of(item))
        rollout.turns, rollout.turn_rewards, rollout.answered = session.turns, turn_rewards, session.answered
        rollout.tool_calls, rollout.tool_errors = session.tool_calls, session.tool_errors
        rollout.tool_parse_errors = session.tool_parse_errors
        return rollout

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
        super().close()


def _turn_rewards(rewarded: dict[int, float], final: float, turns: int) -> list[float]:
    """One reward per model reply, in order: what `reward_turn` gave it, plus `final` (Result.reward) on the
    last, as an Env's last step carries its outcome."""
    out = [rewarded.get(turn, 0.0) for turn in range(turns)] or [0.0]
    out[-1] += final
    return out


def _openai_images(messages: list[dict]) -> list[dict]:
    """A row's image parts ({"type": "image", "image": <data URL>}, molt.inputs.data) as the OpenAI wire's."""
    def part(p: Any) -> Any:
        is_image = isinstance(p, dict) and p.get("type") == "image"
        return {"type": "image_url", "image_url": {"url": p["image"]}} if is_image else p
    return [{**m, "content": [part(p) for p in m["content"]]} if isinstance(m.get("content"), list) else m
            for m in messages]
