"""The RL step as named phases: rollout -> score -> logprobs (old / reference) -> update.

``qerl.train.rl_step`` runs them in this order and adds the step's metrics;
``benchmarks/table3_speed_memory.py`` times the same functions (with random advantages in place of
``score``), so Table 3 measures what training runs.

- ``rollout``: sample completions from the model itself (AQN noise on its norms only meanwhile).
- ``score``: rewards, group advantages, the loss mask, DAPO's dynamic sampling -> a ``Batch``.
- ``logprobs``: old log-probs from a clean forward (skipped when ``reuse_training_logprobs``: one
  optimizer step on one pass, where TRL uses the training forward's own, detached) and the KL
  reference's (beta > 0: the same model with adapters off).
- ``update``: the optimizer steps over mini/micro-batches, with each loss normalised as its
  ``loss_type`` says (``qerl.loss``).

Under torchrun every rank runs every phase on its share of the prompts (whole groups); ``Batch``
holds the global per-completion counts that keep the summed gradient the single-process one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qerl import distributed as qdist
from qerl import loss as qloss
from qerl import rewards as qrewards
from qerl.noise import find_norms, noisy_norms
from qerl.qlinear import QuantLinear
from qerl.rollout import RolloutOutput, sequence_logprobs

LOSS_METRICS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "kl", "entropy")


class NonFiniteError(RuntimeError):
    """A NaN/inf loss or gradient: training stops instead of corrupting the adapters."""


class adapters_disabled:
    """Context: every QuantLinear's LoRA off and trained norms back at their initial weights (the KL
    reference policy, no second copy; PEFT's disable_adapter does the same to modules_to_save)."""

    def __init__(self, model):
        self.mods = [m for m in model.modules() if isinstance(m, QuantLinear)]
        initial = getattr(model, "qerl_initial_norms", {})
        self.norms = [(m.weight, initial[n]) for n, m in find_norms(model) if n in initial]
        self.trained = []

    def __enter__(self):
        for m in self.mods:
            m._adapters_enabled = False
        with torch.no_grad():
            self.trained = [w.detach().clone() for w, _ in self.norms]
            for w, w0 in self.norms:
                w.copy_(w0)

    def __exit__(self, *exc):
        for m in self.mods:
            m._adapters_enabled = True
        with torch.no_grad():
            for (w, _), t in zip(self.norms, self.trained):
                w.copy_(t)


@dataclass
class Batch:
    """What the update trains on, besides the rollout: this rank's rows of the global batch.

    ``adv`` [local] and ``cmask`` [local, C] (the loss mask: the completion mask, minus truncated
    completions with mask_truncated_completions) are this rank's; ``idx`` (global indices of the
    completions trained, CPU) and ``n_loss_tokens`` (loss tokens of every completion, CPU) are global.
    """

    adv: torch.Tensor
    cmask: torch.Tensor
    idx: torch.Tensor
    n_loss_tokens: torch.Tensor
    first: int = 0  # global index of this rank's first completion

    @classmethod
    def whole(cls, ro: RolloutOutput, adv: torch.Tensor) -> Batch:
        """Every completion of a single-process rollout, with the given advantages (benchmarks)."""
        n = ro.completion_ids.size(0)
        return cls(adv.to(ro.completion_ids.device), ro.completion_mask, torch.arange(n),
                   ro.completion_mask.sum(1).to(torch.float64).cpu())

    @property
    def n_local(self) -> int:
        return self.cmask.size(0)


def rollout(cfg, engine, model, prompt_ids: list, step: int, sigma: float, first: int = 0,
            ignore_eos: bool = False) -> tuple[RolloutOutput, int]:
    """Sample ``cfg.max_completion_length`` tokens after each prompt; returns (rollout, noisy modules).

    AQN noise of std ``sigma`` is on the norm weights during sampling only (restored bitwise after).
    Sequence i samples from the keys (seed, first + i): the same tokens on any rank or batch.
    """
    model.eval()
    with noisy_norms(model, sigma, seed=cfg.seed * 104729 + step) as n_noisy:
        ro = engine.generate(prompt_ids, cfg.max_completion_length, temperature=cfg.temperature, top_p=cfg.top_p,
                             top_k=cfg.top_k, seed=cfg.seed * 7919 + step,
                             seq_ids=list(range(first, first + len(prompt_ids))), ignore_eos=ignore_eos)
    return ro, n_noisy


