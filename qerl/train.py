"""The RL loop, top to bottom: rollout -> rewards -> advantages -> policy updates -> AQN.

One model object serves both paths. The rollout samples from it with no grad (AQN noise added to
its RMSNorm weights for the duration of the rollout only, then restored bitwise); the policy
update runs the training forward through the frozen packed base and the LoRA adapters. There is
no second copy and no weight sync. Departures from textbook GRPO, all settings:
- ``old_logp`` comes from a clean (noise-free) forward right after the rollout, as TRL does when
  num_iterations > 1; the gap between it and the sampling log-probs (noise and kernel differences)
  is logged as ``sampling/logprob_gap``.
- the KL reference (beta > 0) is the same model with adapters disabled.
- DAPO dynamic sampling drops zero-signal groups and counts them; it does not resample.

Exact resume: prompts, sampling and noise of step k are seeded by (seed, k), and the checkpoint
holds trainable weights, optimizer, scheduler and RNG states.
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from qerl import data as qdata
from qerl import evaluate as qeval
from qerl import loss as qloss
from qerl import rewards as qrewards
from qerl.config import TrainConfig
from qerl.logging import RunLogger
from qerl.noise import AQNConfig, keep_norms_fp32, noisy_norms
from qerl.qlinear import QuantLinear
from qerl.quantize import QuantizeConfig, lora_parameters, model_size_bytes, quantize_
from qerl.rollout import GenerateEngine, sequence_logprobs

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class NonFiniteError(RuntimeError):
    """A NaN/inf loss or gradient: training stops instead of corrupting the adapters."""


# ----------------------------------------------------------------------------- model
def pick_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def build_policy(cfg: TrainConfig, device=None, model=None, tokenizer=None, lora: bool = True):
    """Load the model and turn it into the method's policy. Returns (model, tokenizer, trainable, info).

    lora=False gives the untrained rows of Table 1: the base in cfg.fmt with no adapter (bf16: the
    dense model untouched).
    """
    from qerl import models

    device = device or pick_device()
    if model is None:
        model, tokenizer = models.load_model(cfg.model, dtype=DTYPES[cfg.dtype], device=device)
    info = {"method": cfg.method, "fmt": cfg.fmt}
    if cfg.method == "bf16_full" or (cfg.fmt == "bf16" and not lora):
        for p in model.parameters():
            p.requires_grad_(True)
        trainable = [p for p in model.parameters()]
    else:
        fmt = cfg.fmt
        if fmt == "nf4" and device.type == "cpu":
            print("[qerl] nf4 on CPU: using qerl's pure-torch NF4 (bitsandbytes-compatible codes) instead of "
                  "bitsandbytes kernels; same quantized weights, slower")
        rep = quantize_(model, QuantizeConfig(fmt=fmt, lora_rank=cfg.lora_rank if lora else 0, lora_alpha=cfg.lora_alpha,
                                              lora_dropout=cfg.lora_dropout, backend=cfg.backend))
        info.update(rep)
        trainable = lora_parameters(model)
    info["norms_fp32"] = keep_norms_fp32(model)  # so small AQN sigmas are not rounded away (see noise.py)
    info["model_size_bytes"] = model_size_bytes(model)
    info["trainable_params"] = sum(p.numel() for p in trainable)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = True
    return model, tokenizer, trainable, info


class adapters_disabled:
    """Context: every QuantLinear's LoRA off (the KL reference policy, no second copy)."""

    def __init__(self, model):
        self.mods = [m for m in model.modules() if isinstance(m, QuantLinear)]

    def __enter__(self):
        for m in self.mods:
            m._adapters_enabled = False

    def __exit__(self, *exc):
        for m in self.mods:
            m._adapters_enabled = True


def make_optimizer(cfg: TrainConfig, params, total_updates: int):
    from transformers import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup

    if cfg.optim == "adamw_8bit":
        if not torch.cuda.is_available():
            raise ValueError("optim=adamw_8bit needs CUDA (bitsandbytes); use optim=adamw on the CPU")
        import bitsandbytes as bnb

        opt = bnb.optim.AdamW8bit(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    else:
        opt = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    warm = int(cfg.warmup_ratio * total_updates)
    if cfg.lr_scheduler == "cosine":
        sched = get_cosine_schedule_with_warmup(opt, warm, total_updates)
    else:
        sched = get_constant_schedule_with_warmup(opt, warm)
    return opt, sched


# ----------------------------------------------------------------------------- data
def prompts_for_step(n: int, step: int, per_step: int, seed: int) -> list[int]:
    """Indices of the prompts of a step: epochs of seeded permutations, a pure function of step."""
    out = []
    for i in range(step * per_step, (step + 1) * per_step):
        epoch, pos = divmod(i, n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        out.append(int(perm[pos]))
    return out


# ----------------------------------------------------------------------------- checkpoints
def save_checkpoint(path: Path, step: int, model, trainable_names, opt, sched, cfg: TrainConfig):
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    params = dict(model.named_parameters())
    save_file({n: params[n].detach().contiguous().cpu() for n in trainable_names}, str(path / "trainable.safetensors"))
    torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "step": step,
                "rng": {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
                        "python": random.getstate()}}, path / "state.pt")
    if cfg.method != "bf16_full":
        try:
            from qerl.export import export_peft_adapter

            export_peft_adapter(model, path / "adapter", base_model_name_or_path=cfg.model)
        except Exception as e:  # the adapter is a convenience copy; trainable.safetensors is the checkpoint
            print(f"[qerl] PEFT adapter export skipped: {e}")


