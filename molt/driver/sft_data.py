"""SFT data: chat conversations → token ids and a mask on the assistant's tokens, through the chat template.

A row holds `data.messages_key` (OpenAI-format messages; an assistant turn may carry `tool_calls`, a tool
result is a `tool` message) and optionally `tools` (the tool schemas the template shows). For each
assistant message the template renders the messages before it with the generation prompt, and the
messages up to it: the text in between is what the model writes in that turn. Its tokens are the
targets, up to and including the eos token that closes the turn (what follows eos is template glue the
model never samples). Every piece is tokenized on its own, as the agent path tokenizes a prompt and the
engine samples a turn, so the trained ids are the ids the model reads and writes when it runs.

A template that re-renders earlier turns (Qwen3 drops the `<think>` blocks of turns before the last user
message) makes the next prompt stop extending the text so far: the conversation is then split there, the
text so far is one example and the next starts from the new prompt. Each assistant turn is thus trained
in exactly the context the model sees when it writes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from molt.agents.render import encode, render
from molt.inputs.data import read_rows
from molt.spec import DataSpec, HubDataset, RunSpec
from molt.spec.agent import TOOLS_KEY


@dataclass
class Example:
    token_ids: list[int]
    loss_mask: list[int]    # 1 on the tokens the model is trained to write


def _check_conversation(row: Any, data: DataSpec) -> dict[str, Any]:
    if not isinstance(row, dict):
        raise ValueError(f"expected an object, got {type(row).__name__}")
    messages = row.get(data.messages_key)
    if not (isinstance(messages, list) and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                               for m in messages)):
        raise ValueError(f"'{data.messages_key}' must be a list of {{role: str, ...}} messages; "
                         f"keys present: {sorted(row)}")
    roles = [m["role"] for m in messages]
    if "assistant" not in roles:
        raise ValueError("the conversation has no assistant message to train on")
    if roles[0] == "assistant":
        raise ValueError("the conversation starts with an assistant message (nothing prompts it)")
    if not isinstance(row.get(TOOLS_KEY) or [], list):
        raise ValueError(f"'{TOOLS_KEY}' must be a list of tool schemas")
    return row


def load_conversations(path: str | Path | HubDataset, data: DataSpec) -> list[dict[str, Any]]:
    """The checked rows of a JSONL or Parquet file (or hub dataset) of conversations."""
    return read_rows(path, lambda row: _check_conversation(row, data), data)


def load_examples(spec: RunSpec, tokenizer: Any, source: str | HubDataset) -> list[Example]:
    """The examples of a conversation set (data.train_path or a data.eval entry), tokenized for `spec`."""
    from molt.inputs.data_hub import describe

    rows = load_conversations(source, spec.data)
    name = describe(source) if isinstance(source, HubDataset) else str(source)
    return tokenize_rows(rows, tokenizer, spec.data, spec.model.max_model_len, name,
                         spec.model.chat_template_kwargs)


def tokenize_conversation(tokenizer: Any, messages: list[dict], tools: list[dict] | None = None,
                          chat_template_kwargs: dict[str, Any] | None = None) -> list[Example]:
    """One example, or several where the template re-renders earlier turns (see the module doc)."""
    examples, ids, mask, text = [], [], [], ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render(tokenizer, messages[:i], tools, True, chat_template_kwargs)
        turn = render(tokenizer, messages[:i + 1], tools, False, chat_template_kwargs)
        if not turn.startswith(prompt):
            raise ValueError(f"message {i}: the chat template's rendering of this assistant turn does not "
                             "start with its generation prompt, so its tokens cannot be told apart")
        if not prompt.startswith(text):   # earlier turns were rendered differently: a new example
            examples.append(Example(ids, mask))
            ids, mask = [], []
            text = ""
        context, target = encode(tokenizer, prompt[len(text):]), encode(tokenizer, turn[len(prompt):])
        eos = [j for j, t in enumerate(target) if t == tokenizer.eos_token_id]
        trained = eos[-1] + 1 if eos else len(target)
        ids += context + target
        mask += [0] * len(context) + [1] * trained + [0] * (len(target) - trained)
        text = turn
    examples.append(Example(ids, mask))
    return [e for e in examples if any(e.loss_mask)]


def tokenize_rows(rows: list[dict[str, Any]], tokenizer: Any, data: DataSpec, max_len: int,
                  source: str, chat_template_kwargs: dict[str, Any] | None = None) -> list[Example]:
    """All examples of the rows; an example longer than `max_len` tokens is an error naming its row."""
    out = []
    for i, row in enumerate(rows):
        for example in tokenize_conversation(tokenizer, row[data.messages_key], row.get(TOOLS_KEY),
                                             chat_template_kwargs):
            if len(example.token_ids) > max_len:
                raise ValueError(f"{source}: row {i} renders to {len(example.token_ids)} tokens, above "
                                 f"model.max_model_len={max_len}; shorten or drop it")
            out.append(example)
    return out


def sft_batch(examples: list[Example], pad_id: int, ranks: int) -> dict[str, torch.Tensor]:
    """input_ids / attention_mask / loss_mask [B, T], right-padded; rows sorted by length and dealt to the
    `ranks` data-parallel shards in turn, so each rank's micro-batches hold rows of similar length (little
    padding) and the ranks similar work. The order of rows changes nothing else: the loss is a global
    token mean."""
    by_length = sorted(examples, key=lambda e: len(e.token_ids))
    rows = [e for r in range(ranks) for e in by_length[r::ranks]]
    length = max(len(e.token_ids) for e in rows)
    batch = {"input_ids": torch.full((len(rows), length), pad_id, dtype=torch.long),
             "attention_mask": torch.zeros((len(rows), length), dtype=torch.long),
             "loss_mask": torch.zeros((len(rows), length), dtype=torch.float32)}
    for i, e in enumerate(rows):
        n = len(e.token_ids)
        batch["input_ids"][i, :n] = torch.tensor(e.token_ids)
        batch["attention_mask"][i, :n] = 1
        batch["loss_mask"][i, :n] = torch.tensor(e.loss_mask, dtype=torch.float32)
    return batch
