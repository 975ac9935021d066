"""The OpenAI Responses API (`POST /v1/responses`, the OpenAI Agents SDK's default wire) as a chat turn.

A Responses request carries the whole conversation as input items (messages, `function_call` and
`function_call_output` items); vLLM's own converters turn them into chat messages and chat tools, so
the turn goes through the same session accumulation as `/v1/chat/completions` and the trajectory does
not depend on the wire. The reply comes back as output items (a message, function calls), plain or as
the Responses event stream, built from vLLM's and the OpenAI SDK's schemas.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Any

from openai.types.responses import (
    ResponseContentPartAddedEvent,
    ResponseContentPartDoneEvent,
    ResponseFunctionCallArgumentsDeltaEvent,
    ResponseFunctionCallArgumentsDoneEvent,
    ResponseIncompleteEvent,
    ResponseOutputItemAddedEvent,
    ResponseOutputItemDoneEvent,
    ResponseTextDeltaEvent,
    ResponseTextDoneEvent,
)
from vllm.entrypoints.generate.base.protocol import FunctionCall
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.responses.protocol import (
    InputTokensDetails,
    OutputTokensDetails,
    ResponseCompletedEvent,
    ResponseCreatedEvent,
    ResponseInProgressEvent,
    ResponsesRequest,
    ResponsesResponse,
    ResponseUsage,
)
from vllm.entrypoints.openai.responses.utils import (
    build_response_output_items,
    construct_input_messages,
    construct_tool_dicts,
)

# What `chat_request` carries over, plus labels that change neither the tokens nor the reply (`store`:
# nothing is kept, and previous_response_id is refused), and chat_template_kwargs equal to the run's
# (LoopbackServer._admit). Anything else is refused once it differs from its default
# (molt.agents.wire.OPENAI_SUPPORTED says why).
SUPPORTED = frozenset({
    "input", "instructions", "model", "max_output_tokens", "temperature", "top_p", "top_k", "seed", "stream",
    "tools", "tool_choice", "parallel_tool_calls", "text", "structured_outputs", "metadata", "user", "store",
    "service_tier", "prompt_cache_key", "request_id", "chat_template_kwargs"})


def chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request this Responses request is: same messages, tools, tool choice and sampling."""
    hosted = sorted({t.type for t in req.tools} - {"function"})
    if hosted:   # web_search, file_search, code_interpreter, mcp ...: OpenAI runs those, this server does not
        raise ValueError(f"tools of type {hosted} are not supported: the loopback server runs no hosted "
                         "tools; give the agent function tools")
    tools = construct_tool_dicts(req.tools, req.tool_choice) if req.tools else None
    choice = req.tool_choice
    if not isinstance(choice, str):   # {"type": "function", "name": ...} is the only forced form here
        choice = choice.model_dump() if hasattr(choice, "model_dump") else dict(choice)
        if choice.get("type") != "function":
            raise ValueError(f"tool_choice {choice} is not supported (only a function by name)")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    text_format = req.text.format if req.text is not None else None
    return ChatCompletionRequest.model_validate({
        "messages": construct_input_messages(request_instructions=req.instructions, request_input=req.input),
        "tools": tools, "tool_choice": choice if tools else "none",
        "parallel_tool_calls": req.parallel_tool_calls, "temperature": req.temperature,
        "top_p": req.top_p, "top_k": req.top_k, "seed": req.seed,
        "max_completion_tokens": req.max_output_tokens, "structured_outputs": req.structured_outputs,
        "response_format": _chat_format(text_format.model_dump(by_alias=True)) if text_format else None})


def _chat_format(fmt: dict) -> dict:
    # Responses puts the schema beside `type`; chat nests it under `json_schema`.
    if fmt.get("type") != "json_schema":
        return fmt
    return {"type": "json_schema", "json_schema": {"name": fmt.get("name") or "output",
                                                   "schema": fmt.get("schema"), "strict": fmt.get("strict")}}


