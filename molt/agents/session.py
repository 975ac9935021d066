"""One chat agent's conversation as one token-exact trajectory.

Each request's messages are compared with what the session already holds. If they extend it (the
earlier prompt unchanged, followed by one of the replies this session returned), only the new tail is
tokenized and appended after the reply's exact sampled ids (a reply echoed as it was returned is
recognised by equality, any other spelling by its rendering, with tool-call arguments compared as JSON;
the earlier prompt's rendering is kept from its turn, so a continued turn renders twice). Anything
else — a compacted history, a template that drops old `<think>` blocks, an edited reply — seals the
segment and opens a new one from the re-rendered conversation. All segments belong to the same rollout
and share its reward.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from molt.agents.render import continuation, encode, render, text_of
from molt.agents.tools import ERROR_PREFIX
from molt.agents.trace import Trace
from molt.inputs.vision import normalize
from molt.trajectory import Sampler


@dataclass
class Candidate:
    """A reply returned to the agent whose tokens join the trajectory once the agent continues from it."""
    out: dict[str, Any]      # the sampler's result
    message: dict            # the assistant message as the agent will echo it back
    unreadable: bool = False  # the tool parser could not read a call in it (agent/tool_parse_errors)
    # the template's text of prompt + this reply (no generation prompt), rendered only when an echoed
    # reply is not this message itself and must be recognised by its rendering
    rendered: str | None = None


class ChatSession:
    def __init__(self, trace: Trace, tokenizer: Any, sampler: Sampler, loop: asyncio.AbstractEventLoop,
                 max_turns: int, max_total_tokens: int, sampling: dict[str, Any],
                 chat_template_kwargs: dict[str, Any]) -> None:
        self.id, self.key = secrets.token_hex(8), "sk-molt-" + secrets.token_urlsafe(24)
        self.trace, self.tokenizer, self.sampler, self.loop = trace, tokenizer, sampler, loop
        self.max_turns, self.max_total_tokens = max_turns, max_total_tokens
        self.sampling = sampling        # the rollout's defaults (training's, or rollout.eval's in evaluation)
        self.chat_template_kwargs = chat_template_kwargs   # the template's variables, the same every turn
        self.turns = 0
        self.lock = asyncio.Lock()      # one request at a time per session (created in the server's loop)
        self.history: list[dict] = []   # messages of the last request (its prompt)
        self.history_text = ""          # their rendering with a generation prompt: the next turn's glue
                                        # starts from it, so it is rendered once per turn, not twice
        self.tools: list[dict] | None = None
        self.candidates: list[Candidate] = []
        # agent/* metrics: tool calls in the replies that joined the trajectory, tool messages reporting
        # an error, and whether the reply the agent ended on was an answer (no call, not cut short)
        self.tool_calls, self.tool_errors, self.answered = 0, 0, False
        self.tool_parse_errors = 0

    def checkpoint(self) -> Callable[[], None]:
        """A function that puts this session and its trace back as they are now."""
        trace = {k: list(v) if isinstance(v, list) else v for k, v in vars(self.trace).items()}
        saved = (self.turns, self.history, self.history_text, self.tools, list(self.candidates),
                 self.tool_calls, self.tool_errors, self.tool_parse_errors, trace)

        def undo() -> None:
            self.turns, self.history, self.history_text, self.tools, self.candidates, self.tool_calls, \
                self.tool_errors, self.tool_parse_errors, trace = saved
            vars(self.trace).update(trace)
        return undo

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        """Accumulate this request into the trajectory; return the ids the engine is to continue."""
        tok, continued = self.tokenizer, self._continued(messages, tools)
        self.tool_errors += _tool_errors(messages)
        if continued is None:
            if self.candidates:   # the agent did not continue from any reply: keep the first one it got
                self._keep(self.candidates[0])
            text = self._render(messages, tools)
            self.trace.restart(encode(tok, text), normalize(messages)[1])
        else:
            chosen, tail, text = continued
            self._keep(chosen)
            self.trace.extend_prompt(encode(tok, tail), normalize(messages[len(self.history) + 1:])[1])
        self.history, self.history_text, self.tools, self.candidates = messages, text, tools, []
        return list(self.trace.ids)

    def _continued(self, messages: list[dict], tools: list[dict] | None) -> tuple[Candidate, str, str] | None:
        """The reply the request continues from, the text to append after its ids, and the request's
        rendering; None if the request does not extend the session."""
        n, tok = len(self.history), self.tokenizer
        if not self.candidates or tools != self.tools or len(messages) <= n + 1:
            return None
        # Equal messages render equally; only a rewritten prefix pays for a render to compare.
        same = messages[:n] == self.history
        if not same and self._render(messages[:n], tools) != self.history_text:
            return None
        if not same and normalize(messages[:n])[1] != normalize(self.history)[1]:   # no image bytes rendered
            return None
        reply = _canonical(messages[n])
        # A reply echoed as it was returned is that candidate; any other spelling is recognised by its
        # rendering, as the template sees it.
        chosen = next((c for c in self.candidates if same and _canonical(c.message) == reply), None)
        if chosen is None:
            rendered = self._render(messages[:n] + [reply], tools, generation_prompt=False)
            chosen = next((c for c in self.candidates if self._rendered(c) == rendered), None)
        if chosen is None:
            return None
        ids = list(chosen.out["token_ids"])
        tail, full = continuation(tok, self.history_text, messages[:n + 1], messages[n + 1:], tools,
                                  bool(ids) and ids[-1] == tok.eos_token_id, self.chat_template_kwargs)
        return None if tail is None else (chosen, tail, full)

    def offer(self, out: dict[str, Any], message: dict, unreadable: bool = False) -> None:
        self.candidates.append(Candidate(out, message, unreadable))

    def _rendered(self, candidate: Candidate) -> str:
        if candidate.rendered is None:
            candidate.rendered = self._render(self.history + [_canonical(candidate.message)], self.tools,
                                              generation_prompt=False)
        return candidate.rendered

    def _render(self, messages: list[dict], tools: list[dict] | None, generation_prompt: bool = True) -> str:
        return render(self.tokenizer, messages, tools, generation_prompt, self.chat_template_kwargs)

    def _keep(self, reply: Candidate) -> None:
        self.trace.add_sample(reply.out)
        self.tool_calls += len(reply.message.get("tool_calls") or [])
        self.tool_parse_errors += reply.unreadable

    def finish(self) -> None:
        """The agent returned: the reply it got last is part of the trajectory."""
        if self.candidates:
            last = self.candidates[0]
            self._keep(last)
            self.answered = not last.message.get("tool_calls") and last.out.get("finish_reason") == "stop"
            self.candidates = []


def _tool_errors(messages: list[dict]) -> int:
    """The tool messages after the request's last assistant message (what the agent's tools just
    answered) that report an error."""
    count = 0
    for message in reversed(messages):
        if message.get("role") != "tool":
            break
        count += text_of(message.get("content")).startswith(ERROR_PREFIX)
    return count


def _canonical(message: dict) -> dict:
    """`message` with its tool calls' arguments in one JSON spelling, for recognising an echoed reply:
    some agents (pydantic-ai) send a call back re-serialised, which is still the call the model sampled."""
    calls = []
    for call in message.get("tool_calls") or []:
        fn = dict(call.get("function") or {})
        try:
            fn["arguments"] = json.dumps(json.loads(fn["arguments"]), sort_keys=True)
        except (KeyError, TypeError, ValueError):
            pass
        calls.append({**call, "function": fn})
    return {**message, "tool_calls": calls} if calls else message
