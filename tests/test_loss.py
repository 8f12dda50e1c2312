"""Tests of qerl.loss against hand-computed values on a toy batch.

Run: .venv/bin/python -m pytest tests/test_loss.py -q   (CPU, a few seconds)

The toy batch: 2 completions, 3 positions, the second completion padded at position 2.
Log-ratios are chosen so the ratios are [1, 1.5, 0.5] and [1.1, 0.7, pad], advantages [1, -2].
With epsilon = 0.2 the per-token losses -min(r A, clip(r) A) are, by hand:
    seq 0 (A=+1):  r=1 -> -1 ;  r=1.5 clipped to 1.2 -> -1.2 ;  r=0.5 (low side, A>0: not clipped) -> -0.5
    seq 1 (A=-2):  r=1.1 -> 2.2 ;  r=0.7 clipped to 0.8 -> 1.6
so the token sum is 1.1 over 5 tokens.
"""

import math

import pytest
import torch

from qerl.loss import (
    LOSS_TYPES,
    compute_advantages,
    dynamic_sampling_filter,
    entropy_from_logits,
    policy_loss,
    selective_log_softmax,
)

DT = torch.float64


def toy(requires_grad=False):
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -0.7]], dtype=DT, requires_grad=requires_grad)
    log_ratio = torch.log(torch.tensor([[1.0, 1.5, 0.5], [1.1, 0.7, 1.0]], dtype=DT))
    old = (logp - log_ratio).detach()
    adv = torch.tensor([1.0, -2.0], dtype=DT)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    return logp, old, adv, mask


# ----------------------------------------------------------------------------- loss types

@pytest.mark.parametrize(
    "loss_type, kwargs, expected",
    [
        ("grpo", {}, ((-1 - 1.2 - 0.5) / 3 + (2.2 + 1.6) / 2) / 2),  # 0.5
        ("bnpo", {}, 1.1 / 5),
        ("dr_grpo", {"max_completion_length": 4}, 1.1 / (2 * 4)),
        ("dapo", {"num_items_in_batch": 10}, 1.1 / 10),
    ],
)
def test_loss_types_hand_values(loss_type, kwargs, expected):
    logp, old, adv, mask = toy()
    loss, metrics = policy_loss(logp, old, adv, mask, loss_type, epsilon=0.2, **kwargs)
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    # clip metrics: low = (r < 0.8 and A < 0) -> seq1 tok1; high = (r > 1.2 and A > 0) -> seq0 tok1
    assert metrics["clip_ratio/low_mean"] == pytest.approx(1 / 5)
    assert metrics["clip_ratio/high_mean"] == pytest.approx(1 / 5)
    assert metrics["clip_ratio/region_mean"] == pytest.approx(2 / 5)
    assert "kl" not in metrics


def test_epsilon_high_widens_upper_clip_only():
    logp, old, adv, mask = toy()
    # epsilon_high = 0.6: r = 1.5 is no longer clipped (-1.5), the low side is unchanged
    loss, metrics = policy_loss(logp, old, adv, mask, "grpo", epsilon=0.2, epsilon_high=0.6)
    assert loss.item() == pytest.approx(((-1 - 1.5 - 0.5) / 3 + (2.2 + 1.6) / 2) / 2, abs=1e-12)
    assert metrics["clip_ratio/high_mean"] == 0.0
    assert metrics["clip_ratio/low_mean"] == pytest.approx(1 / 5)
    # a wider lower epsilon (0.4) un-clips r = 0.7 for A < 0: token loss 1.4 instead of 1.6
    loss, metrics = policy_loss(logp, old, adv, mask, "bnpo", epsilon=0.4, epsilon_high=0.2)
    assert loss.item() == pytest.approx((-1 - 1.2 - 0.5 + 2.2 + 1.4) / 5, abs=1e-12)
    assert metrics["clip_ratio/low_mean"] == 0.0
    assert metrics["clip_ratio/high_mean"] == pytest.approx(1 / 5)


