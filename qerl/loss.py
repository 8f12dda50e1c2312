"""Policy losses and group advantages for GRPO / DAPO, with TRL's semantics.

Pure torch, no model code. Everything here works on tensors the trainer already has:

    rewards [B*G]                      -> compute_advantages -> advantages [B*G]
    logits [N, T, V], completion ids   -> selective_log_softmax -> logp [N, T]
    logp, old_logp, ref_logp, mask     -> policy_loss -> scalar loss + TRL metrics

Conventions (as in TRL's GRPOTrainer, which this module re-implements, not copies):

* ``mask`` is the completion mask [N, T] (1 for a real completion token, 0 for padding and,
  with ``mask_truncated_completions``, for truncated completions).
* The per-token objective is the clipped importance ratio of PPO,
  ``-min(r * A, clip(r, 1 - epsilon, 1 + epsilon_high) * A)`` with ``r = exp(logp - old_logp)``,
  plus ``beta * KL`` where KL is the k3 estimator ``exp(ref - logp) - (ref - logp) - 1``.
* ``loss_type`` only changes how token losses are reduced to a scalar:

  ========  ==========================================================================
  grpo      mean over tokens of each sequence, then mean over the sequences
  bnpo      sum over all tokens / number of completion tokens in THIS (local) micro-batch
  dr_grpo   sum over all tokens / (number of sequences * max_completion_length)
  dapo      sum over all tokens / ``num_items_in_batch``, the number of completion tokens
            in the GLOBAL batch (all gradient-accumulation micro-batches of one optimiser
            step), passed in by the trainer
  ========  ==========================================================================

  The QeRL paper's "DAPO" runs were TRL 0.18's ``loss_type="bnpo"`` with ``beta=0`` and
  ``epsilon_high=0.28`` (TRL 0.18 had no "dapo"). Today's TRL "dapo" is the token-level mean
  over the global accumulated batch, which is the DAPO paper's definition. Both exist here
  under TRL's names, so a config says exactly which one it ran.

* Gradient accumulation: TRL divides grpo / bnpo / dr_grpo by the number of accumulation
  steps (so summing the micro-batch gradients averages them) and does NOT divide dapo (its
  normaliser is already global). ``policy_loss(..., gradient_accumulation_steps=k)`` does the
  same, so the trainer can call ``loss.backward()`` on every micro-batch as it is.
  Single process only: TRL's extra ``/ num_processes`` for dapo is not needed here.

Non-finite inputs: ``policy_loss`` never raises on NaN/inf values (checking would need a
host sync). Any NaN or +-inf in ``logp``, ``old_logp``, ``ref_logp`` (when ``beta > 0``) or the
advantage at an UNMASKED position makes the returned loss NaN, so the trainer detects it with
``torch.isfinite(loss)`` and skips the step. Values at masked positions are ignored entirely,
for the loss and for its gradient (padding may hold garbage).

Run the tests with ``.venv/bin/python -m pytest tests/test_loss.py -q``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor


@dataclass(frozen=True)
class LossType:
    """How a ``loss_type`` reduces the masked token losses [N, T] of a micro-batch to a scalar.

    ``reduce(per_token, maskf, max_completion_length, num_items_in_batch)``; ``normaliser`` says
    what that scalar is divided by, which is how a data-parallel rank's share of a micro-batch is
    rescaled to the global one (``loss_share``): "sequences" (the micro-batch's sequence count),
    "tokens" (its completion tokens) or "global" (a count over the whole accumulated batch, the
    same on every rank). ``per_accumulation``: also divided by the gradient-accumulation steps.
    ``needs``: the keyword arguments of ``policy_loss`` it requires.
    """

    reduce: Callable[[Tensor, Tensor, int | None, int | Tensor | None], Tensor]
    normaliser: str
    per_accumulation: bool = True
    needs: tuple[str, ...] = ()


# A new loss type is one entry here (TRL's names and semantics; see the module docstring).
LOSS_REDUCTIONS: dict[str, LossType] = {
    "grpo": LossType(lambda pt, m, L, items: (pt.sum(dim=1) / m.sum(dim=1).clamp(min=1.0)).mean(), "sequences"),
    "bnpo": LossType(lambda pt, m, L, items: pt.sum() / m.sum().clamp(min=1.0), "tokens"),
    "dr_grpo": LossType(lambda pt, m, L, items: pt.sum() / (pt.shape[0] * int(L)), "sequences",
                        needs=("max_completion_length",)),
    "dapo": LossType(lambda pt, m, L, items: pt.sum() / torch.as_tensor(items, dtype=pt.dtype, device=pt.device),
                     "global", per_accumulation=False, needs=("num_items_in_batch",)),
}
LOSS_TYPES = tuple(LOSS_REDUCTIONS)
SCALE_REWARDS = ("group", "batch", "none")
# TRL adds this to the std before dividing, so zero-variance groups get advantage 0, not NaN.
ADVANTAGE_EPS = 1e-4


# ----------------------------------------------------------------------------- advantages

def _group_std(rewards: Tensor, num_generations: int) -> Tensor:
    """Unbiased std of each group of ``num_generations`` rewards, shape [B]; 0 when G == 1."""
    grouped = rewards.view(-1, num_generations)
    if num_generations == 1:
        # torch's unbiased std of one value is NaN; a single sample has no spread.
        return torch.zeros(grouped.shape[0], dtype=rewards.dtype, device=rewards.device)
    return grouped.std(dim=1)


def _check_rewards(rewards: Tensor, num_generations: int) -> Tensor:
    if not isinstance(num_generations, int) or num_generations < 1:
        raise ValueError(f"num_generations must be a positive int, got {num_generations!r}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [num_prompts * num_generations], got shape {tuple(rewards.shape)}")
    if rewards.numel() == 0 or rewards.numel() % num_generations != 0:
        raise ValueError(
            f"rewards has {rewards.numel()} values, not a positive multiple of num_generations={num_generations}"
        )
    return rewards if rewards.is_floating_point() else rewards.float()


def compute_advantages(
    rewards: Tensor, num_generations: int, scale_rewards: str = "group"
) -> tuple[Tensor, dict[str, float]]:
    """Group-relative advantages, as TRL's GRPOTrainer computes them.

    ``rewards`` is [B*G], ordered so that the G completions of one prompt are contiguous
    (prompt 0's G completions, then prompt 1's, ...). The advantage of completion i is its
    reward minus the mean reward of its group, then divided by ``std + 1e-4`` where std is
    (Bessel-corrected, like ``torch.std``):

    * ``"group"``: the std of its own group (GRPO, the paper's setting);
    * ``"batch"``: the std of all B*G rewards (Dr. GRPO / "REINFORCE++"-style scaling);
    * ``"none"``: no division at all (Dr. GRPO's recommendation).

    Returns ``(advantages [B*G], stats)`` with TRL's metric names:
    ``reward`` (mean reward), ``reward_std`` (mean of the std used, the group std for
    "group" and "none", the batch std for "batch") and ``frac_reward_zero_std`` (fraction of
    completions whose std is ~0, i.e. of groups that carry no learning signal under "group").
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}")
    rewards = _check_rewards(rewards, num_generations)
    group_mean = rewards.view(-1, num_generations).mean(dim=1).repeat_interleave(num_generations)
    advantages = rewards - group_mean
    if scale_rewards == "batch":
        if rewards.numel() > 1:
            std = rewards.std().expand_as(rewards)
        else:
            std = torch.zeros_like(rewards)
    else:  # "group", and "none" still reports the group std as TRL does
        std = _group_std(rewards, num_generations).repeat_interleave(num_generations)
    is_std_zero = torch.isclose(std, torch.zeros_like(std))
    if scale_rewards != "none":
        advantages = advantages / (std + ADVANTAGE_EPS)
    stats = {
        "reward": rewards.mean().item(),
        "reward_std": std.mean().item(),
        "frac_reward_zero_std": is_std_zero.float().mean().item(),
    }
    return advantages, stats


def dynamic_sampling_filter(rewards: Tensor, num_generations: int) -> Tensor:
    """DAPO dynamic sampling: which groups have rewards that are not all equal.

    Returns a bool tensor [B] (one entry per prompt/group), True where the group's rewards
    differ, i.e. where the group gives a non-zero advantage. "Equal" uses the same test as
    ``frac_reward_zero_std`` (``torch.isclose(group_std, 0)``), so with ``scale_rewards="group"``
    ``keep.float().mean() == 1 - frac_reward_zero_std``. A group of one completion (G == 1)
    is never kept. Expand to completions with ``keep.repeat_interleave(num_generations)``.
    """
    rewards = _check_rewards(rewards, num_generations)
    std = _group_std(rewards, num_generations)
    if num_generations == 1:
        return torch.zeros_like(std, dtype=torch.bool)
    return ~torch.isclose(std, torch.zeros_like(std))


# ----------------------------------------------------------------------------- log-probs

def _rows(x: Tensor) -> Tensor:
    return x.reshape(-1, x.shape[-1])


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # bf16/fp16 logsumexp over a 150k vocabulary loses several digits: work in fp32 (fp64 stays fp64).
    return torch.float64 if dtype == torch.float64 else torch.float32


def selective_log_softmax(logits: Tensor, ids: Tensor, chunk: int = 128) -> Tensor:
    """log softmax(logits)[..., ids]: the log-prob of the given tokens, shape ``ids.shape``.

    ``logits`` is [..., V] and ``ids`` is [...] (same leading shape). Computed as
    ``logits[id] - logsumexp(logits)`` on ``chunk`` rows at a time, upcast to fp32 per chunk,
    so neither a full [N, T, V] log_softmax nor a full fp32 copy of bf16 logits is ever held.
    Returns fp32 (fp64 for fp64 logits), differentiable. Temperature is the caller's job:
    TRL divides the logits by the sampling temperature before this.
    """
    if logits.shape[:-1] != ids.shape:
        raise ValueError(f"ids shape {tuple(ids.shape)} must equal logits.shape[:-1] {tuple(logits.shape[:-1])}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    flat_logits, flat_ids = _rows(logits), ids.reshape(-1, 1).long()
    dtype = _compute_dtype(logits.dtype)
    out = []
    for start in range(0, flat_logits.shape[0], chunk):
        x = flat_logits[start:start + chunk].to(dtype)
        picked = x.gather(-1, flat_ids[start:start + chunk]).squeeze(-1)
        out.append(picked - torch.logsumexp(x, dim=-1))
    if not out:
        return torch.zeros(ids.shape, dtype=dtype, device=logits.device)
    return torch.cat(out).view(ids.shape)


def entropy_from_logits(logits: Tensor, chunk: int = 128) -> Tensor:
    """Token entropy ``-sum_v p_v log p_v`` of softmax(logits), shape ``logits.shape[:-1]``.

    Uses ``H = logsumexp(l) - sum_v softmax(l)_v * l_v`` on ``chunk`` rows at a time in fp32,
    so memory stays at a few [chunk, V] fp32 buffers. Differentiable (no no_grad inside);
    wrap the call in ``torch.no_grad()`` when it is only logged (TRL's ``entropy`` metric).
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    flat = _rows(logits)
    dtype = _compute_dtype(logits.dtype)
    out = []
    for start in range(0, flat.shape[0], chunk):
        x = flat[start:start + chunk].to(dtype)
        probs = torch.softmax(x, dim=-1)
        out.append(torch.logsumexp(x, dim=-1) - (probs * x).sum(dim=-1))
    if not out:
        return torch.zeros(logits.shape[:-1], dtype=dtype, device=logits.device)
    return torch.cat(out).view(logits.shape[:-1])


# ----------------------------------------------------------------------------- policy loss

def _masked_mean(x: Tensor, mask: Tensor, count: Tensor) -> float:
    return ((x * mask).sum() / count).item()


def policy_loss(
    logp: Tensor,
    old_logp: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    loss_type: str,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    beta: float = 0.0,
    ref_logp: Tensor | None = None,
    num_items_in_batch: int | Tensor | None = None,
    max_completion_length: int | None = None,
    gradient_accumulation_steps: int = 1,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped-ratio policy loss of GRPO/DAPO for one micro-batch, reduced as TRL's ``loss_type``.

    Args:
        logp: [N, T] log-probs of the completion tokens under the policy being trained
            (carries the gradient).
        old_logp: [N, T] log-probs under the policy that sampled (no grad). ``None`` means
            one policy update per rollout (TRL's ``num_iterations == 1``): ``logp.detach()``,
            so the ratio is exactly 1 and the gradient is ``-A * grad logp``.
        advantages: [N] (or [N, 1]) one advantage per completion.
        mask: [N, T] completion mask (bool, int or float 0/1).
        loss_type: one of ``LOSS_TYPES`` (see the module docstring).
        epsilon: lower clip, ratio >= 1 - epsilon (the paper's 0.2).
        epsilon_high: upper clip, ratio <= 1 + epsilon_high; defaults to ``epsilon``
            (DAPO's clip-higher uses 0.28).
        beta: weight of the k3 KL to the reference policy; 0 disables it (and ``ref_logp``).
        ref_logp: [N, T] reference log-probs, required when ``beta > 0``.
        num_items_in_batch: "dapo" only: completion tokens in the whole accumulated batch.
        max_completion_length: "dr_grpo" only: the generation budget L (denominator N * L).
        gradient_accumulation_steps: grpo/bnpo/dr_grpo are divided by it, dapo is not (TRL).

    Returns ``(loss, metrics)``: a 0-dim tensor and floats under TRL's names
    ``clip_ratio/low_mean`` (tokens with ratio < 1-epsilon and A < 0, i.e. where the lower
    clip is active), ``clip_ratio/high_mean`` (ratio > 1+epsilon_high and A > 0),
    ``clip_ratio/region_mean`` (either), and ``kl`` (masked token mean, only when beta > 0),
    all token means over this micro-batch's completion tokens.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    epsilon_low = float(epsilon)
    epsilon_high = epsilon_low if epsilon_high is None else float(epsilon_high)
    if epsilon_low < 0 or epsilon_high < 0:
        raise ValueError(f"epsilon and epsilon_high must be >= 0, got {epsilon_low} and {epsilon_high}")
    if beta < 0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    if logp.dim() != 2:
        raise ValueError(f"logp must be [N, T], got shape {tuple(logp.shape)}")
    n_seq, n_tok = logp.shape
    if mask.shape != logp.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} must equal logp shape {tuple(logp.shape)}")
    if old_logp is not None and old_logp.shape != logp.shape:
        raise ValueError(f"old_logp shape {tuple(old_logp.shape)} must equal logp shape {tuple(logp.shape)}")
    if advantages.numel() != n_seq:
        raise ValueError(f"advantages must hold one value per sequence ({n_seq}), got shape {tuple(advantages.shape)}")
    if beta > 0:
        if ref_logp is None:
            raise ValueError("beta > 0 needs ref_logp (the reference policy's log-probs)")
        if ref_logp.shape != logp.shape:
            raise ValueError(f"ref_logp shape {tuple(ref_logp.shape)} must equal logp shape {tuple(logp.shape)}")
    spec = LOSS_REDUCTIONS[loss_type]
    if "max_completion_length" in spec.needs:
        if max_completion_length is None or int(max_completion_length) < 1:
            raise ValueError(f"loss_type={loss_type!r} needs max_completion_length >= 1")
        if n_tok > max_completion_length:
            raise ValueError(f"completions have {n_tok} positions, more than max_completion_length={max_completion_length}")
    if "num_items_in_batch" in spec.needs:
        if num_items_in_batch is None or float(num_items_in_batch) <= 0:
            raise ValueError(
                f"loss_type={loss_type!r} needs num_items_in_batch > 0: the completion-token count of the whole "
                "accumulated batch (sum of the completion masks of all its micro-batches)"
            )
    if not isinstance(gradient_accumulation_steps, int) or gradient_accumulation_steps < 1:
        raise ValueError(f"gradient_accumulation_steps must be a positive int, got {gradient_accumulation_steps!r}")

    valid = mask.bool()
    maskf = valid.to(logp.dtype)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    # Zero the masked positions BEFORE any exp: padding may hold -inf/NaN, and exp(inf) * 0 or
    # a NaN in an unused branch would still poison the loss or its gradient.
    logp_v = torch.where(valid, logp, zero)
    old_v = logp_v.detach() if old_logp is None else torch.where(valid, old_logp.to(logp.dtype), zero)
    adv = torch.where(valid, advantages.reshape(n_seq, 1).to(logp.dtype), zero)

    log_ratio = logp_v - old_v
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    per_token = -torch.min(ratio * adv, clipped * adv)
    finite = torch.isfinite(log_ratio).all() & torch.isfinite(adv).all()
    if beta > 0:
        ref_v = torch.where(valid, ref_logp.to(logp.dtype), zero)
        delta = ref_v - logp_v
        per_token_kl = torch.exp(delta) - delta - 1
        per_token = per_token + beta * per_token_kl
        finite = finite & torch.isfinite(delta).all()
    per_token = torch.where(valid, per_token, zero)

    loss = spec.reduce(per_token, maskf, max_completion_length, num_items_in_batch)
    if spec.per_accumulation:
        loss = loss / gradient_accumulation_steps
    # No host sync: a non-finite input turns the loss into NaN, which the trainer checks.
    loss = torch.where(finite, loss, torch.full_like(loss, float("nan")))

    with torch.no_grad():
        count = maskf.sum().clamp(min=1.0)
        is_low = (ratio < 1 - epsilon_low) & (adv < 0)
        is_high = (ratio > 1 + epsilon_high) & (adv > 0)
        metrics = {
            "clip_ratio/low_mean": _masked_mean(is_low.to(logp.dtype), maskf, count),
            "clip_ratio/high_mean": _masked_mean(is_high.to(logp.dtype), maskf, count),
            "clip_ratio/region_mean": _masked_mean((is_low | is_high).to(logp.dtype), maskf, count),
        }
        if beta > 0:
            metrics["kl"] = _masked_mean(per_token_kl, maskf, count)
    return loss, metrics


def loss_share(loss_type: str, n_own: int, n_micro: int, tokens_own: float, tokens_micro: float) -> float:
    """Factor that rescales a loss ``policy_loss`` normalised by a rank's share of a micro-batch
    (``n_own`` of its ``n_micro`` sequences, ``tokens_own`` of its ``tokens_micro`` loss tokens) to
    the normaliser of the whole (global) micro-batch, so that the ranks' losses SUM to the
    single-process one. Token counts are clamped at 1 as the reductions clamp them. In a single
    process the share is the whole micro-batch and the factor is 1.
    """
    kind = LOSS_REDUCTIONS[loss_type].normaliser
    if kind == "sequences":
        return n_own / n_micro
    if kind == "tokens":
        return max(tokens_own, 1.0) / max(tokens_micro, 1.0)
    if kind == "global":
        return 1.0
    raise ValueError(f"loss_type {loss_type!r}: unknown normaliser {kind!r}")
