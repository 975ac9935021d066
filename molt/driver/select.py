"""Which rollouts a step trains on, and with which rewards.

    take a batch from the pool (dynamic sampling: refill it while the filters drop groups)
    → statistics of everything generated → drop failed rollouts → filters → reward transforms

All of it reads config (`agent.on_failure`, `algo.filters`, `algo.reward`); the loop calls it without
knowing which algorithm runs.
"""

from __future__ import annotations

import torch

from molt.algo import apply_filters, filter_drops, shape_rewards
from molt.rollout.pool import RolloutPool
from molt.spec import RunSpec
from molt.trajectory import Rollout, Segment


def rollout_metrics(spec: RunSpec, rollouts: list[Rollout]) -> dict[str, float]:
    """Reward and failure statistics of the whole batch; stops the run on too many failures."""
    ok = [r for r in rollouts if r.ok]
    failed = len(rollouts) - len(ok)
    if rollouts and failed / len(rollouts) > spec.agent.max_failure_rate:
        errors = sorted({r.error for r in rollouts if r.error})[:3]
        raise RuntimeError(f"{failed}/{len(rollouts)} rollouts failed, above agent.max_failure_rate="
                           f"{spec.agent.max_failure_rate}; first errors: {errors}")
    rewards = torch.tensor([r.reward for r in ok] or [0.0])
    out = {"reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()) if len(ok) > 1 else 0.0,
           "rollout/failed": float(failed), "rollout/count": float(len(rollouts)),
           "tokens/sampled": float(sum(r.num_sampled for r in rollouts)),
           "rollout/segments_per": sum(len(r.segments) for r in ok) / max(len(ok), 1),
           "rollout/context_truncated": float(sum(r.context_truncated for r in rollouts))}
    return out | agent_metrics(ok)


def agent_metrics(ok: list[Rollout]) -> dict[str, float]:
    """What the agents did, per rollout that did not fail (docs/loop.md#metrics): agent/* from the runner's
    counts, info/KEY the mean of Result.info[KEY] over the rollouts whose info has KEY."""
    out = {}
    for name, of in (("turns", "turns"), ("tool_calls", "tool_calls"), ("tool_errors", "tool_errors"),
                     ("tool_parse_errors", "tool_parse_errors"), ("answer_rate", "answered")):
        out[f"agent/{name}"] = sum(float(getattr(r, of)) for r in ok) / max(len(ok), 1)
    for key in sorted({k for r in ok for k in r.info}):
        values = [float(r.info[key]) for r in ok if key in r.info]
        out[f"info/{key}"] = sum(values) / len(values)
    return out


def context_warning(spec: RunSpec, rollouts: list[Rollout]) -> str:
    """The first time a run's responses are cut by the context: which rollout, and what to change."""
    cut = next(r for r in rollouts if r.context_truncated)
    prompt = cut.segments[0].prompt_len if cut.segments else 0
    return (f"molt: responses are cut short by the context (rollout/context_truncated counts them; first: "
            f"rollout {cut.rollout_id}, a {prompt}-token prompt): a turn stopped before rollout.max_tokens="
            f"{spec.rollout.max_tokens} because model.max_model_len={spec.model.max_model_len} or "
            f"agent.max_total_tokens={spec.agent.max_total_tokens} left no more room; raise them, or lower "
            "rollout.max_tokens")


def drop_failed(spec: RunSpec, rollouts: list[Rollout]) -> list[Rollout]:
    """agent.on_failure: drop the whole group of a failed rollout, or only the failed rollout."""
    if spec.agent.on_failure == "drop_group":
        bad_groups = {r.group_id for r in rollouts if not r.ok}
        return [r for r in rollouts if r.group_id not in bad_groups]
    return [r for r in rollouts if r.ok]


def group_ids(rollouts: list[Rollout]) -> torch.Tensor:
    """[R] each rollout's group as 0, 1, ... in order of first appearance (the groups of the algo/ code)."""
    index = {g: i for i, g in enumerate(dict.fromkeys(r.group_id for r in rollouts))}
    return torch.tensor([index[r.group_id] for r in rollouts], dtype=torch.long)


def filter_rollouts(spec: RunSpec, rollouts: list[Rollout]) -> tuple[list[Rollout], dict[str, float]]:
    """The rollouts left after `drop_failed` and `algo.filters`, in order, and `filter/*` metrics."""
    kept = drop_failed(spec, rollouts)
    keep, filter_metrics = apply_filters(*filter_inputs(kept), spec.algo)
    return [kept[i] for i in keep.tolist()], {k: float(v) for k, v in filter_metrics.items()}