def load_trainable(path, model):
    """Load a checkpoint's trainable tensors (LoRA, or all weights for bf16_full) into the model."""
    from safetensors.torch import load_file

    f = Path(path) / "trainable.safetensors"
    if not f.exists():
        raise FileNotFoundError(f"{f} not found: expected a qerl checkpoint folder (checkpoints/step-N)")
    state = load_file(str(f))
    params = dict(model.named_parameters())
    missing = set(state) - set(params)
    if missing:
        raise ValueError(f"checkpoint {path} has parameters the model lacks: {sorted(missing)[:5]}")
    with torch.no_grad():
        for n, t in state.items():
            params[n].copy_(t.to(params[n].device))


def load_checkpoint(path: Path, model, opt, sched) -> int:
    load_trainable(path, model)
    st = torch.load(path / "state.pt", weights_only=False)
    opt.load_state_dict(st["optimizer"])
    sched.load_state_dict(st["scheduler"])
    torch.set_rng_state(st["rng"]["torch"])
    if st["rng"]["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["rng"]["cuda"])
    random.setstate(st["rng"]["python"])
    return int(st["step"])


def latest_checkpoint(output_dir: Path) -> Path | None:
    cks = sorted((output_dir / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    return cks[-1] if cks else None


# ----------------------------------------------------------------------------- one step
def rl_step(cfg, model, tokenizer, engine, opt, sched, trainable, prompts, step, aqn: AQNConfig, device):
    """One rollout and its policy updates; returns the step's metrics."""
    G = cfg.num_generations
    metrics: dict = {}
    t0 = time.perf_counter()
    # ---- rollout (AQN noise only while sampling; restored bitwise afterwards)
    stage, sigma = aqn.sigma_at(step, cfg.max_steps)
    prompt_ids = [p["prompt_ids"] for p in prompts for _ in range(G)]
    golds = [p["answer"] for p in prompts for _ in range(G)]
    gen = torch.Generator(device=device).manual_seed(cfg.seed * 7919 + step)
    model.eval()
    with noisy_norms(model, sigma, seed=cfg.seed * 104729 + step) as n_noisy:
        ro = engine.generate(prompt_ids, cfg.max_completion_length, temperature=cfg.temperature, top_p=cfg.top_p,
                             top_k=cfg.top_k, generator=gen)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t_roll = time.perf_counter() - t0
    metrics.update({"aqn/sigma": sigma, "aqn/stage": stage, "aqn/num_modules": n_noisy, "time/rollout_s": t_roll,
                    "throughput/rollout_tokens_per_s": ro.num_completion_tokens / max(t_roll, 1e-9)})
    cmask = ro.completion_mask
    lengths = cmask.sum(1).float()
    metrics["sampling/entropy"] = float((ro.entropy * cmask).sum() / cmask.sum().clamp(min=1))
    # ---- rewards and advantages
    texts = tokenizer.batch_decode(ro.completion_ids * cmask + engine.pad_id * (1 - cmask), skip_special_tokens=True)
    res = qrewards.score_batch(texts, golds)
    acc = torch.tensor(res.rewards, dtype=torch.float32)
    fmt_r = torch.tensor(res.format, dtype=torch.float32)
    rewards = acc + cfg.format_reward_weight * fmt_r
    adv, stats = qloss.compute_advantages(rewards, G, cfg.scale_rewards)
    metrics.update(stats)
    metrics.update({"rewards/accuracy/mean": float(acc.mean()), "rewards/format/mean": float(fmt_r.mean()),
                    "rewards/unparsed": res.unparsed})
    trunc = ro.truncated.cpu()
    term = lengths[~trunc.to(lengths.device)]
    metrics.update({"completions/mean_length": float(lengths.mean()), "completions/min_length": float(lengths.min()),
                    "completions/max_length": float(lengths.max()), "completions/clipped_ratio": float(trunc.float().mean()),
                    "completions/mean_terminated_length": float(term.mean()) if term.numel() else None})
    keep = torch.ones(len(texts), dtype=torch.bool)
    if cfg.dynamic_sampling:
        keep = qloss.dynamic_sampling_filter(rewards, G).repeat_interleave(G)
        metrics["dynamic_sampling/kept_groups"] = int(keep.sum()) // G
    if cfg.mask_truncated_completions:
        cmask = cmask * (~ro.truncated).long()[:, None]
    idx = torch.nonzero(keep).squeeze(1)
    adv = adv.to(device)
    # ---- log-probs of the sampled sequences under the clean policy (old) and reference (beta)
    t1 = time.perf_counter()
    mb = cfg.micro_batch_size
    old_lp = torch.zeros_like(ro.logprobs)
    ref_lp = torch.zeros_like(ro.logprobs) if cfg.beta > 0 else None
    with torch.no_grad():
        for s in range(0, len(texts), mb):
            sl = slice(s, s + mb)
            lp, _ = sequence_logprobs(model, ro.prompt_ids[sl], ro.prompt_mask[sl], ro.completion_ids[sl],
                                      ro.completion_mask[sl], cfg.temperature)
            old_lp[sl] = lp
            if ref_lp is not None:
                with adapters_disabled(model):
                    ref_lp[sl], _ = sequence_logprobs(model, ro.prompt_ids[sl], ro.prompt_mask[sl], ro.completion_ids[sl],
                                                      ro.completion_mask[sl], cfg.temperature)
    m = ro.completion_mask.float()
    gap = (old_lp - ro.logprobs).abs() * m
    metrics["sampling/logprob_gap"] = float(gap.sum() / m.sum().clamp(min=1))
    metrics["sampling/logprob_gap_max"] = float(gap.max()) if m.sum() > 0 else None
    # ---- policy updates
    model.train()
    n = idx.numel()
    mini = cfg.mini_batch_size or n
    acc_metrics: dict[str, list] = {}
    losses, grad_norms = [], []
    for it in range(cfg.num_iterations):
        order = idx[torch.randperm(n, generator=torch.Generator().manual_seed(cfg.seed + 31 * step + it))] if n else idx
        for ms in range(0, n, mini):
            mini_idx = order[ms:ms + mini]
            micro = [mini_idx[i:i + mb] for i in range(0, mini_idx.numel(), mb)]
            n_tokens = int(cmask[mini_idx.to(cmask.device)].sum())
            opt.zero_grad(set_to_none=True)
            for mi in micro:
                mi_d = mi.to(device)
                lp, ent = sequence_logprobs(model, ro.prompt_ids[mi_d], ro.prompt_mask[mi_d], ro.completion_ids[mi_d],
                                            ro.completion_mask[mi_d], cfg.temperature, with_entropy=True)
                mask = cmask[mi_d]
                loss, lm = qloss.policy_loss(lp, old_lp[mi_d], adv[mi_d], mask, cfg.loss_type, epsilon=cfg.epsilon,
                                             epsilon_high=cfg.epsilon_high, beta=cfg.beta,
                                             ref_logp=ref_lp[mi_d] if ref_lp is not None else None,
                                             num_items_in_batch=n_tokens, max_completion_length=cfg.max_completion_length,
                                             gradient_accumulation_steps=len(micro))
                if not torch.isfinite(loss):
                    raise NonFiniteError(f"non-finite loss ({loss.item()}) at step {step}, iteration {it}: stopping. "
                                         "Lower the learning rate, check the data, or resume from the last checkpoint.")
                loss.backward()
                losses.append(loss.item() * len(micro))
                fm = mask.float()
                lm["entropy"] = float((ent * fm).sum() / fm.sum().clamp(min=1))
                for k, v in lm.items():
                    acc_metrics.setdefault(k, []).append(v)
            gn = torch.nn.utils.clip_grad_norm_(trainable, cfg.max_grad_norm)
            if not torch.isfinite(gn):
                raise NonFiniteError(f"non-finite gradient norm at step {step}: stopping before the update")
            grad_norms.append(float(gn))
            opt.step()
            sched.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    metrics["time/train_s"] = time.perf_counter() - t1
    for k, v in acc_metrics.items():
        metrics[k] = sum(v) / len(v) if v else None
    metrics.setdefault("kl", None)
    metrics["loss"] = sum(losses) / len(losses) if losses else None
    metrics["grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else None
    metrics["learning_rate"] = sched.get_last_lr()[0]
    metrics["num_tokens_step"] = int((ro.prompt_mask.sum() + ro.completion_mask.sum()).item())
    metrics["step_time"] = time.perf_counter() - t0
    return metrics


# ----------------------------------------------------------------------------- the loop
def train(cfg: TrainConfig, model=None, tokenizer=None, stop_after: int | None = None) -> dict:
    """Run RL training as configured; writes cfg.output_dir. ``stop_after`` ends early (tests of resume)."""
    out = Path(cfg.output_dir)
    device = pick_device()
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    model, tokenizer, trainable, info = build_policy(cfg, device, model, tokenizer)
    trainable_names = [n for n, p in model.named_parameters() if p.requires_grad]
    train_recs = qdata.load_dataset_split(cfg.dataset, "train", data_dir=cfg.data_dir, seed=cfg.seed,
                                          **({"levels": cfg.arith_levels} if cfg.dataset == "arith" else {}))
    train_recs, skipped = qdata.tokenize_prompts(train_recs, tokenizer, cfg.max_prompt_length)
    engine = GenerateEngine(model, tokenizer)
    n_per_rollout = cfg.rollout_batch_size
    updates_per_step = cfg.num_iterations * math.ceil(n_per_rollout / (cfg.mini_batch_size or n_per_rollout))
    opt, sched = make_optimizer(cfg, trainable, cfg.max_steps * updates_per_step)
    aqn = AQNConfig(enabled=cfg.aqn, sigma_start=cfg.sigma_start, sigma_end=cfg.sigma_end, num_stages=cfg.num_stages,
                    schedule=cfg.noise_schedule, seed=cfg.seed)
    start = 0
    resume = None
    if cfg.resume_from:
        resume = latest_checkpoint(out) if cfg.resume_from == "auto" else Path(cfg.resume_from)
        if cfg.resume_from != "auto" and (resume is None or not resume.exists()):
            raise FileNotFoundError(f"resume_from={cfg.resume_from}: no such checkpoint")
        if resume is not None:
            start = load_checkpoint(resume, model, opt, sched)
            print(f"[qerl] resumed from {resume} at step {start}")
    logger = RunLogger(out, {**cfg.to_dict(), "policy": info, "prompts_skipped": skipped}, cfg.wandb_mode,
                       cfg.wandb_project, cfg.wandb_group, resume=resume is not None)
    eval_kw = dict(samples=cfg.eval_samples, temperature=cfg.eval_temperature, top_p=cfg.eval_top_p,
                   greedy=cfg.eval_greedy, max_new_tokens=cfg.eval_max_completion_length or cfg.max_completion_length,
                   batch_size=max(cfg.micro_batch_size, 8), limit=cfg.eval_limit, data_dir=cfg.data_dir, seed=cfg.seed,
                   arith_levels=cfg.arith_levels, max_prompt_length=cfg.max_prompt_length)
    summary: dict = {"status": "partial", **{f"policy/{k}": v for k, v in info.items()}}
    if start == 0 and cfg.eval_datasets:
        ev = qeval.evaluate_datasets(model, tokenizer, cfg.eval_datasets, **eval_kw)
        logger.log({f"eval/{d}/accuracy": r["accuracy"] for d, r in ev.items()}, step=0)
        summary.update({f"eval_before/{d}/accuracy": r["accuracy"] for d, r in ev.items()})
    num_tokens = 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    end = cfg.max_steps if stop_after is None else min(cfg.max_steps, stop_after)
    bar = tqdm(range(start, end), desc=f"{cfg.method}", initial=start, total=cfg.max_steps)
    for step in bar:
        idx = prompts_for_step(len(train_recs), step, cfg.prompts_per_step, cfg.seed)
        m = rl_step(cfg, model, tokenizer, engine, opt, sched, trainable, [train_recs[i] for i in idx], step, aqn, device)
        num_tokens += m.pop("num_tokens_step")
        m["num_tokens"] = num_tokens
        m["memory/peak_gib"] = (torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else _rss_peak_gib())
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.max_steps:
            ev = qeval.evaluate_datasets(model, tokenizer, cfg.eval_datasets, **eval_kw)
            m.update({f"eval/{d}/accuracy": r["accuracy"] for d, r in ev.items()})
        logger.log(m, step=step + 1)
        bar.set_postfix(reward=f"{m['reward']:.3f}", ent=f"{m['entropy']:.3f}" if m.get("entropy") else "-")
        if cfg.save_every and (step + 1) % cfg.save_every == 0:
            save_checkpoint(out / "checkpoints" / f"step-{step + 1}", step + 1, model, trainable_names, opt, sched, cfg)
    done = end == cfg.max_steps
    if done:
        save_checkpoint(out / "checkpoints" / f"step-{end}", end, model, trainable_names, opt, sched, cfg)
        if cfg.eval_datasets:
            ev = qeval.evaluate_datasets(model, tokenizer, cfg.eval_datasets, **eval_kw)
            logger.log({f"eval/{d}/accuracy": r["accuracy"] for d, r in ev.items()}, step=end)
            summary.update({f"eval/{d}/accuracy": r["accuracy"] for d, r in ev.items()})
            summary.update({f"eval/{d}/format": r["format"] for d, r in ev.items()})
        summary["status"] = "ok"
    summary["steps"] = end
    logger.finish(summary)
    return summary


def _rss_peak_gib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit("use: python -m qerl train ...")

