"""Fused decode-step kernels for the fast rollout engine (qerl.rollout.fast, ``fused=True``).

A bs1 decode step is bound by the number of kernels it launches, not by its bytes:
HF's RMSNorm alone is 7 elementwise kernels, rotary embedding 10, a LoRA Linear 5 besides its
base GEMV. These Triton kernels do the same arithmetic in fewer launches, reading every weight
live from the model's modules (LoRA A/B, norm weights that AQN perturbs in place), so a CUDA
graph captured once sees every later update:

  - ``rmsnorm`` / ``add_rmsnorm``: (residual + delta, then) HF's RMSNorm in one kernel; writes the
    new residual and the normed activations. ``add_rmsnorm_lora_a`` also multiplies the normed rows
    by the LoRA A's of the Linears they feed (q/k/v, gate/up), in the same launch.
  - ``rope_cache_write``: Qwen3's q/k RMSNorm (if any), rotary embedding of q and k, and the K/V
    cache write at the slot read from a device tensor (no host sync), one kernel for all heads.
  - ``silu_mul``: SiLU(gate) * up.
  - ``lora_a``: h = x A^T for up to three adapters that share the input x (q/k/v, gate/up), one
    kernel, split over K: at decode batches partial sums that ``lora_out`` adds in a fixed order;
    from 16 rows a tiled tl.dot kernel that sums its K chunks itself, in a fixed order (the last
    program of a tile, found by a counter; no float atomics). Deterministic either way.
  - ``lora_out``: y += bias + scaling * h B^T in place on up to three base outputs, one kernel;
    ``lora_silu_mul``: the same for gate and up, then SiLU(gate) * up, one kernel (``_lora_a``: with the
    LoRA A product of the result for down_proj); ``lora_rope_cache_write``: q/k/v's lora_out and
    ``rope_cache_write`` in one launch (few rows).

Rounding follows HF's modules wherever it is cheap to (bf16 rounding of x_hat before the norm
weight, of each rotary product and of SiLU before the multiply), but reductions run in a
different order, so results may differ from the unfused path by rounding; tests compare each
kernel with a torch reference and the fused engine with the unfused one.

Each kernel is a ``torch.library.custom_op`` (namespace ``qerl``), so a TorchDispatchMode sees
one op per launch (how tests/test_fused.py counts a decode step's kernels). Inputs are 2-D
[rows, features], contiguous. On the CPU the kernels run under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from qerl.kernels.common import num_sms, pdl_args, pdl_enter, splitk_epilogue, workspace
from qerl.kernels.common import rnd as _rnd

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

# lora_a below LORA_A_DOT_MIN_M rows (decode batches): short K chunks, at most LORA_A_MAX_SPLITS partial sums, at least 256
# elements each, so that a program streams its slice of A in one or two loads rather than four
# dependent ones (lora_out then sums the partials in one vector load).
LORA_A_MIN_CHUNK = 256
LORA_A_MAX_SPLITS = 32
# lora_out loads up to this many partial-sum floats of h at once (a [splits, rows, r] block)
LORA_OUT_H_BLOCK = 4096


def lora_a_chunk(M: int, K: int) -> int:
    """K elements a lora_a program sums below LORA_A_DOT_MIN_M rows (its partial sums: cdiv(K, chunk))."""
    return max(LORA_A_MIN_CHUNK, triton.next_power_of_2(triton.cdiv(K, LORA_A_MAX_SPLITS)))


@triton.jit
def _pick(i, p0, p1, p2):
    """p0, p1 or p2 by a runtime index (a pointer or a scalar of up to three grouped tensors)."""
    if i == 0:
        p = p0
    elif i == 1:
        p = p1
    else:
        p = p2
    return p


# ----------------------------------------------------------------------------------------------
# residual add + RMSNorm


@triton.jit
def _add_rmsnorm_kernel(res_ptr, delta_ptr, w_ptr, res_out_ptr, out_ptr, a0, a1, a2, h_ptr, N, R, NR, eps,
                        HAS_DELTA: tl.constexpr, STORE_RES: tl.constexpr, HAS_A: tl.constexpr, BLOCK: tl.constexpr,
                        BLOCK_R: tl.constexpr, PDL: tl.constexpr = False):
    """Row program_id(0); program_id(1) == 0 stores the residual and the normed row, and with HAS_A
    every program also multiplies the normed row by BLOCK_R rows of the stacked A (lora_a's h)."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    TY: tl.constexpr = out_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK)
    m = offs < N
    x = tl.load(res_ptr + row * N + offs, mask=m, other=0.0)
    if HAS_DELTA:  # the residual add in the activation dtype, as h + delta is
        d = tl.load(delta_ptr + row * N + offs, mask=m, other=0.0)
        x = _rnd(x.to(tl.float32) + d.to(tl.float32), TY)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / N
    # HF: x * rsqrt(var + eps) in fp32, rounded to the input dtype, then times the weight
    xn = _rnd(xf * tl.rsqrt(var + eps), TY).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    y = _rnd(xn * w, TY)
    if j == 0:
        if STORE_RES:
            tl.store(res_out_ptr + row * N + offs, x, mask=m)
        tl.store(out_ptr + row * N + offs, y, mask=m)
    if HAS_A:
        nrb = tl.cdiv(R, BLOCK_R)
        rr = (j % nrb) * BLOCK_R + tl.arange(0, BLOCK_R)
        mr = rr < R
        a = tl.load(_pick(j // nrb, a0, a1, a2) + rr[:, None].to(tl.int64) * N + offs[None, :],
                    mask=mr[:, None] & m[None, :], other=0.0).to(tl.float32)
        acc = tl.sum(a * y.to(tl.float32)[None, :], axis=1)
        tl.store(h_ptr + row * NR + (j // nrb) * R + rr, acc, mask=mr)


def _norm_launch(res, delta, weight, eps, res_out, out, As=(), h=None):
    M, N = res.shape
    n, R = len(As), (As[0].shape[0] if As else 1)
    BLOCK_R = min(triton.next_power_of_2(R), 64 if INTERPRETED else 2)
    a = list(As) + [As[0] if As else res] * (3 - n)  # padding of one pointer type (the kernel picks one)
    BLOCK = triton.next_power_of_2(N)
    _add_rmsnorm_kernel[(M, n * triton.cdiv(R, BLOCK_R) if n else 1)](
        res, delta if delta is not None else res, weight, res_out, out, a[0], a[1], a[2], h if n else res,
        N, R, n * R, eps, HAS_DELTA=delta is not None, STORE_RES=delta is not None or n > 0, HAS_A=n > 0,
        BLOCK=BLOCK, BLOCK_R=BLOCK_R,
        num_warps=8 if BLOCK >= 4096 else 4, **pdl_args(res.device))


@torch.library.custom_op("qerl::rmsnorm", mutates_args=())
def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF RMSNorm of x [M, N] with ``weight`` [N] (any float dtype), output in x.dtype."""
    out = torch.empty_like(x)
    _norm_launch(x, None, weight, eps, x, out)
    return out


@torch.library.custom_op("qerl::add_rmsnorm", mutates_args=())
def add_rmsnorm(res: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(r, RMSNorm(r)) with r = res + delta (rounded to res.dtype, as a torch add is)."""
    res_out, out = torch.empty_like(res), torch.empty_like(res)
    _norm_launch(res, delta, weight, eps, res_out, out)
    return res_out, out


@torch.library.custom_op("qerl::add_rmsnorm_lora_a", mutates_args=())
def add_rmsnorm_lora_a(res: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                       As: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``add_rmsnorm`` (res itself, copied, when delta is None) and, in the same launch, ``lora_a``
    of the normed rows for the adapters ``As`` of the Linears it feeds: (r, x, h [1, M, n*r])."""
    res_out, out = torch.empty_like(res), torch.empty_like(res)
    h = torch.empty((1, res.shape[0], len(As) * As[0].shape[0]), dtype=torch.float32, device=res.device)
    _norm_launch(res, delta, weight, eps, res_out, out, As, h)
    return res_out, out, h


# ----------------------------------------------------------------------------------------------
# q/k norm + rotary embedding + KV-cache write


@triton.jit
def _head_norm(x1, x2, w_ptr, offs, m, eps, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, TY: tl.constexpr):
    """Qwen3's per-head RMSNorm on the two halves of one head (HF rounding)."""
    var = (tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / HEAD_DIM
    r = tl.rsqrt(var + eps)
    w1 = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + HALF + offs, mask=m, other=0.0).to(tl.float32)
    x1 = _rnd(_rnd(x1 * r, TY).to(tl.float32) * w1, TY).to(tl.float32)
    x2 = _rnd(_rnd(x2 * r, TY).to(tl.float32) * w2, TY).to(tl.float32)
    return x1, x2


@triton.jit
def _rope(x1, x2, c1, c2, s1, s2, TY: tl.constexpr):
    """x * cos + rotate_half(x) * sin with each product and the sum rounded to TY (as HF in TY)."""
    y1 = _rnd(_rnd(x1 * c1, TY).to(tl.float32) + _rnd(-x2 * s1, TY).to(tl.float32), TY)
    y2 = _rnd(_rnd(x2 * c2, TY).to(tl.float32) + _rnd(x1 * s2, TY).to(tl.float32), TY)
    return y1, y2


@triton.jit
def _rope_cache_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, q_out_ptr, kc_ptr, vc_ptr, cpos_ptr,
                       L, eps, NH: tl.constexpr, NKV: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
                       BLOCK: tl.constexpr, QK_NORM: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    TY: tl.constexpr = q_out_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK)
    m = offs < HALF
    c1 = tl.load(cos_ptr + b * HEAD_DIM + offs, mask=m, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + b * HEAD_DIM + HALF + offs, mask=m, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + b * HEAD_DIM + offs, mask=m, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + b * HEAD_DIM + HALF + offs, mask=m, other=0.0).to(tl.float32)
    if h < NH:  # a query head: rotated into q_out [B, NH, 1, HEAD_DIM]
        src = q_ptr + (b * NH + h) * HEAD_DIM
        x1 = tl.load(src + offs, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF + offs, mask=m, other=0.0).to(tl.float32)
        if QK_NORM:
            x1, x2 = _head_norm(x1, x2, qn_ptr, offs, m, eps, HEAD_DIM, HALF, TY)
        y1, y2 = _rope(x1, x2, c1, c2, s1, s2, TY)
        dst = q_out_ptr + (b * NH + h) * HEAD_DIM
        tl.store(dst + offs, y1, mask=m)
        tl.store(dst + HALF + offs, y2, mask=m)
    else:  # a key/value head: rotated k and v into cache[b, kh, cpos]
        kh = h - NH
        src = k_ptr + (b * NKV + kh) * HEAD_DIM
        x1 = tl.load(src + offs, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF + offs, mask=m, other=0.0).to(tl.float32)
        if QK_NORM:
            x1, x2 = _head_norm(x1, x2, kn_ptr, offs, m, eps, HEAD_DIM, HALF, TY)
        y1, y2 = _rope(x1, x2, c1, c2, s1, s2, TY)
        slot = ((b * NKV + kh) * L + tl.load(cpos_ptr)) * HEAD_DIM
        tl.store(kc_ptr + slot + offs, y1, mask=m)
        tl.store(kc_ptr + slot + HALF + offs, y2, mask=m)
        vsrc = v_ptr + (b * NKV + kh) * HEAD_DIM
        tl.store(vc_ptr + slot + offs, tl.load(vsrc + offs, mask=m), mask=m)
        tl.store(vc_ptr + slot + HALF + offs, tl.load(vsrc + HALF + offs, mask=m), mask=m)


@torch.library.custom_op("qerl::rope_cache_write", mutates_args=("k_cache", "v_cache"))
def rope_cache_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, cpos: torch.Tensor,
                     q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float) -> torch.Tensor:
    """One token per row: q [B, NH*D], k/v [B, NKV*D], cos/sin [B, D] (HF rotary_emb output).

    Returns the rotated queries [B, NH, 1, D]; writes the rotated keys and the values into
    k_cache / v_cache [B, NKV, L, D] at slot ``cpos`` ([1] long, on the device). q_norm/k_norm:
    Qwen3's per-head RMSNorm weights [D] (both or neither), applied before the rotation.
    """
    B, NKV, L, D = k_cache.shape
    NH = q.shape[1] // D
    q_out = torch.empty((B, NH, 1, D), dtype=q.dtype, device=q.device)
    has_norm = q_norm is not None
    _rope_cache_kernel[(B, NH + NKV)](
        q, k, v, cos, sin, q_norm if has_norm else q, k_norm if has_norm else q, q_out, k_cache, v_cache, cpos,
        L, eps, NH=NH, NKV=NKV, HEAD_DIM=D, HALF=D // 2, BLOCK=triton.next_power_of_2(D // 2), QK_NORM=has_norm,
        **pdl_args(q.device))
    return q_out


# ----------------------------------------------------------------------------------------------
# SiLU(gate) * up


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    TY: tl.constexpr = out_ptr.dtype.element_ty
    g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=m, other=0.0).to(tl.float32)
    s = _rnd(g / (1.0 + tl.exp(-g)), TY).to(tl.float32)  # F.silu in the activation dtype, then the product
    tl.store(out_ptr + offs, _rnd(s * u, TY), mask=m)


@torch.library.custom_op("qerl::silu_mul", mutates_args=())
def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up, elementwise, in gate.dtype."""
    out = torch.empty_like(gate)
    n = gate.numel()
    BLOCK = 1024
    _silu_mul_kernel[(triton.cdiv(n, BLOCK),)](gate, up, out, n, BLOCK=BLOCK, **pdl_args(gate.device))
    return out


# ----------------------------------------------------------------------------------------------
# LoRA: h = x A^T for grouped adapters, then y += bias + scaling * h B^T


@triton.jit
def _lora_a_kernel(x_ptr, a0, a1, a2, h_ptr, M, K, R, NR, K_CHUNK: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    """Decode batches: partial sum s = program_id(1) (a K chunk) of rows program_id(2) of h for rows
    rr of adapter i's A (program_id(0)), a broadcast product in fp32."""
    pdl_enter(PDL)
    nrb = tl.cdiv(R, BLOCK_R)
    i = tl.program_id(0) // nrb  # adapter i, rows rr of its A
    rr = (tl.program_id(0) % nrb) * BLOCK_R + tl.arange(0, BLOCK_R)
    s = tl.program_id(1)  # K chunk
    rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    a_ptr = _pick(i, a0, a1, a2)
    mr, mm = rr < R, rows < M
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(s * K_CHUNK, tl.minimum(s * K_CHUNK + K_CHUNK, K), BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        mk = ks < K
        a = tl.load(a_ptr + rr[:, None].to(tl.int64) * K + ks[None, :], mask=mr[:, None] & mk[None, :],
                    other=0.0).to(tl.float32)
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * K + ks[None, :], mask=mm[:, None] & mk[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * a[None, :, :], axis=2)
    tl.store(h_ptr + (s * M + rows[:, None]).to(tl.int64) * NR + i * R + rr[None, :], acc,
             mask=mm[:, None] & mr[None, :])


@triton.jit
def _lora_a_tiled_kernel(x_ptr, a0, a1, a2, h_ptr, ws_ptr, cnt_ptr, M, K, R, NR, K_CHUNK,
                         BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                         BF16_DOT: tl.constexpr, PDL: tl.constexpr = False):
    """Many rows: rows program_id(0) x all r columns of adapter program_id(2), over the K chunk
    program_id(1), on the tensor cores in fp32 precision. bf16 activations in row tiles of up to 32: A's
    fp32 split exactly into three bf16 parts (8 significant bits each), three bf16 products with the
    activations as they are, each product exact and summed in fp32 (7B bs64 step: lora_a 0.90 -> 0.79
    ms); otherwise tf32x3 (at 64-row tiles the three bf16 products were slower: o at M = 256 8.2 -> 11.7
    us; results/decode_profile/NOTES.md). The K chunks are summed in this
    launch, in a fixed order (common.splitk_epilogue), so h is final: lora_out reads each h element
    once instead of every chunk's partial in every column tile."""
    pdl_enter(PDL)
    mt, s, i = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    rr = tl.arange(0, BLOCK_R)
    mm, mr = rows < M, rr < R
    a_ptr = _pick(i, a0, a1, a2)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    k_hi = tl.minimum(s * K_CHUNK + K_CHUNK, K)
    for k0 in range(s * K_CHUNK, k_hi, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        mk = ks < k_hi
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * K + ks[None, :], mask=mm[:, None] & mk[None, :],
                    other=0.0)
        a = tl.load(a_ptr + rr[:, None].to(tl.int64) * K + ks[None, :], mask=mr[:, None] & mk[None, :],
                    other=0.0).to(tl.float32)
        if x_ptr.dtype.element_ty == tl.bfloat16 and BLOCK_M <= 32:
            # a = p1 + p2 + p3 exactly (each remainder is exact in fp32; either rounding of the casts works)
            p1 = a.to(tl.bfloat16)
            r1 = a - p1.to(tl.float32)
            p2 = r1.to(tl.bfloat16)
            p3 = (r1 - p2.to(tl.float32)).to(tl.bfloat16)
            if BF16_DOT:
                acc = tl.dot(x, tl.trans(p1), acc)
                acc = tl.dot(x, tl.trans(p2), acc)
                acc = tl.dot(x, tl.trans(p3), acc)
            else:  # the interpreter's bf16 dot is wrong: the same exact products in fp32
                xf = x.to(tl.float32)
                acc = tl.dot(xf, tl.trans(p1.to(tl.float32)), acc, input_precision="ieee")
                acc = tl.dot(xf, tl.trans(p2.to(tl.float32)), acc, input_precision="ieee")
                acc = tl.dot(xf, tl.trans(p3.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(x.to(tl.float32), tl.trans(a), acc, input_precision="tf32x3")
    # adapter i's partials in their own [S, M, R] slice of the workspace, its tiles' counters after the others'
    ws_i = ws_ptr + i.to(tl.int64) * tl.num_programs(1) * M * R
    splitk_epilogue(acc, h_ptr + i * R, ws_i, cnt_ptr, rows, rr, M, R, NR, i * tl.num_programs(0) + mt)


# lora_a takes the tiled kernel from this many rows (a decode batch of 64: 2.0 ms of the 7B step in
# the broadcast kernel, which re-reads x for every two rows of A; results/decode_profile/)
LORA_A_DOT_MIN_M = 16
# The tiled kernel (an H100 sweep over the 7B groups at M = 16-256, results/decode_profile/NOTES.md):
# 16-row tiles up to LORA_A_SMALL_TILE_MAX_M rows (K steps of 128), 64-row tiles above (K steps of 64),
# K split for about LORA_A_PROGRAMS programs (K chunks x row tiles x adapters) on 132 SMs. Summing a
# tile's partials SB at a load after a CTA barrier was slower (about 1 us a launch).
LORA_A_SMALL_TILE_MAX_M = 128
LORA_A_PROGRAMS = 128
LORA_A_TILE_FLOATS = 8192


def lora_a_tiled_config(M: int, K: int, n: int, sms: int = 132, R: int = 32, BLOCK_M: int | None = None,
                        BLOCK_K: int | None = None, programs: int | None = None) -> dict:
    """Launch config of the tiled lora_a: row tile, K step, K chunk (a multiple of the step). BLOCK_M,
    BLOCK_K and programs (about how many programs on 132 SMs) override the rule (benchmark sweeps)."""
    BM = BLOCK_M or (16 if M <= LORA_A_SMALL_TILE_MAX_M else 64)
    # at most LORA_A_TILE_FLOATS of A a K step, so that high ranks keep a pipelined tile in shared memory
    BK = BLOCK_K or min(128 if BM == 16 else 64, max(16, LORA_A_TILE_FLOATS // max(16, triton.next_power_of_2(R))))
    tiles = n * triton.cdiv(M, BM)
    splits = max(1, min(triton.cdiv(K, BK), round((programs or LORA_A_PROGRAMS) * sms / 132 / tiles)))
    chunk = triton.cdiv(triton.cdiv(K, splits), BK) * BK
    return dict(BLOCK_M=BM, BLOCK_K=BK, K_CHUNK=chunk)


def _lora_a_tiled(x: torch.Tensor, As: list[torch.Tensor], BLOCK_M: int, BLOCK_K: int, K_CHUNK: int,
                  num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    """h [1, M, n*r] (final sums) by the tiled kernel with an explicit config (benchmarks sweep it)."""
    M, K = x.shape
    R, n = As[0].shape[0], len(As)
    S, mt = triton.cdiv(K, K_CHUNK), triton.cdiv(M, BLOCK_M)
    BLOCK_R = max(16, triton.next_power_of_2(R))
    ws, cnt = workspace(x.device, n * S * M * R if S > 1 else 1, n * mt, lane="lora_a")
    h = torch.empty((1, M, n * R), dtype=torch.float32, device=x.device)
    a = list(As) + [As[0]] * (3 - n)
    _lora_a_tiled_kernel[(mt, S, n)](x, a[0], a[1], a[2], h, ws, cnt, M, K, R, n * R, K_CHUNK,
                                     BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K, BF16_DOT=not INTERPRETED,
                                     num_warps=num_warps, num_stages=num_stages, **pdl_args(x.device))
    return h


@torch.library.custom_op("qerl::lora_a", mutates_args=())
def lora_a(x: torch.Tensor, As: list[torch.Tensor]) -> torch.Tensor:
    """Partial sums [S, M, n*r] of x [M, K] times each A_i^T ([r, K], 1 <= n <= 3, equal r):
    h = partial.sum(0) = cat(x A_0^T, x A_1^T, ...), summed by ``lora_out`` (S = 1 from
    LORA_A_DOT_MIN_M rows: the sums are final). fp32."""
    M, K = x.shape
    if M >= LORA_A_DOT_MIN_M:
        return _lora_a_tiled(x, As, **lora_a_tiled_config(M, K, len(As), num_sms(x.device), As[0].shape[0]))
    R = As[0].shape[0]
    n = len(As)
    chunk = lora_a_chunk(M, K)
    S = triton.cdiv(K, chunk)
    BLOCK_M = min(16, triton.next_power_of_2(M))
    BLOCK_R = triton.next_power_of_2(R) if INTERPRETED else 2  # GPU: many small programs; interpreter: few
    BLOCK_K = min(chunk, triton.next_power_of_2(K))
    h = torch.empty((S, M, n * R), dtype=torch.float32, device=x.device)
    a = list(As) + [As[0]] * (3 - n)
    grid = (n * triton.cdiv(R, BLOCK_R), S, triton.cdiv(M, BLOCK_M))
    _lora_a_kernel[grid](x, a[0], a[1], a[2], h, M, K, R, n * R, K_CHUNK=chunk, BLOCK_M=BLOCK_M,
                         BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K, **pdl_args(x.device))
    return h


@triton.jit
def _lora_tile(y_ptr, B, bias, h_ptr, ms, mm, M, N, cols, mn, i, R, NR, S, rr, mr, scaling,
               HAS_LORA: tl.constexpr, HAS_BIAS: tl.constexpr, USE_DOT: tl.constexpr, SB: tl.constexpr):
    """Rows ``ms`` of output i, columns ``cols``: y + bias + scaling * h B^T in fp32, [ROWS, BLOCK_N]
    (h: the sum of the S partial sums of lora_a, SB of them a load, added in a fixed order)."""
    msk = mm[:, None] & mn[None, :]
    y = tl.load(y_ptr + ms[:, None].to(tl.int64) * N + cols[None, :], mask=msk, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += bias[None, :]
    if HAS_LORA:
        h = tl.zeros((ms.shape[0], rr.shape[0]), dtype=tl.float32)
        sb = tl.arange(0, SB)
        for s0 in range(0, S, SB):  # [SB, ROWS, r] partial sums a load (one load for S <= SB)
            ss = s0 + sb
            hp = tl.load(h_ptr + ((ss[:, None, None] * M + ms[None, :, None]).to(tl.int64) * NR + i * R
                                  + rr[None, None, :]),
                         mask=(ss[:, None, None] < S) & mm[None, :, None] & mr[None, None, :], other=0.0)
            h += tl.sum(hp, axis=0)
        if USE_DOT:  # many rows: one near-fp32 (tf32x3) matmul [ROWS, R] x [R, BLOCK_N]
            y += scaling * tl.dot(h, tl.trans(B), input_precision="tf32x3")
        else:
            y += scaling * tl.sum(h[:, None, :] * B[None, :, :], axis=2)
    return y


@triton.jit
def _lora_out_kernel(y0, y1, y2, b0, b1, b2, c0, c1, c2, h_ptr, out_ptr, M, N0, N1, N2, R, NR, S, scaling,
                     HAS_LORA: tl.constexpr, HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_R: tl.constexpr, ROWS: tl.constexpr, SB: tl.constexpr, PDL: tl.constexpr = False,
                     TO_OUT: tl.constexpr = False, NEXT_A: tl.constexpr = False, an_ptr=None, hn_ptr=None, RN=1,
                     BLOCK_RN: tl.constexpr = 1):
    """Output i = program_id(0) in place (TO_OUT: into out_ptr, one output), columns of program_id(1),
    rows of program_id(2) (ROWS at a time, so that a large batch spreads over programs); or (SILU_MUL,
    one program row) out = SiLU(y0') * y1', and with NEXT_A this column block's share of out A^T for the
    LoRA A [RN, N] of the Linear it feeds (down_proj): hn[program_id(1), rows, :RN], fp32 partial sums."""
    pdl_enter(PDL)
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ms = tl.program_id(2) * ROWS + tl.arange(0, ROWS)
    mm = ms < M
    rr = tl.arange(0, BLOCK_R)
    mr = rr < R
    N = _pick(i, N0, N1, N2)
    mn = cols < N
    B, B1, bias, bias1 = 0.0, 0.0, 0.0, 0.0
    if HAS_LORA:
        B = tl.load(_pick(i, b0, b1, b2) + cols[:, None].to(tl.int64) * R + rr[None, :],
                    mask=mn[:, None] & mr[None, :], other=0.0).to(tl.float32)
        if SILU_MUL:
            B1 = tl.load(b1 + cols[:, None].to(tl.int64) * R + rr[None, :], mask=mn[:, None] & mr[None, :],
                         other=0.0).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(_pick(i, c0, c1, c2) + cols, mask=mn, other=0.0).to(tl.float32)
        if SILU_MUL:
            bias1 = tl.load(c1 + cols, mask=mn, other=0.0).to(tl.float32)
    y_ptr = _pick(i, y0, y1, y2)
    TY: tl.constexpr = y0.dtype.element_ty
    USE_DOT: tl.constexpr = ROWS >= 16 and BLOCK_R >= 16
    y = _lora_tile(y_ptr, B, bias, h_ptr, ms, mm, M, N, cols, mn, i, R, NR, S, rr, mr, scaling, HAS_LORA, HAS_BIAS,
                   USE_DOT, SB)
    offs = ms[:, None].to(tl.int64) * N + cols[None, :]
    if SILU_MUL:  # y is the gate rows; the up rows are output 1; HF rounding of each step
        g = _rnd(y, TY).to(tl.float32)
        u = _rnd(_lora_tile(y1, B1, bias1, h_ptr, ms, mm, M, N, cols, mn, 1, R, NR, S, rr, mr, scaling,
                            HAS_LORA, HAS_BIAS, USE_DOT, SB), TY).to(tl.float32)
        act = _rnd(g / (1.0 + tl.exp(-g)), TY).to(tl.float32)
        o = _rnd(act * u, TY)
        tl.store(out_ptr + offs, o, mask=mm[:, None] & mn[None, :])
        if NEXT_A:  # [ROWS, BLOCK_N] x [BLOCK_N, RN]: the rows' partial sums over these columns
            rn = tl.arange(0, BLOCK_RN)
            an = tl.load(an_ptr + rn[None, :].to(tl.int64) * N + cols[:, None], mask=mn[:, None] & (rn < RN)[None, :],
                         other=0.0).to(tl.float32)
            of = tl.where(mm[:, None] & mn[None, :], o.to(tl.float32), 0.0)
            part = tl.sum(of[:, :, None] * an[None, :, :], axis=1)
            tl.store(hn_ptr + (tl.program_id(1) * M + ms[:, None]).to(tl.int64) * RN + rn[None, :], part,
                     mask=mm[:, None] & (rn < RN)[None, :])
    elif TO_OUT:
        tl.store(out_ptr + offs, _rnd(y, TY), mask=mm[:, None] & mn[None, :])
    else:
        tl.store(y_ptr + offs, _rnd(y, TY), mask=mm[:, None] & mn[None, :])


# Rows a lora_out program takes: up to 4 at small M (a broadcast product), from 16 rows up to
# LORA_OUT_DOT_ROWS in one program with a near-fp32 (tf32x3) tl.dot (each B tile then read once per column block,
# not once per 4 rows). Before: one program looped over all M rows; at M = 64 the 7B decode step
# spent 9.8 ms in qerl's fused kernels (results/decode_profile/h100_profile_decode_69e04ba.log),
# 5.4 ms with 4-row programs (h100_profile_decode_0f3b7a2.log: lora_out 3.2 ms).
# From 16 rows at rank >= 16 (an H100 sweep over the 7B groups, results/decode_profile/NOTES.md): 16-row
# tiles up to 32 rows, 64 above; 32 columns a program up to 128 rows, 64 otherwise.
LORA_OUT_ROWS = 4
LORA_OUT_DOT_ROWS = 64
LORA_OUT_H_FLOATS = 8192


def _lora_out_launch(ys, h, Bs, biases, scaling, out=None, BLOCK_N=None, ROWS=None, num_warps=4, dest=None,
                     next_A=None, next_h=None):
    """The lora_out / lora_silu_mul launch; BLOCK_N / ROWS / num_warps override the rule (benchmarks sweep them).
    ``dest`` (one output): the result goes there, ``ys[0]`` is only read (the training forward's LoRA)."""
    n, M = len(ys), ys[0].shape[0]
    has_lora, has_bias = h is not None, len(biases) > 0
    R = Bs[0].shape[1] if has_lora else 1
    if ROWS is None:
        ROWS = min(LORA_OUT_ROWS, triton.next_power_of_2(max(M, 1)))
        if M >= 16 and R >= 16:  # at most LORA_OUT_H_FLOATS of h a tile (rank 256 at 64 rows overflowed smem)
            ROWS = min(16 if M <= 32 else LORA_OUT_DOT_ROWS, max(16, LORA_OUT_H_FLOATS // triton.next_power_of_2(R)))
    if BLOCK_N is None:
        BLOCK_N = 32 if 16 <= M <= 128 and R >= 16 else 64
    y = list(ys) + [ys[0]] * (3 - n)
    b = (list(Bs) + [Bs[0]] * (3 - n)) if has_lora else y
    c = (list(biases) + [biases[0]] * (3 - n)) if has_bias else y
    S, NR = (h.shape[0], h.shape[2]) if has_lora else (1, 1)
    Ns = [t.shape[1] for t in y]
    BLOCK_R = triton.next_power_of_2(R)
    # partial sums a load: several at decode batches (one vector load); one at a time in the 16+-row tiles,
    # where a [2, 64, r] block cost registers: lora_out 0.82 -> 1.09 ms a bs64 7B step (H100,
    # results/decode_profile/NOTES.md)
    SB = 1 if ROWS >= 16 else max(1, min(triton.next_power_of_2(S), LORA_OUT_H_BLOCK // (ROWS * BLOCK_R)))
    if dest is not None and (out is not None or n != 1):
        raise ValueError("lora_out: dest takes one output, without the SiLU epilogue")
    grid = (1 if out is not None else n, triton.cdiv(max(Ns), BLOCK_N), max(1, triton.cdiv(M, ROWS)))
    target = out if out is not None else (dest if dest is not None else y[0])
    extra = {"TO_OUT": True} if dest is not None else {}
    if next_A is not None:  # the SiLU epilogue's partial sums of out next_A^T, one a column block
        if out is None:
            raise ValueError("lora_out: next_A needs the SiLU epilogue")
        extra.update(NEXT_A=True, an_ptr=next_A, hn_ptr=next_h, RN=next_A.shape[0],
                     BLOCK_RN=triton.next_power_of_2(next_A.shape[0]))
    _lora_out_kernel[grid](y[0], y[1], y[2], b[0], b[1], b[2], c[0], c[1], c[2], h if has_lora else y[0],
                           target, M, Ns[0], Ns[1], Ns[2], R, NR, S, scaling,
                           HAS_LORA=has_lora, HAS_BIAS=has_bias, SILU_MUL=out is not None, BLOCK_N=BLOCK_N,
                           BLOCK_R=BLOCK_R, ROWS=ROWS, SB=SB, num_warps=num_warps,
                           **pdl_args(ys[0].device), **extra)


@torch.library.custom_op("qerl::lora_out", mutates_args=("ys",))
def lora_out(ys: list[torch.Tensor], h: torch.Tensor | None, Bs: list[torch.Tensor], biases: list[torch.Tensor],
             scaling: float) -> None:
    """In place, for each base output y_i [M, N_i] (1 to 3): y_i += bias_i + scaling * h_i B_i^T,
    with h_i the i-th r columns of ``lora_a``'s partial sums (h None: bias only; biases []: none);
    one rounding to y's dtype."""
    _lora_out_launch(ys, h, Bs, biases, scaling)


@torch.library.custom_op("qerl::lora_out_to", mutates_args=())
def lora_out_to(y: torch.Tensor, h: torch.Tensor, B: torch.Tensor, scaling: float) -> torch.Tensor:
    """A new tensor y + scaling * h B^T (h [1, M, r] final sums, y [M, N]; one rounding to y's dtype):
    ``lora_out`` without touching y, for the training forward (autograd keeps y as it is)."""
    dest = torch.empty_like(y)
    _lora_out_launch([y], h, [B], [], scaling, dest=dest)
    return dest


@torch.library.custom_op("qerl::lora_silu_mul", mutates_args=())
def lora_silu_mul(gate: torch.Tensor, up: torch.Tensor, h: torch.Tensor | None, Bs: list[torch.Tensor],
                  biases: list[torch.Tensor], scaling: float) -> torch.Tensor:
    """SiLU(g) * u with g, u = ``lora_out`` of the base outputs gate and up (their LoRA in h's
    columns 0 and 1), each rounded to gate.dtype as HF's separate modules would: one launch for
    the MLP's two epilogues and its activation."""
    out = torch.empty_like(gate)
    _lora_out_launch([gate, up], h, Bs, biases, scaling, out=out)
    return out


# Columns a lora_silu_mul_lora_a program takes: its partial sums of the down LoRA A product are one a column
# block, which down's lora_out then adds (fewer, wider blocks: fewer partials for it to read).
SILU_LORA_A_BLOCK_N = 128


@torch.library.custom_op("qerl::lora_silu_mul_lora_a", mutates_args=())
def lora_silu_mul_lora_a(gate: torch.Tensor, up: torch.Tensor, h: torch.Tensor | None, Bs: list[torch.Tensor],
                         biases: list[torch.Tensor], scaling: float,
                         next_A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``lora_silu_mul`` and, in the same launch, the LoRA A product of its output for the Linear it feeds
    (down_proj; ``next_A`` [r, N]): (out [M, N], partial sums [S, M, r] fp32 over column blocks, whose sum
    over the first dimension is out next_A^T): the form ``lora_out`` takes for h."""
    M, N = gate.shape
    if next_A.dim() != 2 or next_A.shape[1] != N:
        raise ValueError(f"lora_silu_mul_lora_a: next_A must be [r, {N}], got {tuple(next_A.shape)}")
    out = torch.empty_like(gate)
    BLOCK_N = SILU_LORA_A_BLOCK_N
    hn = torch.empty((triton.cdiv(N, BLOCK_N), M, next_A.shape[0]), dtype=torch.float32, device=gate.device)
    _lora_out_launch([gate, up], h, Bs, biases, scaling, out=out, BLOCK_N=BLOCK_N, num_warps=8,
                     next_A=next_A.contiguous(), next_h=hn)
    return out, hn


# ----------------------------------------------------------------------------------------------
# q/k/v bias + LoRA epilogue + rotary + KV-cache write, one launch (the few-row decode step, opt-in)
#
# Measured slower from 16 rows as 16-row tiles with a tl.dot per half head (55597b5, reverted in 08776fd: a
# bs16 step's fused kernels 1.225 -> 1.304 ms, H100): here for decode batches, up to LORA_OUT_ROWS rows a program
# with lora_out's broadcast product, so the step saves q/k/v's lora_out launch.


@triton.jit
def _lora_cols(y_ptr, b_ptr, c_ptr, h_ptr, ms, mm, M, N, cols, mn, i, R, NR, S, rr, mr, scaling,
               HAS_LORA: tl.constexpr, HAS_BIAS: tl.constexpr, SB: tl.constexpr, TY: tl.constexpr):
    """Rows ms, columns cols of output i with its bias and LoRA term (lora_out's arithmetic), rounded to
    TY as lora_out stores it, returned in fp32."""
    B, bias = 0.0, 0.0
    if HAS_LORA:
        B = tl.load(b_ptr + cols[:, None].to(tl.int64) * R + rr[None, :], mask=mn[:, None] & mr[None, :],
                    other=0.0).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(c_ptr + cols, mask=mn, other=0.0).to(tl.float32)
    y = _lora_tile(y_ptr, B, bias, h_ptr, ms, mm, M, N, cols, mn, i, R, NR, S, rr, mr, scaling, HAS_LORA, HAS_BIAS,
                   False, SB)
    return _rnd(y, TY).to(tl.float32)


@triton.jit
def _head_norm_rows(x1, x2, w_ptr, offs, m, eps, HEAD_DIM: tl.constexpr, TY: tl.constexpr):
    """_head_norm on [rows, half] tiles (one head a row)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    var = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM
    r = tl.rsqrt(var + eps)[:, None]
    w1 = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + HALF + offs, mask=m, other=0.0).to(tl.float32)[None, :]
    x1 = _rnd(_rnd(x1 * r, TY).to(tl.float32) * w1, TY).to(tl.float32)
    x2 = _rnd(_rnd(x2 * r, TY).to(tl.float32) * w2, TY).to(tl.float32)
    return x1, x2


@triton.jit
def _lora_rope_cache_kernel(q_ptr, k_ptr, v_ptr, b0, b1, b2, bi0, bi1, bi2, h_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr,
                            q_out_ptr, kc_ptr, vc_ptr, cpos_ptr, M, L, R, NR, S, scaling, eps,
                            NH: tl.constexpr, NKV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
                            BLOCK_R: tl.constexpr, ROWS: tl.constexpr, SB: tl.constexpr, HAS_LORA: tl.constexpr,
                            HAS_BIAS: tl.constexpr, QK_NORM: tl.constexpr, PDL: tl.constexpr = False):
    """Program (row tile, head): the head's columns of q (or k and v) plus bias and LoRA, rounded as
    lora_out rounds them, then rotated (after Qwen3's head norm) as _rope_cache_kernel does."""
    pdl_enter(PDL)
    TY: tl.constexpr = q_out_ptr.dtype.element_ty
    HALF: tl.constexpr = HEAD_DIM // 2
    ms = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    mm = ms < M
    hd = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    m = offs < HALF
    rr = tl.arange(0, BLOCK_R)
    mr = rr < R
    cm = mm[:, None] & m[None, :]
    cs = ms.to(tl.int64)[:, None] * HEAD_DIM + offs[None, :]
    c1 = tl.load(cos_ptr + cs, mask=cm, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + cs + HALF, mask=cm, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + cs, mask=cm, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + cs + HALF, mask=cm, other=0.0).to(tl.float32)
    if hd < NH:  # a query head: rotated into q_out [M, NH, 1, HEAD_DIM]
        col = hd * HEAD_DIM + offs
        x1 = _lora_cols(q_ptr, b0, bi0, h_ptr, ms, mm, M, NH * HEAD_DIM, col, m, 0, R, NR, S, rr, mr, scaling,
                        HAS_LORA, HAS_BIAS, SB, TY)
        x2 = _lora_cols(q_ptr, b0, bi0, h_ptr, ms, mm, M, NH * HEAD_DIM, col + HALF, m, 0, R, NR, S, rr, mr, scaling,
                        HAS_LORA, HAS_BIAS, SB, TY)
        if QK_NORM:
            x1, x2 = _head_norm_rows(x1, x2, qn_ptr, offs, m, eps, HEAD_DIM, TY)
        y1, y2 = _rope(x1, x2, c1, c2, s1, s2, TY)
        dst = q_out_ptr + (ms.to(tl.int64)[:, None] * NH + hd) * HEAD_DIM + offs[None, :]
        tl.store(dst, y1, mask=cm)
        tl.store(dst + HALF, y2, mask=cm)
    else:  # a key/value head: rotated k and v into cache[row, kh, cpos]
        kh = hd - NH
        col = kh * HEAD_DIM + offs
        x1 = _lora_cols(k_ptr, b1, bi1, h_ptr, ms, mm, M, NKV * HEAD_DIM, col, m, 1, R, NR, S, rr, mr, scaling,
                        HAS_LORA, HAS_BIAS, SB, TY)
        x2 = _lora_cols(k_ptr, b1, bi1, h_ptr, ms, mm, M, NKV * HEAD_DIM, col + HALF, m, 1, R, NR, S, rr, mr, scaling,
                        HAS_LORA, HAS_BIAS, SB, TY)
        if QK_NORM:
            x1, x2 = _head_norm_rows(x1, x2, kn_ptr, offs, m, eps, HEAD_DIM, TY)
        y1, y2 = _rope(x1, x2, c1, c2, s1, s2, TY)
        slot = ((ms.to(tl.int64)[:, None] * NKV + kh) * L + tl.load(cpos_ptr)) * HEAD_DIM + offs[None, :]
        tl.store(kc_ptr + slot, y1, mask=cm)
        tl.store(kc_ptr + slot + HALF, y2, mask=cm)
        v1 = _lora_cols(v_ptr, b2, bi2, h_ptr, ms, mm, M, NKV * HEAD_DIM, col, m, 2, R, NR, S, rr, mr, scaling,
                        HAS_LORA, HAS_BIAS, SB, TY)
        v2 = _lora_cols(v_ptr, b2, bi2, h_ptr, ms, mm, M, NKV * HEAD_DIM, col + HALF, m, 2, R, NR, S, rr, mr, scaling,
                        HAS_LORA, HAS_BIAS, SB, TY)
        tl.store(vc_ptr + slot, v1.to(TY), mask=cm)
        tl.store(vc_ptr + slot + HALF, v2.to(TY), mask=cm)


@torch.library.custom_op("qerl::lora_rope_cache_write", mutates_args=("k_cache", "v_cache"))
def lora_rope_cache_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, h: torch.Tensor | None,
                          Bs: list[torch.Tensor], biases: list[torch.Tensor], scaling: float, cos: torch.Tensor,
                          sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cpos: torch.Tensor,
                          q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``lora_out([q, k, v], h, Bs, biases, scaling)`` then ``rope_cache_write`` in one launch, with the
    same arithmetic and roundings; q / k / v (the base outputs) are read, not written."""
    B, NKV, L, D = k_cache.shape
    NH = q.shape[1] // D
    q_out = torch.empty((B, NH, 1, D), dtype=q.dtype, device=q.device)
    has_lora, has_bias, has_norm = h is not None, len(biases) > 0, q_norm is not None
    R = Bs[0].shape[1] if has_lora else 1
    S, NR = (h.shape[0], h.shape[2]) if has_lora else (1, 1)
    ROWS = min(LORA_OUT_ROWS, triton.next_power_of_2(max(B, 1)))
    BLOCK_R = triton.next_power_of_2(R)
    SB = max(1, min(triton.next_power_of_2(S), LORA_OUT_H_BLOCK // (ROWS * BLOCK_R)))
    b = list(Bs) if has_lora else [q] * 3
    c = list(biases) if has_bias else [q] * 3
    _lora_rope_cache_kernel[(triton.cdiv(B, ROWS), NH + NKV)](
        q, k, v, b[0], b[1], b[2], c[0], c[1], c[2], h if has_lora else q, cos, sin,
        q_norm if has_norm else q, k_norm if has_norm else q, q_out, k_cache, v_cache, cpos, B, L, R, NR, S,
        float(scaling), eps, NH=NH, NKV=NKV, HEAD_DIM=D, BLOCK=triton.next_power_of_2(D // 2),
        BLOCK_R=BLOCK_R, ROWS=ROWS, SB=SB, HAS_LORA=has_lora, HAS_BIAS=has_bias, QK_NORM=has_norm,
        **pdl_args(q.device))
    return q_out


# ----------------------------------------------------------------------------------------------
# fakes: each op's outputs (shapes, dtypes, devices) without a launch, so the ops trace under
# torch.compile and run under FakeTensorMode as the 4-bit linears do


@rmsnorm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


@add_rmsnorm.register_fake
def _(res, delta, weight, eps):
    return torch.empty_like(res), torch.empty_like(res)


@add_rmsnorm_lora_a.register_fake
def _(res, delta, weight, eps, As):
    h = res.new_empty((1, res.shape[0], len(As) * As[0].shape[0]), dtype=torch.float32)
    return torch.empty_like(res), torch.empty_like(res), h


@rope_cache_write.register_fake
def _(q, k, v, cos, sin, k_cache, v_cache, cpos, q_norm, k_norm, eps):
    B, _, _, D = k_cache.shape
    return q.new_empty((B, q.shape[1] // D, 1, D))


@silu_mul.register_fake
def _(gate, up):
    return torch.empty_like(gate)


@lora_a.register_fake
def _(x, As):
    M, K = x.shape
    S = 1 if M >= LORA_A_DOT_MIN_M else triton.cdiv(K, lora_a_chunk(M, K))
    return x.new_empty((S, M, len(As) * As[0].shape[0]), dtype=torch.float32)


@lora_out.register_fake
def _(ys, h, Bs, biases, scaling):
    return None


@lora_out_to.register_fake
def _(y, h, B, scaling):
    return torch.empty_like(y)


@lora_silu_mul.register_fake
def _(gate, up, h, Bs, biases, scaling):
    return torch.empty_like(gate)


@lora_rope_cache_write.register_fake
def _(q, k, v, h, Bs, biases, scaling, cos, sin, k_cache, v_cache, cpos, q_norm, k_norm, eps):
    B, _, _, D = k_cache.shape
    return q.new_empty((B, q.shape[1] // D, 1, D))


@lora_silu_mul_lora_a.register_fake
def _(gate, up, h, Bs, biases, scaling, next_A):
    M, N = gate.shape
    return torch.empty_like(gate), gate.new_empty((triton.cdiv(N, SILU_LORA_A_BLOCK_N), M, next_A.shape[0]),
                                                  dtype=torch.float32)