def test_gradient_zero_on_clipped_and_masked_tokens():
    logp, old, adv, mask = toy(requires_grad=True)
    loss, _ = policy_loss(logp, old, adv, mask, "grpo", epsilon=0.2)
    loss.backward()
    # unclipped token: d/dlogp of -r*A / (T_i * N) = -A * r / (T_i * N)
    expected = torch.tensor(
        [[-1 * 1.0 / 6, 0.0, -1 * 0.5 / 6], [2 * 1.1 / 4, 0.0, 0.0]], dtype=DT
    )
    torch.testing.assert_close(logp.grad, expected, rtol=1e-12, atol=1e-12)


def test_old_logp_none_is_ratio_one():
    logp, _, adv, mask = toy(requires_grad=True)
    loss, metrics = policy_loss(logp, None, adv, mask, "bnpo")
    # ratio 1: token loss -A, so (-1 * 3 + 2 * 2) / 5
    assert loss.item() == pytest.approx((-3 + 4) / 5)
    assert metrics["clip_ratio/region_mean"] == 0.0
    loss.backward()
    torch.testing.assert_close(logp.grad, -adv[:, None] * mask / 5)


def test_kl_k3_hand_values():
    logp, old, adv, mask = toy()
    d = torch.tensor([[0.0, math.log(2), math.log(0.5)], [math.log(3), 0.0, 5.0]], dtype=DT)
    ref = logp + d
    # k3 = e^d - d - 1: [0, 1 - ln2, ln2 - 0.5], [2 - ln3, 0, (masked)]
    kl_sum = (1 - math.log(2)) + (math.log(2) - 0.5) + (2 - math.log(3))
    loss, metrics = policy_loss(logp, old, adv, mask, "bnpo", beta=0.1, ref_logp=ref)
    assert metrics["kl"] == pytest.approx(kl_sum / 5, abs=1e-12)
    assert loss.item() == pytest.approx((1.1 + 0.1 * kl_sum) / 5, abs=1e-12)
    # beta = 0 ignores ref_logp entirely
    loss0, metrics0 = policy_loss(logp, old, adv, mask, "bnpo", beta=0.0, ref_logp=ref)
    assert loss0.item() == pytest.approx(1.1 / 5) and "kl" not in metrics0


def test_gradient_accumulation_scaling():
    logp, old, adv, mask = toy()
    for lt, kw in [("grpo", {}), ("bnpo", {}), ("dr_grpo", {"max_completion_length": 3})]:
        one = policy_loss(logp, old, adv, mask, lt, **kw)[0]
        four = policy_loss(logp, old, adv, mask, lt, gradient_accumulation_steps=4, **kw)[0]
        assert four.item() == pytest.approx(one.item() / 4)
    one = policy_loss(logp, old, adv, mask, "dapo", num_items_in_batch=5)[0]
    four = policy_loss(logp, old, adv, mask, "dapo", num_items_in_batch=5, gradient_accumulation_steps=4)[0]
    assert four.item() == one.item()  # dapo's normaliser is already global


def test_dapo_over_micro_batches_equals_global_token_mean():
    torch.manual_seed(0)
    n, t = 6, 7
    logp = -torch.rand(n, t, dtype=DT) * 3
    old = logp + 0.3 * torch.randn(n, t, dtype=DT)
    adv = torch.randn(n, dtype=DT)
    mask = (torch.rand(n, t) > 0.3).long()
    total_tokens = mask.sum()
    full = policy_loss(logp, old, adv, mask, "bnpo", epsilon=0.2, epsilon_high=0.28)[0]
    parts = sum(
        policy_loss(logp[s], old[s], adv[s], mask[s], "dapo", 0.2, 0.28, num_items_in_batch=total_tokens)[0]
        for s in (slice(0, 2), slice(2, 6))
    )
    assert parts.item() == pytest.approx(full.item(), abs=1e-12)
    # while bnpo on the same micro-batches (averaged) generally differs: per-micro-batch token means
    bnpo_parts = sum(
        policy_loss(logp[s], old[s], adv[s], mask[s], "bnpo", 0.2, 0.28, gradient_accumulation_steps=2)[0]
        for s in (slice(0, 2), slice(2, 6))
    )
    assert bnpo_parts.item() != pytest.approx(full.item(), abs=1e-9)


