"""Token-exact record of one rollout: sealed segments plus the open one.

Both agent paths write here. Prompt, observation and tool-output tokens enter with loss mask 0; tokens
come back from the sampler with their behaviour logprob and policy version and enter with mask 1. The
ids appended are the sampler's own, never re-tokenized text (invariant 1).
"""

from __future__ import annotations

import math
from typing import Any

from molt.trajectory import NO_VERSION, AgentError, Rollout, Sample, Segment


class Trace:
    def __init__(self, rollout_id: str, group_id: str) -> None:
        self.rollout_id, self.group_id = rollout_id, group_id
        self.segments: list[Segment] = []
        self.ids: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.routes = None          # MoE routed experts of a prefix of `ids`, from the latest sample
        self.sampling: list[list[float]] = []   # per turn: [first token index, temperature, top_p, top_k]
        self.finish_reason = "stop"
        self.images: list[str] = []   # data URLs of the open segment's image placeholders, in order
        self.turns: list[list[int]] = []   # [turn, first token index] of the open segment's turns
        self.turn = 0                 # samples added so far: the next sample's turn
        self.context_cuts = 0         # samples stopped by the context (`mark_context_cut`)

    def extend_prompt(self, ids: list[int], images: list[str] = ()) -> None:
        """Tokens the model reads but did not sample (prompt, observation, template glue), and the images
        their placeholders stand for."""
        self.images += images
        self.ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [NO_VERSION] * len(ids)

    def add_sample(self, out: Sample) -> None:
        """Append one sampler result (its token_ids, logprobs, versions, finish_reason, and `sampling`: the
        [temperature, top_p, top_k] the engine applied) with mask 1.

        With router replay the result also carries `routed_experts` of its prompt and output (all but
        the last token): the whole segment so far, since the prompt was the segment. They replace the
        earlier ones, so each token keeps the routes of the latest forward that read it (after a refit
        that is the new policy's, which is what the tokens sampled after it saw)."""
        prompt = out.get("prompt_ids")
        if prompt is not None and list(prompt) != self.ids and not self._expand(list(prompt)):
            # The engine shortened the prompt (rollout.prompt_too_long=truncate): the segment must be
            # what it actually read, so a new one starts from its prompt.
            self.restart(list(prompt), self.images)
        ids, logprobs, versions = list(out["token_ids"]), list(out["logprobs"]), list(out["versions"])
        if not (len(ids) == len(logprobs) == len(versions)):
            raise ValueError(f"sampler returned {len(ids)} tokens, {len(logprobs)} logprobs and "
                             f"{len(versions)} versions")
        if out.get("sampling") is not None and ids:
            self.sampling.append([len(self.ids), *out["sampling"]])
        if ids:
            self.turns.append([self.turn, len(self.ids)])
        self.turn += 1
        self.ids += ids
        self.mask += [1] * len(ids)
        self.logprobs += [float(x) for x in logprobs]
        self.versions += [int(v) for v in versions]
        self.routes = out.get("routed_experts")
        self.finish_reason = out.get("finish_reason") or "stop"
        self.context_cuts += bool(out.get("context_cut"))

    def _expand(self, prompt: list[int]) -> bool:
        """Take the engine's `prompt` if it is `ids` with image placeholders expanded: each extra token
        repeats the prompt token before it (never a sampled one). False if it is not."""
        if not self.images:
            return False
        keep, i = [], 0
        for j, token in enumerate(prompt):
            if i < len(self.ids) and token == self.ids[i]:
                keep.append(i)
                i += 1
            elif j and token == prompt[j - 1] and self.mask[keep[-1]] == 0:
                keep.append(keep[-1])
            else:
                return False
        if i != len(self.ids):
            return False
        # a repeated position is a prompt token: its mask, logprob and version are the empty ones
        self.ids = prompt
        self.mask, self.logprobs, self.versions = ([seq[k] for k in keep] for seq in
                                                   (self.mask, self.logprobs, self.versions))
        self.sampling = [[keep.index(span[0]), *span[1:]] for span in self.sampling]
        self.turns = [[turn, keep.index(start)] for turn, start in self.turns]
        return True

    def restart(self, prompt_ids: list[int], images: list[str] = ()) -> None:
        """Seal the open segment and open a new one from `prompt_ids` (the context was rewritten)."""
        images = list(images)
        self.seal()
        self.extend_prompt(prompt_ids, images)

    def seal(self) -> None:
        # A segment without sampled tokens has nothing to train on, so it is dropped.
        if any(self.mask):
            self.segments.append(Segment(
                token_ids=self.ids, loss_mask=self.mask, logprobs=self.logprobs, versions=self.versions,
                rollout_id=self.rollout_id, group_id=self.group_id, segment_index=len(self.segments),
                prompt_len=self.mask.index(1), finish_reason=self.finish_reason, routed_experts=self.routes,
                sampling=self.sampling, images=self.images, turns=self.turns))
        self.ids, self.mask, self.logprobs, self.versions, self.routes = [], [], [], [], None
        self.sampling, self.images, self.turns = [], [], []

    def rollout(self, reward: Any, score: Any = None, info: dict | None = None, label: Any = None) -> Rollout:
        """Seal and return the rollout; a non-numeric / non-finite reward or no sampled token is an error."""
        self.seal()
        reward = as_finite(reward, "reward")
        score = reward if score is None else as_finite(score, "score")
        if not self.segments:
            raise AgentError("the agent sampled no tokens")
        info = {k: as_finite(v, f"info[{k!r}]") for k, v in (info or {}).items()}
        return Rollout(self.rollout_id, self.group_id, self.segments, reward, score=score, label=label,
                       info=info, context_truncated=self.context_cuts)


def mark_context_cut(out: Sample, max_tokens: int) -> Sample:
    """Mark a sample that stopped on length before `max_tokens`, its turn's own bound: the context cut it
    (the engine shrinks a request to model.max_model_len, the agent layer to agent.max_total_tokens)."""
    out["context_cut"] = out.get("finish_reason") == "length" and len(out["token_ids"]) < max_tokens
    return out


def as_finite(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise AgentError(f"{what} must be a finite number, got {value!r}")
    return float(value)


def failed_rollout(rollout_id: str, group_id: str, label: Any, error: str) -> Rollout:
    return Rollout(rollout_id, group_id, segments=[], reward=0.0, label=label, error=error)