def response(req: ResponsesRequest, model: str, reply: tuple[str | None, list[dict]], out: dict,
             prompt_len: int) -> ResponsesResponse:
    """The finished turn as a Responses object; a turn cut at max tokens is `incomplete`."""
    content, calls = reply
    items = build_response_output_items(None, content, [
        FunctionCall(id=c["id"], name=c["function"]["name"], arguments=c["function"]["arguments"])
        for c in calls], tools=req.tools)
    done = len(out["token_ids"])
    cut = out["finish_reason"] == "length" and not calls
    return ResponsesResponse(
        id="resp_" + secrets.token_hex(12), model=model, output=items,
        status="incomplete" if cut else "completed",
        incomplete_details={"reason": "max_output_tokens"} if cut else None,
        parallel_tool_calls=req.parallel_tool_calls is not False, temperature=req.temperature or 1.0,
        tool_choice=req.tool_choice, tools=req.tools, top_p=req.top_p or 1.0, background=False,
        max_output_tokens=req.max_output_tokens or done, service_tier="auto", truncation="disabled",
        instructions=req.instructions, metadata=req.metadata,
        usage=ResponseUsage(input_tokens=prompt_len, output_tokens=done, total_tokens=prompt_len + done,
                            input_tokens_details=InputTokensDetails(cached_tokens=0, cache_write_tokens=0),
                            output_tokens_details=OutputTokensDetails()))


def stream(final: ResponsesResponse) -> Iterator[str]:
    """The Responses event sequence of a finished turn: created, each item added/delta/done, completed."""
    seq = iter(range(1 << 30))

    def event(ev: Any) -> str:
        return f"event: {ev.type}\ndata: {ev.model_dump_json(exclude_none=True)}\n\n"

    opening = final.model_copy(update={"output": [], "status": "in_progress", "usage": None})
    yield event(ResponseCreatedEvent(type="response.created", response=opening, sequence_number=next(seq)))
    yield event(ResponseInProgressEvent(type="response.in_progress", response=opening,
                                        sequence_number=next(seq)))
    for i, item in enumerate(final.output):
        common = {"output_index": i, "sequence_number": 0}
        if item.type == "message":
            text = item.content[0].text
            empty = item.model_copy(update={"content": [], "status": "in_progress"})
            part = {"type": "output_text", "text": "", "annotations": []}
            where = {"item_id": item.id, "output_index": i, "content_index": 0}
            events = [
                ResponseOutputItemAddedEvent(type="response.output_item.added", item=empty, **common),
                ResponseContentPartAddedEvent(type="response.content_part.added", part=part,
                                              sequence_number=0, **where),
                ResponseTextDeltaEvent(type="response.output_text.delta", delta=text, logprobs=[],
                                       sequence_number=0, **where),
                ResponseTextDoneEvent(type="response.output_text.done", text=text, logprobs=[],
                                      sequence_number=0, **where),
                ResponseContentPartDoneEvent(type="response.content_part.done", part={**part, "text": text},
                                             sequence_number=0, **where)]
        else:   # a function call
            empty = item.model_copy(update={"arguments": "", "status": "in_progress"})
            events = [
                ResponseOutputItemAddedEvent(type="response.output_item.added", item=empty, **common),
                ResponseFunctionCallArgumentsDeltaEvent(type="response.function_call_arguments.delta",
                                                        item_id=item.id, delta=item.arguments, **common),
                ResponseFunctionCallArgumentsDoneEvent(type="response.function_call_arguments.done",
                                                       item_id=item.id, arguments=item.arguments,
                                                       name=item.name, **common)]
        events.append(ResponseOutputItemDoneEvent(type="response.output_item.done", item=item, **common))
        for ev in events:
            ev.sequence_number = next(seq)
            yield event(ev)
    if final.status == "incomplete":
        yield event(ResponseIncompleteEvent(type="response.incomplete", response=final.model_dump(),
                                            sequence_number=next(seq)))
    else:
        yield event(ResponseCompletedEvent(type="response.completed", response=final,
                                           sequence_number=next(seq)))
