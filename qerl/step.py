"""One RL step: ``step(...)``, and the phases it runs in order.

- ``rollout``: sample completions from the model itself (AQN noise on its norms only meanwhile).
- ``score``: rewards, group advantages, the loss mask, DAPO's dynamic sampling -> a ``Batch``.
- ``logprobs``: old log-probs from a clean forward (skipped when ``reuse_training_logprobs``: one
  optimizer step on one pass, where TRL uses the training forward's own, detached) and the KL
  reference's (beta > 0: the same model with adapters off).
- ``update``: the optimizer steps over mini/micro-batches, with each loss normalised as its
  ``loss_type`` says (``qerl.loss``).

The trainer (``qerl.train``) calls ``step`` once per training step and logs what it returns. The
phases are public: a benchmark that times them, or trains on given advantages (random weights give
nothing to score: ``Batch.given``), calls ``rollout``, ``logprobs`` and ``update`` itself, in this
order, so it measures what training runs.

Under torchrun every rank runs every phase on its share of the prompts (whole groups); ``Batch``
holds the global per-completion counts that keep the summed gradient the single-process one, and
``qerl.distributed.pack_micro_batches`` gives each rank its rows of every micro-batch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from qerl import distributed as qdist
from qerl import loss as qloss
from qerl import perf as qperf
from qerl import rewards as qrewards
from qerl.logprobs import sequence_logprobs
from qerl.noise import find_norms, rollout_noise
from qerl.packing import completion_lengths, plan_forwards, row_tokens
from qerl.qlinear import QuantLinear
from qerl.rollout import RolloutOutput

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
    def given(cls, ro: RolloutOutput, adv: torch.Tensor, counts: list[int], first: int) -> Batch:
        """Every completion trained, with given advantages ``adv`` [all completions] (no rewards:
        benchmarks); ``ro`` holds this rank's ``counts[rank]`` completions from global index ``first``."""
        n = ro.completion_ids.size(0)
        if adv.numel() != sum(counts):
            raise ValueError(f"{adv.numel()} advantages for {sum(counts)} completions")
        n_loss_tokens = qdist.gather_shards(ro.completion_mask.sum(1).to(torch.float64).cpu(), counts)
        return cls(adv[first:first + n].to(ro.completion_ids.device), ro.completion_mask, torch.arange(sum(counts)),
                   n_loss_tokens, first)

    @property
    def n_local(self) -> int:
        return self.cmask.size(0)


def rollout(cfg, engine, model, prompt_ids: list, step: int, sigma: float, first: int = 0,
            ignore_eos: bool = False, lengths: list[int] | None = None) -> tuple[RolloutOutput, int]:
    """Sample up to ``cfg.max_completion_length`` tokens after each prompt (``lengths``: one cap per
    prompt instead, as the speed benchmarks force a length mix); returns (rollout, noisy modules).

    AQN noise of std ``sigma`` is on the norm weights during sampling only (restored bitwise after);
    ``cfg.aqn_mode == "upstream"``: the accumulated noise of qerl.noise.UpstreamNoise instead.
    Sequence i samples from the keys (seed, first + i): the same tokens on any rank or batch.
    """
    model.eval()
    with rollout_noise(model, cfg.aqn_config(), step, cfg.max_steps, sigma) as n_noisy:
        caps = cfg.max_completion_length if lengths is None else lengths
        ro = engine.generate(prompt_ids, caps, temperature=cfg.temperature, top_p=cfg.top_p,
                             top_k=cfg.top_k, seed=cfg.seed * 7919 + step,
                             seq_ids=list(range(first, first + len(prompt_ids))), ignore_eos=ignore_eos)
    return ro, n_noisy


def decode_step_metrics(engine) -> dict:
    """This rank's last rollout: decode steps in all and at each batch size (the engine's buckets:
    finished sequences leave the batch, qerl.rollout.fast), how often the batch shrank, and (with
    rollout_rows) how many sequences took a freed row. Empty for
    an engine that keeps no such record (the reference engine)."""
    st = getattr(engine, "last_stats", None) or {}
    if "decode_steps" not in st:
        return {}
    out = {"rollout/decode_steps": st["decode_steps"], "rollout/compactions": st.get("compactions", 0)}
    out.update({f"rollout/decode_steps_bs{n}": k for n, k in sorted(st.get("bucket_steps", {}).items(), reverse=True)})
    if st.get("refills"):  # rollout_rows: sequences that started in a row another one had freed
        out["rollout/refills"] = st["refills"]
    return out


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


