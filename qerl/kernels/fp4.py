"""Triton W4A16 kernels for NVFP4 and MXFP4 weights in the compressed-tensors layout.

Weights stay exactly as on disk (CONTRACTS.md): ``weight_packed`` uint8 [N, K/2] (element 2j in
the low nibble of byte j), ``weight_scale`` [N, K/B] (NVFP4: float8_e4m3fn, B=16; MXFP4: uint8
E8M0, B=32), and for NVFP4 ``weight_global_scale`` fp32 [1], a divisor.

Sections, in order: bit decoding helpers, the split-K epilogue, the jitted kernels, config
choice, Python launchers (fused kernels, the decode + cuBLAS scratch path, per-layer plans), and
the torch.library custom ops (with fake and autograd registrations so they work under
torch.compile and CUDA graphs).

Kernels:
  - ``_fwd_gemv_kernel``: y = x W^T for M <= GEMV_MAX_M (decode). Weights read as int32 words and
    decoded two at a time into bf16x2 with packed integer ops (inline PTX), bf16x2 FMAs per word,
    fp32 across words; split-K over the reduction for parallelism. See the GEMV section.
  - ``_fwd_dot_kernel``: y = x W^T with ``tl.dot`` (tensor cores): tiled GEMM for mid M, and
    with BLOCK_M=16 plus split-K for skinny M. By default "swap AB": the tile is computed as
    (W x^T)^T, so the decoded weight is wgmma's register operand A and x, pipelined into shared
    memory, operand B.
  - ``_bwd_dot_kernel``: dx = dy W with ``tl.dot`` (only when asked for: kind="fused").
  - ``_decode_kernel``: W (or a block of it) -> a dense bf16 / fp32 buffer, bit for bit
    qerl.formats.dequantize. From M = SCRATCH_MIN_M the forward, and grad-input at every M, decode
    the weight into a transient scratch (one per device and dtype) and call cuBLAS.

Decoding is by hand (Triton 3.6's ``tl.dot_scaled`` does not compile e4m3 scales on sm_90). In
the tensor-core kernels (``_weight_tile``) an E2M1 code c is placed in the bits of a bf16 so that
its value is exactly c * 2^-126 (magnitude bits at the bottom of the exponent field, so E2M1's
subnormal 0.5 lands on a bf16 subnormal), and multiplied by its block scale, decoded to a bf16
equal to scale * 2^119 (E4M3) or 2^(e-127) * 2^64 (E8M0; e=0, used only by all-zero blocks,
decodes to 0): one bf16 multiply per weight, exact (2 + 4 significant bits, a normal result),
so the tensor-core operand is exact and the only rounding is the fp32 accumulation. The GEMV
has its own packed decode (below). The constant powers of two and the NVFP4 global divisor are
applied once, in the epilogue.

Split-K partial sums are reduced without extra launches. By default in a fixed order: each program
stores its fp32 partial tile in its own slice of a per-device workspace, bumps a per-tile counter,
and the last program to arrive sums the slices in split order, stores the output in x.dtype and
resets the counter, so results are bitwise repeatable. QERL_SPLITK_ATOMIC=1 selects fp32 atomics in
arrival order instead (one zeroed [M, N] slice). Workspaces grow (a fresh allocation, the old one
retired, never freed) only when a larger launch is seen, so warm up once before capturing a CUDA
graph.
"""

from __future__ import annotations

import os
import weakref

import torch
import triton
import triton.language as tl

from qerl.kernels import fp4_mma

# ----------------------------------------------------------------------------------------------
# bit decoding


@triton.jit
def _decode_scale(s, IS_NV: tl.constexpr):
    """Scale bytes -> fp32: E4M3 value times 2^-8 (NVFP4) or 2^(e-127) (MXFP4 E8M0)."""
    s = s.to(tl.int32)
    if IS_NV:
        h = (((s & 0x7F) << 7) | ((s & 0x80) << 8)).to(tl.int16).to(tl.float16, bitcast=True)
        return h.to(tl.float32)
    else:
        return (s << 23).to(tl.float32, bitcast=True)


@triton.jit
def _dot(a, b, acc, F32_DOT: tl.constexpr):
    """acc += a @ b; F32_DOT (set under TRITON_INTERPRET, whose bf16 tl.dot returns garbage in
    triton 3.9) multiplies in fp32 instead, exactly as the bf16 tensor cores would."""
    if F32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


# ----------------------------------------------------------------------------------------------
# epilogue


