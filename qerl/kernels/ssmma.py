"""W4A16 GEMMs for Hopper (sm_90) with the decoded weight tile in shared memory (a probe, not dispatched).

y [M, N] = x [M, K] W^T, W in the compute layout (``layout.to_compute_layout``), for many rows of x
(training forwards, large rollout batches), where each decoded weight tile feeds both operands' worth
of MMAs from shared memory and the decode could run beside the MMAs instead of before them.

Two structures over [128, BN] output tiles (BN 128 or 256 weight rows), a K step of 64 a stage:
  - ``_ss_kernel`` (warp-specialised): a loader warp streams the two [64, 64] activation tiles and the
    weight and scale blocks of a stage into a TMA ring on mbarriers; two consumer warpgroups (64 rows
    of x each) each decode half of the weight tile into a ring of decoded bf16 tiles (128-byte swizzle,
    the MMA's B operand), wait for the other half, and issue a shared-operand warpgroup MMA left in
    flight over the next stage's decode (no register operand: nothing for Triton 3.6's register-A
    hazard to corrupt).
  - ``_sp_kernel`` (``config={"SP": 1}``, eight warps, no roles): each stage all warps decode the tile
    into a ring of three decoded buffers, one CTA barrier, one thread refills the ring slot whose MMA is
    complete, and the [128, BN] MMA is left in flight over the next stage's decode.
Split-K partials are summed in a fixed order by the last program of a tile (bitwise repeatable).

Measured on an H100 against bf16 cuBLAS and the production dispatch (results/kernels/NOTES.md): correct
and repeatable, but slower than decode + cuBLAS at every M from 128 to 2048 on a Qwen2.5-7B layer, so
nothing calls it. The first stage is peeled out of the consumer loops: with a zero-trip path carrying the
zero accumulator to the final wait, ptxas serialised every MMA of the kernel.
"""

from __future__ import annotations

import torch
import triton

from qerl.kernels import common, mma

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    HAVE_SS = hasattr(gl, "warp_specialize")
    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
except ImportError:  # pragma: no cover - older triton
    HAVE_SS = False

BM = 128  # activation rows of a CTA (two consumer warpgroups of 64)
BK = 64  # columns a stage (one compute-layout block)

