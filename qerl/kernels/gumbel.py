"""The rollout's counter-based noise and its Gumbel-max draw in torch: the reference of qerl.kernels.sampling.

Token t of a sequence is drawn as argmax_v(x_v + g_v), x the temperature-scaled (and top-k / top-p
filtered) logits and g_v = -log(-log(u_v)), where u is a pure function of (the sequence's key, the
step t, the vocabulary index v): murmur3's 32-bit finaliser (``uniform_noise``). These are torch ops
on any device (no Triton): the draw off the GPU, and what ``sampling.gumbel_argmax`` must equal.
"""

from __future__ import annotations

import torch

M32 = 0xFFFFFFFF


def fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser on int64 tensors holding values in [0, 2^32)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & M32
    return h ^ (h >> 16)


def uniform_noise(keys: torch.Tensor, t: torch.Tensor | int, vocab: int) -> torch.Tensor:
    """U(0, 1) noise [B, vocab], fp32, strictly inside (0, 1): a pure function of (key, t, index)."""
    if not torch.is_tensor(t):
        t = torch.tensor(t, dtype=torch.long, device=keys.device)
    kt = fmix32(keys ^ ((t.long() * 0x9E3779B1) & M32))  # [B]
    v = torch.arange(vocab, device=keys.device, dtype=torch.long)
    h = fmix32(kt[:, None] ^ ((v * 0x27D4EB2F + 0x165667B1) & M32)[None, :])
    return ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))  # 24 bits: exact in fp32


def gumbel_argmax_torch(x: torch.Tensor, keys: torch.Tensor, t) -> torch.Tensor:
    """argmax_v(x + Gumbel noise of (key, t, v)) per row, as torch ops (any device): the draw that
    ``qerl.kernels.sampling.gumbel_argmax`` makes in one kernel, and its reference."""
    gumbel = -torch.log(-torch.log(uniform_noise(keys, t, x.size(-1))))
    return (x + gumbel).argmax(-1)