@triton.jit
def _epilogue(acc, out_ptr, ws_ptr, cnt_ptr, offs_m, offs_n, M, N, stride_om, tile_id,
              ATOMIC: tl.constexpr = False):
    """Store acc [BM, BN] (already scaled) directly, or reduce it across the split-K programs.

    Default (deterministic): each split stores its partial tile in its own slice of the fp32
    workspace [split, M, N], bumps the tile's counter, and the last program to arrive adds the
    slices in split order 0, 1, ... (the same order whoever arrives last), so the result is
    bitwise repeatable. ATOMIC (opt-in, QERL_SPLITK_ATOMIC=1): fp32 atomics into one [M, N]
    slice in arrival order (not repeatable), which the last arriver reads and zeroes."""
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    n_split = tl.num_programs(1)
    if n_split == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    elif ATOMIC:
        ws_ptrs = ws_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.atomic_add(ws_ptrs, acc, mask=mask, sem="relaxed")
        # acq_rel: our adds are visible before the count, and the last arriver sees everyone's.
        count = tl.atomic_add(cnt_ptr + tile_id, 1, sem="acq_rel")
        if count == n_split - 1:
            # Read the sum where the atomics left it (L2), then zero it for the next call: every
            # other program of this tile is done, so a plain store cannot race.
            total = tl.atomic_add(ws_ptrs, tl.zeros_like(acc), mask=mask, sem="relaxed")
            tl.store(ws_ptrs, tl.zeros_like(acc), mask=mask)
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(cnt_ptr + tile_id, 0)
    else:
        pid_k = tl.program_id(1).to(tl.int64)
        mn = (pid_k * 0 + M) * N  # int64 (M may be the constant 1 when Triton specialises it)
        offs = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
        tl.store(ws_ptr + pid_k * mn + offs, acc, mask=mask)
        # acq_rel: our partial is visible before the count; the last arriver sees every partial.
        count = tl.atomic_add(cnt_ptr + tile_id, 1, sem="acq_rel")
        if count == n_split - 1:
            total = tl.zeros_like(acc)
            for i in range(0, n_split):  # fixed order: bitwise the same result every call
                total += tl.load(ws_ptr + i * mn + offs, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(cnt_ptr + tile_id, 0)


# ----------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _tile_scale(s, IS_NV: tl.constexpr):
    """Scale bytes -> fp32 block scale times 2^119 (NVFP4 E4M3) or 2^64 (MXFP4 E8M0), exactly.

    Times a code from _e2m1_bits (code * 2^-126) this gives the weight times 2^-7 (NVFP4, before
    the global divisor) or 2^-62 (MXFP4): exact in bf16 (2 + 4 significant bits) and a normal
    number. E8M0 byte 0 (all-zero blocks) decodes to 0; MXFP4 scales above 2^63 would overflow
    (no real weight has |w| > 6 * 2^63)."""
    s = s.to(tl.int32)
    if IS_NV:
        f = (((s & 0x7F) << 20) | ((s & 0x80) << 24)).to(tl.float32, bitcast=True)  # E4M3 * 2^-120
        return f * 1.329227995784916e36 * 6.646139978924579e35  # * 2^120 * 2^119
    else:
        return (s << 23).to(tl.float32, bitcast=True) * 18446744073709551616.0  # 2^(e-127) * 2^64


@triton.jit
def _e2m1_bits(b, F32: tl.constexpr):
    """Packed bytes -> (low nibble, high nibble) equal to code * 2^-126: the E2M1 bits s e1 e0 m
    placed at bits 15 and 8..6 of a bf16 (code 0.5 lands on a bf16 subnormal, which the bf16
    multiply keeps), or with F32 at bits 31 and 24..22 of an fp32 (same values)."""
    if F32:
        b = b.to(tl.int32)
        lo = (((b & 0x7) << 22) | ((b & 0x8) << 28)).to(tl.float32, bitcast=True)
        hi = (((b & 0x70) << 18) | ((b & 0x80) << 24)).to(tl.float32, bitcast=True)
    else:
        b = b.to(tl.int16)
        lo = (((b & 0x7) << 6) | ((b & 0x8) << 12)).to(tl.bfloat16, bitcast=True)
        hi = (((b & 0x70) << 2) | ((b & 0x80) << 8)).to(tl.bfloat16, bitcast=True)
    return lo, hi


@triton.jit
def _weight_tile(b, s, HB: tl.constexpr, IS_NV: tl.constexpr, MODE: tl.constexpr):
    """Packed bytes [R, C] and their block-scale bytes [R, C / HB] -> tile [R, 2C] equal to the
    weight times 2^-7 (NVFP4) or 2^-62 (MXFP4), exactly, with one multiply per weight.
    MODE 0: fp32 (the interpreter, whose bf16 flushes subnormals); 1: bf16 (HMUL2, two weights
    at a time). (An inline-PTX nibble decode, four bytes at a time, gave wrong tiles on the H100
    in every configuration of the 2026-11-22 sweep and was not faster than MODE 1: removed.)"""
    R: tl.constexpr = b.shape[0]
    C: tl.constexpr = b.shape[1]
    sc = _tile_scale(s, IS_NV)
    if MODE != 0:
        sc = sc.to(tl.bfloat16)
    sc = tl.reshape(tl.broadcast_to(sc[:, :, None], (R, C // HB, HB)), (R, C))
    lo, hi = _e2m1_bits(b, MODE == 0)
    # join + reshape interleaves (lo_j, hi_j) -> elements 2j, 2j+1 along K.
    return tl.reshape(tl.join(lo * sc, hi * sc), (R, 2 * C))


@triton.jit
def _alpha_bf16(gs_ptr, IS_NV: tl.constexpr):
    """The epilogue multiplier undoing _weight_tile's powers of two (and the NVFP4 divisor)."""
    if IS_NV:
        return 128.0 / tl.load(gs_ptr)  # 2^7 / global_scale
    else:
        return 4611686018427387904.0  # 2^62


@triton.jit
def _fwd_dot_kernel(x_ptr, w_ptr, s_ptr, gs_ptr, out_ptr, ws_ptr, cnt_ptr,
                    M, N, K, stride_xm, stride_om, tiles_per_split,
                    IS_NV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SWAP_AB: tl.constexpr,
                    EVEN_K: tl.constexpr, F32_DOT: tl.constexpr, ATOMIC: tl.constexpr = False):
    """y = x W^T with tensor cores. Grid (cdiv(M, BM) * cdiv(N, BN), split_k).

    SWAP_AB computes the tile as (W x^T)^T: the decoded weight is then the register operand A of
    wgmma (no trip through shared memory) and x the shared-memory operand B, which also lets
    16-row tiles use the 64-row wgmma without padding M. Rows past M or N are clamped (their
    loads read valid memory, their results are never stored), so only a ragged K needs masks."""
    HB: tl.constexpr = 8 if IS_NV else 16
    BKH: tl.constexpr = BLOCK_K // 2
    NBK: tl.constexpr = BKH // HB
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    # Grouped ordering: GROUP_M row-tiles share each weight column-tile while it is in L2.
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    group_size = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_size
    pid_n = (pid % width) // group_size
    KH = K // 2
    NB = KH // HB
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_kh = tl.arange(0, BKH)
    offs_b = tl.arange(0, NBK)
    x_rows = x_ptr + tl.minimum(offs_m, M - 1).to(tl.int64)[:, None] * stride_xm
    n_ld = tl.minimum(offs_n, N - 1).to(tl.int64)
    w_rows = w_ptr + n_ld[:, None] * KH
    s_rows = s_ptr + n_ld[:, None] * NB
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    t0 = pid_k * tiles_per_split
    t1 = tl.minimum(t0 + tiles_per_split, tl.cdiv(K, BLOCK_K))
    for t in range(t0, t1):
        kk = t * BLOCK_K + offs_k
        kh = t * BKH + offs_kh
        blk = t * NBK + offs_b
        if EVEN_K:
            x = tl.load(x_rows + kk[None, :])
            b = tl.load(w_rows + kh[None, :])
            s = tl.load(s_rows + blk[None, :])
        else:
            x = tl.load(x_rows + kk[None, :], mask=kk[None, :] < K, other=0.0)
            b = tl.load(w_rows + kh[None, :], mask=kh[None, :] < KH, other=0)
            s = tl.load(s_rows + blk[None, :], mask=blk[None, :] < NB, other=0)
        w = _weight_tile(b, s, HB, IS_NV, 0 if F32_DOT else 1).to(x.dtype)
        if SWAP_AB:
            acc = _dot(w, tl.trans(x), acc, F32_DOT)
        else:
            acc = _dot(x, tl.trans(w), acc, F32_DOT)
    if SWAP_AB:
        acc = tl.trans(acc)
    acc = acc * _alpha_bf16(gs_ptr, IS_NV)
    _epilogue(acc, out_ptr, ws_ptr, cnt_ptr, offs_m, offs_n, M, N, stride_om, pid, ATOMIC)


@triton.jit
def _e2m1_fp32(b):
    """Packed bytes (int32) -> (low nibble, high nibble) as fp32 values times 2^-14 (via fp16 bits)."""
    lo = (((b & 0x7) << 9) | ((b & 0x8) << 12)).to(tl.int16).to(tl.float16, bitcast=True)
    hi = (((b & 0x70) << 5) | ((b & 0x80) << 8)).to(tl.int16).to(tl.float16, bitcast=True)
    return lo.to(tl.float32), hi.to(tl.float32)


@triton.jit
def _bwd_dot_kernel(dy_ptr, w_ptr, s_ptr, gs_ptr, dx_ptr,
                    M, N, K, stride_dym, stride_dxm,
                    IS_NV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                    BLOCK_R: tl.constexpr, GROUP_M: tl.constexpr, F32_DOT: tl.constexpr):
    """dx = dy W, reducing over N in BLOCK_R chunks. Grid (cdiv(M, BM) * cdiv(K, BK),).

    This is the c567ac0 kernel (masked loads, one scale load per packed byte, fp32 decode): on the
    H100 it measured 0.23x bf16 for the 7B layer at M = 2048, against 0.19x for the best config of
    the rewrite (clamped loads, per-block scale broadcast, swap-AB, bf16 decode) that replaced it
    for a while (results/kernels/NOTES.md)."""
    HB: tl.constexpr = 8 if IS_NV else 16
    BKH: tl.constexpr = BLOCK_K // 2
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_k = tl.cdiv(K, BLOCK_K)
    width = GROUP_M * num_k
    first_m = (pid // width) * GROUP_M
    group_size = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_size
    pid_k = (pid % width) // group_size
    KH = K // 2
    NB = KH // HB
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_kh = pid_k * BKH + tl.arange(0, BKH)
    offs_r = tl.arange(0, BLOCK_R)
    m_mask = offs_m < M
    kh_mask = offs_kh < KH
    dy_rows = dy_ptr + offs_m.to(tl.int64)[:, None] * stride_dym
    acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for r0 in range(0, N, BLOCK_R):
        rr = r0 + offs_r
        r_mask = rr < N
        dy = tl.load(dy_rows + rr[None, :], mask=m_mask[:, None] & r_mask[None, :], other=0.0)
        w_mask = r_mask[:, None] & kh_mask[None, :]
        b = tl.load(w_ptr + rr.to(tl.int64)[:, None] * KH + offs_kh[None, :], mask=w_mask, other=0)
        s = tl.load(s_ptr + rr.to(tl.int64)[:, None] * NB + (offs_kh // HB)[None, :], mask=w_mask, other=0)
        sc = _decode_scale(s, IS_NV)
        lo, hi = _e2m1_fp32(b.to(tl.int32))
        w = tl.reshape(tl.join(lo * sc, hi * sc), (BLOCK_R, BLOCK_K)).to(dy.dtype)
        acc = _dot(dy, w, acc, F32_DOT)
    if IS_NV:
        acc = acc * (4194304.0 / tl.load(gs_ptr))  # 2^(14+8) / global_scale
    else:
        acc = acc * 16384.0  # 2^14
    mask = m_mask[:, None] & (offs_k[None, :] < K)
    tl.store(dx_ptr + offs_m.to(tl.int64)[:, None] * stride_dxm + offs_k[None, :],
             acc.to(dx_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# decode to a dense bf16 / fp32 weight (the scratch path: decode, then cuBLAS)


@triton.jit
def _e2m1_value(c):
    """E2M1 codes (int32, 0..15) -> their fp32 values, built as normal fp32 bit patterns (no
    subnormal operand anywhere, so no flush-to-zero can change them); code 8 is -0.0, as
    qerl.formats decodes it."""
    mag = c & 7
    bits = tl.where(mag >= 2, (mag << 22) + (126 << 23), tl.where(mag == 1, 0x3F000000, 0))
    return (bits | ((c & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _block_step(s, gs, IS_NV: tl.constexpr):
    """Scale bytes (int32) -> the fp32 step of qerl.formats: E4M3 / global_scale (IEEE division,
    NaN for 0x7F / 0xFF) or 2^(e-127) (NaN for 0xFF), bit for bit."""
    if IS_NV:
        h = ((s & 0x7F) << 7).to(tl.int16).to(tl.float16, bitcast=True)  # E4M3 * 2^-8, exact
        v = h.to(tl.float32) * 256.0
        v = tl.where((s & 0x80) != 0, -v, v)
        v = tl.where((s & 0x7F) == 0x7F, float("nan"), v)
        return tl.math.div_rn(v, gs)
    else:
        v = tl.where(s == 0, 0x00400000, s << 23).to(tl.float32, bitcast=True)  # 2^-127: subnormal
        return tl.where(s == 255, float("nan"), v)


@triton.jit
def _round_to(v, dtype: tl.constexpr):
    """fp32 -> dtype; bf16 by round-to-nearest-even on the bits (what torch's cast does; the
    interpreter's own bf16 cast truncates), NaN stays NaN."""
    if dtype == tl.bfloat16:
        bits = v.to(tl.int32, bitcast=True)
        r = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        r = tl.where(v != v, 0x7FC0, r)
        return r.to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return v.to(dtype)


@triton.jit
def _decode_tile(w_ptr, s_ptr, gs_ptr, KH, row0, col0, n_rows, n_blocks, IS_NV: tl.constexpr, BLOCK_N: tl.constexpr,
                 NBK: tl.constexpr, EVEN: tl.constexpr):
    """The tile of program (program_id 0, program_id 1) of the decode kernels: its rows r (relative to
    row0), scale blocks blk (relative to col0's block), packed bytes b [BLOCK_N, NBK, HB] (int32; HB
    bytes of one block contiguous in a thread) and their fp32 steps [BLOCK_N, NBK, 1]. ``n_blocks``:
    scale blocks in the decoded column range (masks when not EVEN)."""
    HB: tl.constexpr = 8 if IS_NV else 16
    NB = KH // HB
    r = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    blk = tl.program_id(1) * NBK + tl.arange(0, NBK)
    j = tl.arange(0, HB)
    rows = (row0 + r).to(tl.int64)
    blk_in = (col0 // (2 * HB)) + blk
    w_ptrs = w_ptr + rows[:, None, None] * KH + blk_in[None, :, None] * HB + j[None, None, :]
    s_ptrs = s_ptr + rows[:, None] * NB + blk_in[None, :]
    if EVEN:
        b = tl.load(w_ptrs).to(tl.int32)
        s = tl.load(s_ptrs).to(tl.int32)
    else:
        m2 = (r < n_rows)[:, None] & (blk < n_blocks)[None, :]
        b = tl.load(w_ptrs, mask=m2[:, :, None], other=0).to(tl.int32)
        s = tl.load(s_ptrs, mask=m2, other=0).to(tl.int32)
    if IS_NV:
        gs = tl.load(gs_ptr)
    else:
        gs = 1.0
    return r, blk, b, _block_step(s, gs, IS_NV)[:, :, None]


@triton.jit
def _decode_kernel(w_ptr, s_ptr, gs_ptr, out_ptr, KH, row0, col0, n_rows, n_cols, stride_on,
                   IS_NV: tl.constexpr, BLOCK_N: tl.constexpr, NBK: tl.constexpr, EVEN: tl.constexpr):
    """out[r, c] = W[row0 + r, col0 + c] for r < n_rows, c < n_cols (col0 and n_cols multiples of
    the scale block), in out's dtype, equal bit for bit to qerl.formats.dequantize: value * step
    in fp32, one rounding to the output dtype. Grid (cdiv(n_rows, BLOCK_N), cdiv(n_cols, NBK * B)).
    A tile is BLOCK_N rows x NBK scale blocks, loaded as [BLOCK_N, NBK, HB] bytes (HB bytes of one
    block contiguous in a thread) with its [BLOCK_N, NBK] scales."""
    HB: tl.constexpr = 8 if IS_NV else 16  # packed bytes per scale block
    r, blk, b, step = _decode_tile(w_ptr, s_ptr, gs_ptr, KH, row0, col0, n_rows, n_cols // (2 * HB), IS_NV, BLOCK_N,
                                   NBK, EVEN)
    lo = _round_to(_e2m1_value(b & 0xF) * step, out_ptr.dtype.element_ty)
    hi = _round_to(_e2m1_value(b >> 4) * step, out_ptr.dtype.element_ty)
    w = tl.reshape(tl.join(lo, hi), (BLOCK_N, NBK * 2 * HB))
    c = tl.program_id(1) * (NBK * 2 * HB) + tl.arange(0, NBK * 2 * HB)
    o_ptrs = out_ptr + r.to(tl.int64)[:, None] * stride_on + c[None, :]
    if EVEN:
        tl.store(o_ptrs, w)
    else:
        tl.store(o_ptrs, w, mask=(r < n_rows)[:, None] & (c < n_cols)[None, :])


@triton.jit
def _bf16_bits(v):
    """fp32 -> the 16 bits of bf16 by round-to-nearest-even (as torch's cast), NaN -> 0x7FC0, in
    the low half of an int32 (the high half is garbage from the arithmetic shift: mask or shift it off)."""
    bits = v.to(tl.int32, bitcast=True)
    r = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where(v != v, 0x7FC0, r)


@triton.jit
def _decode_pairs_kernel(w_ptr, s_ptr, gs_ptr, out_ptr, KH, row0, col0, n_rows, n_cols, stride_on,
                         IS_NV: tl.constexpr, BLOCK_N: tl.constexpr, NBK: tl.constexpr, EVEN: tl.constexpr):
    """_decode_kernel for bf16 output, writing each packed byte's two weights as one int32 word
    (low nibble's bf16 in the low half: the little-endian order of the pair) into out viewed as
    int32, so a thread's HB words of a block are one contiguous run: no interleave of the two
    nibble tensors (tl.join + reshape) before the store. ``stride_on`` and ``n_cols`` count int32
    words (pairs of weights); the values are bit for bit those of _decode_kernel."""
    HB: tl.constexpr = 8 if IS_NV else 16  # packed bytes (= output words) per scale block
    r, blk, b, step = _decode_tile(w_ptr, s_ptr, gs_ptr, KH, row0, col0, n_rows, n_cols // HB, IS_NV, BLOCK_N, NBK,
                                   EVEN)
    j = tl.arange(0, HB)
    lo = _bf16_bits(_e2m1_value(b & 0xF) * step)
    hi = _bf16_bits(_e2m1_value(b >> 4) * step)
    word = (lo & 0xFFFF) | (hi << 16)
    c = blk[None, :, None] * HB + j[None, None, :]  # output word within the chunk's columns
    o_ptrs = out_ptr + r.to(tl.int64)[:, None, None] * stride_on + c
    if EVEN:
        tl.store(o_ptrs, word)
    else:
        tl.store(o_ptrs, word, mask=(r < n_rows)[:, None, None] & (c < n_cols))


# ----------------------------------------------------------------------------------------------
# GEMV decode (M <= 16): packed integer decode, two weights per 32-bit op
#
# The weights are read as int32 words of 8 nibbles (word w holds elements 8w..8w+7, element 8w+i
# in bits 4i..4i+3). One word becomes four bf16x2 pairs (n3, n7), (n2, n6), (n1, n5), (n0, n4)
# with about four integer ops a pair: an E2M1 code s e1 e0 m placed as bf16 bits
# (s << 15) | (e1 e0 m << 6) is exactly code * 2^-126 (code 0.5 lands on a bf16 subnormal), for
# both halves of the word at once. The activations are read as int32 words of two bf16, paired
# the same way with byte permutes (prmt) and pre-scaled by 2^64 (exact), so that the products
# code * x * 2^-62 are normal numbers; they are multiplied and summed with bf16x2 FMAs (HFMA2)
# over one word (4 products a lane), and the word sums are added in fp32, times the fp32 block
# scale. The powers of two come off in the epilogue. The next tile's loads are issued before the
# current tile is computed (software prefetch by hand: Triton does not pipeline these loads).
# Under TRITON_INTERPRET each asm block is emulated with plain Triton ops (fp32 arithmetic); fp32
# activations take an fp32-FMA path (ACC_F32) on the same decode.

_ASM_DECODE = tl.constexpr("""
{
.reg .b32 a, b;
shr.b32 a, $4, 6;  and.b32 a, a, 0x01C001C0; and.b32 b, $4, 0x80008000; or.b32 $0, a, b;
shr.b32 a, $4, 2;  and.b32 a, a, 0x01C001C0; shl.b32 b, $4, 4; and.b32 b, b, 0x80008000; or.b32 $1, a, b;
shl.b32 a, $4, 2;  and.b32 a, a, 0x01C001C0; shl.b32 b, $4, 8; and.b32 b, b, 0x80008000; or.b32 $2, a, b;
shl.b32 a, $4, 6;  and.b32 a, a, 0x01C001C0; shl.b32 b, $4, 12; and.b32 b, b, 0x80008000; or.b32 $3, a, b;
}
""")

# x words X0..X3 = (x0,x1), (x2,x3), (x4,x5), (x6,x7) -> pairs (x3,x7), (x2,x6), (x1,x5), (x0,x4),
# each times 2^64 (an fma with -0 is an exact multiply)
_ASM_XPAIRS = tl.constexpr("""
{
.reg .b32 c, z, t;
mov.b32 c, 0x5F805F80;
mov.b32 z, 0x80008000;
prmt.b32 t, $5, $7, 0x7632; fma.rn.bf16x2 $0, t, c, z;
prmt.b32 t, $5, $7, 0x5410; fma.rn.bf16x2 $1, t, c, z;
prmt.b32 t, $4, $6, 0x7632; fma.rn.bf16x2 $2, t, c, z;
prmt.b32 t, $4, $6, 0x5410; fma.rn.bf16x2 $3, t, c, z;
}
""")

# sum over one word: 4 bf16x2 weight pairs times 4 bf16x2 activation pairs -> fp32
_ASM_DOT8 = tl.constexpr("""
{
.reg .b32 acc, z, f, g;
mov.b32 z, 0x80008000;
fma.rn.bf16x2 acc, $1, $5, z;
fma.rn.bf16x2 acc, $2, $6, acc;
fma.rn.bf16x2 acc, $3, $7, acc;
fma.rn.bf16x2 acc, $4, $8, acc;
shl.b32 f, acc, 16;
and.b32 g, acc, 0xFFFF0000;
add.f32 $0, f, g;
}
""")

_SIGNS = tl.constexpr(-2147450880)  # 0x80008000 as int32
_HI16 = tl.constexpr(-65536)  # 0xFFFF0000 as int32


@triton.jit
def _decode_words(q, USE_ASM: tl.constexpr):
    """int32 words -> four int32 tensors of bf16x2 bits: pairs (n3,n7), (n2,n6), (n1,n5), (n0,n4)."""
    if USE_ASM:
        return tl.inline_asm_elementwise(_ASM_DECODE, "=r,=r,=r,=r,r", [q],
                                         dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
                                         is_pure=True, pack=1)
    else:
        d0 = ((q >> 6) & 0x01C001C0) | (q & _SIGNS)
        d1 = ((q >> 2) & 0x01C001C0) | ((q << 4) & _SIGNS)
        d2 = ((q << 2) & 0x01C001C0) | ((q << 8) & _SIGNS)
        d3 = ((q << 6) & 0x01C001C0) | ((q << 12) & _SIGNS)
        return d0, d1, d2, d3


@triton.jit
def _lo(d):
    return (d << 16).to(tl.float32, bitcast=True)


@triton.jit
def _hi(d):
    return (d & _HI16).to(tl.float32, bitcast=True)


@triton.jit
def _bf16x2_scaled(lo, hi):
    """Emulation: fp32 lo, hi -> int32 bf16x2 bits of (lo * 2^64, hi * 2^64)."""
    a = (lo * 18446744073709551616.0).to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    b = (hi * 18446744073709551616.0).to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) << 16
    return a | b


@triton.jit
def _xpairs(X0, X1, X2, X3, USE_ASM: tl.constexpr):
    """x words (int32, two bf16 each) -> the four scaled activation pairs of _decode_words."""
    if USE_ASM:
        return tl.inline_asm_elementwise(_ASM_XPAIRS, "=r,=r,=r,=r,r,r,r,r", [X0, X1, X2, X3],
                                         dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
                                         is_pure=True, pack=1)
    else:
        p0 = _bf16x2_scaled(_hi(X1), _hi(X3))
        p1 = _bf16x2_scaled(_lo(X1), _lo(X3))
        p2 = _bf16x2_scaled(_hi(X0), _hi(X2))
        p3 = _bf16x2_scaled(_lo(X0), _lo(X2))
        return p0, p1, p2, p3


@triton.jit
def _dot8(d0, d1, d2, d3, p0, p1, p2, p3, USE_ASM: tl.constexpr):
    """sum of the 8 products of one word (bf16x2 FMAs; emulated in fp32 under the interpreter)."""
    if USE_ASM:
        return tl.inline_asm_elementwise(_ASM_DOT8, "=r,r,r,r,r,r,r,r,r", [d0, d1, d2, d3, p0, p1, p2, p3],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        s = _lo(d0) * _lo(p0) + _hi(d0) * _hi(p0) + _lo(d1) * _lo(p1) + _hi(d1) * _hi(p1)
        return s + _lo(d2) * _lo(p2) + _hi(d2) * _hi(p2) + _lo(d3) * _lo(p3) + _hi(d3) * _hi(p3)


@triton.jit
def _xwords(x32row, kw, xm):
    xb = x32row + 4 * kw
    return (tl.load(xb, mask=xm, other=0), tl.load(xb + 1, mask=xm, other=0),
            tl.load(xb + 2, mask=xm, other=0), tl.load(xb + 3, mask=xm, other=0))


@triton.jit
def _word_dot_f32(d0, d1, d2, d3, xrow, kw, xm):
    """fp32 activations: sum_i w[8kw+i] * x[8kw+i] * 2^-62 with fp32 FMAs, [BN, WT]."""
    c: tl.constexpr = 18446744073709551616.0  # 2^64
    xb = xrow + 8 * kw
    p = _lo(d0) * (tl.load(xb + 3, mask=xm, other=0.0) * c)[None, :]
    p += _hi(d0) * (tl.load(xb + 7, mask=xm, other=0.0) * c)[None, :]
    p += _lo(d1) * (tl.load(xb + 2, mask=xm, other=0.0) * c)[None, :]
    p += _hi(d1) * (tl.load(xb + 6, mask=xm, other=0.0) * c)[None, :]
    p += _lo(d2) * (tl.load(xb + 1, mask=xm, other=0.0) * c)[None, :]
    p += _hi(d2) * (tl.load(xb + 5, mask=xm, other=0.0) * c)[None, :]
    p += _lo(d3) * (tl.load(xb + 0, mask=xm, other=0.0) * c)[None, :]
    p += _hi(d3) * (tl.load(xb + 4, mask=xm, other=0.0) * c)[None, :]
    return p


@triton.jit
def _fwd_gemv_kernel(x_ptr, x32_ptr, w_ptr, s_ptr, gs_ptr, out_ptr, ws_ptr, cnt_ptr,
                     M, N, K, stride_xm, stride_x32m, stride_om, stride_wn, tiles_per_split,
                     IS_NV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     GROUPS: tl.constexpr, ACC_F32: tl.constexpr, USE_ASM: tl.constexpr,
                     ATOMIC: tl.constexpr = False):
    """y = x W^T for M <= BLOCK_M <= 16 rows, W read as int32 words (w_ptr: int32 [N, K/8], row
    stride stride_wn), bf16 x as int32 words (x32_ptr) or fp32 x (x_ptr, ACC_F32).
    Grid (cdiv(N, BLOCK_N), split_k). A tile is BLOCK_N rows x GROUPS scale blocks."""
    WPB: tl.constexpr = 2 if IS_NV else 4  # words per scale block
    WT: tl.constexpr = GROUPS * WPB
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    KW = K // 8
    NB = KW // WPB
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    s_rows = s_ptr + offs_n.to(tl.int64)[:, None] * NB
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, GROUPS), dtype=tl.float32)
    t0 = pid_k * tiles_per_split
    t1 = tl.minimum(t0 + tiles_per_split, tl.cdiv(NB, GROUPS))
    kw_end = tl.minimum(KW, t1 * WT)
    nb_end = tl.minimum(NB, t1 * GROUPS)
    # prefetch the first tile
    kw = t0 * WT + tl.arange(0, WT)
    blk = t0 * GROUPS + tl.arange(0, GROUPS)
    q = tl.load(w_rows + kw[None, :], mask=n_mask[:, None] & (kw < kw_end)[None, :], other=0)
    s = tl.load(s_rows + blk[None, :], mask=n_mask[:, None] & (blk < nb_end)[None, :], other=0)
    if BLOCK_M == 1 and not ACC_F32:
        X0, X1, X2, X3 = _xwords(x32_ptr, kw, kw < kw_end)
    for t in range(t0, t1):  # noqa: B007 (a tile counter; the body advances pointers)
        kw_mask = kw < kw_end
        # issue the next tile's loads before computing this one
        kw_n = kw + WT
        blk_n = blk + GROUPS
        q_n = tl.load(w_rows + kw_n[None, :], mask=n_mask[:, None] & (kw_n < kw_end)[None, :], other=0)
        s_n = tl.load(s_rows + blk_n[None, :], mask=n_mask[:, None] & (blk_n < nb_end)[None, :], other=0)
        if BLOCK_M == 1 and not ACC_F32:
            Y0, Y1, Y2, Y3 = _xwords(x32_ptr, kw_n, kw_n < kw_end)
        sc = _decode_scale(s, IS_NV)
        d0, d1, d2, d3 = _decode_words(q, USE_ASM)
        for mi in tl.static_range(BLOCK_M):
            xm = kw_mask & ((kw * 0 + mi) < M)
            if ACC_F32:
                part = _word_dot_f32(d0, d1, d2, d3, x_ptr + mi * stride_xm, kw, xm)
            else:
                if BLOCK_M > 1:
                    X0, X1, X2, X3 = _xwords(x32_ptr + mi * stride_x32m, kw, xm)
                p0, p1, p2, p3 = _xpairs(X0, X1, X2, X3, USE_ASM)
                part = _dot8(d0, d1, d2, d3, p0[None, :], p1[None, :], p2[None, :], p3[None, :], USE_ASM)
            pb = tl.sum(tl.reshape(part, (BLOCK_N, GROUPS, WPB)), axis=2) * sc
            if BLOCK_M == 1:
                acc1 += pb
            else:
                acc += tl.where(offs_m[:, None] == mi, tl.sum(pb, axis=1)[None, :], 0.0)
        q = q_n
        s = s_n
        kw = kw_n
        blk = blk_n
        if BLOCK_M == 1 and not ACC_F32:
            X0 = Y0
            X1 = Y1
            X2 = Y2
            X3 = Y3
    if BLOCK_M == 1:
        acc += tl.sum(acc1, axis=1)[None, :]
    if IS_NV:
        acc = acc * (1180591620717411303424.0 / tl.load(gs_ptr))  # 2^(62+8) / global_scale
    else:
        acc = acc * 4611686018427387904.0  # 2^62
    _epilogue(acc, out_ptr, ws_ptr, cnt_ptr, offs_m, offs_n, M, N, stride_om, pid_n, ATOMIC)


# ----------------------------------------------------------------------------------------------
# configs

# Largest M served by the packed-decode GEMV kernel, and by the 16-row tensor-core kernel.
GEMV_MAX_M = 2  # H100, 5fad37e: the GEMV took 218 / 228 us for the 7B layer at M = 3 / 4, the 16-row kernel 151 at M = 8
SKINNY_MAX_M = 16
# Split-K of the tensor-core kernel: about WAVES * sms programs for 16-row tiles (M <= SKINNY_MAX_M),
# WAVES_MID * sms for larger tiles, at most MAX_SPLIT_MID splits above 16 rows, and at least
# MIN_TILES_PER_SPLIT K tiles per split (the last program of a tile sums every split's partial, so
# many thin splits cost more than they hide). From the H100 split sweep at 69e04ba
# (results/kernels/h100_split_sweep_69e04ba.log, 12 shapes of three families, M = 8-64): at M = 64,
# k/v [512, 3584] 29.7 -> 14.4 us, q/o 30.7 -> 20.1, [1024, 4096] 41.2 -> 15.2 against the old rule
# (WAVES * sms programs, one K tile per split allowed). The GEMV keeps WAVES and one tile: its
# partials are single rows, and the most splits won on the small matrices (k/v at M = 1: 5.7 us).
WAVES = 4
WAVES_MID = 2
MAX_SPLIT_MID = 8
MIN_TILES_PER_SPLIT = 4

_SM_COUNT: dict = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # interpreter: small grids keep the CPU tests fast while still splitting K
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def _split(n_tiles: int, k_tiles: int, sms: int, max_split: int | None = None, waves: int = WAVES,
           min_tiles: int = 1) -> int:
    """Split K so that about waves * sms programs run, at most max_split splits and at least
    min_tiles K tiles a split (never more splits than K tiles)."""
    want = max(1, -(-waves * sms // max(n_tiles, 1)))
    if max_split is not None:
        want = min(want, max_split)
    return max(1, min(want, k_tiles // max(min_tiles, 1)))


def pick_config(kind: str, M: int, N: int, K: int, is_nv: bool) -> dict:
    """Heuristic launch config for ``kind`` in {"gemv", "dot", "bwd"} (overridable)."""
    # Winners of the H100 sweep of 2026-11-22 (benchmarks/bench_kernels.py --sweep-only, Qwen2.5-7B
    # shapes, results/kernels/h100_sweep.json); "large" = N * K >= 2^25 (the 7B-32B MLP matrices).
    large = N * K >= (1 << 25)
    if kind == "gemv":
        bm = 1 if M <= 1 else triton.next_power_of_2(M)
        # 64 columns a tile on the large matrices (gate/up 22.9 vs 25.3 us, down 23.7 vs 26.7 at 7B),
        # 128 on the attention ones (q/o 7.7 vs 7.8 us).
        return dict(BLOCK_M=bm, BLOCK_N=64 if large else 128, GROUPS=8 if is_nv else 4, ACC_F32=False,
                    num_warps=4, num_stages=2)
    if kind == "dot":
        if M <= SKINNY_MAX_M:  # M = 8: down 36.3 (x @ W^T) vs 39.3 us (swap); q/o 11.8 (64x64 swap) vs 13.2
            if large:
                return dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=64, GROUP_M=1, SWAP_AB=False, num_warps=4, num_stages=4)
            return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, GROUP_M=1, SWAP_AB=True, num_warps=4, num_stages=4)
        if M <= 64:
            return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, SWAP_AB=True, num_warps=4, num_stages=4)
        if M >= 1024 and N >= 16384:  # gate/up at M = 2048: 734 vs 781 us (down, N = 3584: 961 vs 882)
            return dict(BLOCK_M=256, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, SWAP_AB=True, num_warps=8, num_stages=3)
        return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, SWAP_AB=True, num_warps=4, num_stages=4)
    if kind == "bwd":
        # c567ac0's config (the H100 sweep of e4ee810 timed the rewritten kernel, since reverted)
        return dict(BLOCK_M=128, BLOCK_K=64, BLOCK_R=64, GROUP_M=8, num_warps=4, num_stages=4)
    raise ValueError(f"kind must be one of ('gemv', 'dot', 'bwd'), got {kind!r}")


def _fit(cfg: dict, K: int) -> dict:
    """Shrink the K tile for small K (tiles must stay >= 16 for tl.dot)."""
    cfg = dict(cfg)
    if "BLOCK_K" in cfg:
        cfg["BLOCK_K"] = max(32, min(cfg["BLOCK_K"], triton.next_power_of_2(K)))
    return cfg


# ----------------------------------------------------------------------------------------------
# launchers

_WORKSPACE: dict = {}
# Workspaces replaced by larger ones. Never freed: a CUDA graph captured earlier (the rollout engine's
# decode steps) holds raw pointers to the buffer it was captured with and keeps replaying into it;
# freeing it would let the allocator hand that memory to other tensors while replays still write
# split-K partial sums there (it did: wrong rollout log-probs, see LOG.md 2026-11-22). Their
# counters stay zeroed: every split-K launch leaves them as it found them.
_RETIRED: list = []
# triton.jit reads TRITON_INTERPRET when this module is imported, not when a kernel runs.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
# Split-K reduction: deterministic (fixed order) by default; QERL_SPLITK_ATOMIC=1 opts into fp32
# atomics in arrival order (not bitwise repeatable). Read at import; tests and the benchmark may
# set fp4.SPLITK_ATOMIC directly.
SPLITK_ATOMIC = os.environ.get("QERL_SPLITK_ATOMIC", "0") == "1"


def _workspace(device: torch.device, n_out: int, n_tiles: int,
               atomic: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 split-K workspace and (zeroed) tile counters for this device and reduction mode.

    Deterministic mode needs split * M * N floats (one slice per split, overwritten each call);
    atomic mode M * N floats that stay zeroed between calls. One pair per device and mode, not per
    stream, so that a CUDA graph captured on a side stream reuses the one allocated during
    warm-up; split-K launches must therefore not run concurrently on two streams of one device
    (qerl runs everything on one stream). A buffer that is outgrown is retired, not freed
    (``_RETIRED``); growth doubles, so the retired ones sum to less than the live one.
    """
    atomic = SPLITK_ATOMIC if atomic is None else atomic
    key = (str(device), atomic)
    ws, cnt = _WORKSPACE.get(key, (None, None))
    if ws is None or ws.numel() < n_out:
        if ws is not None:
            _RETIRED.append(ws)
        ws = torch.zeros(max(n_out, 2 * (ws.numel() if ws is not None else 0), 1 << 16),
                         dtype=torch.float32, device=device)
    if cnt is None or cnt.numel() < n_tiles:
        if cnt is not None:
            _RETIRED.append(cnt)
        cnt = torch.zeros(max(n_tiles, 2 * (cnt.numel() if cnt is not None else 0), 1 << 12),
                          dtype=torch.int32, device=device)
    _WORKSPACE[key] = (ws, cnt)
    return ws, cnt


def _check(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, gs: torch.Tensor | None,
           is_nv: bool, k_dim: int) -> None:
    if x.device.type != "cuda" and not INTERPRETED:
        raise RuntimeError(
            f"triton fp4 kernels got {x.device.type} tensors, but qerl.kernels.fp4 was imported "
            "without TRITON_INTERPRET=1 (set it before the first import to run on the CPU)")
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"triton fp4 kernels take bfloat16 or float32 activations, got {x.dtype}")
    _check_weight(packed, scale, is_nv)
    if x.shape[-1] != k_dim:
        raise ValueError(f"last dim of the input is {x.shape[-1]}, expected {k_dim}")
    for name, t in (("weight_packed", packed), ("weight_scale", scale), ("weight_global_scale", gs)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but the input is on {x.device}")


def _check_weight(packed: torch.Tensor, scale: torch.Tensor, is_nv: bool) -> None:
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(f"weight_packed must be a 2-D uint8 tensor, got {packed.dtype} {list(packed.shape)}")
    block = 16 if is_nv else 32
    N, KH = packed.shape
    if (2 * KH) % block:
        raise ValueError(f"in_features={2 * KH} must be a multiple of the block size {block}")
    if tuple(scale.shape) != (N, 2 * KH // block):
        raise ValueError(f"weight_scale must be [{N}, {2 * KH // block}], got {list(scale.shape)}")


def _int32_words(packed: torch.Tensor) -> torch.Tensor | None:
    """weight_packed [N, K/2] uint8 viewed as int32 [N, K/8] (no copy), or None if it cannot be."""
    try:
        return packed.view(torch.int32) if packed.stride(-1) == 1 else None
    except RuntimeError:
        return None


def _scale_bytes(scale: torch.Tensor) -> torch.Tensor:
    return scale if scale.dtype == torch.uint8 else scale.view(torch.uint8)


# ----------------------------------------------------------------------------------------------
# decode into a transient scratch, then cuBLAS (large M and grad-input)

# Smallest M that takes the decode + cuBLAS path instead of the fused kernels, per (op, format).
# A rule in M alone: the decode costs ~N*K*2.6 bytes of traffic, the GEMM ~2*M*N*K flops, and the
# fused kernels lose a roughly constant fraction of the GEMM, so the crossover barely moves with N
# and K. Measured on the H100 (Qwen2.5-7B layer, results/kernels/NOTES.md): forward, fused vs
# scratch, M = 64: 327 vs 544 us (nvfp4), 305 vs 510 (mxfp4); M = 128: 682 vs 554, 657 vs 519.
# Grad-input: the scratch path wins at every M measured (M = 16: 522 vs 1040 us nvfp4, 488 vs 846
# mxfp4), and the fused kernel's 16-row tiles cost the same below M = 16.
SCRATCH_MIN_M = {("linear", "nvfp4"): 128, ("linear", "mxfp4"): 128,
                 ("grad_input", "nvfp4"): 1, ("grad_input", "mxfp4"): 1}
# The scratch holds one chunk of the decoded weight: rows of W (forward) or columns (grad-input).
# None (default): the whole weight, so the scratch is the largest linear's size (one per device and
# dtype). Chunks are sized to whole multiples of 128. On the H100 chunks of 16 / 32 / 64 MiB were
# 2-20% slower than one chunk at every M (smaller GEMMs; the decode did not speed up from L2).
SCRATCH_CHUNK_BYTES: int | None = None
# Decode tiles (BLOCK_N rows x NBK scale blocks) and the store (PAIRS: bf16 out as int32 pairs),
# the H100 sweep's best on the 7B MLP matrices (benchmarks/kernel_probe.py, read + write TB/s):
# nvfp4 16 x 16 pairs 2.19 / 2.11 (element stores 1.95 / 1.94), mxfp4 32 x 16 pairs, 8 warps,
# 2.13 / 2.13 (element stores 8 x 16: 2.10 / 2.12). fp32 output always takes element stores.
DECODE_CONFIG = {True: dict(BLOCK_N=16, NBK=16, num_warps=4, PAIRS=True),
                 False: dict(BLOCK_N=32, NBK=16, num_warps=8, PAIRS=True)}

_SCRATCH: dict = {}
_SCRATCH_CAPTURED: set = set()
_PLANS_HOLDING_SCRATCH: "weakref.WeakSet" = weakref.WeakSet()  # Plans whose DirectLaunch of the decode references it


def _scratch(device: torch.device, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """The decode scratch of this device and dtype (1-D, at least ``numel``): one per device and
    dtype, reused by every layer, grown (never shrunk) to the largest chunk seen. An outgrown buffer
    is freed, unless a CUDA graph captured it (then it is retired like a workspace)."""
    key = (str(device), dtype)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < numel:
        if buf is not None and key in _SCRATCH_CAPTURED:
            _RETIRED.append(buf)
        _SCRATCH.pop(key, None)
        del buf  # free the old one before allocating the new one
        buf = _SCRATCH[key] = torch.empty(numel, dtype=dtype, device=device)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        _SCRATCH_CAPTURED.add(key)
    return buf


def scratch_bytes(device: torch.device | str | None = None) -> int:
    """Bytes held by the decode scratch buffers (of ``device``, or of all devices): the only dense
    weight memory the 4-bit path keeps between calls, for the memory columns of Table 3."""
    return sum(t.numel() * t.element_size() for (dev, _), t in _SCRATCH.items()
               if device is None or dev == str(torch.device(device)))


def release_scratch() -> None:
    """Free the decode scratch buffers (those no CUDA graph captured)."""
    for plan in list(_PLANS_HOLDING_SCRATCH):  # their kept decode launches reference the scratch
        plan.release()
    _PLANS_HOLDING_SCRATCH.clear()
    for key in list(_SCRATCH):
        if key in _SCRATCH_CAPTURED:
            _RETIRED.append(_SCRATCH[key])
        del _SCRATCH[key]
    _SCRATCH_CAPTURED.clear()


def decode(packed: torch.Tensor, scale: torch.Tensor, gs: torch.Tensor | None, is_nv: bool,
           dtype: torch.dtype = torch.bfloat16, rows: tuple[int, int] | None = None,
           cols: tuple[int, int] | None = None, out: torch.Tensor | None = None,
           config: dict | None = None) -> torch.Tensor:
    """W[rows[0]:rows[1], cols[0]:cols[1]] decoded to ``dtype``, bit for bit as
    qerl.formats.dequantize(..., dtype) (fp32 value * step, one rounding), into ``out`` (a 2-D
    tensor with unit column stride) or a new tensor. Column bounds must be multiples of the scale
    block (16 NVFP4, 32 MXFP4)."""
    _check_weight(packed, scale, is_nv)
    N, KH = packed.shape
    r0, r1 = rows or (0, N)
    c0, c1 = cols or (0, 2 * KH)
    blk = 16 if is_nv else 32
    if not (0 <= r0 <= r1 <= N and 0 <= c0 <= c1 <= 2 * KH) or c0 % blk or c1 % blk:
        raise ValueError(f"decode: rows {r0}:{r1} / cols {c0}:{c1} out of [{N}, {2 * KH}] or not on {blk}-blocks")
    if out is None:
        out = torch.empty((r1 - r0, c1 - c0), dtype=dtype, device=packed.device)
    elif tuple(out.shape) != (r1 - r0, c1 - c0) or out.stride(-1) != 1:
        raise ValueError(f"decode: out must be [{r1 - r0}, {c1 - c0}] with unit column stride, got "
                         f"{list(out.shape)} strides {out.stride()}")
    _decode_into(out, packed, _scale_bytes(scale), gs if gs is not None else packed, is_nv, r0, c0, r1 - r0,
                 c1 - c0, config or DECODE_CONFIG[is_nv])
    return out


def _decode_launch(out, packed, scale_u8, gs_arg, is_nv, r0, c0, n_rows, n_cols, cfg) -> tuple:
    """(kernel, grid, args, kwargs) of the decode of W[r0:r0 + n_rows, c0:c0 + n_cols] into ``out``:
    bf16 out as int32 words (pairs of weights) when cfg asks for PAIRS and its rows allow the view
    (column bounds are whole scale blocks, so the pair count is whole); else one element at a time."""
    hb = 8 if is_nv else 16
    bn, nbk = cfg["BLOCK_N"], cfg["NBK"]
    tile_c = nbk * 2 * hb
    grid = (triton.cdiv(n_rows, bn), triton.cdiv(n_cols, tile_c))
    kw = dict(IS_NV=is_nv, BLOCK_N=bn, NBK=nbk, EVEN=n_rows % bn == 0 and n_cols % tile_c == 0,
              num_warps=cfg["num_warps"])
    if cfg.get("PAIRS", False) and out.dtype == torch.bfloat16 and out.stride(0) % 2 == 0 \
            and out.storage_offset() % 2 == 0:
        out32 = out.view(torch.int32)
        return _decode_pairs_kernel, grid, (packed, scale_u8, gs_arg, out32, packed.shape[1], r0, c0, n_rows,
                                            n_cols // 2, out32.stride(0)), kw
    return _decode_kernel, grid, (packed, scale_u8, gs_arg, out, packed.shape[1], r0, c0, n_rows, n_cols,
                                  out.stride(0)), kw


def _decode_into(out, packed, scale_u8, gs_arg, is_nv, r0, c0, n_rows, n_cols, cfg):
    if n_rows == 0 or n_cols == 0:
        return
    kern, grid, args, kw = _decode_launch(out, packed, scale_u8, gs_arg, is_nv, r0, c0, n_rows, n_cols, cfg)
    kern[grid](*args, **kw)


# Opt-in, not measured yet (QERL_SCRATCH_OVERLAP=1): decode chunk i + 1 on a side stream while
# cuBLAS multiplies chunk i, in two scratch slots (OVERLAP_CHUNKS chunks when SCRATCH_CHUNK_BYTES
# is None). Run `python -m benchmarks.kernel_probe` to compare it with one chunk.
SCRATCH_OVERLAP = os.environ.get("QERL_SCRATCH_OVERLAP", "0") == "1"
OVERLAP_CHUNKS = 4
_SIDE_STREAMS: dict = {}


def _chunk(total: int, other: int, elem: int, align: int, overlap: bool) -> int:
    """Chunk length along a dim of ``total`` (the other dim ``other``) under SCRATCH_CHUNK_BYTES."""
    if SCRATCH_CHUNK_BYTES is None:
        if not overlap:
            return total
        return min(total, -(-triton.cdiv(total, OVERLAP_CHUNKS) // align) * align)
    c = max(align, SCRATCH_CHUNK_BYTES // (other * elem) // align * align)
    return min(total, c)


def _chunked(total: int, chunk: int, slot: int, buf: torch.Tensor, decode, gemm, overlap: bool) -> None:
    """For each chunk [c0, c0 + c): decode(slot buffer, c0, c) -> w, then gemm(w, c0, c). With
    ``overlap`` (CUDA, more than one chunk) the decodes run on a side stream into two alternating
    slots, each waiting for the GEMM that last read its slot; the side stream forks from and joins
    the current stream, so this also works under CUDA-graph capture."""
    if not overlap or total <= chunk:
        for c0 in range(0, total, chunk):
            c = min(chunk, total - c0)
            gemm(decode(buf, c0, c), c0, c)
        return
    main = torch.cuda.current_stream(buf.device)
    side = _SIDE_STREAMS.get(buf.device.index)
    if side is None:
        side = _SIDE_STREAMS[buf.device.index] = torch.cuda.Stream(buf.device)
    side.wait_stream(main)
    freed = [None, None]
    for i, c0 in enumerate(range(0, total, chunk)):
        c = min(chunk, total - c0)
        j = i % 2
        with torch.cuda.stream(side):
            if freed[j] is not None:
                side.wait_event(freed[j])
            w = decode(buf[j * slot:(j + 1) * slot], c0, c)
            ready = torch.cuda.Event()
            ready.record(side)
        main.wait_event(ready)
        gemm(w, c0, c)
        freed[j] = torch.cuda.Event()
        freed[j].record(main)
    main.wait_stream(side)


def scratch_linear(x2: torch.Tensor, packed, scale_u8, gs_arg, is_nv: bool, out: torch.Tensor) -> torch.Tensor:
    """out [M, N] = x2 [M, K] @ W^T: W decoded chunk by chunk of rows into the scratch, cuBLAS per chunk."""
    N, KH = packed.shape
    K = 2 * KH
    overlap = SCRATCH_OVERLAP and x2.device.type == "cuda"
    rows = _chunk(N, K, x2.element_size(), 128, overlap)
    slots = 2 if overlap and rows < N else 1
    buf = _scratch(x2.device, x2.dtype, slots * rows * K)

    def decode(b, r0, n):
        w = b[: n * K].view(n, K)
        _decode_into(w, packed, scale_u8, gs_arg, is_nv, r0, 0, n, K, DECODE_CONFIG[is_nv])
        return w

    def gemm(w, r0, n):
        torch.mm(x2, w.t(), out=out[:, r0:r0 + n] if n < N else out)

    _chunked(N, rows, rows * K, buf, decode, gemm, overlap)
    return out


def scratch_grad_input(dy2: torch.Tensor, packed, scale_u8, gs_arg, is_nv: bool, dx: torch.Tensor) -> torch.Tensor:
    """dx [M, K] = dy2 [M, N] @ W: W decoded chunk by chunk of columns into the scratch."""
    N, KH = packed.shape
    K = 2 * KH
    overlap = SCRATCH_OVERLAP and dy2.device.type == "cuda"
    cols = _chunk(K, N, dy2.element_size(), 128, overlap)
    slots = 2 if overlap and cols < K else 1
    buf = _scratch(dy2.device, dy2.dtype, slots * cols * N)

    def decode(b, c0, c):
        w = b[: N * c].view(N, c)
        _decode_into(w, packed, scale_u8, gs_arg, is_nv, 0, c0, N, c, DECODE_CONFIG[is_nv])
        return w

    def gemm(w, c0, c):
        torch.mm(dy2, w, out=dx[:, c0:c0 + c] if c < K else dx)

    _chunked(K, cols, cols * N, buf, decode, gemm, overlap)
    return dx


def _use_scratch(op: str, is_nv: bool, M: int) -> bool:
    return M >= SCRATCH_MIN_M[(op, "nvfp4" if is_nv else "mxfp4")]


# ----------------------------------------------------------------------------------------------
# fused launches


def _linear_launch(M: int, N: int, K: int, is_nv: bool, device: torch.device, kind: str | None,
                   config: dict | None, split_k: int | None, has_words: bool) -> tuple:
    """(kind, grid, tiles_per_split, ws_numel, n_tiles, meta, num_warps, num_stages) of one launch."""
    if kind is None:
        kind = "gemv" if M <= GEMV_MAX_M and has_words else "dot"
    cfg = _fit(config or pick_config(kind, M, N, K, is_nv), K)
    sms = _num_sms(device)
    meta = {k: v for k, v in cfg.items() if k not in ("num_warps", "num_stages")}
    if kind == "gemv":
        if M > cfg["BLOCK_M"] or cfg["BLOCK_M"] > 16:
            raise ValueError(f"the gemv kernel serves M <= BLOCK_M <= 16, got M={M}, BLOCK_M={cfg['BLOCK_M']}")
        if not has_words:
            raise ValueError("the gemv kernel reads weight_packed as int32 words: it must be contiguous")
        wpb = 2 if is_nv else 4
        k_tiles = triton.cdiv(K // 8 // wpb, cfg["GROUPS"])
        n_tiles = triton.cdiv(N, cfg["BLOCK_N"])
        split = split_k or _split(n_tiles, k_tiles, sms)
    elif kind == "dot":
        k_tiles = triton.cdiv(K, cfg["BLOCK_K"])
        n_tiles = triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"])
        if split_k is None:  # split K only when the output tiles alone cannot fill the GPU
            skinny = cfg["BLOCK_M"] <= SKINNY_MAX_M
            split = (_split(n_tiles, k_tiles, sms, None if skinny else MAX_SPLIT_MID,
                            WAVES if skinny else WAVES_MID, MIN_TILES_PER_SPLIT) if n_tiles < 2 * sms else 1)
        else:
            split = split_k
        meta.setdefault("SWAP_AB", True)  # configs written before these options existed
        meta["EVEN_K"] = K % cfg["BLOCK_K"] == 0
        meta["F32_DOT"] = INTERPRETED
    else:
        raise ValueError(f"kind must be one of ('gemv', 'dot'), got {kind!r}")
    tps = triton.cdiv(k_tiles, split)
    split = triton.cdiv(k_tiles, tps)
    # (without a split the kernel never touches the workspace: do not grow it for big GEMMs)
    ws_numel = 0 if split == 1 else (M * N if SPLITK_ATOMIC else split * M * N)
    meta["ATOMIC"] = SPLITK_ATOMIC
    meta["IS_NV"] = is_nv
    return kind, (n_tiles, split), tps, ws_numel, (n_tiles if split > 1 else 0), meta, cfg["num_warps"], cfg["num_stages"]


def _linear_call(x2, packed, w32, scale_u8, gs_arg, out, launch) -> tuple:
    """(kernel, grid, args, kwargs) of one fused forward launch."""
    kind, grid, tps, ws_numel, n_cnt, meta, warps, stages = launch
    M, K = x2.shape
    N = packed.shape[0]
    ws, cnt = _workspace(x2.device, ws_numel, n_cnt)
    if kind == "gemv":
        acc_f32 = bool(meta.get("ACC_F32", False) or x2.dtype == torch.float32)
        x32 = x2
        if not acc_f32:
            if x2.stride(0) % 2 or x2.storage_offset() % 2:
                x2 = x2.clone(memory_format=torch.contiguous_format)  # contiguous() keeps an odd offset
            x32 = x2.view(torch.int32)
        args = (x2, x32, w32, scale_u8, gs_arg, out, ws, cnt, M, N, K, x2.stride(0), x32.stride(0), out.stride(0),
                w32.stride(0), tps)
        return _fwd_gemv_kernel, grid, args, dict(meta, ACC_F32=acc_f32, USE_ASM=not INTERPRETED,
                                                   num_warps=warps, num_stages=stages)
    args = (x2, packed, scale_u8, gs_arg, out, ws, cnt, M, N, K, x2.stride(0), out.stride(0), tps)
    return _fwd_dot_kernel, grid, args, dict(meta, num_warps=warps, num_stages=stages)


def _run_linear(x2, packed, w32, scale_u8, gs_arg, is_nv, out, launch) -> None:
    fn, grid, args, kwargs = _linear_call(x2, packed, w32, scale_u8, gs_arg, out, launch)
    fn[grid](*args, **kwargs)


def launch_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, gs: torch.Tensor | None,
                  is_nv: bool, kind: str | None = None, config: dict | None = None,
                  split_k: int | None = None) -> torch.Tensor:
    """y = x W^T. ``kind`` ("gemv", "dot", "scratch") / ``config`` / ``split_k`` override the
    heuristics (benchmarks, tests)."""
    N, KH = packed.shape
    K = 2 * KH
    _check(x, packed, scale, gs, is_nv, K)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return out.reshape(*lead, N)
    scale_u8 = _scale_bytes(scale)
    gs_arg = gs if gs is not None else packed  # unused when not NVFP4
    if kind == "scratch" or (kind is None and config is None and _use_scratch("linear", is_nv, M)):
        scratch_linear(x2, packed, scale_u8, gs_arg, is_nv, out)
        return out.reshape(*lead, N)
    w32 = _int32_words(packed)
    launch = _linear_launch(M, N, K, is_nv, x.device, kind, config, split_k, w32 is not None)
    _run_linear(x2, packed, w32, scale_u8, gs_arg, is_nv, out, launch)
    return out.reshape(*lead, N)


def launch_grad_input(dy: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, gs: torch.Tensor | None,
                      is_nv: bool, config: dict | None = None, kind: str | None = None) -> torch.Tensor:
    """dx = dy W. ``kind`` "fused" or "scratch" overrides the choice by M."""
    N, KH = packed.shape
    K = 2 * KH
    _check(dy, packed, scale, gs, is_nv, N)
    lead = dy.shape[:-1]
    dy2 = dy.reshape(-1, N)
    if dy2.stride(-1) != 1:
        dy2 = dy2.contiguous()
    M = dy2.shape[0]
    dx = torch.empty((M, K), dtype=dy.dtype, device=dy.device)
    if M == 0:
        return dx.reshape(*lead, K)
    gs_arg = gs if gs is not None else packed
    if kind == "scratch" or (kind is None and config is None and _use_scratch("grad_input", is_nv, M)):
        scratch_grad_input(dy2, packed, _scale_bytes(scale), gs_arg, is_nv, dx)
        return dx.reshape(*lead, K)
    if kind not in (None, "fused"):
        raise ValueError(f"kind must be None, 'fused' or 'scratch', got {kind!r}")
    cfg = _fit(config or pick_config("bwd", M, N, K, is_nv), K)
    if M <= 16:
        cfg["BLOCK_M"] = 16  # a 128-row tile would be mostly padding
    if dy2.dtype == torch.float32 and not INTERPRETED:
        # Triton 3.6 fails to compile this kernel for sm_90 with fp32 tiles of 64 rows or more
        # (TritonGPUOptimizeDotOperands; seen on an H200, reproduced by compiling on the CPU);
        # 32 rows compile. fp32 is for checks and tests, not for speed.
        cfg["BLOCK_M"] = min(cfg["BLOCK_M"], 32)
    if N < cfg["BLOCK_R"]:
        cfg["BLOCK_R"] = max(16, triton.next_power_of_2(N))
    meta = {k: v for k, v in cfg.items() if k not in ("num_warps", "num_stages")}
    grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(K, cfg["BLOCK_K"]),)
    _bwd_dot_kernel[grid](
        dy2, packed, _scale_bytes(scale), gs_arg, dx,
        M, N, K, dy2.stride(0), dx.stride(0),
        IS_NV=is_nv, F32_DOT=INTERPRETED, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **meta)
    return dx.reshape(*lead, K)


# ----------------------------------------------------------------------------------------------
# per-layer plans: what does not change between calls, resolved once (host overhead of eager calls)


class DirectLaunch:
    """A compiled Triton kernel launched again without Triton's Python launch path.

    ``kernel[grid](...)`` binds the arguments, computes the specialisation key and looks the kernel
    up on every call: ~25-35 us of host time on an H100 machine, against ~13 us for the compiled
    kernel's own launcher (``benchmarks/launch_probe.py``). A DirectLaunch keeps what a first, normal
    launch compiled and every argument of it in signature order (constexprs included, as
    ``JITFunction.run`` passes them), so a later call sets only the arguments that change and calls
    the launcher on the current stream. The caller must keep the first launch's specialisation:
    the same constexprs and integers, and changed tensors 16-byte aligned as the first ones were
    (Plan checks this per call and falls back to a normal launch otherwise). Triton's launch hooks
    (set by profilers such as proton) are not called for these launches. Not under TRITON_INTERPRET."""

    __slots__ = ("_run", "_function", "_metadata", "grid", "values", "_device")

    def __init__(self, jit_fn, compiled, args: tuple, kwargs: dict, grid: tuple, device: torch.device):
        params = list(jit_fn.signature.parameters.values())
        given = dict(zip((p.name for p in params), args))
        given.update((k, v) for k, v in kwargs.items() if k in jit_fn.signature.parameters)
        missing = [p.name for p in params if p.name not in given and p.default is p.empty]
        if missing:
            raise TypeError(f"DirectLaunch: no value for {missing}")
        self.values = [given.get(p.name, p.default) for p in params]
        self._run, self._function, self._metadata = compiled.run, compiled.function, compiled.packed_metadata
        self.grid = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
        self._device = device.index if device.index is not None else torch.cuda.current_device()

    @classmethod
    def first(cls, jit_fn, grid: tuple, args: tuple, kwargs: dict, device: torch.device) -> "DirectLaunch | None":
        """Launch normally; return the DirectLaunch of that launch (None where it cannot be made)."""
        compiled = jit_fn[grid](*args, **kwargs)
        if INTERPRETED or compiled is None:
            return None
        try:
            return cls(jit_fn, compiled, args, kwargs, grid, device)
        except (AttributeError, TypeError, ValueError):  # another Triton's internals: keep the normal path
            return None

    def __call__(self, values: list) -> None:
        g = self.grid
        self._run(g[0], g[1], g[2], torch._C._cuda_getCurrentRawStream(self._device), self._function,
                  self._metadata, None, None, None, *values)


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0


class Plan:
    """One packed weight's launch state, built once per (weight tensors, device): the checked
    buffers, their int32 / uint8 views, and the launch parameters per small M. ``linear`` and
    ``grad_input`` skip the per-call checks and the custom-op dispatch (eager calls; under
    torch.compile the custom ops are used instead)."""

    __slots__ = ("packed", "scale", "gs", "is_nv", "N", "K", "w32", "scale_u8", "gs_arg", "device", "_launch",
                 "_decode", "_direct", "_mma", "__weakref__")
    autograd_fn = None  # PlannedLinear, set below

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, gs: torch.Tensor | None, is_nv: bool,
                 cache: dict | None = None):
        _check_weight(packed, scale, is_nv)
        if is_nv and gs is None:
            raise ValueError("an nvfp4 plan needs weight_global_scale")
        self.packed, self.scale, self.gs, self.is_nv = packed, scale, gs, is_nv
        self.N, self.K = packed.shape[0], 2 * packed.shape[1]
        self.w32 = _int32_words(packed)
        self.scale_u8 = _scale_bytes(scale)
        self.gs_arg = gs if gs is not None else packed
        self.device = packed.device
        self._launch: dict = {}
        self._decode: dict = {}  # dtype -> (DirectLaunch, the scratch buffer it writes) or None
        self._direct: dict = {}  # (M, atomic, dtype, x row stride) -> DirectLaunch of the small-M kernel or None
        # the compute layout of fp4_mma, made on the first small-M bf16 call; in the owner's kernel cache
        # when given (QuantLinear.kernel_cache, which the fused decode step's grouped launches also read)
        self._mma: dict = cache if cache is not None else {}

    def decoded(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole weight decoded into the device's scratch (one decode launch); valid until the
        next decode into that scratch. The launch is kept per dtype as a DirectLaunch (host time of
        the training path: every large-M forward and grad-input) and remade when the scratch buffer
        is a new one; it holds the scratch only through its argument list, and release_scratch()
        clears the plans' launches (Plan.release) so that the memory goes."""
        N, K = self.N, self.K
        buf = _scratch(self.device, dtype, N * K)
        st = self._decode.get(dtype)
        if st is not None and st[1] is buf:
            st[0](st[0].values)
            return buf[: N * K].view(N, K)
        w = buf[: N * K].view(N, K)
        kern, grid, args, kw = _decode_launch(w, self.packed, self.scale_u8, self.gs_arg, self.is_nv, 0, 0, N, K,
                                              DECODE_CONFIG[self.is_nv])
        direct = DirectLaunch.first(kern, grid, args, kw, self.device)
        self._decode[dtype] = (direct, buf) if direct is not None else None
        if direct is not None:
            _PLANS_HOLDING_SCRATCH.add(self)
        return w

    def _mma_layout(self):
        return fp4_mma.cached_layout(self._mma, self.packed, self.scale_u8, self.is_nv)

    def _mma_linear(self, x2: torch.Tensor, out: torch.Tensor, cl: tuple) -> None:
        """out = x2 W^T through fp4_mma on the compute layout cl; its launch kept as a DirectLaunch per
        (M, row stride), like the small-M Triton kernels (host time of eager calls)."""
        dkey = ("mma", x2.shape[0], x2.stride(0), cl[0].data_ptr())
        st = self._direct.get(dkey)
        if st is not None and _aligned(x2) and _aligned(out):
            d, need = st
            ws, cnt = _workspace(x2.device, *need, atomic=False)
            v = list(d.values)
            v[fp4_mma.ARG_X] = x2
            for i in fp4_mma.ARG_OUTS:
                v[i] = out
            v[fp4_mma.ARG_WS], v[fp4_mma.ARG_CNT] = ws, cnt
            d(v)
            return
        fn, grid, args, kwargs, need = fp4_mma.grouped_linear(x2, [(cl[0], cl[1], self.gs, self.N)], self.K,
                                                             self.is_nv, [out], describe=True)
        if dkey not in self._direct and _aligned(x2) and _aligned(out):
            d = DirectLaunch.first(fn, grid, args, kwargs, x2.device)
            self._direct[dkey] = None if d is None else (d, need)
            if d is not None:  # keep no activation, output or workspace of this call
                for i in (fp4_mma.ARG_X, *fp4_mma.ARG_OUTS, fp4_mma.ARG_WS, fp4_mma.ARG_CNT):
                    d.values[i] = None
        else:
            fn[grid](*args, **kwargs)

    def release(self) -> None:
        """Drop the kept launches (their argument lists reference the scratch)."""
        self._decode.clear()
        self._direct.clear()

    def _one_chunk(self) -> bool:
        return SCRATCH_CHUNK_BYTES is None and not SCRATCH_OVERLAP

    def matches(self, packed, scale, gs) -> bool:
        return packed is self.packed and scale is self.scale and gs is self.gs

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        K, N = self.K, self.N
        if x.shape[-1] != K or x.dtype not in (torch.bfloat16, torch.float32) or x.device != self.device:
            _check(x, self.packed, self.scale, self.gs, self.is_nv, K)  # raises with the reason
        x2 = x.reshape(-1, K)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        M = x2.shape[0]
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
        if M == 0:
            pass
        elif fp4_mma.applies(x2, K) and (cl := self._mma_layout()) is not None:
            self._mma_linear(x2, out, cl)
        elif _use_scratch("linear", self.is_nv, M):
            if self._one_chunk():  # decode + cuBLAS with the launch kept in the plan
                torch.mm(x2, self.decoded(x2.dtype).t(), out=out)
            else:
                scratch_linear(x2, self.packed, self.scale_u8, self.gs_arg, self.is_nv, out)
        else:
            key = (M, SPLITK_ATOMIC)
            launch = self._launch.get(key)
            if launch is None:
                launch = _linear_launch(M, N, K, self.is_nv, x.device, None, None, None, self.w32 is not None)
                if M <= 256:
                    self._launch[key] = launch
            dkey = (M, SPLITK_ATOMIC, x2.dtype, x2.stride(0))
            direct = self._direct.get(dkey)
            if direct is not None and _aligned(x2):
                ws, cnt = _workspace(x2.device, launch[3], launch[4])
                v = list(direct.values)
                if launch[0] == "gemv":  # (x, x32, w, s, gs, out, ws, cnt, ...): x32 is x's memory
                    v[0] = v[1] = x2
                    v[5], v[6], v[7] = out, ws, cnt
                else:  # (x, w, s, gs, out, ws, cnt, ...)
                    v[0], v[4], v[5], v[6] = x2, out, ws, cnt
                direct(v)
            else:
                fn, grid, args, kwargs = _linear_call(x2, self.packed, self.w32, self.scale_u8, self.gs_arg, out,
                                                      launch)
                # only when the launch used x2 itself: a copy made for the GEMV has other strides
                if M <= 256 and _aligned(x2) and args[0] is x2 and dkey not in self._direct:
                    d = self._direct[dkey] = DirectLaunch.first(fn, grid, args, kwargs, x2.device)
                    if d is not None:  # keep no activation, output or workspace of this call
                        for i in ((0, 1, 5, 6, 7) if launch[0] == "gemv" else (0, 4, 5, 6)):
                            d.values[i] = None
                else:
                    fn[grid](*args, **kwargs)
        return out.view(*x.shape[:-1], N)

    def grad_input(self, dy: torch.Tensor) -> torch.Tensor:
        N = self.N
        if dy.shape[-1] == N and dy.dtype in (torch.bfloat16, torch.float32) and dy.device == self.device \
                and self._one_chunk():
            dy2 = dy.reshape(-1, N)
            if dy2.stride(-1) != 1:
                dy2 = dy2.contiguous()
            if _use_scratch("grad_input", self.is_nv, dy2.shape[0]):
                dx = torch.empty((dy2.shape[0], self.K), dtype=dy.dtype, device=dy.device)
                torch.mm(dy2, self.decoded(dy2.dtype), out=dx)
                return dx.view(*dy.shape[:-1], self.K)
        return launch_grad_input(dy, self.packed, self.scale, self.gs, self.is_nv)


class PlannedLinear(torch.autograd.Function):
    """y = plan.linear(x) with dx = plan.grad_input(dy) (the weight is frozen)."""

    @staticmethod
    def forward(ctx, x, plan):  # noqa: D401 - autograd signature
        ctx.plan = plan
        return plan.linear(x)

    @staticmethod
    def backward(ctx, dy):
        return ctx.plan.grad_input(dy), None


Plan.autograd_fn = PlannedLinear
# ----------------------------------------------------------------------------------------------
# custom ops: opaque to torch.compile, graph-capturable (no host syncs, no allocations once warm)


@torch.library.custom_op("qerl::nvfp4_linear", mutates_args=())
def nvfp4_linear(x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                 weight_global_scale: torch.Tensor) -> torch.Tensor:
    """y = x W^T for an NVFP4 weight (compressed-tensors layout)."""
    return launch_linear(x, weight_packed, weight_scale, weight_global_scale, True)


@torch.library.custom_op("qerl::mxfp4_linear", mutates_args=())
def mxfp4_linear(x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """y = x W^T for an MXFP4 weight (compressed-tensors layout)."""
    return launch_linear(x, weight_packed, weight_scale, None, False)


@torch.library.custom_op("qerl::nvfp4_grad_input", mutates_args=())
def nvfp4_grad_input(dy: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                     weight_global_scale: torch.Tensor) -> torch.Tensor:
    """dx = dy W for an NVFP4 weight."""
    return launch_grad_input(dy, weight_packed, weight_scale, weight_global_scale, True)


@torch.library.custom_op("qerl::mxfp4_grad_input", mutates_args=())
def mxfp4_grad_input(dy: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """dx = dy W for an MXFP4 weight."""
    return launch_grad_input(dy, weight_packed, weight_scale, None, False)


@nvfp4_linear.register_fake
def _(x, weight_packed, weight_scale, weight_global_scale):
    return x.new_empty((*x.shape[:-1], weight_packed.shape[0]))


@mxfp4_linear.register_fake
def _(x, weight_packed, weight_scale):
    return x.new_empty((*x.shape[:-1], weight_packed.shape[0]))


@nvfp4_grad_input.register_fake
def _(dy, weight_packed, weight_scale, weight_global_scale):
    return dy.new_empty((*dy.shape[:-1], weight_packed.shape[1] * 2))


@mxfp4_grad_input.register_fake
def _(dy, weight_packed, weight_scale):
    return dy.new_empty((*dy.shape[:-1], weight_packed.shape[1] * 2))


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[1:])  # packed buffers: frozen, no gradient, no copies


def _nvfp4_backward(ctx, dy):
    return torch.ops.qerl.nvfp4_grad_input(dy, *ctx.saved_tensors), None, None, None


def _mxfp4_backward(ctx, dy):
    return torch.ops.qerl.mxfp4_grad_input(dy, *ctx.saved_tensors), None, None


nvfp4_linear.register_autograd(_nvfp4_backward, setup_context=_setup_context)
mxfp4_linear.register_autograd(_mxfp4_backward, setup_context=_setup_context)


def linear(x: torch.Tensor, fmt: str, *tensors: torch.Tensor) -> torch.Tensor:
    """Dispatch target of qerl.kernels.linear for the Triton backend."""
    if fmt == "nvfp4":
        return torch.ops.qerl.nvfp4_linear(x, *tensors)
    if fmt == "mxfp4":
        return torch.ops.qerl.mxfp4_linear(x, *tensors)
    raise ValueError(f"fmt must be one of ('nvfp4', 'mxfp4'), got {fmt!r}")


def grad_input(dy: torch.Tensor, fmt: str, *tensors: torch.Tensor) -> torch.Tensor:
    """Dispatch target of qerl.kernels.grad_input for the Triton backend."""
    if fmt == "nvfp4":
        return torch.ops.qerl.nvfp4_grad_input(dy, *tensors)
    if fmt == "mxfp4":
        return torch.ops.qerl.mxfp4_grad_input(dy, *tensors)
    raise ValueError(f"fmt must be one of ('nvfp4', 'mxfp4'), got {fmt!r}")


