"""Chat-template rendering without re-tokenizing history.

The template is rendered as text; only the text that follows the last sampled turn is tokenized. To
find it, the conversation is rendered up to the reply and with the new messages, compared with the
rendering the turn before kept, and the difference is taken after the turn's end marker (the tokenizer's
eos token): tokens the model already sampled are never rendered again, so a re-tokenization that would
merge them differently cannot happen.
"""

from __future__ import annotations

from typing import Any


def render(tokenizer: Any, messages: list[dict], tools: list[dict] | None = None,
           generation_prompt: bool = True, chat_template_kwargs: dict[str, Any] | None = None) -> str:
    """The template's text; `chat_template_kwargs` are the template's variables (model.chat_template_kwargs),
    the same for every render of a run, or a prefix would not render as it did before."""
    return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                         add_generation_prompt=generation_prompt,
                                         **(chat_template_kwargs or {}))


def encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def continuation(tokenizer: Any, prompt: str, answered: list[dict], after: list[dict],
                 tools: list[dict] | None, eos_sampled: bool,
                 chat_template_kwargs: dict[str, Any] | None = None) -> tuple[str | None, str]:
    """Text to append after a sampled reply (the last of `answered`) so that the sequence reads like the
    template's rendering of answered + after (with a generation prompt), and that rendering: the next
    turn's `prompt`. `prompt` is the rendering of the messages before the reply with a generation prompt,
    kept by the caller from the turn before, so a turn renders twice, not three times. The text is None
    when the template renders the earlier messages differently once the reply and `after` follow (the
    prefix was rewritten, e.g. old `<think>` blocks dropped): the rendering then opens a new segment."""
    closed = render(tokenizer, answered, tools, False, chat_template_kwargs)
    full = render(tokenizer, answered + after, tools, True, chat_template_kwargs)
    return glue(tokenizer, prompt, closed, full, eos_sampled), full


def glue(tokenizer: Any, prompt: str, closed: str, full: str, eos_sampled: bool) -> str | None:
    """`continuation`'s text from the three renderings it compares: `prompt` of the messages before the
    reply with a generation prompt, `closed` of them and the reply, `full` of the whole conversation with
    a generation prompt."""
    if not (closed.startswith(prompt) and full.startswith(closed)):
        return None
    turn, eos = closed[len(prompt):], tokenizer.eos_token
    end = turn.rfind(eos)
    if end < 0:
        return None
    # The sampler stops on eos and returns it; a turn cut at max_tokens gets the marker as glue.
    tail = turn[end + len(eos):] if eos_sampled else turn[end:]
    return tail + full[len(closed):]


def text_of(content: Any) -> str:
    """OpenAI content (a string or a list of text parts) as a string, for templates that want text."""
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(p.get("text", "") for p in content if isinstance(p, dict))
