"""The policy and its optimizer: the model loaded and turned into the method's policy (4-bit base +
LoRA, a bare base, or all weights for bf16_full), fp32 master weights for 16-bit full fine-tuning,
and the optimizer / learning-rate schedule of Table 4.

    model, tokenizer, trainable, info = build_policy(cfg)
    opt, sched = make_optimizer(cfg, trainable, total_updates)
    trainable = optimizer_params(opt)   # what to clip and all-reduce (the fp32 masters under bf16_full)

The trainer, evaluation (``qerl eval``) and ``qerl.load_trained`` all build the policy here, so a
checkpoint is loaded into the same model it was trained as.
"""

from __future__ import annotations

import torch

from qerl import distributed as qdist
from qerl import formats, recompute
from qerl.config import TrainConfig
from qerl.noise import find_norms, keep_norms_fp32
from qerl.quantize import lora_parameters, model_size_bytes, quantize_

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def pick_device() -> torch.device:
    return qdist.pick_device()  # cuda:LOCAL_RANK under torchrun


def build_policy(cfg: TrainConfig, device=None, model=None, tokenizer=None, lora: bool = True):
    """Load the model and turn it into the method's policy. Returns (model, tokenizer, trainable, info).

    lora=False gives the untrained rows of Table 1: the base in cfg.fmt with no adapter (bf16: the
    dense model untouched).
    """
    from qerl import models

    device = device or pick_device()
    check_backend(cfg, device, lora)  # --backend triton on a CPU: before the model loads
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
    recompute.enable(model, cfg.gradient_checkpointing)
    model.config.use_cache = True
    return model, tokenizer, trainable, info


def check_backend(cfg: TrainConfig, device, lora: bool = True) -> None:
    """A ValueError naming --backend when the 4-bit base's kernels cannot run on ``device`` (triton on a
    CPU, bitsandbytes for a format it does not serve or without the package)."""
    if formats.is_dense(cfg.fmt) or not cfg.lora:  # no 4-bit base: no kernel to check
        return
    from qerl import kernels

    try:
        kernels.resolve_backend(cfg.backend, cfg.fmt, torch.device(device))
    except RuntimeError as exc:
        raise ValueError(f"--backend {cfg.backend} with fmt {cfg.fmt} on {torch.device(device)}: {exc}") from None


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