def filter_inputs(rollouts: list[Rollout]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What `algo.filters` read, [R] each: rewards, scores (the reward where none), group ids, and whether
    the last turn was cut at max_tokens."""
    rewards = torch.tensor([r.reward for r in rollouts], dtype=torch.float32)
    scores = torch.tensor([r.reward if r.score is None else r.score for r in rollouts], dtype=torch.float32)
    truncated = torch.tensor([bool(r.segments) and r.segments[-1].finish_reason == "length"
                              for r in rollouts])
    return rewards, scores, group_ids(rollouts), truncated


def filter_decisions(spec: RunSpec, rollouts: list[Rollout]) -> dict[str, str]:
    """Rollout id -> why it is trained or not, as `filter_rollouts` decides: "kept", "failed" (its agent
    failed), "group failed" (agent.on_failure=drop_group: another rollout of its group failed) or the
    name of the `algo.filters` filter that dropped it. For the dump (the inspector's groups view)."""
    ok = drop_failed(spec, rollouts)
    drops = dict(zip((r.rollout_id for r in ok), filter_drops(*filter_inputs(ok), spec.algo), strict=True))
    return {r.rollout_id: ("failed" if not r.ok else "group failed") if r.rollout_id not in drops
            else drops[r.rollout_id] or "kept" for r in rollouts}


def shaped_rewards(spec: RunSpec, kept: list[Rollout]) -> tuple[torch.Tensor, dict[str, float]]:
    """[R] rewards of the kept rollouts after `algo.reward`'s transforms, and `reward/*` metrics."""
    rewards = torch.tensor([r.reward for r in kept], dtype=torch.float32)
    lengths = torch.tensor([r.num_sampled for r in kept], dtype=torch.float32)
    # A rollout's responses are capped at max_tokens per turn and by what agent.max_total_tokens leaves after
    # its prompt: the overlong band sits below the smaller of the two, so the penalty can fire at all.
    room = torch.tensor([spec.agent.max_total_tokens - (r.segments[0].prompt_len if r.segments else 0)
                         for r in kept], dtype=torch.float32)
    budget = room.clamp(min=1, max=spec.response_budget)
    rewards, metrics = shape_rewards(rewards, lengths, spec.algo, budget)
    return rewards, {k: float(v) for k, v in metrics.items()}


def turn_credit(spec: RunSpec, kept: list[Rollout], rewards: torch.Tensor, segments: list[Segment],
                shape: torch.Size) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The estimator's rewards [R] and extra inputs under algo.turn_credit: unchanged and none for
    `rollout`; for `turn`, each rollout's return from its first turn and `turn_returns` [S, T] (`shape`,
    the batch's), every sampled token's return from its turn on, G_k = sum_{j >= k} d^(j-k) r_j over the
    rollout's per-turn rewards (d = algo.turn_discount; docs/algo.md#credit-over-turns)."""
    if spec.algo.turn_credit == "rollout":
        return rewards, {}
    returns = {}
    for rollout in kept:
        if not rollout.turn_rewards:
            raise ValueError(f"algo.turn_credit=turn: rollout {rollout.rollout_id} has no per-turn rewards "
                             "(an Env's steps and a ChatAgent's Result and ctx.reward_turn record them)")
        g, out = 0.0, []
        for reward in reversed(rollout.turn_rewards):
            g = reward + spec.algo.turn_discount * g
            out.append(g)
        returns[rollout.rollout_id] = out[::-1]
    tokens = torch.zeros(shape, dtype=rewards.dtype)
    for row, segment in enumerate(segments):
        if not segment.turns:
            raise ValueError(f"algo.turn_credit=turn: segment {segment.rollout_id}/{segment.segment_index} "
                             "does not record its turns")
        ends = [start for _, start in segment.turns[1:]] + [len(segment.token_ids)]
        for (turn, start), end in zip(segment.turns, ends, strict=True):
            tokens[row, start:end] = returns[segment.rollout_id][turn]
    first = torch.tensor([returns[r.rollout_id][0] for r in kept], dtype=rewards.dtype)
    return first, {"turn_returns": tokens}


async def take_batch(pool: RolloutPool, spec: RunSpec,
                     need_current: bool = True) -> tuple[list[list[Rollout]], dict[str, float]]:
    """train.prompts_per_step groups from the pool; with algo.filters.refill_max_groups > 0, more groups
    while fewer than that survive the filters (dynamic sampling, DAPO), at most that many extra.
    `need_current`: as `RolloutPool.next_batch`'s.

    Returns every group generated (the filters run again in `learn`, so statistics and dumps cover
    all of them and the update sees exactly the survivors) and `filter/refill_groups` (extra groups
    generated), `filter/informative_groups` (groups that survive) and `filter/short_groups` (how many the
    batch still lacks when the bound or the prompts ran out)."""
    want, bound = spec.train.prompts_per_step, spec.algo.filters.refill_max_groups
    groups = await pool.next_batch(want, need_current)
    if not bound:
        return groups, {}
    informative = sum(bool(filter_rollouts(spec, g)[0]) for g in groups)
    extra = 0
    while informative < want and extra < bound:
        more = await pool.next_batch(min(want - informative, bound - extra), need_current)
        if not more:
            break                               # the prompts ran out
        extra += len(more)
        informative += sum(bool(filter_rollouts(spec, g)[0]) for g in more)
        groups += more
    return groups, {"filter/refill_groups": float(extra), "filter/informative_groups": float(informative),
                    "filter/short_groups": float(max(want - informative, 0))}
