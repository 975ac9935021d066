"""The `algo` section of the run spec: the estimator, the loss, importance correction, KL, filters and
reward transforms (molt/algo/ implements each by name)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from molt.spec.strict import Strict


class LossSpec(Strict):
    policy: str = Field("ppo", description="policy surrogate, by registered name: ppo (clip), gspo "
                        "(sequence ratio and clip), cispo (clipped, stop-gradient IS weight), dro "
                        "(quadratic penalty on the log-ratio, no clip)")
    eps_low: float = Field(0.2, ge=0, le=1, description="clip: the ratio's (gspo: sequence ratio's; cispo: "
                           "IS weight's) lower bound is 1-eps_low")
    eps_high: float = Field(0.2, ge=0, description="clip: the upper bound is 1+eps_high")
    dro_beta: float = Field(0.05, ge=0, description="dro: weight of the penalty dro_beta/2 * (logp - "
                            "old_logp)^2")
    dual_clip: float | None = Field(None, description="c > 1 bounds the loss of negative-advantage tokens "
                                    "(policy=ppo)")
    norm: Literal["token", "seq", "seq-mean-token-mean"] = Field(
        "token", description="token: global token mean; seq: per-sequence constant (Dr.GRPO); "
        "seq-mean-token-mean: mean over sequences of each one's token mean (original GRPO)")
    value_clip: float = Field(0.2, gt=0, description="critic: largest value change from the old values")
    entropy_coef: float = Field(0.0, description="entropy bonus weight (0 = off)")

    @field_validator("dual_clip")
    @classmethod
    def _dual_clip_above_one(cls, value: float | None) -> float | None:
        # The cap -c*A_t of a negative-advantage token must lie above its loss at ratio 1 (-A_t): with
        # c <= 1 the cap holds at the ratio the update starts from, so those tokens get no gradient.
        if value is not None and value <= 1:
            raise ValueError(f"algo.loss.dual_clip={value} must be > 1: the cap -dual_clip*A_t of a "
                             "negative-advantage token would lie at or below its loss at ratio 1, taking "
                             "its gradient away; use c > 1 (Ye et al. 2020: 3) or null (off)")
        return value

    @model_validator(mode="after")
    def _dual_clip(self) -> LossSpec:
        if self.dual_clip is not None and self.policy != "ppo":
            raise ValueError(f"algo.loss.dual_clip bounds PPO's clipped objective; policy={self.policy} has "
                             "no such term: set dual_clip=null")
        return self


class CorrectionSpec(Strict):
    level: Literal["off", "token", "seq", "geo"] = Field(
        "off", description="importance ratio gated: per token, sequence product or its geometric mean")

    @field_validator("level", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        return "off" if value is False else value  # YAML 1.1 reads a bare `off` as false
    mode: Literal["mask", "clip", "trunc"] = Field(
        "trunc", description="outside [low, high]: mask drops, clip clamps, trunc caps at high (TIS)")
    low: float = Field(0.0, description="lower end of the accepted ratio band")
    high: float = Field(2.0, description="upper end of the accepted ratio band")

    @model_validator(mode="after")
    def _band(self) -> CorrectionSpec:
        if not self.low < self.high:
            raise ValueError(f"correction band low={self.low} must be below high={self.high}")
        return self


class KLSpec(Strict):
    estimator: Literal["k1", "k2", "k3"] = Field("k3", description="KL(policy || reference) estimator")
    coef: float = Field(0.0, ge=0, description="KL penalty weight (0 = off; > 0 needs model.reference); with "
                        "target: the initial weight")
    in_reward: bool = Field(False, description="fold the KL penalty into the reward instead of the loss")
    target: float | None = Field(None, gt=0, description="adaptive KL (Ziegler et al.): steer coef so the "
                                 "mean KL per sampled token approaches this (null = fixed coef)")
    horizon: int = Field(10000, ge=1, description="adaptive KL: rollouts over which coef may change by "
                         "a factor e^0.2 (a step counts as at most one horizon)")

    @model_validator(mode="after")
    def _adaptive(self) -> KLSpec:
        if self.target is not None and self.coef <= 0:
            raise ValueError("algo.kl.target needs an initial algo.kl.coef > 0 (the controller scales it)")
        # As a loss term k1 = logp - ref_logp has the gradient of logp alone, whose mean over the policy's
        # own samples is 0: it would add noise and never pull toward the reference.
        if self.estimator == "k1" and self.coef > 0 and not self.in_reward:
            raise ValueError("algo.kl.estimator=k1 as a loss term (algo.kl.in_reward=false) has a zero-mean "
                             "gradient on the policy's own samples, so it never pulls toward the reference; "
                             "use k1 with algo.kl.in_reward=true, or k2 / k3 in the loss")
        return self


class RewardSpec(Strict):
    overlong_buffer_frac: float = Field(0.0, ge=0, lt=1, description="DAPO soft overlong penalty: this "
                                        "share of the response budget, at its end, costs up to "
                                        "overlong_penalty, linearly (DAPO: 0.2; 0 = off)")
    overlong_penalty: float = Field(1.0, ge=0, description="the overlong penalty at the full budget")
    clip: float | None = Field(None, gt=0, description="clip each rollout's reward to [-clip, clip]")
    normalize: Literal["off", "batch"] = Field(
        "off", description="batch: (r - mean) / (std + 1e-6) over the batch's rollouts")

    @field_validator("normalize", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        return "off" if value is False else value  # YAML 1.1 reads a bare `off` as false


class FilterSpec(Strict):
    drop_equal_rewards: bool = Field(
        False, description="dynamic sampling: drop groups whose rewards are all equal")
    score_range: tuple[float, float] | None = Field(
        None, description="keep only groups whose mean score lies inside [low, high]")
    drop_truncated: bool = Field(False, description="drop responses cut off at max_tokens")
    refill_max_groups: int = Field(0, ge=0, description="dynamic sampling: generate up to this many extra "
                                   "groups per step to replace groups the filters drop (0 = train on fewer)")

    @field_validator("score_range")
    @classmethod
    def _ordered(cls, value: tuple[float, float] | None) -> tuple[float, float] | None:
        if value is not None and value[0] > value[1]:
            raise ValueError(f"algo.filters.score_range={list(value)}: low must not exceed high (every group "
                             "would be dropped)")
        return value


class AlgoSpec(Strict):
    estimator: str = Field("grpo", description="advantage estimator, by registered name (checked after "
                           "algo.plugins are imported)")
    plugins: list[str] = Field(
        default_factory=list, description="modules (dotted, or .py files) imported before the names are "
        "checked, in the driver and every trainer rank: they register estimators or policy losses")
    gamma: float = Field(1.0, description="discount of later rewards (reinforce_pp, gae)")
    lam: float = Field(1.0, description="GAE lambda")
    turn_credit: Literal["rollout", "turn"] = Field(
        "rollout", description="rollout: every sampled token gets its rollout's summed reward; turn: each "
        "turn's tokens get the return from that turn on (the per-turn rewards of an Env's steps or a "
        "ChatAgent's ctx.reward_turn, discounted by turn_discount), against the group's baseline of "
        "whole-rollout returns (grpo, dr_grpo, rloo)")
    turn_discount: float = Field(1.0, ge=0, le=1, description="turn credit: weight of a reward k turns "
                                 "later is turn_discount**k")
    distill_coef: float = Field(1.0, description="on_policy_distill: weight of the teacher log-ratio")
    loss: LossSpec = Field(default_factory=LossSpec, description="the clipped policy loss")
    correction: CorrectionSpec = Field(default_factory=CorrectionSpec,
                                       description="importance correction of trainer vs engine logprobs")
    kl: KLSpec = Field(default_factory=KLSpec, description="KL regularization to model.reference")
    filters: FilterSpec = Field(default_factory=FilterSpec, description="batch filters before the update")
    reward: RewardSpec = Field(default_factory=RewardSpec,
                               description="reward shaping, clipping, normalization (after the filters)")

    @model_validator(mode="after")
    def _distill_ignores_the_reward(self) -> AlgoSpec:
        # on_policy_distill's advantages ignore the reward, and policy_loss leaves the loss-form KL out
        # when in_reward is set: the KL would be applied nowhere while adv/kl_in_reward is still logged.
        if self.estimator == "on_policy_distill" and self.kl.coef > 0 and self.kl.in_reward:
            raise ValueError(f"algo.estimator=on_policy_distill with algo.kl.coef={self.kl.coef} and "
                             "algo.kl.in_reward=true: its advantages do not use the reward, so a KL folded "
                             "into it is applied nowhere; set algo.kl.in_reward=false (the KL is then a "
                             "loss term)")
        if self.turn_credit == "rollout" and self.turn_discount != 1.0:
            raise ValueError(f"algo.turn_discount={self.turn_discount} discounts turns only with "
                             "algo.turn_credit=turn; set it, or leave turn_discount at 1")
        folded = self.kl.in_reward and self.kl.coef > 0
        if self.turn_credit == "turn" and (folded or self.reward != RewardSpec()):
            raise ValueError("algo.turn_credit=turn with a KL folded into the reward or algo.reward.* "
                             "transforms: both act on whole-rollout rewards, not on the turns'; set "
                             "algo.kl.in_reward=false and leave algo.reward at its defaults, or use "
                             "algo.turn_credit=rollout")
        # ... and for the same reason the reward transforms would change nothing but reward/* metrics
        if self.estimator == "on_policy_distill" and self.reward != RewardSpec():
            raise ValueError("algo.reward.* with algo.estimator=on_policy_distill: its advantages are the "
                             "teacher log-ratio and do not use the reward, so reward shaping, clipping and "
                             "normalization would change nothing; leave algo.reward at its defaults")
        return self
