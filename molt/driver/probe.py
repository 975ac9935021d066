"""The post-refit probe: where async mode measures invariant 3 when a batch holds no current-policy token.

The trainer measures its gap to the engine on tokens that the weights it holds sampled. In async mode a
batch may hold none: with the engines faster than the trainer, every waiting group finished before the
refit. Waiting for a whole group of the new policy would cost one group's generation every step, so
right after each refit the loop samples `PROBE_TOKENS` tokens of one prompt on the new weights, and the
next step scores them when its batch holds no token of the current policy (`mismatch/probe` = 1). The
probe is never trained on. Where no text-only prompt exists (vision runs) there is no probe and the pool
waits for a current-policy group, as before; a probe whose request fails (its engine died) is reported,
and a next batch without current-policy tokens then logs no `mismatch/*` for its step.
"""

from __future__ import annotations

import asyncio
from typing import Any

from molt.agents.trace import Trace
from molt.algo import gap_metrics, gap_sums
from molt.rollout.dispatch import Dispatcher
from molt.rollout.sampling import TrainingSampler
from molt.spec import RunSpec
from molt.trainer.batch import make_batch
from molt.trajectory import AgentError, EngineDiedError, Rollout, Segment

# Enough sampled tokens that one badly reproduced token shows in `mismatch/max_abs`; few enough that the
# request ends within a few engine steps of the refit, alongside the groups the engines are sampling.
PROBE_TOKENS = 16


def probe_prompt(rollouts: list[Rollout]) -> list[int] | None:
    """The prompt of the first text-only segment of `rollouts` (None if every segment has images: their
    placeholders are already expanded, so they cannot be sent to the engine again as they are)."""
    for r in rollouts:
        for s in r.segments:
            if not s.images and s.prompt_len:
                return s.token_ids[:s.prompt_len]
    return None


async def sample_probe(spec: RunSpec, dispatcher: Dispatcher, prompt_ids: list[int],
                       version: int) -> Segment | None:
    """`PROBE_TOKENS` tokens sampled from `prompt_ids` by the engines' current weights (`version`), with
    the run's sampling and a seeded request; None when the request fails on the engine side."""
    key = f"probe-v{version}"
    sampler = TrainingSampler(dispatcher, spec.run.seed, lambda: version)
    trace = Trace(key, "probe")
    trace.extend_prompt(list(prompt_ids))
    try:
        trace.add_sample(await sampler.generate(list(prompt_ids), {**spec.rollout.request(),
                                                                  "max_tokens": PROBE_TOKENS}, key))
    except (AgentError, EngineDiedError) as err:
        dispatcher.take_lost([key])
        print(f"molt: the probe of policy version {version} failed ({err}); a next batch with no token of "
              "this version logs no mismatch/* for its step", flush=True)
        return None
    finally:
        sampler.release(key)
    trace.seal()
    return trace.segments[0] if trace.segments else None


async def probe_gap(policy: Any, probe: Segment, pad_id: int) -> dict[str, float]:
    """The trainer/engine gap on the probe's sampled tokens, scored by `policy` (the `TrainerRanks` that
    hold the weights which sampled it), under the names the update logs it, plus `mismatch/probe` = 1."""
    batch = make_batch([probe], pad_id)
    logp = await asyncio.to_thread(policy.logprobs, batch)
    sampled = batch["loss_mask"] > 0
    return {**gap_metrics(gap_sums((logp - batch["behaviour_logp"])[sampled])), "mismatch/probe": 1.0}
