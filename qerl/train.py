"""The RL loop, top to bottom: rollout -> rewards -> advantages -> policy updates -> AQN
(one step, ``qerl.step.step``, runs the phases).

One model object serves both paths. The rollout samples from it with no grad (AQN noise added to
its RMSNorm weights for the duration of the rollout only, then restored bitwise); the policy
update runs the training forward through the frozen packed base and the LoRA adapters. There is
no second copy and no weight sync. Departures from textbook GRPO, all settings:
- ``old_logp`` comes from a clean (noise-free) forward right after the rollout, as TRL does when
  num_iterations > 1; with one optimizer step per rollout it is the training forward's own,
  detached (TRL). The gap between it and the sampling log-probs (noise and kernel differences)
  is logged as ``sampling/logprob_gap``; a run without AQN whose gap stays above
  ``max_logprob_gap`` stops (RolloutGapError).
- bf16_full steps fp32 master weights (``MasterWeights``) and computes in bf16.
- the KL reference (beta > 0) is the same model with adapters disabled.
- DAPO dynamic sampling drops zero-signal groups and counts them; it does not resample.

Exact resume: prompts, sampling and noise of step k are seeded by (seed, k), and the checkpoint
holds trainable weights, optimizer, scheduler and RNG states.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm

from qerl import checkpoint as qckpt
from qerl import data as qdata
from qerl import distributed as qdist
from qerl import evaluate as qeval
from qerl import rewards as qrewards
from qerl import run_folder
from qerl import step as qstep
from qerl.config import TrainConfig, eval_settings
from qerl.logging import RunLogger, wandb_settings
from qerl.policy import build_policy, make_optimizer, optimizer_params, pick_device
from qerl.rollout import make_engine
from qerl.step import NonFiniteError, adapters_disabled  # noqa: F401 - re-exported


class RolloutGapError(RuntimeError):
    """The rollout's log-probs stayed far from the training forward's (a broken rollout): training stops."""


# ----------------------------------------------------------------------------- data
def epoch_steps(n_prompts: int, prompts_per_step: int, epochs: float) -> int:
    """Rollout steps of ``epochs`` passes over ``n_prompts`` prompts: floor(epochs * n / prompts_per_step), as
    TRL's sampler drops an incomplete last batch; ValueError when that is not one step."""
    steps = int(epochs * n_prompts) // prompts_per_step
    if steps < 1:
        raise ValueError(f"num_train_epochs={epochs} over {n_prompts} prompts at {prompts_per_step} a step is no step")
    return steps


