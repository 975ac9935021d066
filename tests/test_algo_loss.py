"""Policy / value loss, normalizer and importance correction against hand computations."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from molt.algo import importance_weights, loss_normalizer, policy_loss, value_loss
from molt.spec import AlgoSpec, CorrectionSpec

LN = math.log


def algo(**kw) -> AlgoSpec:
    return AlgoSpec.model_validate(kw)


def batch_of(old, ratio, adv, mask, behaviour=None):
    """A batch whose PPO ratio exp(logp - old_logp) is `ratio`, with logp as a leaf that takes grads."""
    old = torch.tensor(old, dtype=torch.float64)
    logp = (old + torch.tensor(ratio, dtype=torch.float64).log()).requires_grad_()
    f64 = torch.float64
    b = {"old_logp": old, "behaviour_logp": old.clone() if behaviour is None else torch.tensor(behaviour),
         "advantages": torch.tensor(adv, dtype=f64), "loss_mask": torch.tensor(mask, dtype=f64)}
    return logp, b


def test_clipped_surrogate_by_hand():
    # token 0: A>0, ratio 1.5 -> upper clip active: -1 * 1.2; token 1: A<0, ratio 0.5 -> lower clip: 0.8;
    # token 2: inside the band: 2 * 1.1; token 3 is masked (prompt) and must not count.
    logp, b = batch_of([[-1.0, -2.0, -0.5, -3.0]], [[1.5, 0.5, 1.1, 9.0]], [[1.0, -1.0, -2.0, 5.0]],
                       [[1, 1, 1, 0]])
    norm = loss_normalizer(b["loss_mask"], algo(), max_tokens=4)
    assert norm == 3
    loss, m = policy_loss(logp, b, algo(), norm)
    assert loss.item() == pytest.approx((-1.2 + 0.8 + 2.2) / 3)
    assert m["clip_frac_high"].item() == pytest.approx(1 / 3)
    assert m["clip_frac_low"].item() == pytest.approx(1 / 3)
    assert m["ratio_mean"].item() == pytest.approx((1.5 + 0.5 + 1.1) / 3)
    loss.backward()
    # d/dlogp of -A * ratio is -A * ratio where unclipped; clipped tokens get no gradient.
    assert logp.grad.tolist()[0] == pytest.approx([0.0, 0.0, 2.0 * 1.1 / 3, 0.0])


def test_decoupled_ppo_by_hand():
    """algo=decoupled_ppo: the ratio r_t = exp(logp - old_logp) (the proximal policy: the trainer before the
    update) is clipped, the behaviour policy only weights, w_t = exp(old_logp - behaviour_logp), and a token
    whose w_t exceeds 5 is dropped. Per token (A, r, w): (1, 1.1, 2) inside the band: -1.1 * 2; (-1, 0.5,
    0.5) lower clip: 0.8 * 0.5; (1, 1.0, 6) dropped: 0; (-2, 1.3, 1) above the band but A < 0, unclipped:
    2.6. Clipping against the behaviour policy instead (ratio r*w = 2.2 for the first) would give -1.2."""
    from molt.driver.compose import compose

    spec = compose(["algo=decoupled_ppo"]).algo
    old = [[-1.0, -2.0, -0.5, -3.0]]
    behaviour = [[o - LN(w) for o, w in zip(old[0], (2.0, 0.5, 6.0, 1.0), strict=True)]]
    logp, b = batch_of(old, [[1.1, 0.5, 1.0, 1.3]], [[1.0, -1.0, 1.0, -2.0]], [[1, 1, 1, 1]])
    b["behaviour_logp"] = torch.tensor(behaviour, dtype=torch.float64)
    loss, m = policy_loss(logp, b, spec, 4.0)
    assert abs(loss.item() - (-2.2 + 0.4 + 0.0 + 2.6) / 4) <= 1e-12
    loss.backward()
    # d/dlogp of w * (-A * r) where the unclipped term is active, else 0: -1.1 * 2 and 2 * 1.3
    expected = torch.tensor([[-2.2 / 4, 0.0, 0.0, 2.6 / 4]], dtype=torch.float64)
    assert (logp.grad - expected).abs().max().item() <= 1e-12
    assert m["is_masked_frac"].item() == pytest.approx(0.25, abs=1e-12)


def test_asymmetric_and_dual_clip_by_hand():
    spec = algo(loss={"eps_low": 0.1, "eps_high": 0.3, "dual_clip": 3.0})
    # ratio 1.25 with A>0 stays inside [0.9, 1.3]; ratio 4 with A<0: max(4, 0.9) = 4 > 3 -> capped at 3.
    logp, b = batch_of([[-1.0, -1.0, -1.0]], [[1.25, 4.0, 0.85]], [[2.0, -1.0, -1.0]], [[1, 1, 1]])
    loss, m = policy_loss(logp, b, spec, 3.0)
    assert loss.item() == pytest.approx((-2.5 + 3.0 + 0.9) / 3)
    assert m["dual_clip_frac"].item() == pytest.approx(1 / 3)
    assert m["clip_frac_low"].item() == pytest.approx(1 / 3)  # only ratio 0.85 < 0.9 with A < 0
    assert m["clip_frac_high"].item() == 0.0


def test_seq_norm_is_dr_grpo_constant():
    mask = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]])
    assert loss_normalizer(mask, algo(loss={"norm": "seq"}), max_tokens=10) == 2 * 10
    assert loss_normalizer(mask, algo(loss={"norm": "token"}), max_tokens=10) == 3


def test_kl_loss_term_and_entropy_bonus():
    logp, b = batch_of([[-1.0, -2.0]], [[1.0, 1.0]], [[0.0, 0.0]], [[1, 1]])
    b["ref_logp"] = torch.tensor([[-2.0, -2.0]], dtype=torch.float64)
    b["entropy"] = torch.tensor([[0.5, 1.5]], dtype=torch.float64)
    spec = algo(kl={"estimator": "k3", "coef": 0.1}, loss={"entropy_coef": 0.01})
    loss, m = policy_loss(logp, b, spec, 2.0)
    k3 = [math.exp(-1) - 1 + 1, 0.0]  # log r = logp - ref = 1 and 0
    assert m["kl"].item() == pytest.approx(sum(k3) / 2)
    assert m["entropy"].item() == pytest.approx(1.0)
    assert loss.item() == pytest.approx((0.1 * sum(k3) - 0.01 * 2.0) / 2)
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(logp, {k: v for k, v in b.items() if k != "ref_logp"}, spec, 2.0)
    # KL folded into the reward is not a loss term, but still logged.
    folded, _ = policy_loss(logp, b, algo(kl={"coef": 0.1, "in_reward": True}), 2.0)
    assert folded.item() == pytest.approx(0.0)


def test_fully_masked_microbatch_with_padding_is_finite():
    logp = torch.tensor([[-torch.inf, -1.0]], requires_grad=True)
    b = {"old_logp": torch.tensor([[-torch.inf, -1.0]]), "behaviour_logp": torch.tensor([[0.0, -5.0]]),
         "advantages": torch.tensor([[float("nan"), 1.0]]), "loss_mask": torch.zeros(1, 2),
         "ref_logp": torch.tensor([[-torch.inf, 0.0]]), "entropy": torch.zeros(1, 2)}
    spec = algo(kl={"coef": 0.1}, correction={"level": "geo", "mode": "mask", "low": 0.99, "high": 1.01})
    loss, m = policy_loss(logp, b, spec, 1.0)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.isfinite(logp.grad).all() and (logp.grad == 0).all()
    assert all(torch.isfinite(v) for v in m.values())


def test_value_loss_by_hand():
    values = torch.tensor([[0.5, -0.1, 7.0]], requires_grad=True)
    b = {"old_values": torch.tensor([[0.0, 0.0, 0.0]]), "returns": torch.tensor([[1.0, 0.3, 0.0]]),
         "loss_mask": torch.tensor([[1.0, 1.0, 0.0]])}
    loss, m = value_loss(values, b, algo(loss={"value_clip": 0.2}), 2.0)
    # token 0: clipped value 0.2 is further from the return: 0.5 * 0.8^2; token 1: unclipped 0.5 * 0.4^2.
    assert loss.item() == pytest.approx((0.5 * 0.64 + 0.5 * 0.16) / 2)
    assert m["value_clip_frac"].item() == pytest.approx(0.5)
    loss.backward()
    assert values.grad.tolist()[0] == pytest.approx([0.0, (-0.1 - 0.3) / 2, 0.0])


def rows(old, behaviour, mask, **kw):
    return importance_weights(torch.tensor(old).log(), torch.tensor(behaviour).log(), torch.tensor(mask),
                              CorrectionSpec(**kw))


RHO = [[1.5, 0.5, 1.0], [1.02, 0.99, 1.0], [3.0, 1.0, 1.0]]
ONES = [[1.0] * 3] * 3
MASK = [[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]  # last row fully masked


@pytest.mark.parametrize("kw, expected", [
    ({"level": "token", "mode": "trunc", "high": 1.2}, [[1.2, 0.5], [1.02, 0.99]]),          # TIS
    ({"level": "token", "mode": "mask", "low": 0.8, "high": 1.25}, [[0.0, 0.0], [1.02, 0.99]]),  # IcePop
    ({"level": "token", "mode": "clip", "low": 0.8, "high": 1.25}, [[1.25, 0.8], [1.02, 0.99]]),
    ({"level": "seq", "mode": "mask", "low": 0.7, "high": 1.3}, [[1.5, 0.5], [1.02, 0.99]]),   # 0.75 kept
    ({"level": "seq", "mode": "mask", "low": 0.8, "high": 1.3}, [[0.0, 0.0], [1.02, 0.99]]),   # 0.75 out
    ({"level": "seq", "mode": "trunc", "high": 1.0}, [[0.75, 0.75], [1.0, 1.0]]),
    ({"level": "geo", "mode": "mask", "low": 0.99, "high": 1.01}, [[0.0, 0.0], [1.02, 0.99]]),
    ({"level": "geo", "mode": "clip", "low": 0.9, "high": 1.1}, [[0.9, 0.9], [1.0098 ** 0.5] * 2]),
    ({"level": "off"}, [[1.0, 1.0], [1.0, 1.0]]),
])
def test_importance_weights_by_hand(kw, expected):
    w, m = rows(RHO, ONES, MASK, **kw)
    assert w[:2, :2].tolist() == [pytest.approx(r, rel=1e-5) for r in expected]
    assert (w[:, 2] == 0).all() and (w[2] == 0).all()  # nothing outside the mask is weighted
    assert m["is_ratio_max"].item() == pytest.approx(1.5)
    assert m["is_masked_frac"].item() == pytest.approx(sum(x == 0 for r in expected for x in r) / 4)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(1, 6), st.sampled_from(["token", "seq", "geo"]),
       st.sampled_from(["mask", "clip", "trunc"]), st.floats(0.0, 0.999), st.floats(1.001, 10.0),
       st.integers(0, 2**31 - 1))
def test_equal_logprobs_give_unit_weights(b, t, level, mode, low, high, seed):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=g) * 5
    mask = (torch.rand(b, t, generator=g) < 0.7).float()
    spec = CorrectionSpec(level=level, mode=mode, low=low, high=high)
    w, m = importance_weights(logp, logp.clone(), mask, spec)
    assert torch.equal(w, mask)
    assert m["is_masked_frac"].item() == 0.0 and m["is_clipped_frac"].item() == 0.0


def _random_batch(g, b, t):
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    logp = (old + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.3).requires_grad_()
    return logp, {
        "old_logp": old, "behaviour_logp": old + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.1,
        "advantages": torch.randn(b, t, generator=g, dtype=torch.float64),
        "loss_mask": (torch.rand(b, t, generator=g) < 0.6).double(),
        "ref_logp": old - 0.2, "entropy": torch.rand(b, t, generator=g, dtype=torch.float64),
    }


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 8), st.integers(1, 7), st.sampled_from(["token", "seq", "seq-mean-token-mean"]),
       st.sampled_from(["off", "token", "geo"]), st.sampled_from(["ppo", "gspo", "cispo", "dro"]),
       st.integers(0, 2**31 - 1), st.data())
def test_loss_invariant_to_microbatch_split(b, t, norm_kind, level, policy, seed, data):
    g = torch.Generator().manual_seed(seed)
    logp, batch = _random_batch(g, b, t)
    spec = algo(loss={"norm": norm_kind, "policy": policy, "dual_clip": 3.0 if policy == "ppo" else None,
                      "entropy_coef": 0.01}, kl={"coef": 0.05},
                correction={"level": level, "mode": "mask", "low": 0.8, "high": 1.25})
    cuts = sorted(data.draw(st.lists(st.integers(1, b), max_size=3, unique=True)))
    bounds = [0] + [c for c in cuts if c < b] + [b]
    chunks = [slice(lo, hi) for lo, hi in zip(bounds, bounds[1:], strict=False)]
    norm = sum(loss_normalizer(batch["loss_mask"][c], spec, max_tokens=t) for c in chunks)
    assert norm == loss_normalizer(batch["loss_mask"], spec, max_tokens=t)
    full, _ = policy_loss(logp, batch, spec, max(norm, 1.0))
    (full_grad,) = torch.autograd.grad(full, logp)
    total = sum(policy_loss(logp[c], {k: v[c] for k, v in batch.items()}, spec, max(norm, 1.0))[0]
                for c in chunks)
    (split_grad,) = torch.autograd.grad(total, logp)
    assert total.item() == pytest.approx(full.item(), abs=1e-12)
    assert torch.allclose(split_grad, full_grad, atol=1e-12)


def test_gspo_clips_whole_sequences_by_hand():
    # row 0: token ratios 1.5, 0.5, 1.1 -> s = (1.5 * 0.5 * 1.1)^(1/3) = 0.9378, inside [0.8, 1.2]: no token
    # is clipped although PPO would clip 1.5 and 0.5. row 1: ratios 2, 2 -> s = 2 > 1.2 with A > 0:
    # the whole sequence is clipped (no gradient). seq-mean-token-mean: mean over the 2 rows of row means.
    spec = algo(loss={"policy": "gspo", "norm": "seq-mean-token-mean"})
    logp, b = batch_of([[-1.0, -2.0, -0.5], [-1.0, -1.0, 0.0]], [[1.5, 0.5, 1.1], [2.0, 2.0, 1.0]],
                       [[1.0, 1.0, 1.0], [1.0, 1.0, 9.0]], [[1, 1, 1], [1, 1, 0]])
    s = 0.825 ** (1 / 3)
    norm = loss_normalizer(b["loss_mask"], spec, max_tokens=3)
    assert norm == 2
    loss, m = policy_loss(logp, b, spec, norm)
    assert loss.item() == pytest.approx((-s + -1.2) / 2)
    assert m["clip_frac_high"].item() == pytest.approx(2 / 5) and m["clip_frac_low"].item() == 0.0
    assert m["ratio_mean"].item() == pytest.approx((3 * s + 2 * 2.0) / 5)
    loss.backward()
    # d/dlogp_t of -A * s: -s (the sequence ratio's value, grad through the token), times 1/3 (row mean)
    # and 1/2 (two rows); the clipped row gets none.
    assert logp.grad.tolist() == [pytest.approx([-s / 6] * 3), pytest.approx([0.0, 0.0, 0.0])]


def test_cispo_keeps_every_token_by_hand():
    # ratios 1.5, 0.5, 1.1; eps_low 1 (no lower bound, as the paper), eps_high 0.2: w = 1.2, 0.5, 1.1.
    # pg_t = -w_t * A_t * logp_t; its gradient -w_t * A_t reaches every token, also the one PPO clips.
    spec = algo(loss={"policy": "cispo", "eps_low": 1.0, "eps_high": 0.2})
    logp, b = batch_of([[-1.0, -2.0, -0.5]], [[1.5, 0.5, 1.1]], [[1.0, -1.0, 2.0]], [[1, 1, 1]])
    lp = [-1.0 + LN(1.5), -2.0 + LN(0.5), -0.5 + LN(1.1)]
    loss, m = policy_loss(logp, b, spec, 3.0)
    assert loss.item() == pytest.approx((-1.2 * 1.0 * lp[0] + 0.5 * lp[1] - 1.1 * 2.0 * lp[2]) / 3)
    assert m["clip_frac_high"].item() == pytest.approx(1 / 3) and m["clip_frac_low"].item() == 0.0
    loss.backward()
    assert logp.grad.tolist()[0] == pytest.approx([-1.2 / 3, 0.5 / 3, -2.2 / 3])


def test_dro_by_hand():
    # pg_t = -(A_t logp_t - beta / 2 (logp_t - old_t)^2): no ratio, no clip; token mean over 2 tokens
    spec = algo(loss={"policy": "dro", "dro_beta": 0.2})
    logp, b = batch_of([[-1.0, -2.0]], [[1.5, 0.5]], [[1.0, -1.0]], [[1, 1]])
    lp, d = [-1.0 + LN(1.5), -2.0 + LN(0.5)], [LN(1.5), LN(0.5)]
    loss, m = policy_loss(logp, b, spec, 2.0)
    assert loss.item() == pytest.approx((-(lp[0] - 0.1 * d[0] ** 2) - (-lp[1] - 0.1 * d[1] ** 2)) / 2)
    assert m["clip_frac_high"].item() == 0.0 and m["ratio_mean"].item() == pytest.approx(1.0)
    loss.backward()   # d/dlogp_t: -A_t + beta * (logp_t - old_t)
    assert logp.grad.tolist()[0] == pytest.approx([(-1 + 0.2 * d[0]) / 2, (1 + 0.2 * d[1]) / 2])


def test_sft_loss_takes_token_weights_by_hand():
    # loss_mask as weights (molt.tinker's cross_entropy: any real number, e.g. a custom loss's gradient):
    # -(2 * -2 + -0.5 * -3) / 2; the weight-0 token counts in nothing, nll is the unweighted mean
    from molt.algo import sft_loss

    logp = torch.tensor([[-1.0, -2.0, -3.0]], dtype=torch.float64, requires_grad=True)
    loss, m = sft_loss(logp, {"loss_mask": torch.tensor([[0.0, 2.0, -0.5]], dtype=torch.float64)}, 2.0)
    assert loss.item() == pytest.approx(2.5 / 2) and m["nll"].item() == pytest.approx(2.5)
    loss.backward()
    assert logp.grad.tolist() == [[0.0, -1.0, 0.25]]


def test_seq_mean_token_mean_by_hand():
    # ratio 1: pg_t = -A_t. Rows of 3 and 1 sampled tokens: (mean(-1, -2, -3) + -4) / 2 = -3, where the
    # token mean would give -10 / 4. The value loss aggregates the same way.
    spec = algo(loss={"norm": "seq-mean-token-mean"})
    logp, b = batch_of([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]], [[1.0] * 3] * 2,
                       [[1.0, 2.0, 3.0], [4.0, 7.0, 7.0]], [[1, 1, 1], [1, 0, 0]])
    norm = loss_normalizer(b["loss_mask"], spec, max_tokens=3)
    loss, _ = policy_loss(logp, b, spec, norm)
    assert norm == 2 and loss.item() == pytest.approx(-3.0)
    loss.backward()
    assert logp.grad.tolist() == [pytest.approx([-1 / 6, -2 / 6, -3 / 6]), pytest.approx([-2.0, 0.0, 0.0])]
    values = torch.zeros(2, 3, requires_grad=True)
    vb = {"old_values": torch.zeros(2, 3), "returns": torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.0, 0.0]]),
          "loss_mask": b["loss_mask"]}
    vloss, _ = value_loss(values, vb, spec, norm)
    assert vloss.item() == pytest.approx((0.5 * (0.01 + 0.04 + 0.09) / 3 + 0.5 * 0.16) / 2)


def test_policy_loss_names_are_checked():
    from molt.driver.compose import compose
    from molt.spec import SpecError

    with pytest.raises(SpecError, match="did you mean 'gspo'"):   # checked after algo.plugins load
        compose(["algo.loss.policy=gpso"])
    with pytest.raises(ValueError, match="dual_clip"):
        algo(loss={"policy": "cispo", "dual_clip": 3.0})
