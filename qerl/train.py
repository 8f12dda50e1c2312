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
import json
import math
import random
import shutil
import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm

from qerl import checkpoint as qckpt
from qerl import data as qdata
from qerl import distributed as qdist
from qerl import evaluate as qeval
from qerl import formats
from qerl import rewards as qrewards
from qerl import step as qstep
from qerl.config import TrainConfig, eval_settings
from qerl.logging import RunLogger, wandb_settings
from qerl.noise import find_norms, keep_norms_fp32
from qerl.quantize import lora_parameters, model_size_bytes, quantize_
from qerl.rollout import make_engine
from qerl.step import NonFiniteError, adapters_disabled  # noqa: F401 - re-exported

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class RolloutGapError(RuntimeError):
    """The rollout's log-probs stayed far from the training forward's (a broken rollout): training stops."""


# ----------------------------------------------------------------------------- model
def pick_device() -> torch.device:
    return qdist.pick_device()  # cuda:LOCAL_RANK under torchrun


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
    if not cfg.lora or (formats.is_dense(cfg.fmt) and not lora):
        for p in model.parameters():
            p.requires_grad_(True)
        trainable = [p for p in model.parameters()]
    else:
        fmt = cfg.fmt
        if not formats.is_dense(fmt) and "bitsandbytes" in formats.get(fmt).kernels and device.type == "cpu":
            print(f"[qerl] {fmt} on CPU: using qerl's pure-torch {fmt} (bitsandbytes-compatible codes) instead of "
                  "bitsandbytes kernels; same quantized weights, slower")
        rep = quantize_(model, cfg.quantize_config(lora=lora))
        info.update(rep)
        trainable = lora_parameters(model)
    info["norms_fp32"] = keep_norms_fp32(model)  # so small AQN sigmas are not rounded away (see noise.py)
    if cfg.train_norms and lora:  # the official --ln: AQN's norm weights trained (fp32) next to the adapters
        norms = [m.weight for _, m in find_norms(model)]
        for w in norms:
            w.requires_grad_(True)
        trainable = trainable + [w for w in norms if all(w is not t for t in trainable)]
        model.qerl_initial_norms = {n: m.weight.detach().clone() for n, m in find_norms(model)}  # KL reference
        info["trainable_norms"] = len(norms)
    info["model_size_bytes"] = model_size_bytes(model)
    info["trainable_params"] = sum(p.numel() for p in trainable)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = True
    return model, tokenizer, trainable, info


class MasterWeights:
    """fp32 master copies of 16-bit trainable weights (bf16_full): bf16 compute, fp32 updates.

    Each 16-bit parameter's gradient is moved, as soon as autograd accumulates it, into the fp32
    master's ``.grad`` (a post-accumulate-grad hook; the 16-bit ``.grad`` stays None), so the
    micro-batches also accumulate in fp32. The optimizer steps the masters; ``copy_back`` (an
    optimizer step post-hook) then rounds them into the 16-bit weights. Without the masters an
    update of lr 1e-5 is below half a bf16 ulp of most weights and rounds away. fp32 parameters
    (the RMSNorm weights) are their own masters.
    """

    def __init__(self, params):
        self.params = list(params)
        self.masters = []
        for p in self.params:
            if p.dtype == torch.float32:
                self.masters.append(p)
                continue
            m = torch.nn.Parameter(p.detach().float().clone())
            p.register_post_accumulate_grad_hook(self._mover(m))
            self.masters.append(m)
        self._of = {id(p): m for p, m in zip(self.params, self.masters)}

    @staticmethod
    def _mover(master):
        def hook(p):
            g = p.grad.float()
            master.grad = g if master.grad is None else master.grad.add_(g)
            p.grad = None
        return hook

    def master_of(self, p: torch.Tensor) -> torch.Tensor:
        return self._of[id(p)]

    @torch.no_grad()
    def copy_back(self, *_):
        for p, m in zip(self.params, self.masters):
            if m is not p:
                p.copy_(m)


