"""The decode family: an FP4 weight (or a block of it) -> a dense bf16 / fp32 buffer, then cuBLAS.

``_decode_kernel`` / ``_decode_pairs_kernel`` write W bit for bit as qerl.formats.dequantize (the
reference: fp32 value * step, one rounding to the output dtype). From M = SCRATCH_MIN_M["linear"]
the forward, and grad-input at every M, decode the weight into a transient scratch (one per device
and dtype, the largest linear's size) and multiply it with cuBLAS (``scratch_linear``,
``scratch_grad_input``).
"""

from __future__ import annotations

import weakref

import torch
import triton
import triton.language as tl

from qerl.kernels.common import RETIRED, check_weight, scale_bytes


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
# the scratch: decode, then cuBLAS (large M and grad-input)

# Smallest M that takes the decode + cuBLAS path instead of the fused kernels, per op (the same for
# both scale kinds). A rule in M alone: the decode costs ~N*K*2.6 bytes of traffic, the GEMM
# ~2*M*N*K flops, and the fused kernels lose a roughly constant fraction of the GEMM, so the
# crossover barely moves with N and K. Measured on the H100 (Qwen2.5-7B layer,
# results/kernels/NOTES.md): forward, fused vs scratch, M = 64: 327 vs 544 us (nvfp4), 305 vs 510
# (mxfp4); M = 128: 682 vs 554, 657 vs 519. Grad-input: the scratch path wins at every M measured
# (M = 16: 522 vs 1040 us nvfp4, 488 vs 846 mxfp4), and the fused kernel's 16-row tiles cost the
# same below M = 16.
SCRATCH_MIN_M = {"linear": 128, "grad_input": 1}
# The scratch holds one chunk of the decoded weight: rows of W (forward) or columns (grad-input).
# None (default): the whole weight, so the scratch is the largest linear's size (one per device and
# dtype). Chunks are sized to whole multiples of 128. On the H100 chunks of 16 / 32 / 64 MiB were
# 2-20% slower than one chunk at every M (smaller GEMMs; the decode did not speed up from L2).
# Decoding chunk i + 1 on a side stream while cuBLAS multiplies chunk i gave no gain either.
SCRATCH_CHUNK_BYTES: int | None = None
# Decode tiles (BLOCK_N rows x NBK scale blocks) and the store (PAIRS: bf16 out as int32 pairs),
# by scale mode (is_nv): the H100 sweep's best on the 7B MLP matrices (read + write TB/s): E4M3
# scales 16 x 16 pairs 2.19 / 2.11 (element stores 1.95 / 1.94), E8M0 scales 32 x 16 pairs, 8 warps,
# 2.13 / 2.13 (element stores 8 x 16: 2.10 / 2.12). fp32 output always takes element stores.
DECODE_CONFIG = {True: dict(BLOCK_N=16, NBK=16, num_warps=4, PAIRS=True),
                 False: dict(BLOCK_N=32, NBK=16, num_warps=8, PAIRS=True)}

_SCRATCH: dict = {}
_SCRATCH_CAPTURED: set = set()
# Objects (plans) whose kept decode launches reference the scratch: release_scratch() calls their release().
HOLDERS: "weakref.WeakSet" = weakref.WeakSet()


def scratch(device: torch.device, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """The decode scratch of this device and dtype (1-D, at least ``numel``): one per device and
    dtype, reused by every layer, grown (never shrunk) to the largest chunk seen. An outgrown buffer
    is freed, unless a CUDA graph captured it (then it is retired like a workspace)."""
    key = (str(device), dtype)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < numel:
        if buf is not None and key in _SCRATCH_CAPTURED:
            RETIRED.append(buf)
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
    for holder in list(HOLDERS):  # their kept decode launches reference the scratch
        holder.release()
    HOLDERS.clear()
    for key in list(_SCRATCH):
        if key in _SCRATCH_CAPTURED:
            RETIRED.append(_SCRATCH[key])
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
    check_weight(packed, scale, is_nv)
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
    decode_into(out, packed, scale_bytes(scale), gs if gs is not None else packed, is_nv, r0, c0, r1 - r0,
                c1 - c0, config or DECODE_CONFIG[is_nv])
    return out


def decode_launch(out, packed, scale_u8, gs_arg, is_nv, r0, c0, n_rows, n_cols, cfg) -> tuple:
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


def decode_into(out, packed, scale_u8, gs_arg, is_nv, r0, c0, n_rows, n_cols, cfg):
    if n_rows == 0 or n_cols == 0:
        return
    kern, grid, args, kw = decode_launch(out, packed, scale_u8, gs_arg, is_nv, r0, c0, n_rows, n_cols, cfg)
    kern[grid](*args, **kw)


def _chunk(total: int, other: int, elem: int, align: int) -> int:
    """Chunk length along a dim of ``total`` (the other dim ``other``) under SCRATCH_CHUNK_BYTES."""
    if SCRATCH_CHUNK_BYTES is None:
        return total
    c = max(align, SCRATCH_CHUNK_BYTES // (other * elem) // align * align)
    return min(total, c)


def scratch_linear(x2: torch.Tensor, packed, scale_u8, gs_arg, is_nv: bool, out: torch.Tensor) -> torch.Tensor:
    """out [M, N] = x2 [M, K] @ W^T: W decoded chunk by chunk of rows into the scratch, cuBLAS per chunk."""
    N, KH = packed.shape
    K = 2 * KH
    rows = _chunk(N, K, x2.element_size(), 128)
    buf = scratch(x2.device, x2.dtype, rows * K)
    for r0 in range(0, N, rows):
        n = min(rows, N - r0)
        w = buf[: n * K].view(n, K)
        decode_into(w, packed, scale_u8, gs_arg, is_nv, r0, 0, n, K, DECODE_CONFIG[is_nv])
        torch.mm(x2, w.t(), out=out[:, r0:r0 + n] if n < N else out)
    return out


def scratch_grad_input(dy2: torch.Tensor, packed, scale_u8, gs_arg, is_nv: bool, dx: torch.Tensor) -> torch.Tensor:
    """dx [M, K] = dy2 [M, N] @ W: W decoded chunk by chunk of columns into the scratch."""
    N, KH = packed.shape
    K = 2 * KH
    cols = _chunk(K, N, dy2.element_size(), 128)
    buf = scratch(dy2.device, dy2.dtype, cols * N)
    for c0 in range(0, K, cols):
        c = min(cols, K - c0)
        w = buf[: N * c].view(N, c)
        decode_into(w, packed, scale_u8, gs_arg, is_nv, 0, c0, N, c, DECODE_CONFIG[is_nv])
        torch.mm(dy2, w, out=dx[:, c0:c0 + c] if c < K else dx)
    return dx


def use_scratch(op: str, M: int) -> bool:
    """Whether ``op`` ("linear" / "grad_input") at M rows takes the decode + cuBLAS path."""
    return M >= SCRATCH_MIN_M[op]
