"""The async loop's loss pieces against a hand computation."""

import math

import pytest
import torch

from rollout.rl.losses import decoupled_grpo_loss, group_advantages


def test_group_advantages_normalise_within_each_group():
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 2.0, 2.0]), [2, 3])
    std_a = math.sqrt(0.5)  # sample std of (1, 0)
    assert adv[:2].tolist() == pytest.approx([0.5 / (std_a + 1e-4), -0.5 / (std_a + 1e-4)])
    assert adv[2:].tolist() == pytest.approx([-4 / 3 / (math.sqrt(4 / 3) + 1e-4), 2 / 3 / (math.sqrt(4 / 3) + 1e-4),
                                              2 / 3 / (math.sqrt(4 / 3) + 1e-4)])


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask"])
def test_importance_weighted_loss_and_its_gradient_match_a_hand_computation(mode):
    current = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -9.0]])
    behaviour = torch.tensor([[-1.5, -0.5, -0.5], [-0.3, -2.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    advantages = torch.tensor([0.7, -1.1])
    logps = current.clone().requires_grad_(True)
    loss, stats = decoupled_grpo_loss(logps, behaviour, advantages, mask, cap=2.0, mode=mode)
    expected, grads, over = 0.0, [[0.0] * 3 for _ in range(2)], 0
    for i in range(2):
        for t in range(3):
            if not mask[i, t]:
                continue
            ratio = math.exp(current[i, t] - behaviour[i, t])
            weight = min(ratio, 2.0) if mode == "token_truncate" else (ratio if ratio <= 2.0 else 0.0)
            over += ratio > 2.0
            expected += -weight * advantages[i].item() / 5  # 5 real tokens
            grads[i][t] = -weight * advantages[i].item() / 5  # d/dlogp of weight * exp(logp - sg(logp)) = weight
    loss.backward()
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert logps.grad.tolist() == [pytest.approx(row, rel=1e-6) for row in grads]
    key = "clipped_fraction" if mode == "token_truncate" else "masked_fraction"
    assert over == 1 and stats[key] == pytest.approx(1 / 5)
    assert stats["is_ratio/max"] == pytest.approx(math.exp(0.8))
    ratios = sorted(math.exp(current[i, t] - behaviour[i, t]) for i in range(2) for t in range(3) if mask[i, t])
    assert stats["is_ratio/p99"] == pytest.approx(ratios[3] + 0.96 * (ratios[4] - ratios[3]), rel=1e-5)


def test_bad_settings_are_named():
    x = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="mode must be one of"):
        decoupled_grpo_loss(x, x, torch.zeros(1), x, mode="sequence")
    with pytest.raises(ValueError, match="cap must be >= 1"):
        decoupled_grpo_loss(x, x, torch.zeros(1), x, cap=0.5)