def test_masked_positions_are_ignored_even_if_non_finite():
    logp, old, adv, mask = toy(requires_grad=True)
    clean, _ = policy_loss(logp, old, adv, mask, "grpo")
    bad_logp = logp.detach().clone()
    bad_logp[1, 2] = float("nan")
    bad_logp.requires_grad_(True)
    bad_old = old.clone()
    bad_old[1, 2] = float("inf")
    bad_ref = logp.detach().clone()
    bad_ref[1, 2] = -float("inf")
    loss, metrics = policy_loss(bad_logp, bad_old, adv, mask, "grpo", beta=0.1, ref_logp=bad_ref)
    assert torch.isfinite(loss) and math.isfinite(metrics["kl"])
    assert loss.item() == pytest.approx(clean.item())  # ref == logp on valid tokens: kl 0
    loss.backward()
    assert torch.isfinite(bad_logp.grad).all() and bad_logp.grad[1, 2] == 0


def test_a_fully_masked_sequence_counts_in_grpo_mean():
    logp, old, adv, mask = toy()
    mask = mask.clone()
    mask[1] = 0
    loss, _ = policy_loss(logp, old, adv, mask, "grpo")
    # TRL: per-sequence mean with count clamped to 1 -> seq 1 contributes 0, still divides by N=2
    assert loss.item() == pytest.approx((-2.7 / 3) / 2)


@pytest.mark.parametrize("where", ["logp", "old_logp", "advantages", "ref_logp"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_unmasked_input_gives_nan_loss(where, value):
    logp, old, adv, mask = toy()
    ref = logp.clone()
    tensors = {"logp": logp.clone(), "old_logp": old.clone(), "advantages": adv.clone(), "ref_logp": ref}
    if where == "advantages":
        tensors[where][0] = value
    else:
        tensors[where][0, 1] = value
    loss, _ = policy_loss(
        tensors["logp"], tensors["old_logp"], tensors["advantages"], mask, "bnpo", beta=0.04,
        ref_logp=tensors["ref_logp"],
    )
    assert torch.isnan(loss)


def test_invalid_arguments():
    logp, old, adv, mask = toy()
    with pytest.raises(ValueError) as err:
        policy_loss(logp, old, adv, mask, "ppo")
    for name in LOSS_TYPES:
        assert name in str(err.value)
    with pytest.raises(ValueError, match="max_completion_length"):
        policy_loss(logp, old, adv, mask, "dr_grpo")
    with pytest.raises(ValueError, match="max_completion_length"):
        policy_loss(logp, old, adv, mask, "dr_grpo", max_completion_length=2)  # T = 3 > 2
    with pytest.raises(ValueError, match="num_items_in_batch"):
        policy_loss(logp, old, adv, mask, "dapo")
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(logp, old, adv, mask, "grpo", beta=0.1)
    with pytest.raises(ValueError, match="mask shape"):
        policy_loss(logp, old, adv, mask[:, :2], "grpo")
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(logp, old, adv[:1], mask, "grpo")
    with pytest.raises(ValueError, match="epsilon"):
        policy_loss(logp, old, adv, mask, "grpo", epsilon=-0.1)


# ----------------------------------------------------------------------------- advantages

REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
GROUP0_STD = math.sqrt(4 * 0.25 / 3)  # unbiased std of [1, 0, 0, 1]
BATCH_STD = math.sqrt(5.5 / 7)  # unbiased std of all 8 (mean 1.25, squared deviations sum 5.5)


@pytest.mark.parametrize(
    "scale, denom, reward_std, frac_zero",
    [
        ("group", GROUP0_STD + 1e-4, (4 * GROUP0_STD) / 8, 0.5),
        ("batch", BATCH_STD + 1e-4, BATCH_STD, 0.0),
        ("none", 1.0, (4 * GROUP0_STD) / 8, 0.5),
    ],
)
def test_advantages_hand_values(scale, denom, reward_std, frac_zero):
    adv, stats = compute_advantages(REWARDS, 4, scale)
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]) / denom
    torch.testing.assert_close(adv, expected, rtol=1e-6, atol=1e-7)
    assert stats["reward"] == pytest.approx(1.25)
    assert stats["reward_std"] == pytest.approx(reward_std, rel=1e-6)
    assert stats["frac_reward_zero_std"] == pytest.approx(frac_zero)