def optimizer_params(opt) -> list:
    """The tensors the optimizer steps (the fp32 masters under bf16_full): clip and reduce these grads."""
    return [p for g in opt.param_groups for p in g["params"]]


def make_optimizer(cfg: TrainConfig, params, total_updates: int):
    """(optimizer, scheduler) of the trainable ``params``. bf16_full with 16-bit weights: the optimizer
    steps fp32 masters (``opt.qerl_master``, a MasterWeights) and copies them into the weights."""
    from transformers import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup

    params = list(params)
    master = None
    if not cfg.lora and any(p.dtype != torch.float32 for p in params):
        master = MasterWeights(params)
        params = master.masters
    # No weight decay on 1-D parameters (norm weights, biases), as the HF Trainer (and so TRL) does.
    groups = [{"params": [p for p in params if p.dim() > 1], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    betas = (0.9, cfg.adam_beta2)
    if cfg.optim == "adamw_8bit":
        if not torch.cuda.is_available():
            raise ValueError("optim=adamw_8bit needs CUDA (bitsandbytes); use optim=adamw on the CPU")
        import bitsandbytes as bnb

        opt = bnb.optim.AdamW8bit(groups, lr=cfg.learning_rate, betas=betas)
    else:
        opt = torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=betas)
    opt.qerl_master = master
    if master is not None:
        opt.register_step_post_hook(master.copy_back)
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


def epoch_steps(n_prompts: int, prompts_per_step: int, epochs: float) -> int:
    """Rollout steps of ``epochs`` passes over ``n_prompts`` prompts: floor(epochs * n / prompts_per_step), as
    TRL's sampler drops an incomplete last batch; ValueError when that is not one step."""
    steps = int(epochs * n_prompts) // prompts_per_step
    if steps < 1:
        raise ValueError(f"num_train_epochs={epochs} over {n_prompts} prompts at {prompts_per_step} a step is no step")
    return steps


# ----------------------------------------------------------------------------- checkpoints
def save_checkpoint(path: Path, step: int, model, trainable_names, opt, sched, cfg: TrainConfig,
                    run_state: dict | None = None) -> Path:
    """Write checkpoint ``path`` (checkpoints/step-N) atomically (qerl.checkpoint): the trainable weights,
    optimizer / scheduler / RNG states, the config, the run's record ``run_state`` (resume.json) and a
    PEFT copy of the adapter, then the manifest."""
    from safetensors.torch import save_file

    params = dict(model.named_parameters())
    master = getattr(opt, "qerl_master", None)  # bf16_full: the fp32 masters are the trained weights
    tensors = {n: master.master_of(params[n]) if master is not None else params[n] for n in trainable_names}
    tensors = {n: t.detach().contiguous().cpu() for n, t in tensors.items()}
    state = {"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "step": step,
             "rng": {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
                     "python": random.getstate()}}
    opt_bytes = sum(v.numel() * v.element_size() for s in state["optimizer"]["state"].values() for v in s.values()
                    if isinstance(v, torch.Tensor))
    tensor_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    estimate = tensor_bytes * (2 if cfg.lora else 1) + opt_bytes  # LoRA: the PEFT copy holds the adapter again

    def adapter(dst: Path):
        from qerl.export import export_run_adapter

        try:
            export_run_adapter(model, dst, cfg)
        except Exception as e:  # the adapter is a convenience copy; trainable.safetensors is the checkpoint
            if qckpt.disk_full(e):
                raise
            shutil.rmtree(dst, ignore_errors=True)
            print(f"[qerl] PEFT adapter export skipped: {e}")

    writers = {
        "trainable.safetensors": lambda f: save_file(tensors, str(f)),
        "state.pt": lambda f: qckpt.torch_save(state, f),
        "config.json": lambda f: f.write_text(json.dumps(cfg.to_dict(), indent=2, default=str)),  # read by `eval`
        qckpt.RUN_STATE: lambda f: f.write_text(json.dumps({"step": step, **(run_state or {})}, indent=1, default=str)),
    }
    if cfg.lora:
        writers["adapter"] = adapter
    return qckpt.write(path, writers, estimate_bytes=estimate, meta={"step": step, "method": cfg.method})


def read_checkpoint_config(path) -> dict:
    """What a checkpoint says about the policy it was trained as: {model, method, lora_rank, lora_alpha,
    lora_dropout, train_norms} as far as it records them.

    ``path`` is a qerl checkpoint folder (its config.json; older checkpoints: the run folder's
    config.json two levels up) or a PEFT adapter folder (adapter_config.json: r, lora_alpha,
    modules_to_save; the method is not recorded there). LoRA on a subset of the projections cannot be
    rebuilt (qerl puts LoRA on all seven) and is refused.
    """
    from qerl.arch import LINEAR_NAMES, NORM_NAMES

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such checkpoint or adapter folder")
    peft = path / "adapter_config.json"
    if peft.exists():
        c = json.loads(peft.read_text())
        targets = {t.rsplit(".", 1)[-1] for t in (c.get("target_modules") or [])}
        if targets != set(LINEAR_NAMES) or c.get("rank_pattern") or c.get("alpha_pattern"):
            raise ValueError(f"{peft}: LoRA on {sorted(targets)} (rank/alpha patterns {c.get('rank_pattern')}, "
                             f"{c.get('alpha_pattern')}); qerl rebuilds only one rank and alpha on all of "
                             f"{list(LINEAR_NAMES)}")
        saved = set(c.get("modules_to_save") or [])
        if saved - set(NORM_NAMES):
            raise ValueError(f"{peft}: modules_to_save {sorted(saved)}; qerl trains only {list(NORM_NAMES)}")
        out = {"lora_rank": int(c["r"]), "lora_alpha": float(c["lora_alpha"]),
               "lora_dropout": float(c.get("lora_dropout") or 0.0), "train_norms": bool(saved)}
        from qerl.export import adapter_info  # qerl's adapters record their method and base

        info = {k: v for k, v in adapter_info(path).items() if k in ("model", "method")}
        return {**({"model": c["base_model_name_or_path"]} if c.get("base_model_name_or_path") else {}), **out, **info}
    for cfg_file in (path / "config.json", path.parent.parent / "config.json"):
        if cfg_file.exists() and (path / "trainable.safetensors").exists():
            c = json.loads(cfg_file.read_text())
            keys = ("model", "method", "lora_rank", "lora_alpha", "lora_dropout", "train_norms")
            return {k: c[k] for k in keys if k in c}
    raise FileNotFoundError(f"{path} is neither a qerl checkpoint (trainable.safetensors with config.json here or "
                            f"in its run folder) nor a PEFT adapter folder (adapter_config.json)")


def _read_checkpoint_file(load, f: Path):
    """``load(f)``; a file that exists but cannot be read is a ValueError naming it (not a reader's traceback)."""
    try:
        return load(f)
    except FileNotFoundError:
        raise
    except Exception as exc:  # noqa: BLE001 - safetensors / pickle errors of a truncated or corrupt file
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        raise ValueError(f"cannot read {f} ({type(exc).__name__}: {lines[0] if lines else ''}): the file is truncated "
                         f"or corrupt; use another checkpoint (--resume-from {f.parent.parent}/step-N)") from exc


def load_trainable(path, model) -> dict:
    """Load a checkpoint's trainable tensors (LoRA, trained norms, or all weights for bf16_full) into the
    model (cast to its dtypes) and return them as stored; ``path`` may also be a PEFT adapter folder
    that qerl exported (adapter_model.safetensors)."""
    from safetensors.torch import load_file

    path = Path(path)
    f = path / "trainable.safetensors"
    if f.exists():
        state = _read_checkpoint_file(lambda p: load_file(str(p)), f)
    elif (path / "adapter_model.safetensors").exists():
        prefix = "base_model.model."
        raw = _read_checkpoint_file(lambda p: load_file(str(p)), path / "adapter_model.safetensors")
        state = {k.removeprefix(prefix): v for k, v in raw.items()}
    else:
        raise FileNotFoundError(f"{f} not found: expected a qerl checkpoint folder (checkpoints/step-N) "
                                "or a PEFT adapter folder (adapter_model.safetensors)")
    params = dict(model.named_parameters())
    missing = set(state) - set(params)
    if missing:
        raise ValueError(f"checkpoint {path} has parameters the model lacks: {sorted(missing)[:5]}")
    bad = [(n, tuple(t.shape), tuple(params[n].shape)) for n, t in state.items() if t.shape != params[n].shape]
    if bad:
        raise ValueError(f"checkpoint {path} does not fit the model (LoRA rank?): {bad[0][0]} is {bad[0][1]} "
                         f"in the checkpoint, {bad[0][2]} in the model")
    with torch.no_grad():
        for n, t in state.items():
            params[n].copy_(t.to(params[n].device))
    return state


def load_checkpoint(path: Path, model, opt, sched) -> int:
    qckpt.verify(path, names=("trainable.safetensors", "state.pt", qckpt.RUN_STATE))
    state = load_trainable(path, model)
    master = getattr(opt, "qerl_master", None)
    if master is not None:  # bf16_full: the fp32 masters resume from the stored fp32 values
        params = dict(model.named_parameters())
        with torch.no_grad():
            for n, t in state.items():
                master.master_of(params[n]).copy_(t.to(params[n].device))
    st = _read_checkpoint_file(lambda p: torch.load(p, weights_only=False), path / "state.pt")
    opt.load_state_dict(st["optimizer"])
    sched.load_state_dict(st["scheduler"])
    torch.set_rng_state(st["rng"]["torch"])
    if st["rng"]["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["rng"]["cuda"])
    random.setstate(st["rng"]["python"])
    return int(st["step"])


RUN_FILES = ("config.json", "metrics.jsonl", "summary.json", "checkpoints", "wandb", "wandb_run_id", "reward.png")


def check_output_dir(cfg: TrainConfig, clear: bool = True) -> None:
    """Refuse an output_dir that already holds a run, unless cfg.overwrite (its run files are deleted
    when ``clear``) or cfg.resume_from (the run is continued). Other files in the folder are left alone."""
    out = Path(cfg.output_dir)
    found = [n for n in RUN_FILES if (out / n).exists()]
    if not found or cfg.resume_from:
        return
    if not cfg.overwrite:
        status = "a"
        if (out / "summary.json").is_file():
            try:
                status = "a finished" if json.loads((out / "summary.json").read_text()).get("status") == "ok" else "an unfinished"
            except ValueError:
                pass
        raise FileExistsError(f"{out} already holds {status} run ({', '.join(found)}): pass --overwrite to replace it, "
                              f"--resume-from auto to continue it, or another --output-dir")
    if clear:
        for n in found:
            p = out / n
            shutil.rmtree(p) if p.is_dir() else p.unlink()


def _finished_summary(out: Path) -> dict | None:
    """summary.json of a run folder whose run finished (status ok), else None."""
    try:
        summary = json.loads((out / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    return summary if summary.get("status") == "ok" else None


def _cut_metrics(metrics: Path, record: dict, step: int) -> int:
    """Cut metrics.jsonl back to the rows logged when the checkpoint of ``step`` was saved (its resume.json);
    a checkpoint without that record: to the rows of steps <= ``step``."""
    if "metrics_rows" in record:
        return qckpt.cut_rows(metrics, int(record["metrics_rows"]))
    if not metrics.is_file():
        return 0
    keep = 0
    for ln in (ln for ln in metrics.read_text().splitlines() if ln.strip()):
        try:
            if json.loads(ln).get("step", 0) > step:
                break
        except ValueError:  # a row cut off by the crash
            break
        keep += 1
    return qckpt.cut_rows(metrics, keep)


def latest_checkpoint(output_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run folder (qerl.checkpoint: one with its manifest)."""
    return qckpt.latest_complete(Path(output_dir) / "checkpoints")[0]


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
    owns_group = qdist.init()  # torchrun's env -> process group; nothing in a single process
    rank, world = qdist.world()
    main = rank == 0
    check_output_dir(cfg, clear=main)
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
    engine = make_engine(model, tokenizer, kind=cfg.engine, max_seq_len=longest + cfg.max_completion_length)
    n_per_rollout = cfg.rollout_batch_size
    updates_per_step = cfg.num_iterations * math.ceil(n_per_rollout / (cfg.mini_batch_size or n_per_rollout))
    opt, sched = make_optimizer(cfg, trainable, cfg.max_steps * updates_per_step)
    trainable = optimizer_params(opt)  # bf16_full: the fp32 masters hold the gradients
    start, resume, record = 0, None, {}
    if cfg.resume_from:
        if cfg.resume_from == "auto":
            resume, incomplete = qckpt.latest_complete(out / "checkpoints")
            if incomplete:
                qdist.print0(f"[qerl] skipped incomplete checkpoints (saves cut off before their manifest): "
                             f"{', '.join(str(p) for p in incomplete)}")
            if resume is None:  # the documented choice: start fresh, and say so (experiments pass auto to new runs)
                qdist.print0(f"[qerl] --resume-from auto: no checkpoint in {out / 'checkpoints'}; starting at step 1")
        else:
            resume = Path(cfg.resume_from)
            if not resume.is_dir():
                raise FileNotFoundError(f"resume_from={cfg.resume_from}: no such checkpoint")
            if not qckpt.is_complete(resume):
                qdist.print0(f"[qerl] warning: {resume} has no {qckpt.MANIFEST} (saved by an older qerl, or cut off "
                             "mid-save); its files are read unchecked")
        if resume is not None:
            record = qckpt.read_run_state(resume)
            start = load_checkpoint(resume, model, opt, sched)
            qdist.print0(f"[qerl] resumed from {resume} at step {start}")
            finished = _finished_summary(out) if start >= cfg.max_steps else None
            if finished is not None:  # nothing left to train: no second final checkpoint or evaluation
                qdist.print0(f"[qerl] {out} already finished ({start} of {cfg.max_steps} steps); nothing to do")
                if owns_group:
                    qdist.cleanup()
                return finished
            if main:  # metrics.jsonl back to what the run had logged at that checkpoint: no step twice
                dropped = _cut_metrics(out / "metrics.jsonl", record, start)
                if dropped:
                    qdist.print0(f"[qerl] {out / 'metrics.jsonl'}: dropped {dropped} rows logged after step {start}")
    qdist.broadcast_params(trainable)  # every rank starts from rank 0's weights
    if opt.qerl_master is not None:
        opt.qerl_master.copy_back()
    run_config = {**cfg.to_dict(), "reward": rewards.refs(), "policy": info, "prompts_skipped": skipped, "world_size": world,
                  "command": _command_line(), "data_sources": data_sources(cfg)}
    logger = RunLogger(out, run_config, resume=resume is not None, **wandb_settings(cfg)) if main else _NullLogger()
    eval_kw = {**eval_settings(cfg), "seed": cfg.seed}
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
        save_checkpoint(out / "checkpoints" / f"step-{at}", at, model, trainable_names, opt, sched, cfg, run_state)
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


def data_sources(cfg: TrainConfig) -> dict[str, str]:
    """Where each dataset of the run is read from: "built-in" (arith, generated), a local folder (the
    data_dir flag, else $QERL_DATA_DIR, resolved), or "hub". What the run read, whatever flags it got."""
    root = qdata._resolve_data_dir(cfg.data_dir)

    def source(name: str) -> str:
        if name not in qdata.DATASETS:  # your own data: the file or folder, else a hub dataset
            return str(Path(name).expanduser().resolve()) if Path(name).expanduser().exists() else "hub"
        return "built-in" if name == "arith" else str(root.resolve()) if root is not None else "hub"

    return {name: source(name) for name in dict.fromkeys((cfg.dataset, *cfg.eval_datasets))}


def _command_line() -> str:
    """The command line of this process (python -m qerl train ...), as it ran."""
    import shlex
    import sys

    argv = list(sys.argv)
    if argv and argv[0].endswith(("qerl/__main__.py", "qerl\\__main__.py")):
        argv = ["-m", "qerl"] + argv[1:]
    return shlex.join([sys.executable, *argv])


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