def logprobs(cfg, model, ro: RolloutOutput, reuse: bool, rows: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(old log-probs, reference log-probs or None), no grad, in the forwards of ``forwards``.

    ``reuse``: the old log-probs are left at zero for ``update`` to fill from the training forward
    (no forward here unless beta > 0 needs the reference). ``rows``: the rows this rank computes of a
    rollout every rank holds whole (``global_view``); the others' come by a sum over ranks.
    """
    old_lp = torch.zeros_like(ro.logprobs)
    ref_lp = torch.zeros_like(ro.logprobs) if cfg.beta > 0 else None
    if reuse and ref_lp is None:
        return old_lp, None
    model.eval()
    mine = torch.arange(ro.completion_ids.size(0)) if rows is None else rows
    with torch.no_grad():
        for fwd in forwards(cfg, ro.prompt_mask, ro.completion_mask, mine):
            rows_d = fwd.to(ro.completion_ids.device)
            w = _width(cfg, ro.completion_mask[rows_d])
            args = (ro.prompt_ids[rows_d], ro.prompt_mask[rows_d], ro.completion_ids[rows_d, :w],
                    ro.completion_mask[rows_d, :w], cfg.temperature)
            if not reuse:
                old_lp[rows_d, :w], _ = sequence_logprobs(model, *args, packed=cfg.padding_free)
            if ref_lp is not None:
                with adapters_disabled(model):
                    ref_lp[rows_d, :w], _ = sequence_logprobs(model, *args, packed=cfg.padding_free)
    if rows is not None:  # each row was computed on one rank (zeros elsewhere): the sum is every rank's whole
        old_lp = old_lp if reuse else qdist.all_reduce(old_lp, "sum")
        ref_lp = None if ref_lp is None else qdist.all_reduce(ref_lp, "sum")
    return old_lp, ref_lp


def forwards(cfg, prompt_mask: torch.Tensor, completion_mask: torch.Tensor, rows: torch.Tensor) -> list[torch.Tensor]:
    """The training forwards over ``rows`` (local row indices, CPU), each a tensor of rows.

    Padding-free (``cfg.padding_free``): rows sorted by length and cut by ``cfg.token_budget`` tokens
    (``qerl.packing.plan_forwards``; rows with no completion token are left out). Padded: ``rows`` in
    order, ``cfg.micro_batch_size`` at a time."""
    if not cfg.padding_free:
        mb = cfg.micro_batch_size
        return [rows[i:i + mb] for i in range(0, rows.numel(), mb)]
    tokens = row_tokens(prompt_mask[rows.to(prompt_mask.device)], completion_mask[rows.to(completion_mask.device)])
    plan = plan_forwards(tokens.tolist(), cfg.token_budget)
    return [rows[torch.tensor(f, dtype=torch.long)] for f in plan]


WIDTH_ROUND = 64  # micro-batch widths are multiples of this (or the rollout's width): few distinct GEMM shapes


def _width(cfg, cmask: torch.Tensor) -> int:
    """Completion positions a forward over these rows needs: their longest completion. Padding-free, that
    is only the width of the per-token [rows, width] tensors of the loss (the forward runs over the real
    tokens). Padded: rounded up to a multiple of WIDTH_ROUND (at most the rollout's width). The rollout is as wide as its longest sequence;
    cutting each micro-batch to its own longest skips the padding after the rows' last tokens (causal
    attention: the positions kept compute the same). The rounding keeps the training GEMMs to a few
    shapes, each row count a multiple of 16: the 4-bit path's first forward and backward at a new width
    cost more than later ones (7B: ~5 s over a step's 8 micro-batches, bf16 LoRA none; results/table3/
    NOTES.md), so a run meets at most cap / WIDTH_ROUND such widths, once each."""
    C = cmask.size(1)
    if cmask.numel() == 0:
        return max(C, 1)
    w = max(1, int(completion_lengths(cmask).max()))
    return w if cfg.padding_free else min(C, -(-w // WIDTH_ROUND) * WIDTH_ROUND)


def _mini_batches(cfg, idx: torch.Tensor, step: int):
    """(iteration, global indices of one mini-batch) in training order: each of ``cfg.num_iterations``
    passes shuffles ``idx`` (seeded by step and pass) and cuts it into ``cfg.mini_batch_size`` (0: all)."""
    n = idx.numel()
    mini = cfg.mini_batch_size or max(n, 1)
    for it in range(cfg.num_iterations):
        order = idx[torch.randperm(n, generator=torch.Generator().manual_seed(cfg.seed + 31 * step + it))] if n else idx
        for ms in range(0, n, mini):
            yield it, order[ms:ms + mini]


def _accumulate(cfg, model, ro: RolloutOutput, batch: Batch, old_lp, ref_lp, pack, micro: list, micro_tokens: list,
                rows: list, n_tokens: int, keys: tuple, reuse: bool) -> float | None:
    """One training forward over a pack of this rank's micro-batch members, each member's loss scaled
    to its share of its micro-batch, and one backward of their sum. Fills each member's metrics row
    (loss, token sums of ``keys``). Returns the loss value if it is not finite (nothing is backpropagated)."""
    device = ro.completion_ids.device
    rows_d = torch.cat([own for _, own in pack]).to(device)
    w = _width(cfg, ro.completion_mask[rows_d])  # the pack's longest completion (see _width)
    lp_all, ent_all = sequence_logprobs(model, ro.prompt_ids[rows_d], ro.prompt_mask[rows_d],
                                        ro.completion_ids[rows_d, :w], ro.completion_mask[rows_d, :w], cfg.temperature,
                                        with_entropy=True, packed=cfg.padding_free)
    total, at = 0.0, 0
    for j, own in pack:
        sl = slice(at, at + own.numel())
        at += own.numel()
        mi_d = own.to(device)
        lp, ent, mask = lp_all[sl], ent_all[sl], batch.cmask[mi_d, :w]
        if reuse:
            old_lp[mi_d, :w] = lp.detach()
        loss, lm = qloss.policy_loss(lp, None if reuse else old_lp[mi_d, :w], batch.adv[mi_d], mask, cfg.loss_type,
                                     epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high, beta=cfg.beta,
                                     ref_logp=ref_lp[mi_d, :w] if ref_lp is not None else None,
                                     num_items_in_batch=n_tokens, max_completion_length=cfg.max_completion_length,
                                     gradient_accumulation_steps=len(micro))
        loss = loss * qloss.loss_share(cfg.loss_type, own.numel(), micro[j].numel(),
                                       float(batch.n_loss_tokens[own + batch.first].sum()), micro_tokens[j])
        if not torch.isfinite(loss):
            return float(loss.item())
        total = total + loss
        fm = mask.float()
        n_own = float(fm.sum())
        lm["entropy"] = float((ent.detach() * fm).sum() / fm.sum().clamp(min=1))
        # a micro-batch's rows may span several forwards (and ranks): its row of the table sums their parts
        rows[j][0] += loss.item() * len(micro)
        for c, k in enumerate(keys, 1):
            rows[j][c] += lm[k] * n_own  # token means -> token sums
    total.backward()
    return None


def _packs(cfg, ro: RolloutOutput, batch: Batch, micro: list, mine: torch.Tensor | None = None):
    """This rank's training forwards over a mini-batch's micro-batches ``micro`` (global indices): each a
    list of (j, local rows of micro[j] in that forward). Padding-free: the rows that have loss tokens,
    cut by tokens (``forwards``), so a micro-batch may span forwards; each part keeps its micro-batch's
    normaliser (``qerl.loss.loss_share``), and the gradient is the same however the rows are cut.
    Padded: ``qerl.distributed.pack_micro_batches`` (whole micro-batches of this rank's rows). ``mine``: the
    rows this rank trains, of a rollout every rank holds whole (``global_view``); default: its own rows."""
    if not cfg.padding_free:
        yield from qdist.pack_micro_batches(micro, batch.first, batch.n_local, cfg.micro_batch_size)
        return
    owner = {}
    keep = None if mine is None else set(mine.tolist())
    for j, mi in enumerate(micro):
        for r in (mi[(mi >= batch.first) & (mi < batch.first + batch.n_local)] - batch.first).tolist():
            if keep is None or r in keep:
                owner[r] = j
    rows = torch.tensor(sorted(owner), dtype=torch.long)
    if rows.numel():  # rows whose loss mask is empty add nothing to the loss or its gradient
        rows = rows[(batch.cmask[rows.to(batch.cmask.device)].sum(1) > 0).cpu()]
    for f in forwards(cfg, ro.prompt_mask, ro.completion_mask, rows):
        pack = {}
        for r in f.tolist():
            pack.setdefault(owner[r], []).append(r)
        yield [(j, torch.tensor(rs, dtype=torch.long)) for j, rs in sorted(pack.items())]


def update(cfg, model, ro: RolloutOutput, batch: Batch, old_lp: torch.Tensor, ref_lp: torch.Tensor | None,
           opt, sched, trainable: list, step: int, reuse: bool, balanced: bool = False) -> dict:
    """The policy updates of one rollout: ``cfg.num_iterations`` passes, one optimizer step per mini-batch.

    The global mini/micro-batch plan is the same on every rank; each rank runs its members of each
    micro-batch (packed into forwards of up to ``micro_batch_size`` rows), and the gradients are
    summed once per optimizer step. Each mini-batch's loss tokens are dapo's normaliser, at least 1
    as the other reductions clamp theirs: a mini-batch whose tokens are all masked (truncated) has
    loss 0, not an error. ``reuse``: each micro-batch's old log-probs are its training forward's,
    detached (and written into ``old_lp``). Returns loss / token metrics (means over micro-batches,
    over all ranks), grad_norm, learning_rate. ``balanced`` (data parallel, padding-free; ``ro`` and ``batch``
    every rank's whole, ``global_view``): each mini-batch's rows are split among the ranks by their tokens
    (``balanced_rows``), so the ranks' forwards carry about the same tokens.
    """
    mb = cfg.micro_batch_size
    model.train()
    keys = LOSS_METRICS if cfg.beta > 0 else tuple(k for k in LOSS_METRICS if k != "kl")
    table = []  # per global micro-batch: [loss, sums of the token metrics over this rank's tokens]
    micro_tokens = []  # per global micro-batch: its completion tokens over all ranks
    grad_norms = []
    from qerl.logging import progress

    idx = batch.idx
    n_mine = (balanced_rows(ro, batch, idx).numel() if balanced
              else int(((idx >= batch.first) & (idx < batch.first + batch.n_local)).sum()))
    bar = progress(cfg.num_iterations * n_mine, "update", unit="row")
    for it, mini_idx in _mini_batches(cfg, batch.idx, step):
        micro = [mini_idx[i:i + mb] for i in range(0, mini_idx.numel(), mb)]
        tokens = [float(batch.n_loss_tokens[mi].sum()) for mi in micro]
        rows = [[0.0] * (1 + len(keys)) for _ in micro]
        table += rows
        micro_tokens += tokens
        n_tokens = max(int(batch.n_loss_tokens[mini_idx].sum()), 1)
        opt.zero_grad(set_to_none=True)
        bad = None
        mine = balanced_rows(ro, batch, mini_idx) if balanced else None
        for pack in _packs(cfg, ro, batch, micro, mine):
            bad = _accumulate(cfg, model, ro, batch, old_lp, ref_lp, pack, micro, tokens, rows, n_tokens, keys, reuse)
            bar.update(sum(own.numel() for _, own in pack))
            if bad is not None:
                break
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


def perf_metrics(cfg, model, ro: RolloutOutput, reuse: bool, train_s: float) -> dict:
    """``perf/train_tokens_per_s`` (real tokens of the rollout's rows over the training phases' seconds),
    ``perf/train_tflops`` and ``perf/mfu`` (model FLOPs of those phases, qerl.perf; None off a known GPU),
    summed over ranks."""
    n_fwd = (0 if reuse else 1) + (1 if cfg.beta > 0 else 0)
    fl = qperf.training_flops(model, ro.prompt_mask, ro.completion_mask, n_fwd, cfg.num_iterations)
    flops, tokens = qdist.all_reduce([fl["flops"], float(fl["real_tokens"])], "sum")
    _, world = qdist.world()
    peak = qperf.peak_tflops() if ro.completion_ids.is_cuda else None
    return {"perf/train_tokens_per_s": tokens / max(train_s, 1e-9), "perf/train_tflops": flops / max(train_s, 1e-9) / 1e12,
            "perf/mfu": qperf.mfu(flops, train_s, peak * world if peak else None)}


def balanced_rows(ro: RolloutOutput, batch: Batch, rows: torch.Tensor) -> torch.Tensor:
    """This rank's share of ``rows`` (global indices of a rollout every rank holds whole), balanced by the
    tokens a padding-free forward computes for each (rows without loss tokens count none: they are not run)."""
    rank, world = qdist.world()
    tokens = row_tokens(ro.prompt_mask, ro.completion_mask) * (batch.cmask.sum(1) > 0)
    return qdist.balance(rows, tokens.cpu(), world)[rank]


def global_view(ro: RolloutOutput, batch: Batch, counts: list[int]) -> tuple[RolloutOutput, Batch]:
    """Every rank's rollout and batch rows gathered on every rank (token ids and masks: a few MB), so the
    training forwards can be balanced over the ranks by tokens (``balanced_rows``) whoever sampled a row."""
    def rows(t, left=False):
        return qdist.gather_rows(t, counts, left=left)

    whole = RolloutOutput(rows(ro.prompt_ids, left=True), rows(ro.prompt_mask, left=True), rows(ro.completion_ids),
                          rows(ro.completion_mask), rows(ro.logprobs), rows(ro.entropy),
                          qdist.gather_shards(ro.truncated.long(), counts).bool())
    return whole, Batch(qdist.gather_shards(batch.adv, counts), rows(batch.cmask), batch.idx, batch.n_loss_tokens, 0)


def logprob_gap(ro: RolloutOutput, old_lp: torch.Tensor, batch: Batch, reuse: bool,
                rows: torch.Tensor | None = None) -> dict:
    """``sampling/logprob_gap`` (mean |old - rollout| log-prob over completion tokens, all ranks) and
    its max. With ``reuse`` only the rows this rank trained (with loss tokens) have old log-probs. ``rows``: a
    rollout every rank holds whole; this rank counts these rows (those it computed or trained)."""
    scored = torch.ones(batch.n_local, dtype=torch.bool)
    if rows is not None:
        scored = torch.zeros(batch.n_local, dtype=torch.bool)
        scored[rows] = True
        if reuse:
            scored &= (batch.cmask.sum(1) > 0).cpu()
    elif reuse:
        scored = torch.zeros(batch.n_local, dtype=torch.bool)
        idx = batch.idx
        scored[idx[(idx >= batch.first) & (idx < batch.first + batch.n_local)] - batch.first] = True
        scored &= (batch.cmask.sum(1) > 0).cpu()  # rows with no loss token run no training forward
    m = ro.completion_mask.float() * scored.to(ro.completion_mask.device)[:, None]
    gap = (old_lp - ro.logprobs).abs() * m
    gap_sum, gap_n = qdist.all_reduce([float(gap.sum()), float(m.sum())], "sum")
    gap_max = qdist.all_reduce(float(gap.max()) if gap.numel() else 0.0, "max")
    return {"sampling/logprob_gap": gap_sum / max(gap_n, 1.0), "sampling/logprob_gap_max": gap_max if gap_n > 0 else None}


def step(cfg, model, engine, opt, sched, trainable: list, prompts: list[dict], step: int, *, tokenizer,
         rewards=None) -> dict:
    """One RL step: rollout -> score -> old / reference log-probs -> policy updates. Returns the
    step's metrics, reduced over ranks (and ``num_tokens_step``, its prompt + completion tokens).

    ``prompts`` are the step's global prompts (dicts with ``prompt_ids`` and the ``answer``), each
    sampled ``cfg.num_generations`` times. Under torchrun each rank rolls out a contiguous share of
    whole groups (``qerl.distributed.shard``) and trains on those completions; the loss of each
    micro-batch is normalised by the counts of the GLOBAL micro/mini-batch, so the summed gradient
    is the single-process one (``qerl.loss.loss_share``). In a single process the share is
    everything. AQN's sigma is the schedule's at ``step`` (``cfg.aqn_config()``). ``tokenizer``
    decodes the completions for the rewards; ``rewards``: the run's reward functions (a
    ``qerl.rewards.RewardSet``; default: cfg's), called with each completion's prompt record as its
    dataset columns.
    """
    if not prompts or tokenizer is None:
        raise ValueError("step needs the step's prompts (with their answers) and the tokenizer to score them")
    t0 = time.perf_counter()
    G = cfg.num_generations
    rank, world = qdist.world()
    shares = [qdist.shard(len(prompts), r, world) for r in range(world)]
    counts = [(hi - lo) * G for lo, hi in shares]
    first = shares[rank][0] * G  # global index of this rank's first completion
    mine = prompts[shares[rank][0]:shares[rank][1]]
    stage, sigma = cfg.aqn_config().sigma_at(step, cfg.max_steps)
    ro, n_noisy = rollout(cfg, engine, model, [p["prompt_ids"] for p in mine for _ in range(G)], step, sigma, first)
    t_roll = time.perf_counter() - t0
    rows = [p for p in mine for _ in range(G)]
    batch, scored = score(cfg, tokenizer, engine.pad_id, ro, [p.get("answer") for p in rows], counts, first,
                          ro.completion_ids.device, rewards=rewards, rows=rows)
    ent_sum, ent_n, n_compl, n_prompt = qdist.all_reduce(
        [float((ro.entropy * ro.completion_mask).sum()), float(ro.completion_mask.sum()),
         float(ro.num_completion_tokens), float(ro.prompt_mask.sum())], "sum")
    t_roll_max = qdist.all_reduce(t_roll, "max")
    metrics: dict = {"aqn/sigma": sigma, "aqn/stage": stage, "aqn/num_modules": n_noisy, "time/rollout_s": t_roll_max,
                     "throughput/rollout_tokens_per_s": n_compl / max(t_roll_max, 1e-9),
                     "sampling/entropy": ent_sum / max(ent_n, 1.0)}
    metrics.update(decode_step_metrics(engine))
    metrics.update(scored)
    t1 = time.perf_counter()
    reuse = reuse_training_logprobs(cfg, batch.idx.numel())
    balanced = world > 1 and cfg.padding_free  # the training rows split among the ranks by tokens
    if balanced:
        ro_t, batch_t = global_view(ro, batch, counts)
        lp_rows = balanced_rows(ro_t, batch_t, torch.arange(ro_t.completion_ids.size(0)))
    else:
        ro_t, batch_t, lp_rows = ro, batch, None
    old_lp, ref_lp = logprobs(cfg, model, ro_t, reuse, lp_rows)
    updated = update(cfg, model, ro_t, batch_t, old_lp, ref_lp, opt, sched, trainable, step, reuse, balanced)
    gap_rows = (balanced_rows(ro_t, batch_t, batch_t.idx) if reuse else lp_rows) if balanced else None
    metrics.update(logprob_gap(ro_t, old_lp, batch_t, reuse, gap_rows))
    metrics["time/train_s"] = qdist.all_reduce(time.perf_counter() - t1, "max")
    metrics.update(perf_metrics(cfg, model, ro, reuse, metrics["time/train_s"]))  # each rank its sampled rows: summed
    metrics.update(updated)
    metrics["num_tokens_step"] = int(n_prompt + n_compl)
    metrics["step_time"] = qdist.all_reduce(time.perf_counter() - t0, "max")
    return metrics