def score(cfg, tokenizer, pad_id: int, ro: RolloutOutput, golds: list, counts: list[int], first: int,
          device, rewards: qrewards.RewardSet | None = None, rows: list[dict] | None = None) -> tuple[Batch, dict]:
    """Rewards of this rank's completions, then (over all ranks) advantages and what is trained.

    ``rewards``: the run's reward functions (default: cfg's); ``rows``: each completion's dataset
    record (its prompt and columns reach the reward functions; default: just ``golds`` as answer).
    Returns the ``Batch`` and the step's reward / completion metrics (global).
    """
    G = cfg.num_generations
    cmask = ro.completion_mask
    texts = tokenizer.batch_decode(ro.completion_ids * cmask + pad_id * (1 - cmask), skip_special_tokens=True)
    rewards = rewards if rewards is not None else qrewards.RewardSet.from_config(cfg)
    rows = rows if rows is not None else [{"answer": g} for g in golds]
    prompts = [r.get("prompt", r.get("question")) for r in rows]
    cols = [r.get("columns") or {k: v for k, v in r.items() if k in ("answer", "level")} for r in rows]
    columns = {k: [c.get(k) for c in cols] for k in sorted({k for c in cols for k in c})}
    if rewards.needs_answer:  # the gold answer as the built-in rewards read it (from answer_column)
        columns["answer"] = [r.get("answer") for r in rows]
    comp, unparsed = rewards(prompts, texts, columns)
    if cfg.mask_truncated_completions:
        cmask = cmask * (~ro.truncated).long()[:, None]
    K = len(rewards.names)
    per_seq = torch.tensor(comp, dtype=torch.float64).view(len(texts), K)
    per_seq = torch.cat([per_seq, torch.stack([ro.completion_mask.sum(1), cmask.sum(1), ro.truncated.long()], 1)
                         .to(torch.float64).cpu()], 1)
    per_seq = qdist.gather_shards(per_seq, counts)  # [all completions, K + 3]: every rank holds the whole batch's
    comp_all = per_seq[:, :K]
    lengths, n_loss_tokens, trunc = per_seq[:, K].float(), per_seq[:, K + 1], per_seq[:, K + 2].bool()
    unparsed = qdist.all_reduce(float(unparsed), "sum")
    weights = torch.tensor(rewards.weights, dtype=torch.float64)
    total = (comp_all * weights).nansum(1).float()  # TRL: a None reward is left out of the weighted sum
    adv, metrics = qloss.compute_advantages(total, G, cfg.scale_rewards)  # global: the same on every rank
    for j, name in enumerate(rewards.names):
        col = comp_all[:, j]
        ok = col[~torch.isnan(col)]
        metrics[f"rewards/{name}/mean"] = float(ok.mean()) if ok.numel() else None
        metrics[f"rewards/{name}/std"] = float(ok.std()) if ok.numel() > 1 else None
    if rewards.needs_answer:
        metrics["rewards/unparsed"] = int(unparsed)
    term = lengths[~trunc]
    metrics.update({"completions/mean_length": float(lengths.mean()), "completions/min_length": float(lengths.min()),
                    "completions/max_length": float(lengths.max()), "completions/clipped_ratio": float(trunc.float().mean()),
                    "completions/mean_terminated_length": float(term.mean()) if term.numel() else None})
    keep = torch.ones(len(total), dtype=torch.bool)
    if cfg.dynamic_sampling:
        keep = qloss.dynamic_sampling_filter(total, G).repeat_interleave(G)
        metrics["dynamic_sampling/kept_groups"] = int(keep.sum()) // G
    idx = torch.nonzero(keep).squeeze(1)  # global indices
    n = ro.completion_ids.size(0)
    return Batch(adv[first:first + n].to(device), cmask, idx, n_loss_tokens, first), metrics


def reuse_training_logprobs(cfg, n: int) -> bool:
    """Whether the training forward's detached log-probs serve as the old log-probs: one iteration
    and one optimizer step over the ``n`` trained completions (the ratio is then exactly 1)."""
    return cfg.num_iterations == 1 and (cfg.mini_batch_size == 0 or cfg.mini_batch_size >= n)


