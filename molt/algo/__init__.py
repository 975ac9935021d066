"""molt.algo: estimators, losses, importance correction, KL and filters as pure tensor functions.

Every registry maps a config name (from the `algo` group) to one function, so the training loop
looks functions up by name and never branches on the algorithm:

    ESTIMATORS        algo.estimator          -> advantage estimator (compute_advantages calls it)
    GROUP_BASELINE    the estimators that need several samples per prompt
    LOSS_NORMS        algo.loss.norm          -> additive loss normalizer (loss_normalizer)
    CORRECTIONS       algo.correction.level   -> gated importance statistic (importance_weights)
    CORRECTION_MODES  algo.correction.mode    -> weight from the statistic
    KL_ESTIMATORS     algo.kl.estimator       -> per-token KL
    FILTERS           algo.filters.<name>     -> rollout filter (apply_filters)
"""

from molt.algo import opo  # noqa: F401  (registers the worked-example estimator)
from molt.algo.correction import CORRECTION_MODES, CORRECTIONS, importance_weights
from molt.algo.estimators import (
    ESTIMATORS,
    GROUP_BASELINE,
    Advantages,
    compute_advantages,
    kl_penalty,
    register_estimator,
    rollout_rewards,
)
from molt.algo.filters import FILTERS, apply_filters
from molt.algo.groups import group_mean, group_sum, rollout_sum, to_tokens, token_gae
from molt.algo.kl import KL_ESTIMATORS, kl_k1, kl_k2, kl_k3
from molt.algo.loss import LOSS_NORMS, loss_normalizer, policy_loss, sft_loss, value_loss
from molt.algo.masked import masked_max, masked_mean, masked_sum, masked_whiten

__all__ = [
    "CORRECTIONS", "CORRECTION_MODES", "ESTIMATORS", "FILTERS", "GROUP_BASELINE", "KL_ESTIMATORS",
    "LOSS_NORMS", "Advantages", "apply_filters", "compute_advantages", "group_mean", "group_sum",
    "importance_weights", "kl_k1", "kl_k2", "kl_k3", "kl_penalty", "loss_normalizer", "masked_max",
    "masked_mean", "masked_sum", "masked_whiten", "policy_loss", "register_estimator", "rollout_rewards",
    "rollout_sum", "sft_loss", "to_tokens", "token_gae", "value_loss",
]