def prompts_for_step(n: int, step: int, per_step: int, seed: int) -> list[int]:
    """Indices of the prompts of a step: epochs of seeded permutations, a pure function of step."""
    out = []
    for i in range(step * per_step, (step + 1) * per_step):
        epoch, pos = divmod(i, n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        out.append(int(perm[pos]))
    return out


# ----------------------------------------------------------------------------- the loop
def train(cfg: TrainConfig, model=None, tokenizer=None, stop_after: int | None = None, reward_funcs=None,
          train_dataset=None) -> dict:
    """Run RL training as configured; writes cfg.output_dir. ``stop_after`` ends early (tests of resume).

    ``reward_funcs``: callables with TRL's signature ``f(prompts, completions, **columns) -> list[float]``
    (or built-in names / module:function references), replacing cfg.reward; weighted by
    cfg.reward_weights. ``train_dataset``: rows (a list of dicts or a datasets.Dataset) or a file,
    replacing cfg.dataset; cfg.prompt_column / answer_column name their fields.

    Under torchrun every rank runs this (data parallel, see qerl.distributed): rollouts and updates are
    split, files, W&B, checkpoints and evaluation are rank 0's, and the returned summary holds
    evaluations on rank 0 only.
    """
    out = Path(cfg.output_dir)
    existed, had_run = out.exists(), any((out / n).exists() for n in run_folder.RUN_FILES)
    try:
        return _train(cfg, model, tokenizer, stop_after, reward_funcs, train_dataset)
    except BaseException:
        if not had_run and int(os.environ.get("RANK", "0")) == 0:  # a run that failed before its first step leaves nothing behind
            run_folder.remove_unstarted(out, remove_folder=not existed)
        raise


def _train(cfg: TrainConfig, model, tokenizer, stop_after, reward_funcs, train_dataset) -> dict:
    """train()'s body (train() removes what it wrote when it fails before its first step)."""
    out = Path(cfg.output_dir)
    owns_group = qdist.init()  # torchrun's env -> process group; nothing in a single process
    rank, world = qdist.world()
    main = rank == 0
    run_folder.check_output_dir(cfg, clear=main)
    if cfg.resume_from and cfg.resume_from != "auto":  # a missing path, a file, a run folder: before the model loads
        qckpt.check_resume_from(cfg.resume_from)
    if cfg.prompts_per_step < world:
        raise ValueError(f"prompts_per_step={cfg.prompts_per_step} < world size {world}: every rank needs a prompt")
    rewards = qrewards.RewardSet.from_config(cfg, reward_funcs)  # bad rewards or data fail before the model loads
    own = dict(prompt_column=cfg.prompt_column, answer_column=cfg.answer_column, require_answer=rewards.needs_answer)
    if train_dataset is not None:
        train_recs = qdata.user_records(train_dataset, **own)
    else:
        train_recs = qdata.load_dataset_split(cfg.dataset, "train", data_dir=cfg.data_dir, seed=cfg.seed,
                                              **({"levels": cfg.arith_levels} if cfg.dataset == "arith" else
                                                 {"config": cfg.bigmath_config} if cfg.dataset == "bigmath" else
                                                 {} if cfg.dataset in qdata.DATASETS else own))
    if cfg.prompts_per_step > len(train_recs):
        qdist.print0(f"[qerl] warning: prompts_per_step={cfg.prompts_per_step} but {cfg.dataset if train_dataset is None else 'train_dataset'} "
                     f"has {len(train_recs)} prompts: every step repeats each prompt up to "
                     f"{math.ceil(cfg.prompts_per_step / len(train_recs))} times; lower --prompts-per-step")
    device = pick_device()
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    model, tokenizer, trainable, info = build_policy(cfg, device, model, tokenizer)
    trainable_names = [n for n, p in model.named_parameters() if p.requires_grad]
    train_recs, skipped = qdata.tokenize_prompts(train_recs, tokenizer, cfg.max_prompt_length, cfg.chat_template,
                                                 qdata.prompt_suffix(cfg.prompt_suffix))
    if cfg.num_train_epochs:  # TRL's num_train_epochs: the step count follows from the data
        cfg = dataclasses.replace(cfg, max_steps=epoch_steps(len(train_recs), cfg.prompts_per_step, cfg.num_train_epochs))
    # The static KV cache is sized for the longest prompt this run has (not max_prompt_length): at the
    # small profile that is a 256-slot cache instead of 512 (64 x 30 layers x 2 x 3 x 64 bf16: 0.38 GB
    # instead of 0.75).
    longest = max((len(r["prompt_ids"]) for r in train_recs), default=cfg.max_prompt_length)
    engine = make_engine(model, tokenizer, kind=cfg.engine, max_seq_len=longest + cfg.max_completion_length,
                         max_batch=cfg.rollout_rows or None)  # the reference engine ignores it
    n_per_rollout = cfg.rollout_batch_size
    updates_per_step = cfg.num_iterations * math.ceil(n_per_rollout / (cfg.mini_batch_size or n_per_rollout))
    opt, sched = make_optimizer(cfg, trainable, cfg.max_steps * updates_per_step)
    trainable = optimizer_params(opt)  # bf16_full: the fp32 masters hold the gradients
    start, record = 0, {}
    resume = qckpt.resume_point(out, cfg.resume_from, say=qdist.print0)
    if resume is not None:
        record = qckpt.read_run_state(resume)
        start = qckpt.load_checkpoint(resume, model, opt, sched)
        qdist.print0(f"[qerl] resumed from {resume} at step {start}")
        finished = run_folder.finished_summary(out) if start >= cfg.max_steps else None
        if finished is not None:  # nothing left to train: no second final checkpoint or evaluation
            qdist.print0(f"[qerl] {out} already finished ({start} of {cfg.max_steps} steps); nothing to do")
            if owns_group:
                qdist.cleanup()
            return finished
        if main:  # metrics.jsonl back to what the run had logged at that checkpoint: no step twice
            dropped = qckpt.cut_metrics(out / "metrics.jsonl", record, start)
            if dropped:
                qdist.print0(f"[qerl] {out / 'metrics.jsonl'}: dropped {dropped} rows logged after step {start}")
    qdist.broadcast_params(trainable)  # every rank starts from rank 0's weights
    if opt.qerl_master is not None:
        opt.qerl_master.copy_back()
    run_config = {**cfg.to_dict(), "reward": rewards.refs(), "policy": info, "prompts_skipped": skipped, "world_size": world,
                  "command": run_folder.command_line(), "data_sources": run_folder.data_sources(cfg)}
    logger = RunLogger(out, run_config, resume=resume is not None, **wandb_settings(cfg)) if main else _NullLogger()
    eval_kw = {**eval_settings(cfg), "seed": cfg.seed, "rewards": rewards}  # your eval files: your reward functions
    summary: dict = {"status": "partial", **{f"policy/{k}": v for k, v in info.items()}}
    summary.update({k: v for k, v in record.get("summary", {}).items() if k != "status"})  # eval_before/*, ...
    if main and start == 0 and cfg.eval_datasets and cfg.eval_before:  # evaluation: rank 0 only, the others wait
        ev = qeval.evaluate_datasets(model, tokenizer, **eval_kw)
        logger.log(qeval.summary_entries("eval", ev), step=0)
        summary.update(qeval.summary_entries("eval_before", ev))
    num_tokens = int(record.get("num_tokens", 0))
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the evaluation engine's cache and graphs: give them back to the GPU
        torch.cuda.reset_peak_memory_stats()
    peak = {"memory/peak_gib": 0.0, "memory/peak_reserved_gib": 0.0}
    gap_run = int(record.get("gap_run", 0))  # consecutive steps whose rollout-vs-training log-prob gap is above max_logprob_gap
    end = cfg.max_steps if stop_after is None else min(cfg.max_steps, stop_after)
    last_saved = start if resume is not None else None

    def save(at: int):
        nonlocal last_saved
        run_state = {"metrics_rows": qckpt.count_rows(out / "metrics.jsonl"), "num_tokens": num_tokens,
                     "gap_run": gap_run, "summary": summary}
        qckpt.save_checkpoint(out / "checkpoints" / f"step-{at}", at, model, trainable_names, opt, sched, cfg, run_state)
        last_saved = at
        if cfg.save_total_limit:
            qckpt.prune(out / "checkpoints", cfg.save_total_limit)

    bar = tqdm(range(start, end), desc=f"{cfg.method}", initial=start, total=cfg.max_steps, disable=not main)
    for step in bar:
        idx = prompts_for_step(len(train_recs), step, cfg.prompts_per_step, cfg.seed)
        m = qstep.step(cfg, model, engine, opt, sched, trainable, [train_recs[i] for i in idx], step, tokenizer=tokenizer,
                       rewards=rewards)
        num_tokens += m.pop("num_tokens_step")
        m["num_tokens"] = num_tokens
        m["memory/peak_gib"] = qdist.all_reduce(
            torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else _rss_peak_gib(), "max")
        if device.type == "cuda":  # what the caching allocator holds: what other processes on the GPU cannot use
            m["memory/peak_reserved_gib"] = qdist.all_reduce(torch.cuda.max_memory_reserved() / 2**30, "max")
        for k in peak:
            peak[k] = max(peak[k], m.get(k) or 0.0)
        if main and cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.max_steps:
            ev = qeval.evaluate_datasets(model, tokenizer, **eval_kw)
            m.update(qeval.summary_entries("eval", ev))
        logger.log(m, step=step + 1)
        gap = m.get("sampling/logprob_gap")
        gap_run = gap_run + 1 if (not cfg.aqn and gap is not None and gap > cfg.max_logprob_gap) else 0
        if cfg.max_logprob_gap_steps and gap_run >= cfg.max_logprob_gap_steps:
            msg = (f"broken rollout: mean |rollout - training| log-prob gap {gap:.3f} nats at step {step + 1}, "
                   f"above max_logprob_gap={cfg.max_logprob_gap} for {gap_run} consecutive steps (a run without "
                   "AQN should be near 0.01-0.05); check the rollout engine / 4-bit kernels, or raise "
                   "max_logprob_gap / set max_logprob_gap_steps=0 to disable the check")
            logger.finish({**summary, "status": "stopped", "error": msg, "steps": step + 1})
            raise RolloutGapError(msg)
        bar.set_postfix(reward=f"{m['reward']:.3f}", ent=f"{m['entropy']:.3f}" if m.get("entropy") else "-")
        if main and cfg.save_every and (step + 1) % cfg.save_every == 0:
            save(step + 1)
    done = end == cfg.max_steps
    if done and main:
        if last_saved != end:
            save(end)
        if cfg.eval_datasets:
            ev = qeval.evaluate_datasets(model, tokenizer, **eval_kw)
            logger.log(qeval.summary_entries("eval", ev), step=end)
            summary.update(qeval.summary_entries("eval", ev))
    if done:
        summary["status"] = "ok"
    summary["steps"] = end
    # the training steps' peak (GPU: allocated and reserved by this process; CPU: the process's RSS), over
    # the steps this invocation ran; the evaluations are outside it
    summary.update({k: v for k, v in peak.items() if v > 0})
    if device.type == "cuda" and main:  # steps and the final evaluation (the peak since the first step)
        summary["memory/peak_with_eval_gib"] = torch.cuda.max_memory_allocated() / 2**30
        summary["memory/peak_reserved_with_eval_gib"] = torch.cuda.max_memory_reserved() / 2**30
    logger.finish(summary)
    qdist.barrier()  # the others wait for rank 0's checkpoint and evaluation
    if owns_group:
        qdist.cleanup()
    return summary


class _NullLogger:
    """The RunLogger of ranks other than 0: they write nothing."""

    def log(self, metrics: dict, step: int):
        pass

    def finish(self, summary: dict):
        pass


def _rss_peak_gib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class _CallableModule(type(sys)):
    """``qerl.train(cfg, ...)`` calls ``train``: importing this module makes ``qerl.train`` the module
    (the import system sets the attribute), so the module itself forwards the call."""

    def __call__(self, *args, **kwargs):
        return train(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":  # pragma: no cover
    raise SystemExit("use: python -m qerl train ...")