if HAVE_SS:

    @gluon.jit
    def _ss_loader(x_desc, w_desc, s_desc, x_bufs, w_bufs, s_bufs, ready, empty, m0, nb0, i0, i1):
        """The loader warp: per ring stage the two activation tiles and the weight and scale blocks."""
        STAGES: gl.constexpr = ready.type.shape[0]
        nbytes: gl.constexpr = 2 * x_desc.block_type.nbytes + w_desc.block_type.nbytes + s_desc.block_type.nbytes
        for it in range(i0, i1):
            j = it - i0
            s = j % STAGES
            mbarrier.wait(empty.index(s), ((j // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, nbytes)
            tma.async_copy_global_to_shared(x_desc, [m0, it * 64], bar, x_bufs.index(2 * s))
            tma.async_copy_global_to_shared(x_desc, [m0 + 64, it * 64], bar, x_bufs.index(2 * s + 1))
            tma.async_copy_global_to_shared(w_desc, [nb0, it * 2, 0], bar, w_bufs.index(s))
            tma.async_copy_global_to_shared(s_desc, [nb0, it * 64], bar, s_bufs.index(s))

    @gluon.jit
    def _ss_decode_tile(w_buf, s_buf, ASM: gl.constexpr, NB: gl.constexpr, W: gl.constexpr = 4):
        """NB 16-row blocks x 64 columns of weights and scales from the ring -> bf16 [16 NB, 64]
        (the qerl.kernels.mma decode: exact, 20 instructions per 8 weights). A warp decodes NB / 4
        blocks, 16 bytes a lane per block."""
        w_l: gl.constexpr = gl.BlockedLayout([1, 1, 1, 1, 16], [1, 8, 4, 1, 1], [W, 1, 1, 1, 1], [4, 3, 2, 1, 0])
        s_l: gl.constexpr = gl.BlockedLayout([1, 1, 1, 1, 8], [1, 8, 4, 1, 1], [W, 1, 1, 1, 1], [4, 3, 2, 1, 0])
        s7_l: gl.constexpr = gl.BlockedLayout([1, 1, 1, 1, 4, 2, 2], [1, 8, 4, 1, 1, 1, 1], [W, 1, 1, 1, 1, 1, 1],
                                              [6, 5, 4, 3, 2, 1, 0])
        flat5: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[4, 3, 2, 1, 0])
        wq = w_buf._reinterpret(gl.uint8, [NB, 8, 4, 1, 16], flat5).load(w_l)
        sq = s_buf._reinterpret(gl.uint8, [NB, 8, 1, 1, 8], flat5).load(s_l)
        sq = sq + gl.zeros([NB, 8, 4, 1, 8], gl.uint8, s_l)
        s16 = gl.convert_layout(
            gl.reshape(gl.expand_dims(gl.convert_layout(gl.reshape(sq, [NB, 8, 4, 1, 4, 2]),
                                                        gl.SliceLayout(6, s7_l)), 6)
                       + gl.zeros([NB, 8, 4, 1, 4, 2, 2], gl.uint8, s7_l), [NB, 8, 4, 1, 16]), w_l)
        lo, hi = gl.inline_asm_elementwise(ASM, "=r,=r,=r,=r,r,r", [wq, s16],
                                           dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=4)
        wv = gl.join(lo, hi)
        wv = gl.reshape(wv, [NB, 8, 4, 1, 4, 2, 2, 2])  # [nb, g, c, kb, t, h, e, q]
        wv = gl.permute(wv, [0, 5, 1, 3, 4, 7, 2, 6])  # [nb, h, g, kb, t, q, c, e]
        return gl.reshape(wv, [16 * NB, 64])

    @gluon.jit
    def _ss_stage(x_bufs, w_bufs, s_bufs, d_bufs, ready, empty, dready, dempty, j, wg: gl.constexpr, acc,
                  HB: gl.constexpr, DB: gl.constexpr, ASM: gl.constexpr):
        """Stage j of a consumer warpgroup: decode its half of the weight tile into the decoded ring,
        wait for the other half, issue the MMA and leave it in flight; once the MMA of stage j - 1 is
        complete, hand that stage's buffers back."""
        STAGES: gl.constexpr = ready.type.shape[0]
        DSTAGES: gl.constexpr = dready.type.shape[0]
        s = j % STAGES
        d = j % DSTAGES
        mbarrier.wait(ready.index(s), (j // STAGES) & 1)
        mbarrier.wait(dempty.index(d), ((j // DSTAGES) & 1) ^ 1)
        for q in gl.static_range(HB // DB):  # DB blocks (16 DB rows) at a time: fewer live registers
            wv = _ss_decode_tile(w_bufs.index(s).slice(wg * HB + q * DB, DB),
                                 s_bufs.index(s).slice(wg * HB + q * DB, DB), ASM, DB)
            d_bufs.index(d).slice(16 * (wg * HB + q * DB), 16 * DB).store(wv)
        fence_async_shared()  # each thread's stores, seen by the MMA's (async-proxy) reads
        _cta_barrier()  # every warp of this warpgroup has stored and fenced
        mbarrier.arrive(dready.index(d), count=1)
        mbarrier.wait(dready.index(d), (j // DSTAGES) & 1)  # the other half too
        acc = warpgroup_mma(x_bufs.index(2 * s + wg), d_bufs.index(d).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(1, deps=[acc])
        if j > 0:  # the MMA of stage j - 1 is complete: its buffers go back
            mbarrier.arrive(empty.index((j - 1) % STAGES), count=1)
            mbarrier.arrive(dempty.index((j - 1) % DSTAGES), count=1)
        return acc

    @gluon.jit
    def _ss_consumer(x_bufs, w_bufs, s_bufs, d_bufs, ready, empty, dready, dempty, i0, i1, wg: gl.constexpr,
                     gs_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, m0, n0, tile, pid_k, n_split,
                     BN: gl.constexpr, IS_NV: gl.constexpr, ASM: gl.constexpr, DB: gl.constexpr):
        """One consumer warpgroup: activation rows m0 + 64 wg .. + 64 x the CTA's BN weight rows, the
        stages of its K range (at least one: the launch gives every split one), then its epilogue."""
        HB: gl.constexpr = BN // 32  # 16-row blocks of this warpgroup's half
        mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
        # the first stage outside the loop: the accumulator that reaches the final wait is always an
        # MMA's (a zero-trip path from the zeros would make ptxas serialise every MMA of the kernel)
        acc = _ss_stage(x_bufs, w_bufs, s_bufs, d_bufs, ready, empty, dready, dempty, 0, wg,
                        gl.zeros([64, BN], gl.float32, layout=mma_l), HB, DB, ASM)
        for j in range(1, i1 - i0):
            acc = _ss_stage(x_bufs, w_bufs, s_bufs, d_bufs, ready, empty, dready, dempty, j, wg, acc, HB, DB, ASM)
        acc = warpgroup_mma_wait(0, deps=[acc])
        if IS_NV:
            alpha = 128.0 / gl.load(gs_ptr)
        else:
            alpha = 4611686018427387904.0
        acc = acc * alpha
        # offsets from the tile's first element (int32: a tile spans < 2^31 elements; the base is 64-bit)
        r0 = m0 + 64 * wg
        offs_m = gl.arange(0, 64, layout=gl.SliceLayout(1, mma_l))
        offs_n = gl.arange(0, BN, layout=gl.SliceLayout(0, mma_l))
        mask = (offs_m[:, None] < M - r0) & (offs_n[None, :] < N - n0)
        o_off = offs_m[:, None] * N + offs_n[None, :]
        base = r0.to(gl.int64) * N + n0
        if n_split == 1:
            gl.store(out_ptr + base + o_off, acc.to(out_ptr.dtype.element_ty), mask=mask)
        else:  # workspace [split, M, N]; the last program of the tile sums the partials in split order
            mn = (pid_k.to(gl.int64) * 0 + M) * N
            gl.store(ws_ptr + (pid_k * mn + base) + o_off, acc, mask=mask)
            _cta_barrier()
            count = gl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
            if count == n_split - 1:
                total = gl.zeros([64, BN], gl.float32, layout=mma_l)
                for p in range(0, n_split):
                    total += gl.load(ws_ptr + (p * mn + base) + o_off, mask=mask, other=0.0, cache_modifier=".cg")
                gl.store(out_ptr + base + o_off, total.to(out_ptr.dtype.element_ty), mask=mask)
                gl.atomic_xchg(cnt_ptr + tile, 0)

    @gluon.jit
    def _ss_kernel(x_desc, w_desc, s_desc, gs_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, NB_K, iters_per_split, MT,
                   IS_NV: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, DSTAGES: gl.constexpr,
                   ASM: gl.constexpr, DB: gl.constexpr, REGS: gl.constexpr, num_warps: gl.constexpr):
        """out[M, N] = x W^T. Grid (N tiles * MT, split): the MT row tiles of x for one weight tile next
        to each other (they share it in L2)."""
        pid0 = gl.program_id(0)
        pid_n = pid0 // MT
        m0 = (pid0 % MT) * 128
        pid_k = gl.program_id(1)
        n_split = gl.num_programs(1)
        i0 = pid_k * iters_per_split
        i1 = gl.minimum(i0 + iters_per_split, NB_K)
        NB: gl.constexpr = BN // 16
        x_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES * 2, 64, 64], x_desc.layout)
        w_bufs = gl.allocate_shared_memory(gl.uint8, [STAGES, NB, 2, 256], w_desc.layout)
        s_bufs = gl.allocate_shared_memory(gl.uint8, [STAGES, NB, 64], s_desc.layout)
        d_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        d_bufs = gl.allocate_shared_memory(gl.bfloat16, [DSTAGES, BN, 64], d_l)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        dready = gl.allocate_shared_memory(gl.int64, [DSTAGES, 1], mbarrier.MBarrierLayout())
        dempty = gl.allocate_shared_memory(gl.int64, [DSTAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)
        for i in gl.static_range(DSTAGES):
            mbarrier.init(dready.index(i), count=2)
            mbarrier.init(dempty.index(i), count=2)
        n0 = pid_n * BN
        tile = pid0 * 2
        gl.warp_specialize([
            (_ss_consumer, (x_bufs, w_bufs, s_bufs, d_bufs, ready, empty, dready, dempty, i0, i1, 0, gs_ptr, out_ptr,
                            ws_ptr, cnt_ptr, M, N, m0, n0, tile, pid_k, n_split, BN, IS_NV, ASM, DB)),
            (_ss_consumer, (x_bufs, w_bufs, s_bufs, d_bufs, ready, empty, dready, dempty, i0, i1, 1, gs_ptr, out_ptr,
                            ws_ptr, cnt_ptr, M, N, m0, n0, tile + 1, pid_k, n_split, BN, IS_NV, ASM, DB)),
            (_ss_loader, (x_desc, w_desc, s_desc, x_bufs, w_bufs, s_bufs, ready, empty, m0, pid_n * NB, i0, i1)),
        ], [4, 1], [REGS, 24])


    @gluon.jit
    def _sp_load(x_desc, w_desc, s_desc, x_bufs, w_bufs, s_bufs, ready, m0, nb0, it, i1, slot):
        """Stage it's activation, weight and scale tiles into ring slot `slot` (nothing past i1)."""
        bar = ready.index(slot)
        pred = it < i1
        mbarrier.expect(bar, x_desc.block_type.nbytes + w_desc.block_type.nbytes + s_desc.block_type.nbytes, pred=pred)
        tma.async_copy_global_to_shared(x_desc, [m0, it * 64], bar, x_bufs.index(slot), pred=pred)
        tma.async_copy_global_to_shared(w_desc, [nb0, it * 2, 0], bar, w_bufs.index(slot), pred=pred)
        tma.async_copy_global_to_shared(s_desc, [nb0, it * 64], bar, s_bufs.index(slot), pred=pred)

    @gluon.jit
    def _sp_stage(x_desc, w_desc, s_desc, x_bufs, w_bufs, s_bufs, d_bufs, ready, m0, nb0, i0, i1, j, acc,
                  ASM: gl.constexpr):
        """Stage j: decode the weight tile into the decoded ring (each warp its 16-row blocks), one CTA
        barrier, refill the ring slot whose MMA is complete, issue the MMA and leave it in flight."""
        STAGES: gl.constexpr = ready.type.shape[0]
        NB: gl.constexpr = w_bufs.type.shape[1]
        s = j % STAGES
        d = j % 3
        mbarrier.wait(ready.index(s), (j // STAGES) & 1)
        wv = _ss_decode_tile(w_bufs.index(s), s_bufs.index(s), ASM, NB, 8)
        # three decoded buffers: this one's last reader, the MMA of stage j - 3, is complete in both
        # warpgroups (each waited for it in stage j - 2, before the CTA barrier of stage j - 1)
        d_bufs.index(d).store(wv)
        fence_async_shared()  # each thread's stores, seen by the MMA's (async-proxy) reads
        # every warp has stored, and has waited for its warpgroup's MMA of stage j - 2 (in stage j - 1),
        # so that stage's ring slot can be refilled
        _cta_barrier()
        _sp_load(x_desc, w_desc, s_desc, x_bufs, w_bufs, s_bufs, ready, m0, nb0, i0 + j + STAGES - 2, i1,
                 (j + STAGES - 2) % STAGES)
        acc = warpgroup_mma(x_bufs.index(s), d_bufs.index(d).permute((1, 0)), acc, is_async=True)
        return warpgroup_mma_wait(1, deps=[acc])

    @gluon.jit
    def _sp_kernel(x_desc, w_desc, s_desc, gs_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, NB_K, iters_per_split, MT,
                   IS_NV: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, ASM: gl.constexpr,
                   BMT: gl.constexpr, num_warps: gl.constexpr):
        """out[M, N] = x W^T, [BMT, BN] tiles, eight warps, software-pipelined (no warp roles)."""
        pid0 = gl.program_id(0)
        pid_n = pid0 // MT
        m0 = (pid0 % MT) * BMT
        pid_k = gl.program_id(1)
        n_split = gl.num_programs(1)
        i0 = pid_k * iters_per_split
        i1 = gl.minimum(i0 + iters_per_split, NB_K)
        NB: gl.constexpr = BN // 16
        nb0 = pid_n * NB
        x_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BMT, 64], x_desc.layout)
        w_bufs = gl.allocate_shared_memory(gl.uint8, [STAGES, NB, 2, 256], w_desc.layout)
        s_bufs = gl.allocate_shared_memory(gl.uint8, [STAGES, NB, 64], s_desc.layout)
        d_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        d_bufs = gl.allocate_shared_memory(gl.bfloat16, [3, BN, 64], d_l)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
        for i in gl.static_range(STAGES - 2):
            _sp_load(x_desc, w_desc, s_desc, x_bufs, w_bufs, s_bufs, ready, m0, nb0, i0 + i, i1, i)
        mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, BN, 16])
        acc = _sp_stage(x_desc, w_desc, s_desc, x_bufs, w_bufs, s_bufs, d_bufs, ready, m0, nb0, i0, i1, 0,
                        gl.zeros([BMT, BN], gl.float32, layout=mma_l), ASM)
        for j in range(1, i1 - i0):
            acc = _sp_stage(x_desc, w_desc, s_desc, x_bufs, w_bufs, s_bufs, d_bufs, ready, m0, nb0, i0, i1, j, acc, ASM)
        acc = warpgroup_mma_wait(0, deps=[acc])
        if IS_NV:
            alpha = 128.0 / gl.load(gs_ptr)
        else:
            alpha = 4611686018427387904.0
        acc = acc * alpha
        offs_m = gl.arange(0, BMT, layout=gl.SliceLayout(1, mma_l))
        offs_n = gl.arange(0, BN, layout=gl.SliceLayout(0, mma_l))
        mask = (offs_m[:, None] < M - m0) & (offs_n[None, :] < N - pid_n * BN)
        o_off = offs_m[:, None] * N + offs_n[None, :]
        base = m0.to(gl.int64) * N + pid_n * BN
        if n_split == 1:
            gl.store(out_ptr + base + o_off, acc.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            mn = (pid_k.to(gl.int64) * 0 + M) * N
            gl.store(ws_ptr + (pid_k * mn + base) + o_off, acc, mask=mask)
            _cta_barrier()
            count = gl.atomic_add(cnt_ptr + pid0, 1, sem="acq_rel")
            if count == n_split - 1:
                total = gl.zeros([BMT, BN], gl.float32, layout=mma_l)
                for p in range(0, n_split):
                    total += gl.load(ws_ptr + (p * mn + base) + o_off, mask=mask, other=0.0, cache_modifier=".cg")
                gl.store(out_ptr + base + o_off, total.to(out_ptr.dtype.element_ty), mask=mask)
                gl.atomic_xchg(cnt_ptr + pid0, 0)


# ----------------------------------------------------------------------------------------------
# launch


def pick_config(M: int, N: int, K: int) -> dict:
    """Launch config by rule: BN weight rows a CTA, STAGES raw and DSTAGES decoded ring stages."""
    return dict(BN=256, STAGES=4, DSTAGES=2, DB=4, REGS=232, waves=1)


def _descs(x2: torch.Tensor, packed_c: torch.Tensor, scales_c: torch.Tensor, BN: int, cache: dict | None,
           xrows: int = 64):
    gl_layout = gl.NVMMASharedLayout
    M, K = x2.shape
    x_desc = TensorDescriptor(x2, [M, K], [x2.stride(0), 1], [xrows, BK],
                              gl_layout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
    key = ("ss_descriptors", BN, packed_c.data_ptr(), scales_c.data_ptr())
    wd = cache.get(key) if cache is not None else None
    if wd is None:
        nb, nbk = packed_c.shape[:2]
        w3 = packed_c.view(nb, nbk * 2, 256)
        s2 = scales_c.view(nb, nbk * 64)
        wd = (TensorDescriptor(w3, [nb, nbk * 2, 256], [nbk * 512, 256, 1], [BN // 16, 2, 256],
                               gl_layout(swizzle_byte_width=0, element_bitwidth=8, rank=3)),
              TensorDescriptor(s2, [nb, nbk * 64], [nbk * 64, 1], [BN // 16, 64],
                               gl_layout(swizzle_byte_width=0, element_bitwidth=8, rank=2)))
        if cache is not None:
            cache[key] = wd
    return x_desc, wd[0], wd[1]


def linear(x2: torch.Tensor, packed_c: torch.Tensor, scales_c: torch.Tensor, gs: torch.Tensor | None, N: int,
           K: int, is_nv: bool, out: torch.Tensor | None = None, config: dict | None = None,
           split_k: int | None = None, cache: dict | None = None) -> torch.Tensor:
    """y [M, N] = x2 [M, K] W^T with W in the compute layout; bf16 x2 with contiguous rows, K and the
    row stride multiples of 8, 16-byte aligned (the bulk copies' rules)."""
    M = x2.shape[0]
    if x2.dtype != torch.bfloat16 or x2.stride(-1) != 1:
        raise ValueError("the shared-operand kernel takes bfloat16 activations with contiguous rows")
    if K % 8 or (M > 1 and x2.stride(0) % 8) or x2.data_ptr() % 16:
        raise ValueError("the shared-operand kernel copies activations in bulk: K and the row stride must be "
                         "multiples of 8, the data 16-byte aligned")
    cfg = dict(pick_config(M, N, K), **(config or {}))
    BN = cfg["BN"]
    if out is None:
        out = torch.empty((M, N), dtype=x2.dtype, device=x2.device)
    bmt = cfg.get("BMT", BM) if cfg.get("SP") else BM
    mt = triton.cdiv(M, bmt)
    n_tiles = triton.cdiv(packed_c.shape[0] * 16, BN)
    iters = packed_c.shape[1]
    split_k = split_k or cfg.get("split")
    if split_k is None:
        want = cfg["waves"] * common.num_sms(x2.device) / max(n_tiles * mt, 1)
        split_k = 1
        while split_k * 2 <= min(want, 8, iters // 4):
            split_k *= 2
    ips = triton.cdiv(iters, split_k)
    split = triton.cdiv(iters, ips)
    ws, cnt = common.workspace(x2.device, 0 if split == 1 else split * M * N, n_tiles * mt * 2 if split > 1 else 0)
    x_desc, w_desc, s_desc = _descs(x2, packed_c, scales_c, BN, cache, bmt if cfg.get("SP") else 64)
    if cfg.get("SP"):
        _sp_kernel[(n_tiles * mt, split)](
            x_desc, w_desc, s_desc, gs if gs is not None else scales_c, out, ws, cnt, M, N, iters, ips, mt,
            IS_NV=is_nv, BN=BN, STAGES=cfg["STAGES"], ASM=mma._ASM_NV if is_nv else mma._ASM_MX, BMT=bmt, num_warps=cfg.get("W", 8),
            **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}))
        return out
    _ss_kernel[(n_tiles * mt, split)](
        x_desc, w_desc, s_desc, gs if gs is not None else scales_c, out, ws, cnt, M, N, iters, ips, mt,
        IS_NV=is_nv, BN=BN, STAGES=cfg["STAGES"], DSTAGES=cfg["DSTAGES"],
        ASM=mma._ASM_NV if is_nv else mma._ASM_MX, DB=cfg["DB"], REGS=cfg["REGS"], num_warps=4)
    return out


_AVAILABLE: dict = {}


def available(device: torch.device) -> bool:
    """Gluon with warp_specialize, an sm_90 GPU, and the kernel through its self-test (once)."""
    if not HAVE_SS or device.type != "cuda":
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    ok = _AVAILABLE.get(idx)
    if ok is None:
        if torch.cuda.get_device_capability(idx)[0] != 9:
            ok = False
        elif torch.cuda.is_current_stream_capturing():
            return False
        else:
            ok = _self_test(torch.device("cuda", idx))
        _AVAILABLE[idx] = ok
    return ok


def _self_test(device: torch.device) -> bool:
    """The kernel against the fp32 reference on a ragged 300 x 320 weight at 5 and 200 rows (one and
    two row tiles, a partial weight tile), both formats (mma.self_test)."""
    return mma.self_test(device, lambda x, pc, sc, gs, n, k, nv: linear(x, pc, sc, gs, n, k, nv),
                         "shared-operand fp4 kernel", "decode + cuBLAS serves its calls", n=300, k=320, Ms=(5, 200))
