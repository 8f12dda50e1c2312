"""The rollout's Gumbel-max draw in one kernel, with its counter-based noise computed in registers.

The rollout's ``sample_tokens`` draws token t of each row as argmax_v(x_v + g_v), x the
temperature-scaled (and top-k / top-p filtered) logits and g_v = -log(-log(u_v)), where u is a pure
function of (the sequence's key, the step t, the vocabulary index v): murmur3's 32-bit finaliser
(``qerl.kernels.gumbel.uniform_noise``). In torch that is about twenty elementwise kernels over [B, V] int64 tensors: at
B = 64 and V = 152k, ~1 ms of a 9.35 ms Qwen2.5-7B decode step, 0.03 ms in this kernel (H100 A/B,
results/decode_profile/NOTES.md).

``gumbel_argmax`` does the same arithmetic in one launch over (rows x vocabulary blocks): the hash in
uint32 registers (the same bits as the int64 torch code, which masks to 32 bits after each step), u
exactly as torch makes it (24 bits, exact in fp32), the two logs with libdevice's ``logf`` (what torch's
CUDA ``log`` calls), the fp32 add, and a per-block argmax; then the first maximum over the blocks. So
the token is torch's for the same inputs (ties to the lowest index, as ``torch.argmax``), which the GPU
test checks token for token; ``gumbel_argmax_reference`` (``gumbel.gumbel_argmax_torch``) is that torch code. NaN logits are not
expected here (the trainer's guards stop a NaN run earlier); where one occurs torch.argmax would pick it
and this kernel may not.

A ``torch.library.custom_op`` (``qerl::gumbel_argmax``, with a fake for torch.compile); on the CPU it
runs under ``TRITON_INTERPRET=1`` (tests), else ``sample_tokens`` keeps the torch code there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from qerl.kernels.common import (  # the interpreter has no libdevice: numpy's float32 log stands in
    INTERPRETED,
    pdl_args,
    pdl_enter,
)
from qerl.kernels.gumbel import gumbel_argmax_torch

BLOCK_V = 2048  # vocabulary entries a program: V = 152k -> 75 programs a row


@triton.jit
def _fmix32(h):
    """murmur3's 32-bit finaliser on uint32 (wrapping multiplies, logical shifts)."""
    h = h ^ (h >> 16)
    h = h * tl.full(h.shape, 0x85EBCA6B, tl.uint32)
    h = h ^ (h >> 13)
    h = h * tl.full(h.shape, 0xC2B2AE35, tl.uint32)
    return h ^ (h >> 16)


@triton.jit
def _gumbel_argmax_kernel(x_ptr, keys_ptr, t_ptr, val_ptr, idx_ptr, V, stride_x, NBLK, BLOCK: tl.constexpr,
                          LIBDEVICE: tl.constexpr, T_PER_ROW: tl.constexpr, PDL: tl.constexpr = False):
    """Program (row, block): max over its BLOCK entries of x + g and the first index reaching it."""
    pdl_enter(PDL)
    row = tl.program_id(0)
    blk = tl.program_id(1)
    key = tl.load(keys_ptr + row).to(tl.uint32)  # keys hold values in [0, 2^32)
    # the low 32 bits of t decide (t * c) mod 2^32; one t for all rows, or each row's own
    t = tl.load(t_ptr + row if T_PER_ROW else t_ptr).to(tl.uint32)
    kt = _fmix32(key ^ (t * tl.full(t.shape, 0x9E3779B1, tl.uint32)))
    v = blk * BLOCK + tl.arange(0, BLOCK)
    m = v < V
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + v, mask=m, other=float("-inf"))
    vu = v.to(tl.uint32) * tl.full(v.shape, 0x27D4EB2F, tl.uint32) + tl.full(v.shape, 0x165667B1, tl.uint32)
    h = _fmix32(kt ^ vu)
    u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
    if LIBDEVICE:  # logf, as torch's CUDA log (tl.log would be lg2.approx)
        g = -libdevice.log(-libdevice.log(u))
    else:
        g = -tl.log(-tl.log(u))
    y = tl.where(m, x + g, float("-inf"))
    best, at = tl.max(y, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(val_ptr + row * NBLK + blk, best)
    tl.store(idx_ptr + row * NBLK + blk, blk * BLOCK + at)


@torch.library.custom_op("qerl::gumbel_argmax", mutates_args=())
def gumbel_argmax(x: torch.Tensor, keys: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """argmax_v(x[b, v] - log(-log(u(keys[b], t[b], v)))) per row b: x fp32 [B, V] (rows contiguous), keys
    int64 [B] from ``sequence_keys``, t an int64 tensor on x's device: one element (every row's step) or
    [B] (each row's own step, as when rows decode sequences that started at different steps). int64 [B]."""
    if x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"gumbel_argmax takes fp32 [B, V] logits with contiguous rows, got {x.dtype} "
                         f"{tuple(x.shape)} strides {x.stride()}")
    B, V = x.shape
    per_row = t.dim() == 1 and t.numel() == B and B != 1
    if keys.shape != (B,) or not (t.numel() == 1 or per_row):
        raise ValueError(f"gumbel_argmax: keys must be [{B}] and t one element or [{B}], got {tuple(keys.shape)}, "
                         f"{tuple(t.shape)}")
    if per_row:
        t = t.contiguous()
    nblk = triton.cdiv(V, BLOCK_V)
    vals = torch.empty((B, nblk), dtype=torch.float32, device=x.device)
    idx = torch.empty((B, nblk), dtype=torch.int32, device=x.device)
    if B:
        _gumbel_argmax_kernel[(B, nblk)](x, keys, t, vals, idx, V, x.stride(0), nblk, BLOCK=BLOCK_V,
                                             LIBDEVICE=not INTERPRETED, T_PER_ROW=per_row, num_warps=4,
                                             **pdl_args(x.device))
    # the first block holding the row's maximum (torch.argmax: the first one), then its index there
    return idx.gather(1, vals.argmax(-1, keepdim=True)).squeeze(1).long()


@gumbel_argmax.register_fake
def _(x, keys, t):
    return x.new_empty((x.shape[0],), dtype=torch.long)


# the torch code the kernel replaces (``sample_tokens``' draw off the GPU or with fused=False)
gumbel_argmax_reference = gumbel_argmax_torch
