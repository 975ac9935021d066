"""molt.algo: estimators, losses, importance correction, KL and filters as pure tensor functions.

Every registry maps a config name (from the `algo` group) to one function, so the training loop
looks functions up by name and never branches on the algorithm:

    ESTIMATORS        algo.estimator          -> advantage estimator (compute_advantages calls it)
    ESTIMATOR_NEEDS   algo.estimator          -> what it needs of the run (EstimatorNeeds: a critic, a
                                                 reference, several samples per prompt, per-turn returns)
    POLICY_LOSSES     algo.loss.policy        -> per-token policy surrogate (policy_loss calls it)
    LOSS_NORMS        algo.loss.norm          -> aggregation: normalizer and per-token scale
    CORRECTIONS       algo.correction.level   -> gated importance statistic (importance_weights)
    CORRECTION_MODES  algo.correction.mode    -> weight from the statistic
    KL_ESTIMATORS     algo.kl.estimator       -> per-token KL
    FILTERS           algo.filters.<name>     -> rollout filter (apply_filters)
    REWARD_TRANSFORMS algo.reward.<key>       -> reward transform after the filters (shape_rewards)
    DATUM_LOSSES      a client's loss_fn        -> a summed loss over datums (molt.tinker; datum_loss)

`load_plugins` imports `algo.plugins` into them; the driver checks the spec's names and needs against them
(molt.driver.compose.check_algorithm).
"""

from molt.algo.correction import CORRECTION_MODES, CORRECTIONS, gap_metrics, gap_sums, importance_weights
from molt.algo.datum_losses import DATUM_LOSSES, datum_loss
from molt.algo.estimators import (
    ESTIMATOR_NEEDS,
    ESTIMATORS,
    Advantages,
    EstimatorInputs,
    EstimatorNeeds,
    compute_advantages,
    kl_penalty,
    register_estimator,
    rollout_rewards,
)
from molt.algo.filters import FILTERS, apply_filters, filter_drops
from molt.algo.groups import group_mean, group_sum, rollout_sum, to_tokens, token_gae
from molt.algo.kl import KL_ESTIMATORS, adaptive_kl_coef, kl_k1, kl_k2, kl_k3, with_kl_coef
from molt.algo.loss import LOSS_NORMS, loss_normalizer, policy_loss, sft_loss, token_scale, value_loss
from molt.algo.masked import masked_max, masked_mean, masked_sum, masked_whiten
from molt.algo.plugins import load_plugins
from molt.algo.rewards import REWARD_TRANSFORMS, shape_rewards
from molt.algo.surrogates import POLICY_LOSSES

__all__ = [
    "adaptive_kl_coef", "Advantages", "apply_filters", "compute_advantages", "CORRECTION_MODES",
    "CORRECTIONS", "datum_loss", "DATUM_LOSSES", "ESTIMATOR_NEEDS", "EstimatorInputs", "EstimatorNeeds",
    "ESTIMATORS", "filter_drops", "FILTERS", "gap_metrics", "gap_sums", "group_mean", "group_sum",
    "importance_weights", "KL_ESTIMATORS", "kl_k1", "kl_k2", "kl_k3", "kl_penalty", "load_plugins",
    "loss_normalizer", "LOSS_NORMS", "masked_max", "masked_mean", "masked_sum", "masked_whiten",
    "policy_loss", "POLICY_LOSSES", "register_estimator", "REWARD_TRANSFORMS", "rollout_rewards",
    "rollout_sum", "sft_loss", "shape_rewards", "to_tokens", "token_gae", "token_scale", "value_loss",
    "with_kl_coef",
]
