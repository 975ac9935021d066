"""Tool calls: parse what the model wrote with vLLM's own parser; constrain a forced call.

The sampled ids are decoded with special tokens kept (`<tool_call>` is a special token in many
tokenizers) and handed to one of vLLM's stock tool parsers, `agent.tool_parser` (default `hermes`: the
`<tool_call>{json}</tool_call>` format of the tiny model's template and of Qwen/Hermes models). A
forced call (OpenAI `tool_choice` naming a function, Anthropic `tool_choice: {type: tool}`) is honoured
the way vLLM honours it: by constraining decoding, here with a regex of exactly the Hermes markup.
A call the parser cannot read (malformed JSON in the markup) leaves the turn without calls, as in vLLM's
server; vLLM logs a traceback for each, which Molt counts instead (agent/tool_parse_errors) and reports
in one log line, once per process.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from typing import Any

from molt.spec.agent import TOOLS_KEY, check_tools
from molt.trajectory import AgentError

log = logging.getLogger(__name__)

FORCEABLE_PARSERS = ("hermes",)   # parsers that read the markup `forced_call_regex` writes
ERROR_PREFIX = "error:"   # a tool message that starts with it reports a failed call (agent/tool_errors)

# Every value these allow is valid JSON: no leading zeros (`01` is not a JSON number, and a parser that
# fails on it drops the call), strings of printable ASCII without `"` and `\`.
_INT = r"-?(0|[1-9][0-9]{0,5})"
_VALUE = {"integer": _INT, "number": _INT + r"(\.[0-9]{1,4})?", "boolean": r"(true|false)",
          "string": r'"[ !#-\[\]-~]{0,32}"'}


def _lit(text: str) -> str:
    # Escape only regex operators: grammar engines differ on escapes such as `\ ` that `re.escape` emits.
    return re.sub(r"([\\.^$|?*+()\[\]{}])", r"\\\1", text)


def forced_call_regex(tool: dict[str, Any]) -> str:
    """Regex of one Hermes call to `tool` (OpenAI function shape) with arguments that follow its schema.

    Flat object schemas are supported: each property an `enum` or an integer / number / boolean / string,
    all present, in schema order — enough for calculator-style tools, and a clear error otherwise.
    """
    fn = tool["function"]
    fields = []
    for name, prop in ((fn.get("parameters") or {}).get("properties") or {}).items():
        if "enum" in prop:
            value = "(" + "|".join(_lit(json.dumps(v)) for v in prop["enum"]) + ")"
        elif prop.get("type") in _VALUE:
            value = _VALUE[prop["type"]]
        else:
            raise ValueError(f"forced call to {fn['name']!r}: property {name!r} has a schema a forced call "
                             f"cannot constrain ({prop}); use enum/integer/number/boolean/string")
        fields.append(_lit(json.dumps(name) + ": ") + value)
    head = _lit('<tool_call>{"name": ' + json.dumps(fn["name"]) + ', "arguments": {')
    return head + ", ".join(fields) + _lit("}}</tool_call>")


def offered_tools(agent_tools: list[dict[str, Any]], item: dict) -> list[dict[str, Any]]:
    """The tools a rollout of `item` shows the model: agent.tools, then the row's `tools`; a row's malformed
    `tools` fail its rollout (AgentError), the run goes on."""
    row = item.get(TOOLS_KEY) or []
    try:
        return check_tools(list(agent_tools) + (row if isinstance(row, list) else [row]),
                           f"agent.tools + the dataset row's '{TOOLS_KEY}'")
    except ValueError as err:
        raise AgentError(str(err)) from None


def tool_request(tools: list[dict[str, Any]]) -> Any:
    """The chat request vLLM's tool parsers read the offered `tools` from (`parse_reply`'s `request`)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return ChatCompletionRequest(messages=[{"role": "user", "content": ""}], tools=tools)


_parse_errors = threading.local()   # error records the parser logged during this thread's parse_reply


class _CountParseErrors(logging.Filter):
    """On a vLLM tool parser's logger: an error it logs (with a traceback, once per call it cannot read) is
    counted for the turn being parsed and not printed; the first one is reported in one line."""

    reported = False

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        _parse_errors.count = getattr(_parse_errors, "count", 0) + 1
        if not _CountParseErrors.reported:
            _CountParseErrors.reported = True
            cause = f": {record.exc_info[1]!r:.200}" if record.exc_info else ""
            log.warning("molt: the tool parser could not read a call the model wrote (%s%s); such turns "
                        "have no calls, are counted in agent/tool_parse_errors and are not logged again",
                        record.getMessage(), cause)
        return False


def make_parser(tokenizer: Any, name: str) -> Any:
    """vLLM's tool parser `name` (agent.tool_parser) for this tokenizer; a clear error for an unknown name."""
    from vllm.tool_parsers import ToolParserManager

    try:
        parser_cls = ToolParserManager.get_tool_parser(name)
    except KeyError:
        known = ", ".join(sorted(ToolParserManager.list_registered()))
        raise ValueError(f"agent.tool_parser={name!r} is not a vLLM tool parser; known: {known}") from None
    parser_log = logging.getLogger(parser_cls.__module__)   # vLLM's loggers are named by module
    if not any(isinstance(f, _CountParseErrors) for f in parser_log.filters):
        parser_log.addFilter(_CountParseErrors())
    try:
        return parser_cls(tokenizer)
    except Exception as err:   # e.g. the model's tokenizer lacks the parser's special tokens
        raise ValueError(f"agent.tool_parser={name!r} does not fit this tokenizer: {err}") from err


def parse_reply(parser: Any, tokenizer: Any, ids: list[int],
                request: Any) -> tuple[str | None, list[dict], bool]:
    """(content, tool calls in OpenAI shape, whether the parser failed on a call it could not read) of one
    sampled turn (a parser made by `make_parser`)."""
    if ids and ids[-1] == tokenizer.eos_token_id:
        ids = ids[:-1]
    text = tokenizer.decode(ids, skip_special_tokens=False)
    if not request.tools or request.tool_choice == "none":
        return text, [], False
    _parse_errors.count = 0
    info = parser.extract_tool_calls(text, request)
    unreadable = _parse_errors.count > 0
    if not info.tools_called:
        return text, [], unreadable
    calls = [{"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                          "arguments": c.function.arguments}}
             for c in info.tool_calls]
    if request.parallel_tool_calls is False:   # at most one call, as the API promises; later ones dropped
        calls = calls[:1]
    return info.content, calls, unreadable
