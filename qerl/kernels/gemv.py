"""The GEMV FP4 kernel for decode batches (M <= 16): packed integer decode, two weights per 32-bit op.

``_fwd_gemv_kernel``: y = x W^T for M <= a few rows. Weights read as int32 words and decoded two at
a time into bf16x2 with packed integer ops (inline PTX), bf16x2 FMAs per word, fp32 across words;
split-K over the reduction for parallelism (reduced in a fixed order, qerl.kernels.common).

Reference: ``qerl.kernels.linear_reference`` (dequantize, fp32 matmul).
"""

from __future__ import annotations

import triton
import triton.language as tl

from qerl.kernels.common import decode_scale, splitk_epilogue

# How the GEMV decodes.
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
                     GROUPS: tl.constexpr, ACC_F32: tl.constexpr, USE_ASM: tl.constexpr):
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
        sc = decode_scale(s, IS_NV)
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
    splitk_epilogue(acc, out_ptr, ws_ptr, cnt_ptr, offs_m, offs_n, M, N, stride_om, pid_n)
