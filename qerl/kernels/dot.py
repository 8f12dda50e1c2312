"""The tiled tensor-core FP4 kernels (``tl.dot``): y = x W^T for mid M, dx = dy W when asked for.

  - ``_fwd_dot_kernel``: tiled GEMM for mid M, and with BLOCK_M=16 plus split-K for skinny M. By
    default "swap AB": the tile is computed as (W x^T)^T, so the decoded weight is wgmma's register
    operand A and x, pipelined into shared memory, operand B.
  - ``_bwd_dot_kernel``: dx = dy W (only when asked for: kind="fused"; grad-input otherwise takes
    the decode + cuBLAS path of qerl.kernels.scratch).

Decoding is by hand (Triton 3.6's ``tl.dot_scaled`` does not compile e4m3 scales on sm_90). In the
forward (``_weight_tile``) an E2M1 code c is placed in the bits of a bf16 so that its value is
exactly c * 2^-126 (magnitude bits at the bottom of the exponent field, so E2M1's subnormal 0.5
lands on a bf16 subnormal), and multiplied by its block scale, decoded to a bf16 equal to
scale * 2^119 (E4M3) or 2^(e-127) * 2^64 (E8M0; e=0, used only by all-zero blocks, decodes to 0):
one bf16 multiply per weight, exact (2 + 4 significant bits, a normal result), so the tensor-core
operand is exact and the only rounding is the fp32 accumulation. The constant powers of two and
the global divisor are applied once, in the epilogue.

Operand order. With 16-bit activations the swapped tile is one register-A dot per K step, waited
at once. With fp32 activations the decoded tile becomes fp32 and the product a tf32 MMA, and Triton
splits such a register-A dot along K and leaves its last part in flight across the loop's back edge
(``warp_group_dot_wait`` pendings 1 on Triton 3.7, 7 on 3.6, in the sm_90 TTGIR). That wait names the
accumulator registers but not the A operand's, so the register allocator may hand them to the next
tile's decode while the MMA still reads them (the hazard of triton issue #9433, on a path the 3.7
fix does not cover; wrong products on the H100 under 3.7.1, results/kernels/NOTES.md). So the
launcher (``ops.linear_call``) never swaps for fp32 activations: both operands then stay in shared
memory, safe on every Triton.

Reference: ``qerl.kernels.linear_reference`` / ``grad_input_reference`` (dequantize, fp32 matmul).
"""

from __future__ import annotations

import triton
import triton.language as tl

from qerl.kernels.common import decode_scale, splitk_epilogue


@triton.jit
def _dot(a, b, acc, F32_DOT: tl.constexpr):
    """acc += a @ b; F32_DOT (set under TRITON_INTERPRET, whose bf16 tl.dot returns garbage in
    triton 3.9) multiplies in fp32 instead, exactly as the bf16 tensor cores would."""
    if F32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)



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
def _grouped_tile(pid, num_m, num_c, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program pid in grouped order: GROUP_M row tiles share each column
    tile of the weight while it is in L2."""
    width = GROUP_M * num_c
    first_m = (pid // width) * GROUP_M
    group_size = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % width) % group_size, (pid % width) // group_size


@triton.jit
def _fwd_dot_kernel(x_ptr, w_ptr, s_ptr, gs_ptr, out_ptr, ws_ptr, cnt_ptr,
                    M, N, K, stride_xm, stride_om, tiles_per_split,
                    IS_NV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SWAP_AB: tl.constexpr,
                    EVEN_K: tl.constexpr, F32_DOT: tl.constexpr):
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
    pid_m, pid_n = _grouped_tile(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
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
    splitk_epilogue(acc, out_ptr, ws_ptr, cnt_ptr, offs_m, offs_n, M, N, stride_om, pid)


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

    Masked loads, one scale load per packed byte, fp32 decode: on the H100 this measured 0.23x
    bf16 for the 7B layer at M = 2048, against 0.19x for the best config of a rewrite with clamped
    loads, per-block scale broadcast, swap-AB and a bf16 decode (results/kernels/NOTES.md)."""
    HB: tl.constexpr = 8 if IS_NV else 16
    BKH: tl.constexpr = BLOCK_K // 2
    pid = tl.program_id(0)
    pid_m, pid_k = _grouped_tile(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(K, BLOCK_K), GROUP_M)
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
        sc = decode_scale(s, IS_NV)
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

