"""OpenAI and Anthropic responses for one sampled turn, built from vLLM's own wire schemas.

The engine returns a finished turn, so a streamed response sends that turn as the event sequence the
SDKs expect (role, content, tool-call deltas, finish, usage); streamed and plain responses carry the
same content and the trajectory does not depend on the wire.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator

from vllm.entrypoints.anthropic.protocol import (
    AnthropicContentBlock,
    AnthropicDelta,
    AnthropicMessagesResponse,
    AnthropicStreamEvent,
    AnthropicUsage,
)
from vllm.entrypoints.generate.base.protocol import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
)
from vllm.entrypoints.serve.engine.protocol import UsageInfo

Reply = tuple[str | None, list[dict]]   # (content, tool calls in OpenAI shape)

# The request fields each wire applies, plus labels that change neither the tokens nor the reply. Any
# other field (one of vLLM's schema, a future one, or one it does not know) is refused once it differs
# from its default: dropped silently, it would leave the agent believing it sampled or rendered
# otherwise than it did. (Responses: responses.SUPPORTED.)
OPENAI_SUPPORTED = frozenset({
    "messages", "model", "max_tokens", "max_completion_tokens", "n", "seed", "temperature", "top_p", "top_k",
    "stream", "stream_options", "tools", "tool_choice", "parallel_tool_calls", "response_format",
    "structured_outputs", "user", "request_id", "chat_template_kwargs", "stop_token_ids", "ignore_eos"})
# `thinking` and `output_config` are checked as what vLLM's converter makes of them (ANTHROPIC_AS).
ANTHROPIC_SUPPORTED = frozenset({"model", "messages", "max_tokens", "system", "temperature", "top_p", "top_k",
                                 "stream", "tools", "tool_choice", "metadata", "thinking", "output_config",
                                 "chat_template_kwargs"})
ANTHROPIC_AS = {"thinking_token_budget": "thinking.budget_tokens",
                "reasoning_effort": "output_config.effort or thinking.type=disabled"}
# Explicit no-op values of fields whose schema default is None (`presence_penalty: 0` is accepted).
NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1, "min_p": 0}
# Why a refused field is not honoured, by what it would change; any other is not implemented.
REASONS = (
    ({"presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "logit_bias",
      "allowed_token_ids", "bad_words", "min_tokens", "thinking_token_budget", "use_beam_search",
      "length_penalty", "repetition_detection", "vllm_xargs"},
     "changes the sampling distribution, which the trainer does not reproduce (it recomputes "
     "temperature, top_p and top_k only)"),
    ({"chat_template", "add_generation_prompt", "continue_final_message",
      "add_special_tokens", "documents", "reasoning_effort", "reasoning", "mm_processor_kwargs"},
     "changes how the prompt is rendered: the session renders, and trains on, the model's chat "
     "template with model.chat_template_kwargs"),
    ({"previous_response_id", "conversation", "prompt", "background"},
     "needs server-side state, which the loopback server does not keep: send the whole conversation"),
)


def _finish(out: dict, calls: list[dict]) -> str:
    return "tool_calls" if calls else ("length" if out["finish_reason"] == "length" else "stop")


def _usage(prompt_len: int, outs: list[dict]) -> UsageInfo:
    done = sum(len(o["token_ids"]) for o in outs)
    return UsageInfo(prompt_tokens=prompt_len, completion_tokens=done, total_tokens=prompt_len + done)


def openai_response(model: str, replies: list[Reply], outs: list[dict], prompt_len: int) -> dict:
    choices = [ChatCompletionResponseChoice(
        index=i, finish_reason=_finish(out, calls),
        message=ChatMessage(role="assistant", content=content, tool_calls=[
            ToolCall(id=c["id"], function=FunctionCall(**c["function"])) for c in calls]))
        for i, ((content, calls), out) in enumerate(zip(replies, outs, strict=True))]
    return ChatCompletionResponse(model=model, choices=choices, usage=_usage(prompt_len, outs)).model_dump(
        mode="json", exclude_none=True)


def openai_stream(model: str, replies: list[Reply], outs: list[dict], prompt_len: int,
                  include_usage: bool) -> Iterator[str]:
    cid = "chatcmpl-" + secrets.token_hex(12)

    def chunk(choices: list, usage: UsageInfo | None = None) -> str:
        body = ChatCompletionStreamResponse(id=cid, model=model, choices=choices, usage=usage)
        return f"data: {body.model_dump_json(exclude_none=True)}\n\n"

    for i, ((content, calls), out) in enumerate(zip(replies, outs, strict=True)):
        opening = DeltaMessage(role="assistant", content="")
        yield chunk([ChatCompletionResponseStreamChoice(index=i, delta=opening)])
        if content:
            yield chunk([ChatCompletionResponseStreamChoice(index=i, delta=DeltaMessage(content=content))])
        for j, call in enumerate(calls):
            delta = DeltaToolCall(index=j, id=call["id"], type="function",
                                  function=DeltaFunctionCall(**call["function"]))
            yield chunk([ChatCompletionResponseStreamChoice(index=i, delta=DeltaMessage(tool_calls=[delta]))])
        yield chunk([ChatCompletionResponseStreamChoice(index=i, delta=DeltaMessage(),
                                                        finish_reason=_finish(out, calls))])
    if include_usage:
        yield chunk([], _usage(prompt_len, outs))
    yield "data: [DONE]\n\n"


def _stop_reason(out: dict, calls: list[dict]) -> str:
    return "tool_use" if calls else ("max_tokens" if out["finish_reason"] == "length" else "end_turn")


def _blocks(reply: Reply) -> list[AnthropicContentBlock]:
    content, calls = reply
    blocks = [AnthropicContentBlock(type="text", text=content)] if content else []
    return blocks + [AnthropicContentBlock(type="tool_use", id=c["id"], name=c["function"]["name"],
                                           input=json.loads(c["function"]["arguments"])) for c in calls]


def anthropic_response(model: str, reply: Reply, out: dict, prompt_len: int) -> dict:
    msg = AnthropicMessagesResponse(
        id="msg_" + secrets.token_hex(12), model=model, content=_blocks(reply),
        stop_reason=_stop_reason(out, reply[1]),
        usage=AnthropicUsage(input_tokens=prompt_len, output_tokens=len(out["token_ids"])))
    return msg.model_dump(mode="json", exclude_none=True)


def anthropic_stream(model: str, reply: Reply, out: dict, prompt_len: int) -> Iterator[str]:
    def event(ev: AnthropicStreamEvent) -> str:
        return f"event: {ev.type}\ndata: {ev.model_dump_json(exclude_none=True)}\n\n"

    start = AnthropicMessagesResponse(id="msg_" + secrets.token_hex(12), model=model, content=[],
                                      usage=AnthropicUsage(input_tokens=prompt_len, output_tokens=0))
    yield event(AnthropicStreamEvent(type="message_start", message=start))
    for i, block in enumerate(_blocks(reply)):
        if block.type == "text":
            opening = AnthropicContentBlock(type="text", text="")
            delta = AnthropicDelta(type="text_delta", text=block.text)
        else:
            opening = AnthropicContentBlock(type="tool_use", id=block.id, name=block.name, input={})
            delta = AnthropicDelta(type="input_json_delta", partial_json=json.dumps(block.input))
        yield event(AnthropicStreamEvent(type="content_block_start", index=i, content_block=opening))
        yield event(AnthropicStreamEvent(type="content_block_delta", index=i, delta=delta))
        yield event(AnthropicStreamEvent(type="content_block_stop", index=i))
    usage = AnthropicUsage(input_tokens=prompt_len, output_tokens=len(out["token_ids"]))
    stop = AnthropicDelta(stop_reason=_stop_reason(out, reply[1]))
    yield event(AnthropicStreamEvent(type="message_delta", delta=stop, usage=usage))
    yield event(AnthropicStreamEvent(type="message_stop"))
