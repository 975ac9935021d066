"""The worked example of docs/algo.md: a new estimator (OPO) is a plugin file (examples/algo/opo.py), one
yaml naming it in `algo.plugins`, one metric, one test.

Runs it the way the training loop does: config name -> plugin import -> composed RunSpec -> registry -> loss.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from molt.algo import ESTIMATORS, EstimatorInputs, compute_advantages, loss_normalizer, policy_loss
from molt.driver.compose import compose
from molt.spec import RunSpec


def test_a_plugin_is_imported_before_its_name_is_checked():
    # A fresh process: the production registry has no `opo`; the spec refuses the bare name and points at
    # algo.plugins; naming the plugin file makes the same name pass.
    code = textwrap.dedent("""
        from molt.algo import ESTIMATORS
        from molt.driver.compose import compose
        from molt.spec import SpecError
        assert "opo" not in ESTIMATORS
        try:
            compose(["algo.estimator=opo"])
            raise SystemExit("accepted an unregistered estimator")
        except SpecError as err:
            assert "unknown estimator 'opo'" in str(err) and "algo.plugins" in str(err), err
        spec = compose(["algo.estimator=opo", "algo.plugins=[examples/algo/opo.py]"])
        assert spec.algo.plugins == ["examples/algo/opo.py"] and "opo" in ESTIMATORS
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_trainer_rank_imports_the_plugins(ray_session, tmp_path):
    """A policy loss registered by a plugin is looked up inside the trainer's rank, another process."""
    from test_trainer import batch_of

    from molt.trainer.ranks import TrainerRanks

    plugin = tmp_path / "twin_loss.py"
    plugin.write_text("from molt.algo.surrogates import POLICY_LOSSES\n"
                      "POLICY_LOSSES['ppo_twin'] = POLICY_LOSSES['ppo']\n")
    spec = RunSpec.model_validate({"algo": {"plugins": [str(plugin)], "loss": {"policy": "ppo_twin"}},
                                   "train": {"micro_batch_size": 8}})
    group = TrainerRanks(spec, "policy")
    try:
        metrics = group.update(batch_of(0))
    finally:
        group.shutdown()
    assert torch.isfinite(torch.tensor(metrics["train/loss"]))


def test_opo_end_to_end_through_config_and_registry():
    spec = compose(["algo=opo"])
    assert spec.algo.estimator == "opo"
    # Group 0: rollout 0 (reward 1) has 2 + 1 sampled tokens in two segments, rollout 1 (reward 0) has 1.
    # Baseline = (3 * 1 + 1 * 0) / 4 = 0.75, so A = 0.25 and -0.75. Group 1 is rollout 2 alone: A = 0.
    rewards = torch.tensor([1.0, 0.0, 4.0], dtype=torch.float64)
    groups, seg = torch.tensor([0, 0, 1]), torch.tensor([0, 0, 1, 2])
    mask = torch.tensor([[0, 1, 1], [1, 0, 0], [0, 0, 1], [1, 1, 0]], dtype=torch.float64)
    out = ESTIMATORS[spec.algo.estimator](EstimatorInputs(rewards, groups, seg, mask, spec.algo))
    expected = torch.tensor([0.25, 0.25, -0.75, 0.0], dtype=torch.float64)[:, None] * mask
    assert torch.allclose(out.advantages, expected)
    assert out.metrics["opo_baseline_mean"].item() == pytest.approx((0.75 + 0.75 + 4.0) / 3)

    adv = compute_advantages(rewards, groups, seg, mask, spec.algo)
    assert torch.equal(adv.advantages, out.advantages) and "opo_baseline_mean" in adv.metrics
    # On-policy first step: ratio 1, no correction: loss = -sum(A) / tokens and dloss/dlogp = -A / tokens.
    old = -torch.rand(mask.shape, dtype=torch.float64)
    logp = old.clone().requires_grad_()
    batch = {"old_logp": old, "behaviour_logp": old, "advantages": adv.advantages, "loss_mask": mask}
    norm = loss_normalizer(mask, spec.algo, max_tokens=spec.rollout.max_tokens)
    loss, metrics = policy_loss(logp, batch, spec.algo, norm)
    loss.backward()
    assert norm == 6
    assert loss.item() == pytest.approx(-(2 * 0.25 + 0.25 - 0.75) / 6)
    assert torch.allclose(logp.grad, -expected / 6)
    assert metrics["clip_frac_high"].item() == 0.0 and metrics["is_masked_frac"].item() == 0.0


@pytest.mark.parametrize("name, estimator, correction", [
    ("reinforce_pp", "reinforce_pp", ("off", "trunc", 0.0, 2.0)),
    ("reinforce_baseline", "reinforce_baseline", ("off", "trunc", 0.0, 2.0)),
    ("grpo", "grpo", ("off", "trunc", 0.0, 2.0)),
    ("dr_grpo", "dr_grpo", ("off", "trunc", 0.0, 2.0)),
    ("rloo", "rloo", ("off", "trunc", 0.0, 2.0)),
    ("opo", "opo", ("off", "trunc", 0.0, 2.0)),
    ("tis", "grpo", ("token", "trunc", 0.0, 2.0)),
    ("icepop", "grpo", ("token", "mask", 0.5, 5.0)),
    ("grpo_seq_mask_tis", "grpo", ("geo", "mask", 0.99, 1.01)),
])
def test_algo_presets_compose(name, estimator, correction):
    algo = compose([f"algo={name}"]).algo
    c = algo.correction
    assert algo.estimator == estimator and algo.estimator in ESTIMATORS
    assert (c.level, c.mode, c.low, c.high) == correction


def test_opo_folds_the_kl_penalty_into_the_reward():
    """With algo.kl.in_reward the reward each baseline sees is R - coef * sum_t KL_t (k1 here), as for the
    other group estimators; `adv/kl_in_reward` is then logged for a penalty that was really applied."""
    spec = compose(["algo=opo", "algo.kl.in_reward=true", "algo.kl.coef=0.5", "algo.kl.estimator=k1",
                    "model.reference=policy"])
    rewards, groups, seg = torch.tensor([1.0, 0.0], dtype=torch.float64), torch.zeros(2), torch.arange(2)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.float64)
    logp = torch.tensor([[-1.0, -2.0, -9.0], [-1.0, -9.0, -9.0]], dtype=torch.float64)
    ref = torch.tensor([[-1.5, -1.0, 0.0], [-3.0, 0.0, 0.0]], dtype=torch.float64)
    # KL sums: rollout 0: 0.5 + (-1.0) = -0.5 -> r = 1 + 0.25 = 1.25; rollout 1: 2.0 -> r = 0 - 1 = -1
    # baseline = (2 * 1.25 + 1 * -1) / 3 = 0.5 -> A = 0.75, -1.5
    adv = compute_advantages(rewards, groups, seg, mask, spec.algo, logp=logp, ref_logp=ref)
    assert torch.allclose(adv.advantages, torch.tensor([[0.75, 0.75, 0], [-1.5, 0, 0]], dtype=torch.float64))
    assert adv.metrics["kl_in_reward"].item() == pytest.approx((0.5 - 1.0 + 2.0) / 3)
