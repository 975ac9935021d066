"""The token-first contract: what flows from the engine's sampler to the loss.

A `Segment` is one contiguous token sequence the trainer sees. Everything is token ids exactly as the
engine produced them (never re-tokenized text). A rollout has one or more segments (a chat agent that
compacts its context starts a new one) and exactly one reward; a group is the rollouts of one prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, NotRequired, Protocol, TypedDict

import numpy as np

NO_VERSION = -1  # `versions` entry of a token the engine did not sample (prompt, observation)


class AgentError(ValueError):
    """A rollout failed for a reason on the agent's side: its code (env, agent, tools) raised, it returned
    or asked for something Molt cannot train on, or its data row is unusable. The runner records it on the
    rollout and the run goes on (up to agent.max_failure_rate); any other exception is a Molt bug and
    stops the run with its traceback."""


class EngineDiedError(RuntimeError):
    """An engine actor is gone (its rollouts are restarted), or no engine is left to run (the run stops).
    Part of the contract: the dispatcher raises it through any sampler, and an agent's runner tells it
    from an agent's own failure without knowing the rollout side."""


class Sample(TypedDict):
    """One completion, engine -> agent (a plain dict: it crosses Ray). `EngineActor.generate` makes it,
    the dispatcher adds `engine`, the agent layer (`Trace.add_sample`) turns it into a segment's tokens."""
    token_ids: list[int]            # the sampled ids
    logprobs: list[float]           # behaviour logprob of each sampled id
    versions: list[int]             # policy version that sampled each id
    finish_reason: str              # stop | length | abort
    prompt_ids: list[int]           # the prompt as the engine read it (image placeholders expanded)
    sampling: list[float]           # [temperature, top_p, top_k] the engine applied
    prompt_logprobs: NotRequired[list[float | None]]   # when the request asked for them
    routed_experts: NotRequired[np.ndarray]            # MoE: [len, layers, top_k] expert ids
    engine: NotRequired[int]        # the dispatcher's index of the engine that sampled it
    context_cut: NotRequired[bool]  # the agent layer: stopped by the context before its turn's max_tokens


class Sampler(Protocol):
    """What an agent samples through: `molt.rollout.sampling.TrainingSampler` in training, the dispatcher
    (with the eval sampling) in evaluation. `release(key)` forgets a finished rollout's state."""

    async def generate(self, prompt_ids: list[int], sampling: dict[str, Any], key: str,
                       images: list[str] | None = None) -> Sample: ...

    def release(self, key: str) -> None: ...


@dataclass
class Segment:
    token_ids: list[int]            # prompt + response (+ observations), as the engine saw them
    loss_mask: list[int]            # 1 exactly on tokens the engine sampled, else 0
    logprobs: list[float]           # behaviour logprob of each sampled token; 0.0 where loss_mask == 0
    versions: list[int]             # policy version that sampled each token; NO_VERSION where mask == 0
    rollout_id: str
    group_id: str
    segment_index: int = 0
    prompt_len: int = 0             # tokens before the first sampled token
    finish_reason: str = "stop"     # of the last sampled turn: stop | length | abort
    routed_experts: np.ndarray | None = None  # MoE: [len, layers, top_k] expert ids (see pad_routes)
    # What each turn was sampled with, as the engine applied it: [first token index, temperature, top_p,
    # top_k] per turn, in order; a turn's values hold until the next turn's index. The trainer scores
    # every token under the same distribution. Empty: the run's rollout.temperature/top_p/top_k.
    sampling: list[list[float]] = field(default_factory=list)
    # Vision-language models: the images (data URLs of their exact bytes, molt.inputs.vision) that the image
    # placeholders in `token_ids` stand for, in order; `token_ids` holds the placeholders as the engine
    # expanded them (one per merged patch), so the trainer reads the sequence the engine read.
    images: list[str] = field(default_factory=list)
    # [turn, first token index] of each turn sampled in this segment, in order: `turn` counts the rollout's
    # sampled turns from 0 across its segments, and a turn's tokens run to the next turn's start (per-turn
    # credit, algo.turn_credit). Empty: the segment's sampled tokens are one turn, the rollout's only.
    turns: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if not (len(self.loss_mask) == len(self.logprobs) == len(self.versions) == n):
            raise ValueError(f"segment {self.rollout_id}/{self.segment_index}: token_ids ({n}), loss_mask "
                             f"({len(self.loss_mask)}), logprobs ({len(self.logprobs)}) and versions "
                             f"({len(self.versions)}) must have one entry per token")
        starts = [span[0] for span in self.sampling]
        if any(len(span) != 4 for span in self.sampling) or starts != sorted(starts) or \
                any(not 0 <= i < n for i in starts):
            raise ValueError(f"segment {self.rollout_id}/{self.segment_index}: sampling must be "
                             "[first token index, temperature, top_p, top_k] spans in token order")
        firsts = [t[1] for t in self.turns if len(t) == 2]
        if len(firsts) != len(self.turns) or firsts != sorted(firsts) or any(not 0 <= i < n for i in firsts):
            raise ValueError(f"segment {self.rollout_id}/{self.segment_index}: turns must be [turn, first "
                             "token index] pairs in token order")
        if self.routed_experts is not None:
            self.routed_experts = pad_routes(np.asarray(self.routed_experts), n)

    def __eq__(self, other: object) -> bool:
        # the generated __eq__ cannot compare the routes array; compare it by value
        if not isinstance(other, Segment):
            return NotImplemented
        a, b = self.routed_experts, other.routed_experts
        same_routes = a is b is None or (a is not None and b is not None and np.array_equal(a, b))
        return same_routes and all(getattr(self, f.name) == getattr(other, f.name) for f in fields(self)
                                   if f.name != "routed_experts")


def pad_routes(routes: np.ndarray, length: int) -> np.ndarray:
    """Routes [k, layers, top_k] of the first k <= length tokens, extended to `length` tokens.

    An engine returns routes only for tokens that were an input to its forward, so the last token (and
    anything appended after the last sample) has none; those routes steer no logprob of an earlier
    token, and the filler (experts 0..top_k-1) is never trained on.
    """
    if routes.ndim != 3 or len(routes) > length:
        raise ValueError(f"routed experts of shape {routes.shape} for {length} tokens")
    filler = np.broadcast_to(np.arange(routes.shape[2], dtype=routes.dtype), (length - len(routes),
                                                                               *routes.shape[1:]))
    return np.concatenate([routes, filler]) if len(filler) else routes


@dataclass
class Rollout:
    rollout_id: str
    group_id: str
    segments: list[Segment]
    reward: float
    score: float | None = None      # for filters; defaults to reward
    label: Any = None
    info: dict[str, float] = field(default_factory=dict)   # scalar diagnostics, logged
    error: str | None = None        # set when the agent failed; such a rollout is never trained on
    # What the agent did (agent/* metrics): sampled turns (LLM calls), the tool calls agent.tool_parser
    # read in them, the tool messages that reported an error ("error: ..."), and whether it ended on an
    # answer rather than on a budget (agent.max_turns, max_total_tokens, a turn cut at max_tokens);
    # tool_parse_errors: sampled turns with a call the parser could not read (malformed markup or JSON).
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_parse_errors: int = 0
    answered: bool = False
    turn_rewards: list[float] = field(default_factory=list)   # each turn's (model reply's) reward, in order
    # responses stopped by the context (model.max_model_len, agent.max_total_tokens) before their turn's
    # max_tokens (rollout/context_truncated)
    context_truncated: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def num_sampled(self) -> int:
        return sum(sum(s.loss_mask) for s in self.segments)