def test_advantages_edge_cases_and_errors():
    adv, stats = compute_advantages(torch.tensor([3, 5]), 1, "group")  # int rewards, G = 1
    assert adv.tolist() == [0.0, 0.0] and stats["frac_reward_zero_std"] == 1.0
    with pytest.raises(ValueError) as err:
        compute_advantages(REWARDS, 4, "std")
    assert all(s in str(err.value) for s in ("group", "batch", "none"))
    with pytest.raises(ValueError, match="multiple"):
        compute_advantages(REWARDS, 3)
    with pytest.raises(ValueError, match="1-D"):
        compute_advantages(REWARDS.view(2, 4), 4)


def test_dynamic_sampling_filter():
    keep = dynamic_sampling_filter(REWARDS, 4)
    assert keep.tolist() == [True, False]
    _, stats = compute_advantages(REWARDS, 4, "group")
    assert keep.float().mean().item() == pytest.approx(1 - stats["frac_reward_zero_std"])
    r = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0, 1.0])
    assert dynamic_sampling_filter(r, 2).tolist() == [False, False, True]
    assert dynamic_sampling_filter(r, 1).tolist() == [False] * 6


# ----------------------------------------------------------------------------- log-probs, entropy

def test_selective_log_softmax_matches_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 50, dtype=DT) * 4
    ids = torch.randint(0, 50, (3, 5))
    ref = torch.log_softmax(logits, -1).gather(-1, ids[..., None]).squeeze(-1)
    out = selective_log_softmax(logits, ids, chunk=4)  # 15 rows: chunks of 4 plus a remainder
    assert out.shape == ids.shape and out.dtype == DT
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    # bf16 logits: computed in fp32 from the bf16 values
    lb = logits.to(torch.bfloat16)
    out_b = selective_log_softmax(lb, ids, chunk=7)
    assert out_b.dtype == torch.float32
    ref_b = torch.log_softmax(lb.double(), -1).gather(-1, ids[..., None]).squeeze(-1)
    torch.testing.assert_close(out_b.double(), ref_b, rtol=0, atol=1e-5)
    # differentiable: gradient of sum log p(id) is onehot - softmax
    x = logits[0, :2].clone().requires_grad_(True)
    selective_log_softmax(x, ids[0, :2]).sum().backward()
    expected = torch.nn.functional.one_hot(ids[0, :2], 50).double() - torch.softmax(logits[0, :2], -1)
    torch.testing.assert_close(x.grad, expected)
    with pytest.raises(ValueError, match="shape"):
        selective_log_softmax(logits, ids[:, :4])


def test_entropy_from_logits():
    v = 64
    uniform = torch.zeros(2, 3, v)
    torch.testing.assert_close(entropy_from_logits(uniform), torch.full((2, 3), math.log(v)))
    peaked = torch.full((1, v), -1e4)
    peaked[0, 5] = 0
    assert entropy_from_logits(peaked).item() == pytest.approx(0.0, abs=1e-6)
    torch.manual_seed(1)
    logits = (torch.randn(4, 9, v) * 3).to(torch.bfloat16)
    p = torch.softmax(logits.double(), -1)
    ref = -(p * torch.log(p)).sum(-1)
    out = entropy_from_logits(logits, chunk=5)
    assert out.shape == (4, 9) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-5)
