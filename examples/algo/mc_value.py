"""A plugin estimator that needs a critic: Monte-Carlo returns with a learned value baseline.

A_t = G_t - V_t, where G_t is each sampled token's discounted reward-to-go (algo.gamma; the KL penalty per
token when algo.kl.in_reward) and V_t the critic's value of the tokens before it; the critic is trained
towards G_t. It is GAE at lambda = 1, without whitening. `needs_critic=True` is all the run needs to know:
the driver then requires model.critic=true and trains the critic on the returns this returns, with no
edit to molt/spec/ (use: algo.plugins=[examples/algo/mc_value.py] algo.estimator=mc_value
model.critic=true).
"""

from __future__ import annotations

from molt.algo.estimators import Advantages, EstimatorInputs, kl_penalty, register_estimator
from molt.algo.groups import token_gae
from molt.algo.masked import masked_mean


@register_estimator("mc_value", needs_critic=True)
def mc_value(x: EstimatorInputs) -> Advantages:
    penalty = kl_penalty(x.loss_mask, x.algo, x.logp, x.ref_logp)
    adv, returns = token_gae(penalty, x.values, x.rewards, x.segment_rollout, x.loss_mask, x.algo.gamma, 1.0)
    return Advantages(adv, returns, {"mc_value_baseline": masked_mean(x.values.to(adv.dtype), x.loss_mask)})
