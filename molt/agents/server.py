"""The loopback chat server: OpenAI `/v1/chat/completions` and `/v1/responses`, Anthropic `/v1/messages`,
on 127.0.0.1.

Every rollout of a chat agent gets a session with its own URL prefix and random key, so stock SDK
clients need nothing but `base_url` and `api_key`. Requests are validated with vLLM's own wire schemas;
a request for an unknown session, with a wrong key, with a malformed or oversized body fails with a 4xx
in the wire's error shape before it can touch any trajectory. So does one with a field the server does
not apply (anything outside the wire's supported list, molt.agents.wire) set away from its default: a
penalty, min_p or token restriction would change the sampling distribution the trainer recomputes, a
template option the rendering it trains on, and a dropped one would go unnoticed. The server runs in
its own thread; each sampler call is sent back to the event loop of the rollout that owns the session.

Slow or vanished clients cost nothing lasting: their connections' deadlines are molt/agents/http.py's,
and a client that disconnects while its turn is sampled cancels the turn, which aborts its engine
requests and leaves the session as it was before the request.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
import threading
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route
from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
from vllm.entrypoints.anthropic.serving import AnthropicServingMessages
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
from vllm.exceptions import VLLMClientError

from molt.agents import responses, wire
from molt.agents.http import ApiError, read_body, server_config
from molt.agents.render import text_of
from molt.agents.session import ChatSession
from molt.agents.tools import FORCEABLE_PARSERS, forced_call_regex, make_parser, parse_reply
from molt.agents.trace import Trace, mark_context_cut
from molt.inputs.vision import normalize
from molt.spec import AgentSpec
from molt.trajectory import Sampler


class LoopbackServer:
    def __init__(self, tokenizer: Any, model_name: str, sampling: dict[str, Any],
                 tool_parser: str = AgentSpec().tool_parser,
                 chat_template_kwargs: dict[str, Any] | None = None) -> None:
        self.tokenizer, self.model_name, self.sampling = tokenizer, model_name, sampling
        self.chat_template_kwargs = dict(chat_template_kwargs or {})   # model.chat_template_kwargs
        self.tool_parser, self.parser = tool_parser, make_parser(tokenizer, tool_parser)
        self.sessions: dict[str, ChatSession] = {}
        # Starlette's routes, not FastAPI's: the handlers read their own bodies, so FastAPI's parameter
        # resolution around each request was only overhead (≈6% of the server's CPU per turn).
        routes = {"chat/completions": self._openai, "responses": self._responses, "messages": self._anthropic}
        self.app = Starlette(routes=[Route(f"/s/{{sid}}/v1/{path}", handler, methods=["POST"])
                                     for path, handler in routes.items()])
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.url = ""

    def start(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))   # a free port chosen by the OS; loopback only
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self._server = uvicorn.Server(server_config(self.app))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the loopback chat server failed to start")
            threading.Event().wait(0.01)

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)
            self._server = None

    def open(self, trace: Trace, sampler: Sampler, max_turns: int, max_total_tokens: int,
             sampling: dict[str, Any] | None = None) -> ChatSession:
        """A session for one rollout; `sampling` (default: the server's) is what its requests start from."""
        session = ChatSession(trace, self.tokenizer, sampler, asyncio.get_running_loop(), max_turns,
                              max_total_tokens, dict(sampling or self.sampling), self.chat_template_kwargs)
        self.sessions[session.id] = session
        return session

    def close(self, session: ChatSession) -> None:
        self.sessions.pop(session.id, None)

    # --- request handling ---------------------------------------------------------------------------

    async def _openai(self, request: Request) -> Any:
        try:
            session, body = await self._admit(request)
            chat = ChatCompletionRequest.model_validate(body)
            self._check(chat.model, ChatCompletionRequest, body, wire.OPENAI_SUPPORTED)
            outs, replies, prompt_len = await self._turn_while_connected(request, session, chat)
        except ApiError as err:
            return err.response(anthropic=False)
        except (ValueError, VLLMClientError) as err:   # pydantic's ValidationError; vLLM's request checks
            return ApiError(400, f"invalid request: {err}").response(anthropic=False)
        if chat.stream:
            usage = bool(chat.stream_options and chat.stream_options.include_usage)
            return StreamingResponse(wire.openai_stream(self.model_name, replies, outs, prompt_len, usage),
                                     media_type="text/event-stream")
        return JSONResponse(wire.openai_response(self.model_name, replies, outs, prompt_len))

    async def _responses(self, request: Request) -> Any:
        try:
            session, body = await self._admit(request)
            req = ResponsesRequest.model_validate(body)
            self._check(req.model, ResponsesRequest, body, responses.SUPPORTED)
            chat = responses.chat_request(req)
            outs, replies, prompt_len = await self._turn_while_connected(request, session, chat)
        except ApiError as err:
            return err.response(anthropic=False)
        except (ValueError, VLLMClientError) as err:   # pydantic's; vLLM's input-item converter
            return ApiError(400, f"invalid request: {err}").response(anthropic=False)
        final = responses.response(req, self.model_name, replies[0], outs[0], prompt_len)
        if req.stream:
            return StreamingResponse(responses.stream(final), media_type="text/event-stream")
        return JSONResponse(final.model_dump(mode="json", exclude_none=True))

    async def _anthropic(self, request: Request) -> Any:
        try:
            session, body = await self._admit(request)
            msg = AnthropicMessagesRequest.model_validate(body)
            self._check(msg.model, AnthropicMessagesRequest, body, wire.ANTHROPIC_SUPPORTED)
            chat = AnthropicServingMessages.to_chat_completion_request(msg)
            # thinking and output_config, checked as the chat fields vLLM's converter made of them
            converted = chat.model_dump(include=chat.model_fields_set)
            self._check(None, ChatCompletionRequest, converted, wire.OPENAI_SUPPORTED, wire.ANTHROPIC_AS,
                        wire.ANTHROPIC_SUPPORTED)
            chat.stream = False
            outs, replies, prompt_len = await self._turn_while_connected(request, session, chat)
        except ApiError as err:
            return err.response(anthropic=True)
        except (ValueError, VLLMClientError) as err:   # pydantic's; vLLM's converter on bad tool changes
            return ApiError(400, f"invalid request: {err}").response(anthropic=True)
        if msg.stream:
            return StreamingResponse(wire.anthropic_stream(self.model_name, replies[0], outs[0], prompt_len),
                                     media_type="text/event-stream")
        return JSONResponse(wire.anthropic_response(self.model_name, replies[0], outs[0], prompt_len))

    async def _admit(self, request: Request) -> tuple[ChatSession, dict]:
        """The session a request belongs to and its JSON body, or a 4xx; nothing is changed here."""
        sid = request.path_params["sid"]
        session = self.sessions.get(sid)
        if session is None:
            raise ApiError(404, f"unknown session '{sid}' (finished, or never opened)")
        auth = request.headers.get("authorization", "")
        key = request.headers.get("x-api-key") or (auth[7:] if auth.lower().startswith("bearer ") else "")
        if not secrets.compare_digest(key.encode(), session.key.encode()):
            raise ApiError(401, "invalid API key for this session")
        raw = await read_body(request)
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ApiError(400, f"request body is not valid JSON: {err}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object")
        asked = body.get("chat_template_kwargs")
        if asked and asked != session.chat_template_kwargs:   # every turn renders with the same variables
            raise ApiError(400, f"chat_template_kwargs={asked} differs from the run's "
                                f"model.chat_template_kwargs={session.chat_template_kwargs}, which every "
                                "request of a session is rendered with: set them there")
        return session, body

    def _check(self, model: str | None, schema: type, body: dict, supported: frozenset[str],
               shown: dict[str, str] | None = None, wire_fields: frozenset[str] | None = None) -> None:
        """One model is served, and a field the server would not honour is refused, never dropped: any
        field outside `supported` that differs from its schema default (`shown` renames converted ones;
        the refusal lists `wire_fields`, the fields of the wire the agent spoke, default `supported`)."""
        if model and model != self.model_name:
            raise ApiError(404, f"model '{model}' not found: this server serves '{self.model_name}' "
                                "(ChatContext.model_name)")
        fields, shown = schema.model_fields, shown or {}
        sent = [k for k, v in body.items() if k not in supported and v not in (None, [], {}) and
                v != wire.NEUTRAL.get(k) and (k not in fields or v != fields[k].get_default())]
        if not sent:
            return
        known = set().union(*(names for names, _ in wire.REASONS))
        why = [*wire.REASONS, (set(sent) - known, "not implemented by the loopback server")]
        parts = [f"{', '.join(shown.get(k, k) for k in sent if k in names)}: {reason}"
                 for names, reason in why if names & set(sent)]
        names = [shown.get(k, k) for k in sent]
        raise ApiError(400, f"unsupported parameter(s) {names}: {'; '.join(parts)}. "
                            "Leave them unset or at their defaults (this wire applies: "
                            f"{', '.join(sorted(wire_fields or supported))})")

    async def _turn_while_connected(self, request: Request, session: ChatSession,
                                    chat: ChatCompletionRequest) -> tuple[list, list, int]:
        """`_turn`, cancelled if the client disconnects first (nobody would read its replies)."""
        turn = asyncio.ensure_future(self._turn(session, chat))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({turn, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not turn.done():
                turn.cancel()
                await asyncio.wait({turn})   # its engine requests are aborted, the session rolled back
        if turn.cancelled():
            raise ApiError(499, "the client disconnected during the turn")
        return turn.result()

    async def _turn(self, session: ChatSession, chat: ChatCompletionRequest) -> tuple[list, list, int]:
        """Accumulate the request into the session's trajectory, sample, and parse the replies.

        A turn that fails or is cancelled leaves the session as it was before the request."""
        # OpenAI's `developer` role is the system prompt under another name; templates know `system`.
        # Text parts are joined into a string; a message with images keeps its parts (molt.inputs.vision).
        messages = [{**m, "content": m["content"] if _has_image(m) else text_of(m.get("content")),
                     "role": "system" if m.get("role") == "developer" else m.get("role")}
                    for m in self._normalize(chat)]
        tools = [t.model_dump(exclude_none=True) for t in chat.tools] if chat.tools else None
        sampling = self._sampling(chat, tools, session.sampling)
        async with session.lock:
            if session.turns >= session.max_turns:
                raise ApiError(400, f"this session used all {session.max_turns} turns (agent.max_turns)")
            undo = session.checkpoint()
            try:
                session.turns += 1
                ids = session.prompt_ids(messages, tools)
                budget = min(sampling["max_tokens"], session.max_total_tokens - len(ids))
                if budget < 1:
                    raise ApiError(400, f"the conversation has {len(ids)} tokens: no room left under "
                                        f"agent.max_total_tokens={session.max_total_tokens}")
                turn_sampling = {**sampling, "max_tokens": budget}
                outs = [mark_context_cut(out, sampling["max_tokens"]) for out in await asyncio.gather(
                    *[self._sample(session, ids, turn_sampling, i) for i in range(chat.n or 1)])]
            except BaseException:
                undo()
                raise
            parsed = [parse_reply(self.parser, self.tokenizer, list(o["token_ids"]), chat) for o in outs]
            for out, (content, calls, unreadable) in zip(outs, parsed, strict=True):
                extra = {"tool_calls": calls} if calls else {}
                # content as the agent's echo of it will arrive here (a call's null content as ""), so
                # the echo is recognised by equality, without rendering it
                session.offer(out, {"role": "assistant", "content": text_of(content), **extra}, unreadable)
        return outs, [(content, calls) for content, calls, _ in parsed], len(ids)

    @staticmethod
    def _normalize(chat: ChatCompletionRequest) -> list[dict]:
        try:
            return normalize([dict(m) for m in chat.messages])[0]
        except ValueError as err:   # an image that is not a readable data URL
            raise ApiError(400, str(err)) from None

    def _sampling(self, chat: ChatCompletionRequest, tools: list[dict] | None,
                  defaults: dict[str, Any]) -> dict[str, Any]:
        # The session's sampling is the default; a request may set its own, max tokens capped at the
        # default's (rollout.max_tokens, or rollout.eval.max_tokens in evaluation).
        sampling = dict(defaults)
        for key in ("temperature", "top_p", "top_k", "seed"):
            if getattr(chat, key) is not None:
                sampling[key] = getattr(chat, key)
        # stop_token_ids and ignore_eos (vLLM's extensions) only say where a reply ends: the trainer's
        # distribution stays the same, and a reply that does not end on eos is closed as a cut one.
        if chat.stop_token_ids:
            sampling["stop_token_ids"] = list(chat.stop_token_ids)
        if chat.ignore_eos:
            sampling["ignore_eos"] = True
        wanted = chat.max_completion_tokens or vars(chat).get("max_tokens")   # the property warns
        sampling["max_tokens"] = min(wanted or defaults["max_tokens"], defaults["max_tokens"])
        choice = chat.tool_choice
        if tools and (choice == "required" or not isinstance(choice, str | type(None))):
            named = [t for t in tools
                     if choice == "required" or t["function"]["name"] == choice.function.name]
            if not named:
                raise ApiError(400, f"tool_choice names {choice.function.name!r}, which is not in tools")
            if self.tool_parser not in FORCEABLE_PARSERS:
                raise ApiError(400, f"a forced tool call is decoded as Hermes markup, which "
                                    f"agent.tool_parser={self.tool_parser!r} does not read")
            try:
                regex = "|".join(f"({forced_call_regex(t)})" for t in named)
            except ValueError as err:
                raise ApiError(400, str(err)) from None
            sampling["structured_outputs"] = {"regex": regex}
        elif (constraint := chat.extract_structured_outputs()) is not None:
            # response_format (json_schema / json_object) or vLLM's own `structured_outputs`; the schema
            # refuses them beside tools, as vLLM's server does.
            sampling["structured_outputs"] = {k: v for k, v in vars(constraint).items()
                                              if not k.startswith("_") and v not in (None, False)}
        return sampling

    async def _sample(self, session: ChatSession, ids: list[int], sampling: dict, choice: int) -> dict:
        if choice and "seed" in sampling:
            sampling = {**sampling, "seed": sampling["seed"] + choice}   # n>1 choices must differ
        images = {"images": list(session.trace.images)} if session.trace.images else {}
        coro = session.sampler.generate(ids, sampling, session.trace.rollout_id, **images)
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, session.loop))


def _has_image(message: dict) -> bool:
    content = message.get("content")
    return isinstance(content, list) and any(part.get("type") == "image" for part in content)


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away (the body has been read, so only a disconnect is left to receive)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
