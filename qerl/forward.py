"""The pieces of a causal LM's forward that the rollout engines and the training forward share,
below both: the decoder stack and lm_head of an HF model, position ids that ignore left padding,
and logits in fp32.

Logits are computed in fp32 from the bf16 hidden state and lm_head weight (``lm_logits``): fp32
accumulation and no bf16 rounding of the logits, whose spacing at |logit| ~ 16 is 0.125. The
rollout and the training forward (``qerl.logprobs``) both use it, which keeps their log-probs
close (``sampling/logprob_gap``).
"""

from __future__ import annotations

import torch


def decoder_and_head(model):
    """(the decoder stack returning hidden states, the lm_head weight) of an HF causal LM."""
    dec = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if dec is None or head is None:
        raise ValueError(f"{type(model).__name__}: expected an HF causal LM with a decoder and an lm_head")
    return dec, head.weight


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Position ids that ignore left padding: 0 at each sequence's first real token."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


# ----------------------------------------------------------------------------------------------
# logits in fp32
class _LinearFp32Out(torch.autograd.Function):
    """h @ W^T with bf16/fp16 operands and an fp32 result (fp32 accumulation, no output rounding)."""

    @staticmethod
    def forward(ctx, h, w):
        ctx.save_for_backward(h, w)
        return torch.mm(h, w.t(), out_dtype=torch.float32)

    @staticmethod
    def backward(ctx, g):
        h, w = ctx.saved_tensors
        g16 = g.to(w.dtype)
        dh = torch.mm(g16, w, out_dtype=torch.float32).to(h.dtype) if ctx.needs_input_grad[0] else None
        dw = torch.mm(g16.t(), h, out_dtype=torch.float32).to(w.dtype) if ctx.needs_input_grad[1] else None
        return dh, dw


def lm_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 logits of ``hidden`` [..., H] under the lm_head ``weight`` [V, H].

    CUDA with 16-bit operands: one GEMM with fp32 output (``torch.mm(..., out_dtype=float32)``).
    Elsewhere: an fp32 matmul of upcast operands (same math, slower; CPU tests and small models).
    """
    shape = hidden.shape[:-1]
    h = hidden.reshape(-1, hidden.size(-1))
    if h.is_cuda and h.dtype in (torch.bfloat16, torch.float16) and weight.dtype == h.dtype:
        out = _LinearFp32Out.apply(h, weight)
    else:
        out = torch.nn.functional.linear(h.float(), weight.float())
    return out.reshape(*shape, weight.size(0))