def logprobs(cfg, model, ro: RolloutOutput, reuse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(old log-probs, reference log-probs or None), no grad, in micro-batches.

    ``reuse``: the old log-probs are left at zero for ``update`` to fill from the training forward
    (no forward here unless beta > 0 needs the reference).
    """
    mb = cfg.micro_batch_size
    old_lp = torch.zeros_like(ro.logprobs)
    ref_lp = torch.zeros_like(ro.logprobs) if cfg.beta > 0 else None
    if reuse and ref_lp is None:
        return old_lp, None
    model.eval()
    with torch.no_grad():
        for s in range(0, ro.completion_ids.size(0), mb):
            sl = slice(s, s + mb)
            args = (ro.prompt_ids[sl], ro.prompt_mask[sl], ro.completion_ids[sl], ro.completion_mask[sl], cfg.temperature)
            if not reuse:
                old_lp[sl], _ = sequence_logprobs(model, *args)
            if ref_lp is not None:
                with adapters_disabled(model):
                    ref_lp[sl], _ = sequence_logprobs(model, *args)
    return old_lp, ref_lp


def update(cfg, model, ro: RolloutOutput, batch: Batch, old_lp: torch.Tensor, ref_lp: torch.Tensor | None,
           opt, sched, trainable: list, step: int, reuse: bool) -> dict:
    """The policy updates of one rollout: ``cfg.num_iterations`` passes, one optimizer step per mini-batch.

    The global mini/micro-batch plan is the same on every rank; each rank runs the members of each
    micro-batch it generated, and the gradients are summed once per optimizer step. ``reuse``: each
    micro-batch's old log-probs are its training forward's, detached (and written into ``old_lp``).
    Returns loss / token metrics (means over micro-batches, over all ranks), grad_norm, learning_rate.
    """
    device = ro.completion_ids.device
    mb = cfg.micro_batch_size
    idx, n_loss_tokens, first, n_local = batch.idx, batch.n_loss_tokens, batch.first, batch.n_local
    n = idx.numel()
    model.train()
    mini = cfg.mini_batch_size or n
    keys = LOSS_METRICS if cfg.beta > 0 else tuple(k for k in LOSS_METRICS if k != "kl")
    table = []  # per global micro-batch: [loss, sums of the token metrics over this rank's tokens]
    micro_tokens = []  # per global micro-batch: its completion tokens over all ranks
    grad_norms = []
    from qerl.logging import progress

    bar = progress(cfg.num_iterations * -(-max(n, 1) // mb), "update", unit="micro-batch")
    for it in range(cfg.num_iterations):
        order = idx[torch.randperm(n, generator=torch.Generator().manual_seed(cfg.seed + 31 * step + it))] if n else idx
        for ms in range(0, n, mini):
            mini_idx = order[ms:ms + mini]
            micro = [mini_idx[i:i + mb] for i in range(0, mini_idx.numel(), mb)]
            # loss tokens of the mini-batch (dapo's normaliser); at least 1, as the other reductions clamp
            # theirs: a mini-batch whose tokens are all masked (truncated) then has loss 0, not an error
            n_tokens = max(int(n_loss_tokens[mini_idx].sum()), 1)
            opt.zero_grad(set_to_none=True)
            bad = None
            # This rank's members of each global micro-batch, packed into forwards of up to mb rows:
            # under data parallelism a rank owns ~mb/world rows of each micro-batch, and packing several
            # micro-batches into one forward keeps forwards full (half as many on 2 GPUs) while each
            # micro-batch keeps its own normaliser. In a single process each pack is one micro-batch.
            packs, pack = [], []
            for mi in micro:
                row = [0.0] * (1 + len(keys))
                micro_tokens.append(float(n_loss_tokens[mi].sum()))
                table.append(row)
                own = mi[(mi >= first) & (mi < first + n_local)] - first
                if own.numel() == 0:
                    continue
                if pack and sum(m[0].numel() for m in pack) + own.numel() > mb:
                    packs.append(pack)
                    pack = []
                pack.append((own, mi.numel(), micro_tokens[-1], row))
            if pack:
                packs.append(pack)
            for pack in packs:
                if bad is not None:
                    break
                rows = torch.cat([m[0] for m in pack]).to(device)
                lp_all, ent_all = sequence_logprobs(model, ro.prompt_ids[rows], ro.prompt_mask[rows],
                                                    ro.completion_ids[rows], ro.completion_mask[rows],
                                                    cfg.temperature, with_entropy=True)
                total, at = 0.0, 0
                for own, n_micro, tokens_micro, row in pack:
                    sl = slice(at, at + own.numel())
                    at += own.numel()
                    mi_d = own.to(device)
                    lp, ent, mask = lp_all[sl], ent_all[sl], batch.cmask[mi_d]
                    if reuse:
                        old_lp[mi_d] = lp.detach()
                    loss, lm = qloss.policy_loss(lp, None if reuse else old_lp[mi_d], batch.adv[mi_d], mask,
                                                 cfg.loss_type, epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high,
                                                 beta=cfg.beta, ref_logp=ref_lp[mi_d] if ref_lp is not None else None,
                                                 num_items_in_batch=n_tokens,
                                                 max_completion_length=cfg.max_completion_length,
                                                 gradient_accumulation_steps=len(micro))
                    loss = loss * qloss.loss_share(cfg.loss_type, own.numel(), n_micro,
                                                   float(n_loss_tokens[own + first].sum()), tokens_micro)
                    if not torch.isfinite(loss):
                        bad = float(loss.item())
                        break
                    total = total + loss
                    fm = mask.float()
                    n_own = float(fm.sum())
                    lm["entropy"] = float((ent.detach() * fm).sum() / fm.sum().clamp(min=1))
                    row[0] = loss.item() * len(micro)
                    row[1:] = [lm[k] * n_own for k in keys]  # token means -> token sums
                if bad is None:
                    total.backward()
                bar.update(len(pack))
            if qdist.any_true(bad is not None):
                raise NonFiniteError(f"non-finite loss ({bad}) at step {step}, iteration {it}: stopping. "
                                     "Lower the learning rate, check the data, or resume from the last checkpoint.")
            qdist.all_reduce_grads(trainable)
            gn = torch.nn.utils.clip_grad_norm_(trainable, cfg.max_grad_norm)
            if not torch.isfinite(gn):
                raise NonFiniteError(f"non-finite gradient norm at step {step}: stopping before the update")
            grad_norms.append(float(gn))
            opt.step()
            sched.step()
    bar.close()
    metrics: dict = {}
    if table:  # each micro-batch's loss and token means over all ranks, then their mean (as one process logs them)
        tab = torch.tensor(qdist.all_reduce([v for row in table for v in row], "sum"), dtype=torch.float64)
        tab = tab.view(len(table), -1)
        tok = torch.tensor(micro_tokens, dtype=torch.float64).clamp(min=1)[:, None]
        metrics["loss"] = float(tab[:, 0].mean())
        metrics.update({k: float((tab[:, 1 + j:2 + j] / tok).mean()) for j, k in enumerate(keys)})
        # TRL's extremes of the clip ratios (over its processes; here over the micro-batches)
        per_micro = {k: tab[:, 1 + j] / tok[:, 0] for j, k in enumerate(keys)}
        metrics["clip_ratio/low_min"] = float(per_micro["clip_ratio/low_mean"].min())
        metrics["clip_ratio/high_max"] = float(per_micro["clip_ratio/high_mean"].max())
    else:
        metrics["loss"] = None
        metrics.update({k: None for k in (*keys, "clip_ratio/low_min", "clip_ratio/high_max")})
    metrics.setdefault("kl", None)
    metrics["grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else None
    metrics["learning_rate"] = sched.get_last_lr()[0]
    return metrics


def logprob_gap(ro: RolloutOutput, old_lp: torch.Tensor, batch: Batch, reuse: bool) -> dict:
    """``sampling/logprob_gap`` (mean |old - rollout| log-prob over completion tokens, all ranks) and
    its max. With ``reuse`` only the rows this rank trained have old log-probs."""
    scored = torch.ones(batch.n_local, dtype=torch.bool)
    if reuse:
        scored = torch.zeros(batch.n_local, dtype=torch.bool)
        idx = batch.idx
        scored[idx[(idx >= batch.first) & (idx < batch.first + batch.n_local)] - batch.first] = True
    m = ro.completion_mask.float() * scored.to(ro.completion_mask.device)[:, None]
    gap = (old_lp - ro.logprobs).abs() * m
    gap_sum, gap_n = qdist.all_reduce([float(gap.sum()), float(m.sum())], "sum")
    gap_max = qdist.all_reduce(float(gap.max()) if gap.numel() else 0.0, "max")
    return {"sampling/logprob_gap": gap_sum / max(gap_n, 1.0), "sampling/logprob_gap_max": gap_max if gap_n > 0 else None}
