"""The losses a client names per request (molt.tinker: the Tinker API's built-in losses), each made of the
loop's own functions: the surrogates of `POLICY_LOSSES`, importance correction and `sft_loss`.

Every loss is the SUM over the tokens a datum scores (no normalizer), so a batch that a client splits into
several requests accumulates to the same gradient as one request. Inputs are per token [B, T], zero off
the scored positions: `loss_mask` (1 on every position a datum scores), `weights`, `advantages`,
`behaviour_logp` (the sampler's logprob of each target token: `logprobs` on the wire); `logp` is the
current forward's logprob of each target (with grad).

    cross_entropy        -sum_t w_t logp_t                              sft_loss, w as token weights
    importance_sampling  -sum_t r_t A_t          r_t = exp(logp_t - q_t)  ppo's surrogate at ratio 1 times
                                                                         the unbounded token IS weight r_t
    ppo                  -sum_t min(r_t A_t, clip(r_t, lo, hi) A_t)     POLICY_LOSSES["ppo"], old = q
    cispo                -sum_t sg(clip(r_t, lo, hi)) A_t logp_t        POLICY_LOSSES["cispo"], old = q
    dro                  -sum_t (A_t logp_t - beta/2 (logp_t - q_t)^2)  POLICY_LOSSES["dro"], old = q

As the hosted service defines them, every position of a datum counts: the RL losses have no sampled-token
mask, a prompt position contributes through its advantage (0 there: nothing) and, for dro, its logprob.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from molt.algo.loss import policy_loss, sft_loss
from molt.spec import AlgoSpec, CorrectionSpec, LossSpec

LossFn = Callable[[Tensor, dict[str, Tensor]], tuple[Tensor, dict[str, Tensor]]]


@dataclass(frozen=True)
class DatumLoss:
    build: Callable[[dict[str, float]], LossFn]   # the loss for one request's config
    inputs: tuple[str, ...]                        # loss_fn_inputs it reads besides target_tokens
    config: dict[str, float | None]                # config keys it takes, with defaults (None: required)


def _cross_entropy(config: dict[str, float]) -> LossFn:
    return lambda logp, mb: sft_loss(logp, {"loss_mask": mb["weights"]}, 1.0)


def _importance_sampling(config: dict[str, float]) -> LossFn:
    # At ratio 1 (old = logp, detached) PPO's surrogate is -A_t with the gradient of logp_t; the token-level
    # correction, clamped to [0, inf), weights it by r_t: value -r_t A_t, gradient -r_t A_t d logp_t.
    algo = AlgoSpec(correction=CorrectionSpec(level="token", mode="clip", low=0.0, high=math.inf))
    return lambda logp, mb: policy_loss(logp, dict(mb, old_logp=logp.detach()), algo, 1.0)


def _against_sampler(policy: str) -> Callable[[dict[str, float]], LossFn]:
    def build(config: dict[str, float]) -> LossFn:
        if policy == "dro":
            loss = LossSpec(policy="dro", dro_beta=config["beta"])
        else:
            loss = LossSpec(policy=policy, eps_low=1 - config["clip_low_threshold"],
                            eps_high=config["clip_high_threshold"] - 1)
        algo = AlgoSpec(loss=loss)
        return lambda logp, mb: policy_loss(logp, dict(mb, old_logp=mb["behaviour_logp"]), algo, 1.0)
    return build


RL_INPUTS = ("logprobs", "advantages")
CLIP = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}   # the hosted service's fixed 1 -/+ 0.2
DATUM_LOSSES: dict[str, DatumLoss] = {
    "cross_entropy": DatumLoss(_cross_entropy, ("weights",), {}),
    "importance_sampling": DatumLoss(_importance_sampling, RL_INPUTS, {}),
    "ppo": DatumLoss(_against_sampler("ppo"), RL_INPUTS, CLIP),
    "cispo": DatumLoss(_against_sampler("cispo"), RL_INPUTS, CLIP),
    "dro": DatumLoss(_against_sampler("dro"), RL_INPUTS, {"beta": None}),
}


def datum_loss(name: str, config: dict[str, float | str] | None) -> LossFn:
    """The loss `name` with the request's `config`; a name, key or value it cannot serve raises ValueError
    naming it (the service refuses the request with that message)."""
    if name not in DATUM_LOSSES:
        raise ValueError(f"loss_fn={name!r} is not served; served: {', '.join(DATUM_LOSSES)}")
    spec = DATUM_LOSSES[name]
    given = dict(config or {})
    unknown = sorted(set(given) - set(spec.config))
    if unknown:
        accepted = ", ".join(spec.config) or "none"
        raise ValueError(f"loss_fn_config key {unknown[0]!r} is not served for loss_fn={name!r} (it takes: "
                         f"{accepted})")
    values: dict[str, float] = {}
    for key, default in spec.config.items():
        value = given.get(key, default)
        if value is None:
            raise ValueError(f"loss_fn={name!r} needs loss_fn_config[{key!r}]")
        if isinstance(value, str):
            raise ValueError(f"loss_fn_config[{key!r}]={value!r} must be a number")
        values[key] = float(value)
    low, high = values.get("clip_low_threshold", 0.0), values.get("clip_high_threshold", 1.0)
    if not 0 <= low <= 1 <= high or values.get("beta", 0.0) < 0:
        raise ValueError(f"loss_fn={name!r}: loss_fn_config {values} is out of range (0 <= "
                         "clip_low_threshold <= 1 <= clip_high_threshold; beta >= 0)")
    return spec.build(values)
