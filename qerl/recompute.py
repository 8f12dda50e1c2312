"""Activation recomputation of the training forward: off, selective or full (``gradient_checkpointing``).

- ``off``: autograd keeps every activation the backward reads. The fastest where it fits; at RL lengths
  it rarely does (7B, 8 rows x 2304 tokens: out of 140 GB, results/table3/NOTES.md).
- ``full``: each decoder layer keeps only its input; the backward runs the layer's forward again
  (HF's gradient checkpointing, non-reentrant). The least memory; one more forward per update.
- ``selective``: the layer is checkpointed as in ``full``, but its matmul outputs (the linears,
  dense or 4-bit, and LoRA A) and the attention's output are kept (PyTorch's selective activation
  checkpointing): the recomputation redoes only the cheap elementwise parts (norms, rotary, SiLU,
  casts, LoRA B's rank-r product), so it costs almost no FLOPs, for about 2.9 MB a token at 7B
  (a ~3x smaller token budget than ``full`` in the same memory: ``qerl.config.TrainConfig.token_budget``).

``enable(model, mode)`` sets one of them on an HF model.
"""

from __future__ import annotations

import functools

import torch

MODES = ("off", "selective", "full")


def parse_mode(value) -> str:
    """A mode from a config or flag value: one of MODES, or a bool (true = full, false = off)."""
    if isinstance(value, bool):
        return "full" if value else "off"
    s = str(value).strip().lower()
    if s in ("true", "on", "yes", "1"):
        return "full"
    if s in ("false", "no", "0", "none"):
        return "off"
    if s not in MODES:
        raise ValueError(f"gradient_checkpointing must be one of {MODES} (or true / false), got {value!r}")
    return s


def _saved_ops() -> set:
    """The ops whose outputs ``selective`` keeps: matmuls and attention kernels."""
    aten = torch.ops.aten
    names = ["mm", "bmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_flash_attention_forward", "_efficient_attention_forward"]
    ops = {getattr(aten, n).default for n in names if hasattr(aten, n)}
    varlen = getattr(getattr(torch.ops, "torch_attn", None), "_varlen_attn", None)  # torch.nn.attention.varlen's op
    if varlen is not None:
        ops.add(varlen.default)
    return ops


def _policy(saved, ctx, op, *args, **kwargs):
    """Keep matmul and attention outputs; a 16-bit ``addmm`` too (a linear with a bias), but not an fp32
    one (LoRA B's rank-r product added to the base output: cheap to redo, twice the bytes to keep)."""
    from torch.utils.checkpoint import CheckpointPolicy

    keep = op in saved or (op is torch.ops.aten.addmm.default and len(args) > 1
                           and getattr(args[1], "dtype", None) in (torch.bfloat16, torch.float16))
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context():
    """The ``context_fn`` of torch.utils.checkpoint that keeps matmul and attention outputs."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(functools.partial(_policy, _saved_ops()))


def enable(model, mode) -> str:
    """Set the recomputation ``mode`` (see the module docstring) on an HF model; returns the mode."""
    mode = parse_mode(mode)
    new = hasattr(model, "activation_checkpointing_enable")  # transformers >= 5.2x; the older names warn there
    if mode == "off":
        if any(getattr(m, "gradient_checkpointing", False) for m in model.modules()):
            (model.activation_checkpointing_disable if new else model.gradient_checkpointing_disable)()
        return mode
    kwargs = {"use_reentrant": False}
    if mode == "selective":
        kwargs["context_fn"] = selective_context
    if new:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return mode
