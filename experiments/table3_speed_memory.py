"""Table 3 (speed and memory; issue #6): the wall time of one full GRPO step (rollout, log-prob
computation, policy update) and peak GPU memory for bf16 LoRA, QLoRA (bitsandbytes NF4) and qerl
NVFP4 (MXFP4 optional) on the Qwen2.5-7B/14B/32B architectures with random weights, batch 2/4/8,
prompt 256, completion 2048 at fixed length, with and without gradient checkpointing; model
sizes; the rollout share of the step. Also the paper's headline: the 32B model on one 80 GB GPU
(`--memory-cap-gib 80` caps this process with torch.cuda.set_per_process_memory_fraction on a
larger GPU), NVFP4 at batch 2 and 8, and bf16 LoRA under the same cap (an OOM is caught, reported
with the phase it happened in, and the run goes on).

One step is the trainer's own phases (``qerl.step.rollout``, ``logprobs``, ``update``, run by
``grpo_step`` in the trainer's order) with the trainer's optimizer (qerl.policy.make_optimizer:
AdamW-8bit on CUDA, the paper's Table 4), minus rewards: random weights give meaningless text, so
the advantages are random normal (``qerl.step.Batch.given``); the timing is what matters. The
row's TrainConfig (``bench_config``): GRPO, one pass, one optimizer step over the batch. The
phases, as ``grpo_step`` times them:
  rollout  one group: a random prompt sampled B times, C tokens, T=1.0, ignore_eos=True: the fast
           engine (static KV cache, CUDA graphs) on the training model's own weights
  logprob  qerl.step.logprobs: old log-probs from a no-grad forward in micro-batches
           (``--old-logprobs reuse``: none, the update's forward gives them, as the trainer does
           with one optimizer step per rollout)
  update   qerl.step.update: per micro-batch the training forward (chunked fp32 log-probs),
           policy_loss, backward; clip_grad_norm_; one optimizer step
``train_s`` = logprob + update (the summary's train_nvfp4_over_bf16 keys).
The GPU is synchronized between phases. Before the timed step, a warm-up captures the engine's CUDA
graphs with short calls and runs the training phases on every micro-batch width the timed step will
train on (fixed lengths: one micro-batch at full length; ``--lengths``: the whole batch with the drawn
lengths), so the timed step measures steady state: the 4-bit path's first step at new widths cost ~5 s
more at 7B (results/table3/NOTES.md), a cost a training run pays once a width. ``--steps N`` times N
steps and reports each phase's median (and every step's seconds under ``steps``).

Writes <out>/<gpu>.json with gpu, git_sha, date, env, rows (one per model x method x batch x
gradient checkpointing; oom/oom_phase/error when it failed), the paper's values as a labelled
reference, and `summary` with exactly the keys of issue #6; prints a table; the last stdout line
is the summary as one JSON object. notebooks/table3.ipynb plots where the step time goes.

Run (GPU; expected minutes on an H100 in brackets; must-have rows first):
  python -m experiments.table3_speed_memory --models qwen2.5-7b qwen2.5-14b --batch 8 \\
      --methods nvfp4 bf16 nf4                                                                 [~10]
  python -m experiments.table3_speed_memory --row qwen2.5-7b/bs64/c512/mb8 --methods nvfp4 bf16 \\
      --out results/table3/bs64                                                                 [~4]
  python -m experiments.table3_speed_memory --models qwen2.5-32b --methods nvfp4 bf16 \\
      --batch 2 8 --memory-cap-gib 80 --out results/table3/32b                                  [~6]
  python -m experiments.table3_speed_memory --models qwen2.5-7b --batch 2 4 8 --grad-ckpt on off \\
      --completion 512                                                                         (optional)
  python -m experiments.table3_speed_memory --merge a/h100.json b/h100.json --out results/table3   (CPU)
A row can also be given as ``--row MODEL/bsB[/cC][/mbM][/gcon|gcsel|gcoff]`` (repeatable), e.g. the RL
batch row above: 64 completions of 512 tokens, micro-batch 8 (the paper's Table 4).

``--lengths mix`` (benchmarks/speed_common.py: a clipped log-normal, median cap / 4, 95th percentile at
the cap, the cap being the row's completion length) draws each row's completion lengths once (seeded by
--seed, the same for every method) and the rollout forces sequence i to end at lengths[i]
(``qerl.step.rollout(..., lengths=...)``, EOS ignored): the rollout's finished sequences leave the batch
(the engine's default) and the training phases see the real mix, as in training (each micro-batch cut
to its own longest completion, ``qerl.step``). The row adds ``length_stats`` (median, p95,
mean, max, total, fraction at the cap), ``decode_steps`` and ``bucket_steps`` (the rollout's decode
steps at each batch size), and its ``rollout_tokens_per_s`` counts the drawn lengths. The same command
with ``--models qwen2.5-7b --batch 64`` in place of ``--row`` runs micro-batch 1 (``--micro-batch``).
Summary:
``qwen2.5-7b/bs64_mix/e2e_nvfp4_over_bf16`` (bf16 step_s / NVFP4 step_s, the same drawn lengths):
  python -m experiments.table3_speed_memory --row qwen2.5-7b/bs64/c2048/mb8 --methods nvfp4 bf16 \\
      --lengths mix --out results/table3/bs64_mix                                              [~5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks import speed_common as sc
from experiments import _common as C
from qerl import kernels as qkernels
from qerl import perf as qperf
from qerl import recompute
from qerl import step as qstep
from qerl.config import QERL_FORMAT, QLORA_FORMAT, TrainConfig, method_name, parse_method, table_bases
from qerl.packing import plan_forwards
from qerl.policy import make_optimizer, optimizer_params
from qerl.quantize import lora_parameters
from qerl.rollout import RolloutOutput

# What this artefact writes (results/<out>/artefact.json, read by qerl.plots and notebooks/table3.ipynb)
ARTEFACT = C.Artefact("table3", "experiments.table3_speed_memory", C.Outputs(
    figure="plot_table3_split", figure_file="table3_step_split.png", notebook="notebooks/table3.ipynb",
    columns=("gpu", "model", "method", "batch", "grad_ckpt", "completion_len", "step_s", "rollout_s", "logprob_s",
             "update_s", "rollout_share", "peak_gib", "model_size_gb", "paper_model_size_gb", "paper_s_per_step",
             "memory_cap_gib", "oom", "oom_phase")))

METHODS = table_bases()  # bf16 and every registered format
SUMMARY_KEYS = (
    "qwen2.5-14b/bs8/e2e_nvfp4_over_bf16",
    "qwen2.5-7b/bs8/e2e_nvfp4_over_bf16",
    "qwen2.5-14b/bs8/e2e_nvfp4_over_nf4",
    "qwen2.5-32b/bs2/peak_gib",
    "qwen2.5-32b/bs8/peak_gib",
    "qwen2.5-32b/bs2/s_per_step",
    "qwen2.5-32b/bs8/s_per_step",
    "qwen2.5-32b/memory_cap_gib",
    "qwen2.5-32b/bf16_lora_oom",
    "qwen2.5-7b/bs8/train_nvfp4_over_bf16",
    "qwen2.5-14b/bs8/train_nvfp4_over_bf16",
    "qwen2.5-7b/bs64/e2e_nvfp4_over_bf16",
    "qwen2.5-7b/bs64_mix/e2e_nvfp4_over_bf16",
    "qwen2.5-7b/bs64_mix/step_s/nvfp4",
    "qwen2.5-7b/bs64_mix/step_s/bf16",
    "qwen2.5-7b/bs64_mix/train_mfu/nvfp4",
    "qwen2.5-7b/bs64_mix/train_mfu/bf16",
    "qwen2.5-7b/bs64_mix/peak_gib/nvfp4",
    "qwen2.5-7b/bs64_mix/peak_gib/bf16",
    "qwen2.5-7b/bs8/step_s/nvfp4",
    "qwen2.5-7b/bs8/step_s/bf16",
)
TARGETS = {
    "qwen2.5-14b/bs8/e2e_nvfp4_over_bf16": ">= 1.7",
    "qwen2.5-7b/bs8/e2e_nvfp4_over_bf16": ">= 1.5 (paper x1.2 to x1.5)",
    "qwen2.5-14b/bs8/e2e_nvfp4_over_nf4": ">= 2.0",
    "qwen2.5-32b/bs2/peak_gib": "<= 70",
    "qwen2.5-32b/bs8/peak_gib": "<= 70",
    "qwen2.5-32b/bs2/s_per_step": "measured (completion length in summary_notes)",
    "qwen2.5-32b/bs8/s_per_step": "measured (completion length in summary_notes)",
    "qwen2.5-32b/memory_cap_gib": "80",
    "qwen2.5-32b/bf16_lora_oom": "true",
    "qwen2.5-7b/bs8/train_nvfp4_over_bf16": ">= 0.9 (issue #18: old log-probs + update)",
    "qwen2.5-14b/bs8/train_nvfp4_over_bf16": ">= 0.9 (issue #18: old log-probs + update)",
    "qwen2.5-7b/bs64/e2e_nvfp4_over_bf16": "measured (an RL batch: 64 x 512 tokens, micro-batch 8)",
    "qwen2.5-7b/bs64_mix/e2e_nvfp4_over_bf16": ">= 1.3 (issues 36, 49: 64 sequences, the mix lengths at cap 2048)",
    "qwen2.5-7b/bs64_mix/step_s/nvfp4": "<= 20 (issue 49; 34.0 at e723ba9, H200)",
    "qwen2.5-7b/bs64_mix/step_s/bf16": "measured (37.5 at e723ba9, H200)",
    "qwen2.5-7b/bs64_mix/train_mfu/nvfp4": ">= 0.40 (issue 49: old log-probs + update, model FLOPs on real tokens)",
    "qwen2.5-7b/bs64_mix/train_mfu/bf16": ">= 0.40 (issue 49)",
    "qwen2.5-7b/bs64_mix/peak_gib/nvfp4": "<= 30.5 (issue 49: e723ba9, H200)",
    "qwen2.5-7b/bs64_mix/peak_gib/bf16": "<= 36.0 (issue 49: e723ba9, H200)",
    "qwen2.5-7b/bs8/step_s/nvfp4": "<= 12.07 (issue 49: e723ba9, H200)",
    "qwen2.5-7b/bs8/step_s/bf16": "measured (16.81 at e723ba9, H200)",
}
# The paper's values (one H100 80GB, vLLM rollouts, its own training stack), as listed in
# docs/design.md: a labelled reference only.
PAPER = {
    "model_size_gb": {"qwen2.5-7b/bf16": 15.2, "qwen2.5-7b/nvfp4": 5.9, "qwen2.5-14b/bf16": 29.6,
                      "qwen2.5-14b/nvfp4": 10.6, "qwen2.5-32b/bf16": 62.3, "qwen2.5-32b/nvfp4": 20.7},
    "s_per_step": {"qwen2.5-32b/nvfp4/bs2": 10.6, "qwen2.5-32b/nvfp4/bs8": 12.2},
    "e2e_speedup_over_bf16": {QERL_FORMAT: "x1.2 to x1.5", QLORA_FORMAT: "x0.7 to x0.8"},
    "source": "QeRL paper Table 3 (H100 80GB, gradient checkpointing), as listed in docs/design.md; reference only",
}


# ----------------------------------------------------------------------------------------------
# one GRPO step: the trainer's own phases (qerl.step) and optimizer (qerl.policy.make_optimizer)


def bench_config(method: str, args, batch: int, micro_batch: int, completion: int, device,
                 recompute_mode: str = "full") -> TrainConfig:
    """The TrainConfig of a row: one rollout of ``batch`` completions, one pass, one optimizer step
    (AdamW-8bit on CUDA as the paper's Table 4, torch AdamW on the CPU), GRPO, no KL; training forwards
    padding-free by ``--token-budget`` (``--padding-free off``: padded micro-batches)."""
    return TrainConfig(**parse_method(method_name(method)), lora_rank=args.lora_rank, lora_alpha=2.0 * args.lora_rank,
                       num_generations=batch, prompts_per_step=1, max_completion_length=completion,
                       max_prompt_length=args.prompt, micro_batch_size=micro_batch, num_iterations=1,
                       mini_batch_size=0, learning_rate=args.learning_rate, warmup_ratio=0.0, lr_scheduler="constant",
                       optim="adamw_8bit" if torch.device(device).type == "cuda" else "adamw", loss_type="grpo",
                       epsilon=0.2, epsilon_high=0.28, beta=0.0, temperature=1.0, top_p=1.0, top_k=0,
                       seed=args.seed, wandb_mode="disabled", padding_free=args.padding_free == "on",
                       forward_token_budget=args.token_budget, gradient_checkpointing=recompute_mode)


def synthetic_rollout(batch: int, prompt_len: int, completion_len: int, vocab: int, device, seed: int = 0,
                      lengths: list[int] | None = None) -> RolloutOutput:
    """A RolloutOutput of random tokens (for warming up the training phases without generating);
    ``lengths``: sequence i's completion ends after lengths[i] tokens (its mask), as the timed rollout's."""
    ids = torch.tensor(sc.random_prompts(batch, prompt_len + completion_len, vocab, seed), device=device)
    ones = torch.ones_like(ids)
    cmask = ones[:, prompt_len:]
    if lengths is not None:
        if len(lengths) != batch or max(lengths) > completion_len:
            raise ValueError(f"{len(lengths)} lengths up to {max(lengths)} for {batch} sequences of {completion_len}")
        cmask = (torch.arange(completion_len, device=device)[None, :]
                 < torch.tensor(lengths, device=device)[:, None]).to(ones.dtype)
    z = torch.zeros((batch, completion_len), dtype=torch.float32, device=device)
    return RolloutOutput(ids[:, :prompt_len], ones[:, :prompt_len], ids[:, prompt_len:], cmask, z, z.clone(),
                         torch.ones(batch, dtype=torch.bool, device=device))


def grpo_step(cfg, model, engine, opt, sched, prompt_ids: list | None, advantages: torch.Tensor, reuse: bool,
              timer, ro: RolloutOutput | None = None, lengths: list[int] | None = None) -> dict:
    """One GRPO step of the trainer's phases on one process, with given ``advantages`` in place of
    rewards: ``qerl.step.rollout`` of ``prompt_ids`` at exactly ``cfg.max_completion_length`` tokens, or
    sequence i at exactly ``lengths[i]`` (skipped when ``ro`` is given), ``qerl.step.logprobs`` (``reuse``: none, the update's forward
    gives them) and ``qerl.step.update``, each timed by ``timer`` as "rollout", "logprob", "update".
    Returns the update's metrics and ``num_tokens_step`` (prompt + completion tokens)."""
    if ro is None:
        sigma = cfg.aqn_config().sigma_at(0, cfg.max_steps)[1]
        with timer("rollout"):
            ro, _ = qstep.rollout(cfg, engine, model, prompt_ids, 0, sigma, ignore_eos=True, lengths=lengths)
    n = ro.completion_ids.size(0)
    batch = qstep.Batch.given(ro, advantages, [n], 0)
    with timer("logprob"):
        old_lp, ref_lp = qstep.logprobs(cfg, model, ro, reuse)
    with timer("update"):
        m = qstep.update(cfg, model, ro, batch, old_lp, ref_lp, opt, sched, optimizer_params(opt), 0, reuse)
    m["num_tokens_step"] = int(ro.prompt_mask.sum()) + ro.num_completion_tokens
    return m


def computed_tokens(cfg, prompt_len: int, lengths: list[int]) -> int:
    """Token positions the training forwards compute for rows of ``lengths`` completion tokens (prompts
    all real): padding-free, the real tokens (packed up to a multiple of qerl.packing.PACK_ALIGN per
    forward); padded, each micro-batch of ``micro_batch_size`` rows at prompt + its width (qerl.step)."""
    from qerl.packing import PACK_ALIGN

    tok = [prompt_len + n for n in lengths]
    if cfg.padding_free:
        plan = plan_forwards(tok, cfg.token_budget)
        return sum(-(-sum(tok[i] for i in f) // PACK_ALIGN) * PACK_ALIGN for f in plan)
    mb, C = cfg.micro_batch_size, max(lengths)
    return sum(len(ch) * (prompt_len + min(C, -(-max(ch) // qstep.WIDTH_ROUND) * qstep.WIDTH_ROUND))
               for ch in (lengths[i:i + mb] for i in range(0, len(lengths), mb)))


def train_perf(model, cfg, prompt_len: int, lengths: list[int], reuse: bool, grad_ckpt: bool, train_s: float) -> dict:
    """Tokens, model FLOPs, TFLOP/s and MFU of the training phases (old log-probs + update; qerl.perf):
    ``train_mfu`` counts the model's FLOPs on real tokens, ``train_hfu`` adds the recomputation."""
    counter = qperf.FlopCounter(model)
    rows = [prompt_len + n for n in lengths]
    fwd, bwd = counter.forward(rows, sum(lengths)), counter.backward(rows, sum(lengths))
    flops = (0 if reuse else fwd) + fwd + bwd
    hw = flops + (fwd if grad_ckpt else 0.0)
    peak = qperf.peak_tflops()
    return dict(real_tokens=sum(rows), computed_tokens=computed_tokens(cfg, prompt_len, lengths),
                train_flops=flops, train_tflops=flops / train_s / 1e12, peak_tflops=peak,
                train_mfu=qperf.mfu(flops, train_s, peak), train_hfu=qperf.mfu(hw, train_s, peak))


def warm_up(cfg, model, engine, opt, sched, prompt_len: int, vocab: int, reuse: bool,
            lengths: list[int] | None = None) -> float:
    """Engine graphs (short calls; every batch bucket when ``lengths``, the timed rollout's caps,
    differ) + the step's training phases: on one micro-batch as wide as the timed rollout's, or, with
    ``lengths``, on the whole batch with those completion lengths, so that every micro-batch width the
    timed step trains on has run once. (A width's first forward and backward cost the 4-bit path several
    seconds more in all at 7B, and bf16 LoRA nothing: results/table3/NOTES.md; a training run meets each
    width once, then steps repeat them.)"""
    t0 = time.perf_counter()
    sc.warm_up_engine(engine, cfg.num_generations, prompt_len, cfg.max_completion_length, vocab, lengths)
    device = model.get_input_embeddings().weight.device
    if lengths:
        n, width = len(lengths), max(lengths)  # the timed step's micro-batches and widths (qerl.step._width)
    else:
        n, width = cfg.micro_batch_size, cfg.max_completion_length  # the timed step's widest training forward
    ro = synthetic_rollout(n, prompt_len, width, vocab, device, seed=1, lengths=lengths)
    grpo_step(cfg, model, engine, opt, sched, None, torch.randn(n), reuse, sc.PhaseTimer(), ro=ro)
    opt.zero_grad(set_to_none=True)
    model.eval()
    sc.sync()
    return time.perf_counter() - t0


def set_grad_ckpt(model, mode) -> None:
    """Activation recomputation off / selective / full (a bool: full or off), as the trainer sets it."""
    recompute.enable(model, mode)


@dataclass(frozen=True)
class RowSpec:
    """One measured configuration of a model (each method runs it): ``--row MODEL/bsB[/cC][/mbM][/gc(on|sel|off)]``."""

    model: str
    batch: int
    completion: int
    micro_batch: int
    grad_ckpt: bool = True
    recompute: str = "full"  # off | selective | full (gcoff / gcsel / gcon)

    @classmethod
    def parse(cls, text: str, args) -> RowSpec:
        model, *parts = text.split("/")
        if model not in sc.MODELS:
            raise ValueError(f"--row {text!r}: unknown model {model!r}; expected one of {list(sc.MODELS)}")
        kw = dict(batch=None, completion=args.completion, micro_batch=args.micro_batch, grad_ckpt=True, recompute="full")
        for part in parts:
            key = next((k for k in ("bs", "mb", "c", "gc") if part.startswith(k)), None)
            val = part[len(key):] if key else ""
            if key == "gc" and val in ("on", "off", "sel"):
                kw["grad_ckpt"] = val != "off"
                kw["recompute"] = {"on": "full", "off": "off", "sel": "selective"}[val]
            elif key in ("bs", "mb", "c") and val.isdigit() and int(val) > 0:
                kw[{"bs": "batch", "mb": "micro_batch", "c": "completion"}[key]] = int(val)
            else:
                raise ValueError(f"--row {text!r}: bad part {part!r} (expected bsN, cN, mbN, gcon, gcsel or gcoff)")
        if kw["batch"] is None:
            raise ValueError(f"--row {text!r}: the batch (bsN) is required")
        return cls(model, **kw)


def row_specs(args) -> list[RowSpec]:
    """--row specs, else every model x --batch x --grad-ckpt at --completion / --micro-batch."""
    if args.row:
        return [RowSpec.parse(r, args) for r in args.row]
    modes = {"on": "full", "off": "off", "selective": "selective"}
    return [RowSpec(m, b, args.completion, args.micro_batch, g != "off", modes[g]) for m in args.models
            for b in args.batch for g in args.grad_ckpt]


def measure(model, spec: RowSpec, method: str, args, vocab: int, opt, sched, extra: dict) -> dict:
    """One row: warm-up and a timed step; an OOM (or other failure) is recorded with its phase."""
    cfg0 = bench_config(method, args, spec.batch, spec.micro_batch, spec.completion, args.device, spec.recompute)
    reuse = (args.old_logprobs == "reuse" or
             (args.old_logprobs == "trainer" and qstep.reuse_training_logprobs(cfg0, spec.batch)))
    row = dict(model=spec.model, method=method, batch=spec.batch, grad_ckpt=spec.grad_ckpt, micro_batch=spec.micro_batch,
               prompt_len=args.prompt, completion_len=spec.completion, old_logprobs="reuse" if reuse else "forward",
               recompute=spec.recompute, padding_free=cfg0.padding_free, token_budget=cfg0.token_budget if cfg0.padding_free else None,
               optimizer=type(opt).__name__, oom=False, lengths=args.lengths, **extra)
    # the completion lengths: every sequence at the cap, or a mix drawn once (the same for every method)
    lengths = sc.draw_lengths(args.lengths, spec.batch, spec.completion, seed=args.seed)
    caps = None if args.lengths == "fixed" else lengths  # per-sequence caps of the rollout (None: all at the cap)
    if caps:
        row["length_stats"] = sc.length_summary(lengths, spec.completion)
    ph = sc.PhaseTimer()
    engine = None
    try:
        cfg = cfg0
        set_grad_ckpt(model, spec.recompute)
        with ph("engine"):
            engine = sc.make_fast_engine(model, spec.batch, args.prompt + spec.completion)
        with ph("warmup"):
            warm_up(cfg, model, engine, opt, sched, args.prompt, vocab, reuse, caps)
        sc.reset_peak()
        steps = []  # one dict of phase seconds per timed step; the row reports the medians
        prompts = [sc.random_prompts(1, args.prompt, vocab, cfg.seed)[0]]  # one group: a prompt sampled B times
        n0 = sc.captures(engine)  # the warm-up captured every graph the timed rollouts replay
        for _ in range(args.steps):
            ph = sc.PhaseTimer()  # the step's phases; an OOM reports the one it happened in
            adv = torch.randn(spec.batch, generator=torch.Generator().manual_seed(cfg.seed))
            t0 = time.perf_counter()
            m = grpo_step(cfg, model, engine, opt, sched, prompts * spec.batch, adv, reuse, ph, lengths=caps)
            steps.append(dict(ph.seconds, step=time.perf_counter() - t0))
            opt.zero_grad(set_to_none=True)
            model.eval()
            tokens = m["num_tokens_step"] - spec.batch * args.prompt
            if tokens != sum(lengths):
                raise RuntimeError(f"rollout returned {tokens} completion tokens, expected {sum(lengths)} "
                                   f"({spec.batch} sequences, lengths {args.lengths})")
            st = getattr(engine, "last_stats", None) or {}
            info = {"loss": m["loss"], "completion_tokens": tokens, "decode_steps": st.get("decode_steps"),
                    "bucket_steps": {str(k): v for k, v in (st.get("bucket_steps") or {}).items()}}
        med = {k: statistics.median(st[k] for st in steps) for k in steps[0]}
        train_s = statistics.median(st["logprob"] + st["update"] for st in steps)
        row.update(train_perf(model, cfg, args.prompt, lengths, reuse, spec.grad_ckpt, train_s))
        row.update(rollout_s=med["rollout"], logprob_s=med["logprob"], update_s=med["update"],
                   train_s=train_s, step_s=med["step"],
                   rollout_share=med["rollout"] / med["step"], peak_gib=sc.peak_gib(),
                   rollout_tokens_per_s=sum(lengths) / med["rollout"],
                   scratch_gib=qkernels.scratch_bytes() / 2**30, timed_steps=len(steps),  # decode scratch (in peak)
                   captures_during_timing=sc.captures(engine) - n0,
                   **({"steps": steps} if len(steps) > 1 else {}), **info)
    except Exception as e:  # noqa: BLE001 - a row must never take the run down
        row["oom"] = sc.is_oom(e)
        row["oom_phase" if row["oom"] else "failed_phase"] = ph.current
        row["error"] = f"{type(e).__name__}: {str(e)[:500]}"
        if not row["oom"]:
            traceback.print_exc()
        print(f"  {'OOM' if row['oom'] else 'FAILED'} in phase {ph.current}: {row['error'][:200]}")
    finally:
        del engine
        opt.zero_grad(set_to_none=True)
        model.eval()
        sc.free()
    return row


# ----------------------------------------------------------------------------------------------
# summary


def _row(rows, model, method, batch, grad_ckpt=True, lengths="fixed"):
    hits = [r for r in rows if r.get("model") == model and r.get("method") == method and r.get("batch") == batch
            and r.get("grad_ckpt") == grad_ckpt and r.get("lengths", "fixed") == lengths and r.get("step_s")]
    return max(hits, key=lambda r: r["completion_len"]) if hits else None


def _train_s(r: dict) -> float:
    """Old log-probs + update (rows written before train_s existed have the two phases)."""
    return r.get("train_s") or r["logprob_s"] + r["update_s"]


def _same_setup(a: dict, b: dict) -> bool:
    """Comparable rows: same lengths and micro-batch, same old-log-prob mode, measured at the same commit."""
    return all(a.get(k) == b.get(k) for k in ("completion_len", "micro_batch", "prompt_len", "git_sha", "length_stats",
                                              "padding_free", "token_budget")) and \
        a.get("old_logprobs", "forward") == b.get("old_logprobs", "forward")


def summarize(rows: list[dict]) -> tuple[dict, dict]:
    """(summary with exactly SUMMARY_KEYS, notes on which rows each value came from)."""
    s, notes = {}, {}

    def ratio(key, model, num, den, batch=8, what="step_s", lengths="fixed"):
        a, b = _row(rows, model, num, batch, lengths=lengths), _row(rows, model, den, batch, lengths=lengths)
        if a and b and not _same_setup(a, b):
            a = b = None
        time_of = _train_s if what == "train_s" else (lambda r: r["step_s"])
        s[key] = time_of(b) / time_of(a) if a and b else None
        notes[key] = (f"{den} {what} / {num} {what}, bs{batch}, grad ckpt on, C={a['completion_len']} ({lengths}), "
                      f"micro-batch {a['micro_batch']}, old log-probs {a.get('old_logprobs', 'forward')}"
                      if a and b else None)

    ratio("qwen2.5-14b/bs8/e2e_nvfp4_over_bf16", "qwen2.5-14b", "nvfp4", "bf16")
    ratio("qwen2.5-7b/bs8/e2e_nvfp4_over_bf16", "qwen2.5-7b", "nvfp4", "bf16")
    ratio("qwen2.5-14b/bs8/e2e_nvfp4_over_nf4", "qwen2.5-14b", "nvfp4", "nf4")
    ratio("qwen2.5-7b/bs8/train_nvfp4_over_bf16", "qwen2.5-7b", "nvfp4", "bf16", what="train_s")
    ratio("qwen2.5-14b/bs8/train_nvfp4_over_bf16", "qwen2.5-14b", "nvfp4", "bf16", what="train_s")
    ratio("qwen2.5-7b/bs64/e2e_nvfp4_over_bf16", "qwen2.5-7b", "nvfp4", "bf16", batch=64)
    ratio("qwen2.5-7b/bs64_mix/e2e_nvfp4_over_bf16", "qwen2.5-7b", "nvfp4", "bf16", batch=64, lengths="mix")
    for meth in ("nvfp4", "bf16"):
        r = _row(rows, "qwen2.5-7b", meth, 64, lengths="mix")
        for key, field in (("step_s", "step_s"), ("train_mfu", "train_mfu"), ("peak_gib", "peak_gib")):
            s[f"qwen2.5-7b/bs64_mix/{key}/{meth}"] = r.get(field) if r else None
            notes[f"qwen2.5-7b/bs64_mix/{key}/{meth}"] = (
                f"{meth}, micro-batch {r['micro_batch']}, padding-free {r.get('padding_free', False)} "
                f"(budget {r.get('token_budget')}), old log-probs {r.get('old_logprobs', 'forward')}, "
                f"{r.get('real_tokens')} real / {r.get('computed_tokens')} computed tokens") if r else None
        r = _row(rows, "qwen2.5-7b", meth, 8)
        s[f"qwen2.5-7b/bs8/step_s/{meth}"] = r["step_s"] if r else None
        notes[f"qwen2.5-7b/bs8/step_s/{meth}"] = (f"{meth}, C={r['completion_len']} fixed, micro-batch {r['micro_batch']}, "
                                                 f"old log-probs {r.get('old_logprobs', 'forward')}") if r else None
    for b in (2, 8):
        r = _row(rows, "qwen2.5-32b", "nvfp4", b)
        s[f"qwen2.5-32b/bs{b}/peak_gib"] = r["peak_gib"] if r else None
        s[f"qwen2.5-32b/bs{b}/s_per_step"] = r["step_s"] if r else None
        note = (f"nvfp4, grad ckpt on, prompt {r['prompt_len']}, completion {r['completion_len']} tokens, "
                f"micro-batch {r['micro_batch']}, cap {r.get('memory_cap_gib')} GiB") if r else None
        notes[f"qwen2.5-32b/bs{b}/peak_gib"] = notes[f"qwen2.5-32b/bs{b}/s_per_step"] = note
    caps = {r.get("memory_cap_gib") for r in rows if r.get("model") == "qwen2.5-32b"}
    s["qwen2.5-32b/memory_cap_gib"] = caps.pop() if len(caps) == 1 else None
    notes["qwen2.5-32b/memory_cap_gib"] = None if len(caps) == 0 else "rows of several caps: see rows"
    bf = [r for r in rows if r.get("model") == "qwen2.5-32b" and r.get("method") == "bf16"]
    s["qwen2.5-32b/bf16_lora_oom"] = any(r.get("oom") for r in bf) if bf else None
    oomed = [f"bs{r['batch']} in {r.get('oom_phase')}" for r in bf if r.get("oom")]
    notes["qwen2.5-32b/bf16_lora_oom"] = (f"OOM: {', '.join(oomed)}" if oomed else "no OOM") if bf else None
    return {k: s[k] for k in SUMMARY_KEYS}, notes


def assemble(rows, prov, settings) -> dict:
    summary, notes = summarize(rows)
    for r in rows:
        r["paper_model_size_gb"] = PAPER["model_size_gb"].get(f"{r.get('model')}/{r.get('method')}")
        r["paper_s_per_step"] = PAPER["s_per_step"].get(f"{r.get('model')}/{r.get('method')}/bs{r.get('batch')}")
    out = {**prov, "settings": settings, "targets": TARGETS, "paper_reference": PAPER, "summary": summary,
           "summary_notes": notes, "rows": rows}
    if prov.get("gpu") == "h200":
        out["gpu_note"] = ("Measured on an H200 (141 GB); the paper used one H100 80GB. The 32B rows run under a "
                           "per-process cap (memory_cap_gib) to stand for the 80 GB GPU.")
    return out


def merge(paths, out):
    files = [json.loads(Path(p).read_text()) for p in paths]
    if len({f["gpu"] for f in files}) != 1:
        raise SystemExit("refusing to merge results from different GPUs")
    keyed = {}
    for f in files:
        for r in f["rows"]:
            r.setdefault("git_sha", f.get("git_sha"))  # each row keeps the commit that measured it
            r.setdefault("date", f.get("date"))
            keyed[(r.get("model"), r.get("method"), r.get("batch"), r.get("grad_ckpt"), r.get("completion_len"),
                   r.get("memory_cap_gib"), r.get("micro_batch"), r.get("old_logprobs", "forward"),
                   r.get("lengths", "fixed"), r.get("padding_free", False), r.get("token_budget"))] = r
    prov = {k: files[-1][k] for k in ("gpu", "git_sha", "date", "env")}
    prov["runs"] = sc.merged_runs(paths, files)
    result = assemble(list(keyed.values()), prov, {"merged": list(map(str, paths))})
    print(f"merged {len(paths)} files, {len(keyed)} rows -> {sc.write_json(result, out, prov['gpu'])}")
    return result


# ----------------------------------------------------------------------------------------------
# main


def print_table(rows):
    print(f"\n{'model':12s} {'method':6s} {'B':>2s} {'GC':>3s} {'C':>5s} {'step s':>8s} {'rollout':>8s} {'logprob':>8s} "
          f"{'update':>8s} {'roll %':>6s} {'peak GiB':>8s} {'size GB':>7s} {'MFU':>5s} {'tokens real/computed':>21s}  status")
    for r in rows:
        def f(k, fmt, r=r):
            v = r.get(k)
            return format(v, fmt) if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"
        status = (f"OOM ({r.get('oom_phase')})" if r.get("oom") else ("FAILED" if r.get("error") else "ok"))
        share = r.get("rollout_share")
        print(f"{r['model']:12s} {r['method']:6s} {r['batch']:2d} {'on' if r.get('grad_ckpt') else 'off':>3s} "
              f"{r['completion_len']:5d} {f('step_s', '8.2f')} {f('rollout_s', '8.2f')} {f('logprob_s', '8.2f')} "
              f"{f('update_s', '8.2f')} {format(100 * share, '6.1f') if share else '-':>6s} {f('peak_gib', '8.1f')} "
              f"{f('model_size_gb', '7.2f')} {f('train_mfu', '5.3f')} "
              f"{str(r.get('real_tokens', '-')) + '/' + str(r.get('computed_tokens', '-')):>21s}  {status}")


def run(args) -> dict:
    device = torch.device(args.device)
    prov = sc.provenance(args.git_sha)
    print("env:", json.dumps(prov["env"]))
    cap = sc.apply_memory_cap(args.memory_cap_gib)
    if cap is not None:
        print(f"memory cap: {cap:.1f} GiB (of {prov['env'].get('gpu_total_gib', 0):.1f} GiB)")
    rows = []
    t_start = time.time()
    settings = {k: v for k, v in vars(args).items() if k != "merge"}

    def save(complete=False):  # after every row: a run cut off by a time limit keeps what it measured
        result = assemble(rows, prov, settings)
        result["complete"] = complete
        return result, sc.write_json(result, args.out, prov["gpu"])

    specs = row_specs(args)
    for mk in dict.fromkeys(sp.model for sp in specs):  # models in order of first mention
        mine = [sp for sp in specs if sp.model == mk]
        vocab = sc.vocab_size(mk)
        for method in args.methods:
            t0 = time.time()
            try:
                model = sc.build(mk, method, args.lora_rank, device, seed=args.seed)
                sc.sync()
            except Exception as e:  # noqa: BLE001 - e.g. bf16 32B under the 80 GiB cap
                oom = sc.is_oom(e)
                err = f"{type(e).__name__}: {str(e)[:500]}"
                print(f"{mk} {method}: build {'OOM' if oom else 'FAILED'}: {err[:200]}")
                for sp in mine:
                    rows.append(dict(model=mk, method=method, batch=sp.batch, grad_ckpt=sp.grad_ckpt,
                                     micro_batch=sp.micro_batch, prompt_len=args.prompt, completion_len=sp.completion,
                                     memory_cap_gib=cap, oom=oom, error=err,
                                     **{("oom_phase" if oom else "failed_phase"): "build"}))
                sc.free()
                save()
                continue
            sizes = sc.model_bytes(model)
            # the trainer's optimizer over the trainable weights (the schedule is constant: one step per row)
            opt, sched = make_optimizer(bench_config(method, args, 2, 1, args.completion, args.device),
                                        lora_parameters(model), total_updates=1)
            extra = dict(memory_cap_gib=cap, build_s=time.time() - t0, model_size_gb=sizes["model_size_bytes"] / 1e9,
                         lora_gb=sizes["lora_bytes"] / 1e9, lora_rank=args.lora_rank,
                         weights_gib=torch.cuda.memory_allocated() / 2**30)
            print(f"{mk} {method}: built in {extra['build_s']:.0f} s, size {extra['model_size_gb']:.2f} GB")
            for sp in mine:
                rows.append(measure(model, sp, method, args, vocab, opt, sched, extra))
                print_table(rows[-1:])
                save()
            del model, opt, sched
            sc.free()
            print(f"  ({time.time() - t_start:.0f} s so far)")
    result, path = save(complete=True)
    print_table(rows)
    print(f"\nwrote {path} ({time.time() - t_start:.0f} s)")
    for k, v in result["summary"].items():
        print(f"{k:40s} {str(v if not isinstance(v, float) else round(v, 3)):>8s}  target {TARGETS[k]}  "
              f"[{result['summary_notes'][k]}]")
    return result


def parse_args(argv=None):
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["qwen2.5-7b", "qwen2.5-14b"], choices=list(sc.MODELS))
    ap.add_argument("--methods", nargs="+", default=[QERL_FORMAT, "bf16", QLORA_FORMAT], choices=METHODS,
                    help="base formats (LoRA on top of each), run in this order; nf4 runs bitsandbytes' kernels")
    ap.add_argument("--batch", nargs="+", type=int, default=[8], help="completions per step (paper: 2, 4, 8)")
    ap.add_argument("--grad-ckpt", nargs="+", default=["on"], choices=["on", "off", "selective"],
                    help="activation recomputation: on (full), selective or off (qerl.recompute)")
    ap.add_argument("--prompt", type=int, default=256, help="prompt length (paper: 256)")
    ap.add_argument("--completion", type=int, default=2048, help="completion length, fixed (paper: 2048)")
    ap.add_argument("--lengths", default="fixed", type=sc.lengths_arg,
                    help="completion lengths, drawn once per row, the cap being the row's completion length: "
                         + sc.LENGTHS_HELP)
    ap.add_argument("--micro-batch", type=int, default=1, help="sequences per training forward/backward")
    ap.add_argument("--lora-rank", type=int, default=32, help="LoRA rank r (alpha = 2 r); paper Table 4: 32")
    ap.add_argument("--learning-rate", type=float, default=1e-5, help="AdamW learning rate (paper: 1e-5)")
    ap.add_argument("--row", action="append", default=None, metavar="MODEL/bsB[/cC][/mbM][/gcon|gcsel|gcoff]",
                    help="a row to measure instead of --models x --batch x --grad-ckpt (repeatable); unset parts "
                         "take --completion / --micro-batch / gc on: qwen2.5-7b/bs64/c512/mb8")
    ap.add_argument("--old-logprobs", default="trainer", choices=["trainer", "forward", "reuse"],
                    help="trainer: as the trainer does for the row's config (one pass, one optimizer step: reuse); "
                         "forward: a separate no-grad forward (the trainer with num_iterations > 1 or several "
                         "optimizer steps per rollout); reuse: the training forward's (one update per rollout)")
    ap.add_argument("--padding-free", default="on", choices=["on", "off"],
                    help="on: training forwards over the real tokens, packed by --token-budget (qerl.packing); "
                         "off: padded micro-batches of --micro-batch rows cut to their longest completion")
    ap.add_argument("--token-budget", type=int, default=0,
                    help="tokens per padding-free training forward (TrainConfig.forward_token_budget); 0: the trainer's "
                         "default, micro-batch x (prompt + completion) and at least 16384")
    ap.add_argument("--steps", type=int, default=1,
                    help="timed steps per row after the warm-up; the row reports each phase's median and, with "
                         "more than one, every step's seconds (a single step's ratio moves by a few hundredths "
                         "between runs)")
    ap.add_argument("--memory-cap-gib", type=float, default=None,
                    help="cap this process's GPU memory (80: the paper's one H100 80GB)")
    sc.add_run_args(ap, out="results/table3")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    try:
        for spec in row_specs(args):
            sc.check_lengths(args.lengths, spec.completion)
    except ValueError as e:
        ap.error(str(e))
    return args


def main(argv=None):
    args = parse_args(argv)
    result = sc.main_run_or_merge(args, run, merge, "table3_speed_memory.py")
    C.declare(ARTEFACT, Path(args.out))
    return result


if __name__ == "__main__":
    main()
