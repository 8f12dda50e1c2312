"""Warp-specialised W4A16 GEMM for Hopper (sm_90) on the compute layout of ``qerl.kernels.layout``.

y [M, N] = x [M, K] W^T, W in the compute layout (``layout.to_compute_layout``: 16-row x 64-column
blocks of 512 code bytes, each lane's 16 bytes its MMA fragment, and 128 scale bytes a block: bf16 pairs).

A CTA: NWG consumer warpgroups (RPW x 64 weight rows each) x BM rows of x, over a K range, and one
producer warp:
  - the producer (a worker partition of one warp, 24 registers) streams, per ring stage, KB
    activation tiles [BM, 64] (bf16, 128-byte swizzle) and each warpgroup's KB weight blocks and
    scales into a ring of STAGES shared-memory buffers with bulk tensor copies (TMA), each stage
    completing on its own mbarrier. It waits only on the ring's "empty" barriers: no CTA barrier in
    the loop.
  - each consumer warpgroup (the default partition and NWG - 1 worker partitions) waits for a
    stage, decodes its RPW x 64 rows in registers (the ``qerl.kernels.mma`` decode: exact, 15
    instructions per 8 weights, ``make compile-check`` counts them) straight into the register A operand of the warpgroup MMA (RPW 2: two
    64-row instructions an MMA), whose B operand is the shared activation tile. Two forms of this
    loop, chosen by the installed Triton (MMA_IN_FLIGHT):
      - in flight (Triton >= 3.7): each MMA runs while the next block is decoded (wait(1)), and a
        stage goes back to the producer one block late;
      - waited (Triton 3.6): each MMA is waited at once and the stage handed back after its blocks,
        because Triton 3.6 could reuse the registers of a register-A MMA left in flight (triton issue
        #9433, fixed in 3.7).
    The warpgroups of a CTA (NWG 1 or 2) share the activation tile, interleave (one decodes while
    another's MMA runs), and each writes its own epilogue.
Split-K partials are summed in a fixed order by the last program of a tile (bitwise repeatable).
One launch can serve 1-3 weights sharing x (``grouped_linear``: the fused decode step's q/k/v and gate/up):
their tiles lie side by side in the grid, and a CTA takes its weight's descriptors, global scale, output and
workspace slice; each output is bitwise that weight's own launch at the same split.

Where it serves (SERVED_M): 17 <= M <= 32 with either loop, and with MMAs in flight also 38 <= M <= 256
(one consumer warpgroup a CTA; 128-row activation tiles from 65 rows, see ``pick_config``). The mma
kernel serves the other M up to 256. The per-M measurements: results/kernels/NOTES.md.
Measured and not kept: decoding into shared memory for a shared-operand MMA (the decoded tile's
shared-memory traffic bounded it near half the bf16 rate), three or four consumer warpgroups, 128-row
tiles under two consumer warpgroups (register spills), 256-row tiles (1.5-3x slower than 128).

Requires Gluon with warp_specialize, TMA and mbarriers (Triton >= 3.6) and an sm_90 GPU;
``available()`` says whether it can run (a self-test against the fp32 reference at the first call).
"""

from __future__ import annotations

import torch
import triton

from qerl.kernels import common, mma

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    HAVE_WS = hasattr(gl, "warp_specialize")
    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    # the names Triton 3.8 changed: the TMA load (async_copy_global_to_shared -> async_load)
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
except ImportError:  # pragma: no cover - older triton
    HAVE_WS = False

BK = 64  # columns a K step (one compute-layout block)


def _triton_version() -> tuple[int, int]:
    try:
        major, minor = (int("".join(c for c in p if c.isdigit()) or 0) for p in triton.__version__.split(".")[:2])
    except ValueError:  # pragma: no cover - an unparsable version: assume the older compiler
        return (0, 0)
    return major, minor


# Whether the installed Triton keeps a register-A warpgroup MMA's operand intact while the MMA is in
# flight: Triton <= 3.6 could hand those registers to later code before the MMA read them (triton issue
# #9433); the fix (PR #9514) shipped in Triton 3.7. With it the consumers keep one MMA in flight.
MMA_IN_FLIGHT = _triton_version() >= (3, 7)

if HAVE_WS:
    _pdl_enter = mma.pdl_enter  # griddepcontrol (common.pdl_args)

    # a shared-memory buffer viewed with another dtype / shape / layout (``_reinterpret`` up to Triton 3.7)
    if hasattr(gl.shared_memory_descriptor, "reinterpret"):
        @gluon.jit
        def _view(buf, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
            return buf.reinterpret(dtype, shape, layout)
    else:
        @gluon.jit
        def _view(buf, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
            return buf._reinterpret(dtype, shape, layout)

    @gluon.jit
    def _ws_loader(x_desc, w_desc, s_desc, x_bufs, w_bufs, s_bufs, ready, empty, m0, nb0, i0, i1,
                   KB: gl.constexpr, NWG: gl.constexpr):
        """The producer warp: per ring stage, KB activation tiles, and each consumer warpgroup's KB
        weight and scale blocks, on the stage's ready barrier."""
        STAGES: gl.constexpr = ready.type.shape[0]
        nbytes: gl.constexpr = KB * (x_desc.block_type.nbytes
                                     + NWG * (w_desc.block_type.nbytes + s_desc.block_type.nbytes))
        RW: gl.constexpr = w_desc.block_type.shape[0]  # 16-row blocks of a warpgroup
        for it in range(i0, i1):
            j = it - i0
            s = j % STAGES
            mbarrier.wait(empty.index(s), ((j // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, nbytes)
            for kb in gl.static_range(KB):
                k = it * KB + kb
                _tma_load(x_desc, [m0, k * 64], bar, x_bufs.index(s * KB + kb))
                for w in gl.static_range(NWG):
                    idx = (s * KB + kb) * NWG + w
                    _tma_load(w_desc, [nb0 + w * RW, k * 2, 0], bar, w_bufs.index(idx))
                    _tma_load(s_desc, [nb0 + w * RW, k * 128], bar, s_bufs.index(idx))

    @gluon.jit
    def _ws_group_loader(x_desc, w_desc, s_desc, w_desc1, s_desc1, w_desc2, s_desc2, g, x_bufs, w_bufs, s_bufs,
                         ready, empty, m0, nb0, i0, i1, KB: gl.constexpr, NWG: gl.constexpr, NG: gl.constexpr):
        """The producer warp of a launch over NG weights: the loads of weight g's tile (one branch a CTA)."""
        if NG == 1:
            _ws_loader(x_desc, w_desc, s_desc, x_bufs, w_bufs, s_bufs, ready, empty, m0, nb0, i0, i1, KB, NWG)
        else:
            if g == 0:
                _ws_loader(x_desc, w_desc, s_desc, x_bufs, w_bufs, s_bufs, ready, empty, m0, nb0, i0, i1, KB, NWG)
            elif g == 1:
                _ws_loader(x_desc, w_desc1, s_desc1, x_bufs, w_bufs, s_bufs, ready, empty, m0, nb0, i0, i1, KB, NWG)
            else:
                _ws_loader(x_desc, w_desc2, s_desc2, x_bufs, w_bufs, s_bufs, ready, empty, m0, nb0, i0, i1, KB, NWG)

    @gluon.jit
    def _ws_decode(w_buf, s_buf, RB: gl.constexpr, ASM: gl.constexpr, a_l: gl.constexpr):
        """One 64-column block of a warpgroup's RB x 16 weight rows from its ring buffers -> bf16 [RB * 16, 64]
        in the MMA's register A layout (the qerl.kernels.mma decode, exact).
        Warp w holds the 16-row blocks w, w + 4, ...: the rows the warpgroup MMA gives it."""
        # weights [RB (blocks), 8 (g), 4 (c), 1, 16 bytes]: 16 contiguous bytes a lane, blocks w + 4i a warp
        w_l: gl.constexpr = gl.BlockedLayout([1, 1, 1, 1, 16], [1, 8, 4, 1, 1], [4, 1, 1, 1, 1], [4, 3, 2, 1, 0])
        flat5: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[4, 3, 2, 1, 0])
        # the bulk copy wrote each block's 512 bytes in the compute layout's (g, c, byte) order
        wq = _view(w_buf, gl.uint8, [RB, 8, 4, 1, 16], flat5).load(w_l)
        # the block's 128 scale bytes (g, t, bf16 pair): word t of a lane's 16 the pair of its code word t;
        # the four lanes c of a row read the same 16
        sq = _view(s_buf, gl.uint8, [RB, 8, 1, 1, 16], flat5).load(w_l)
        sq = sq + gl.zeros([RB, 8, 4, 1, 16], gl.uint8, w_l)
        lo, hi = gl.inline_asm_elementwise(ASM, "=r,=r,=r,=r,r,r", [wq, sq],
                                           dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=4)
        wv = gl.join(lo, hi)
        wv = gl.reshape(wv, [RB, 8, 4, 1, 4, 2, 2, 2])  # [nb, g, c, kb, t, h, e, q]
        wv = gl.permute(wv, [0, 5, 1, 3, 4, 7, 2, 6])  # [nb, h, g, kb, t, q, c, e]
        return gl.convert_layout(gl.reshape(wv, [RB * 16, 64]), a_l)

    @gluon.jit
    def _ws_stage(x_bufs, w_bufs, s_bufs, ready, empty, j, acc, a_prev, wg: gl.constexpr, KB: gl.constexpr,
                  NWG: gl.constexpr, RB: gl.constexpr, ASM: gl.constexpr, a_l: gl.constexpr, IN_FLIGHT: gl.constexpr):
        """Ring stage j of a consumer warpgroup: wait for it, decode and multiply its KB blocks, hand a stage
        back. Returns (acc, the A operand of the MMA left in flight; unchanged when each MMA is waited)."""
        STAGES: gl.constexpr = ready.type.shape[0]
        s = j % STAGES
        mbarrier.wait(ready.index(s), (j // STAGES) & 1)
        for kb in gl.static_range(KB):
            idx = (s * KB + kb) * NWG + wg
            a = _ws_decode(w_bufs.index(idx), s_bufs.index(idx), RB, ASM, a_l)
            acc = warpgroup_mma(a, x_bufs.index(s * KB + kb).permute((1, 0)), acc, is_async=True)
            if IN_FLIGHT:
                acc, a_prev = warpgroup_mma_wait(1, deps=[acc, a_prev])
                a_prev = a
                if kb == 0:
                    if j > 0:  # the previous stage's last MMA has completed
                        mbarrier.arrive(empty.index((j + STAGES - 1) % STAGES), count=1)
            else:
                acc = warpgroup_mma_wait(0, deps=[acc])
        if not IN_FLIGHT:  # every warp of this warpgroup issued (so had decoded) the MMAs now completed
            mbarrier.arrive(empty.index(s), count=1)
        return acc, a_prev

    @gluon.jit
    def _ws_consumer(x_bufs, w_bufs, s_bufs, ready, empty, i0, i1, wg: gl.constexpr,
                     gs_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, m0, row0, tile, pid_k, n_split,
                     KB: gl.constexpr, NWG: gl.constexpr, RB: gl.constexpr, BM: gl.constexpr, IS_NV: gl.constexpr,
                     ASM: gl.constexpr, IN_FLIGHT: gl.constexpr):
        """One consumer warpgroup: RB x 16 weight rows (from row0) x BM rows of x (RB 8: each MMA is two
        64-row instructions on one activation tile). Per stage it decodes its
        blocks into registers and multiplies them with the shared activation tiles (register-A
        warpgroup MMA, left in flight with IN_FLIGHT, else waited at once); two warpgroups share a CTA
        so that one decodes while the other's MMA runs. Then its own epilogue (split-K partials summed
        in a fixed order by the last program of the tile)."""
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16])
        a_l: gl.constexpr = gl.DotOperandLayout(0, mma, 2)
        acc = gl.zeros([RB * 16, BM], gl.float32, layout=mma)
        a_prev = gl.zeros([RB * 16, 64], gl.bfloat16, layout=a_l)
        if IN_FLIGHT:
            # Each MMA stays in flight while the next block is decoded: wait(1) after issuing block b
            # completes block b - 1, so a stage goes back to the producer one block late (at the first
            # wait of the next stage). The in-flight MMA's A operand is named in that wait, which keeps
            # its registers live (unwritten) until the MMA has read them. The first stage is peeled (a
            # split has at least one): no path then reaches the final wait without an MMA, which ptxas
            # would otherwise answer by serialising every MMA (its C7515).
            acc, a_prev = _ws_stage(x_bufs, w_bufs, s_bufs, ready, empty, 0, acc, a_prev, wg, KB, NWG, RB, ASM, a_l,
                                    IN_FLIGHT)
            for it in range(i0 + 1, i1):
                acc, a_prev = _ws_stage(x_bufs, w_bufs, s_bufs, ready, empty, it - i0, acc, a_prev, wg, KB, NWG,
                                        RB, ASM, a_l, IN_FLIGHT)
            acc, a_prev = warpgroup_mma_wait(0, deps=[acc, a_prev])
        else:
            for it in range(i0, i1):
                acc, a_prev = _ws_stage(x_bufs, w_bufs, s_bufs, ready, empty, it - i0, acc, a_prev, wg, KB, NWG,
                                        RB, ASM, a_l, IN_FLIGHT)
        if IS_NV:
            alpha = 128.0 / gl.load(gs_ptr)
        else:
            alpha = 4611686018427387904.0
        acc = acc * alpha
        offs_n = row0 + gl.arange(0, RB * 16, layout=gl.SliceLayout(1, mma))
        offs_m = m0 + gl.arange(0, BM, layout=gl.SliceLayout(0, mma))
        mask = (offs_n[:, None] < N) & (offs_m[None, :] < M)
        o_off = offs_m[None, :].to(gl.int64) * N + offs_n[:, None]
        if n_split == 1:
            gl.store(out_ptr + o_off, acc.to(out_ptr.dtype.element_ty), mask=mask)
        else:  # workspace [split, M, N]; the last program of the tile sums the partials in split order
            mn = (pid_k.to(gl.int64) * 0 + M) * N
            gl.store(ws_ptr + pid_k.to(gl.int64) * mn + o_off, acc, mask=mask)
            _cta_barrier()
            count = gl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
            if count == n_split - 1:
                total = gl.zeros([RB * 16, BM], gl.float32, layout=mma)
                for p in range(0, n_split):
                    total += gl.load(ws_ptr + p * mn + o_off, mask=mask, other=0.0, cache_modifier=".cg")
                gl.store(out_ptr + o_off, total.to(out_ptr.dtype.element_ty), mask=mask)
                gl.atomic_xchg(cnt_ptr + tile, 0)

    @gluon.jit
    def _ws_kernel(x_desc, w_desc, s_desc, gs_ptr, out_ptr, w_desc1, s_desc1, gs1, out1, w_desc2, s_desc2, gs2, out2,
                   ws_ptr, cnt_ptr, M, N, N1, N2, T0, T1, NB_K, iters_per_split, MT,
                   IS_NV: gl.constexpr, NWG: gl.constexpr, BM: gl.constexpr, STAGES: gl.constexpr,
                   KB: gl.constexpr, ASM: gl.constexpr, REGS: gl.constexpr, IN_FLIGHT: gl.constexpr,
                   num_warps: gl.constexpr, RPW: gl.constexpr = 1, NG: gl.constexpr = 1, PDL: gl.constexpr = False):
        """out_g[M, N_g] = x W_g^T for NG weights (1-3) sharing x. Grid (weight tiles * MT, split): the T0
        tiles of weight 0, then T1 of weight 1, then weight 2's; the MT row tiles of x for one weight tile
        next to each other (they share it in L2). A CTA: NWG consumer warpgroups of RPW x 64 weight rows each
        (all of them on one activation tile) and one producer warp."""
        _pdl_enter(PDL)
        pid0 = gl.program_id(0)
        pid_n = pid0 // MT
        m0 = (pid0 % MT) * BM
        pid_k = gl.program_id(1)
        n_split = gl.num_programs(1)
        g = 0
        if NG > 1:  # this tile's weight g: its global scale, output, width and workspace slice
            g = (pid_n >= T0).to(gl.int32)
            if NG > 2:
                g += (pid_n >= T0 + T1).to(gl.int32)
            before = gl.where(g == 0, 0, gl.where(g == 1, N, N + N1))  # output columns of the weights before g
            pid_n -= gl.where(g == 0, 0, gl.where(g == 1, T0, T0 + T1))
            N = gl.where(g == 0, N, gl.where(g == 1, N1, N2))
            ws_ptr += (n_split * M).to(gl.int64) * before
            if g == 1:
                gs_ptr = gs1
                out_ptr = out1
            elif g == 2:
                gs_ptr = gs2
                out_ptr = out2
        i0 = pid_k * iters_per_split
        i1 = gl.minimum(i0 + iters_per_split, gl.cdiv(NB_K, KB))
        x_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES * KB, BM, 64], x_desc.layout)
        RB: gl.constexpr = 4 * RPW  # 16-row weight blocks a consumer warpgroup
        w_bufs = gl.allocate_shared_memory(gl.uint8, [STAGES * KB * NWG, RB, 2, 256], w_desc.layout)
        s_bufs = gl.allocate_shared_memory(gl.uint8, [STAGES * KB * NWG, RB, 128], s_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=NWG)
        row0 = pid_n * (RB * 16 * NWG)
        tile = pid0 * NWG
        if NWG == 2:
            gl.warp_specialize([
                (_ws_consumer, (x_bufs, w_bufs, s_bufs, ready, empty, i0, i1, 0, gs_ptr, out_ptr, ws_ptr, cnt_ptr,
                                M, N, m0, row0, tile, pid_k, n_split, KB, NWG, RB, BM, IS_NV, ASM, IN_FLIGHT)),
                (_ws_consumer, (x_bufs, w_bufs, s_bufs, ready, empty, i0, i1, 1, gs_ptr, out_ptr, ws_ptr, cnt_ptr,
                                M, N, m0, row0 + RB * 16, tile + 1, pid_k, n_split, KB, NWG, RB, BM, IS_NV, ASM,
                                IN_FLIGHT)),
                (_ws_group_loader, (x_desc, w_desc, s_desc, w_desc1, s_desc1, w_desc2, s_desc2, g, x_bufs, w_bufs,
                                    s_bufs, ready, empty, m0, pid_n * RB * NWG, i0, i1, KB, NWG, NG)),
            ], [4, 1], [REGS, 24])
        else:
            gl.warp_specialize([
                (_ws_consumer, (x_bufs, w_bufs, s_bufs, ready, empty, i0, i1, 0, gs_ptr, out_ptr, ws_ptr, cnt_ptr,
                                M, N, m0, row0, tile, pid_k, n_split, KB, NWG, RB, BM, IS_NV, ASM, IN_FLIGHT)),
                (_ws_group_loader, (x_desc, w_desc, s_desc, w_desc1, s_desc1, w_desc2, s_desc2, g, x_bufs, w_bufs,
                                    s_bufs, ready, empty, m0, pid_n * RB * NWG, i0, i1, KB, NWG, NG)),
            ], [1], [24])


# ----------------------------------------------------------------------------------------------
# launch


def pick_config(M: int, N: int, K: int) -> dict:
    """Launch config by rule (measured per M on a 7B layer: results/kernels/NOTES.md). BM: the activation
    rows of a CTA; NWG: consumer warpgroups of a CTA; RPW: 64-row weight blocks a warpgroup (all on one
    activation tile); KB: 64-column blocks a ring stage; PAD: activations copied into whole BM-row tiles.

    With MMAs in flight (Triton >= 3.7), one consumer warpgroup a CTA (255 registers, no spills):
      - 17-32 rows: 32-row tiles, 128 weight rows a warpgroup;
      - 33-64: 64-row tiles, a six-stage ring;
      - 65-256: 128-row tiles, so a weight block is decoded once per 128 rows, the rows padded to whole
        tiles (a partly filled 128-row tile measured up to 1.5x slower than a full one).
    Waited (Triton 3.6): two consumer warpgroups, BM a power of two from 16 holding M up to 64, else 128."""
    base = dict(RPW=1, KB=2, REGS=232, maxnreg=None, waves=1, in_flight=MMA_IN_FLIGHT)
    if MMA_IN_FLIGHT and M > 16:
        if M <= 32:
            return dict(base, BM=32, NWG=1, RPW=2, STAGES=6)
        if M <= 64:
            return dict(base, BM=64, NWG=1, STAGES=6)
        return dict(base, BM=128, NWG=1, STAGES=4, PAD=True)
    BM = 16 if M <= 16 else 32 if M <= 32 else 64 if M <= 64 else 128
    return dict(base, BM=BM, NWG=2, KB=2 if BM <= 64 else 1, STAGES=4)


def _x_desc(x2: torch.Tensor, BM: int):
    """The activations' bulk-copy descriptor: [BM, 64] bf16 tiles, 128-byte swizzle."""
    M, K = x2.shape
    return TensorDescriptor(x2, [M, K], [x2.stride(0), 1], [BM, BK],
                            gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))


def _w_descs(packed_c: torch.Tensor, scales_c: torch.Tensor, cache: dict | None, rpw: int = 1):
    """A weight's code and scale descriptors ([4 rpw] 16-row blocks a load), kept in its cache."""
    gl_layout = gl.NVMMASharedLayout
    key = ("ws_descriptors", packed_c.data_ptr(), scales_c.data_ptr(), rpw)
    wd = cache.get(key) if cache is not None else None
    if wd is None:
        nb, nbk = packed_c.shape[:2]
        w3 = packed_c.view(nb, nbk * 2, 256)
        s2 = scales_c.view(nb, nbk * 128)
        wd = (TensorDescriptor(w3, [nb, nbk * 2, 256], [nbk * 512, 256, 1], [4 * rpw, 2, 256],
                               gl_layout(swizzle_byte_width=0, element_bitwidth=8, rank=3)),
              TensorDescriptor(s2, [nb, nbk * 128], [nbk * 128, 1], [4 * rpw, 128],
                               gl_layout(swizzle_byte_width=0, element_bitwidth=8, rank=2)))
        if cache is not None:
            cache[key] = wd
    return wd


def linear(x2: torch.Tensor, packed_c: torch.Tensor, scales_c: torch.Tensor, gs: torch.Tensor | None, N: int,
           K: int, is_nv: bool, out: torch.Tensor | None = None, config: dict | None = None,
           split_k: int | None = None, cache: dict | None = None) -> torch.Tensor:
    """y [M, N] = x2 [M, K] W^T with W in the compute layout; bf16 x2 with contiguous rows, K and the
    row stride multiples of 8, 16-byte aligned (the bulk copies' rules)."""
    return grouped_linear(x2, [(packed_c, scales_c, gs, N)], K, is_nv, None if out is None else [out], config,
                          split_k, [cache])[0]


def grouped_linear(x2: torch.Tensor, weights: list, K: int, is_nv: bool, outs: list | None = None,
                   config: dict | None = None, split_k: int | None = None,
                   caches: list | None = None) -> list[torch.Tensor]:
    """[x2 W_i^T] for 1-3 weights (packed_c, scales_c, gs, N) of one format sharing x2, in ONE launch: the
    weights' tiles side by side in the grid, each CTA one weight's tile (``caches``: each weight's descriptor
    cache or None). The config is picked for the widest weight; split-K for all the tiles together."""
    M = x2.shape[0]
    if not 1 <= len(weights) <= 3:
        raise ValueError(f"the warp-specialised kernel takes 1 to 3 weights a launch, got {len(weights)}")
    if x2.dtype != torch.bfloat16 or x2.stride(-1) != 1:
        raise ValueError("the warp-specialised kernel takes bfloat16 activations with contiguous rows")
    if K % 8 or (M > 1 and x2.stride(0) % 8) or x2.data_ptr() % 16:
        raise ValueError("the warp-specialised kernel copies activations in bulk: K and the row stride must be multiples of 8, "
                         "the data 16-byte aligned")
    nbk = weights[0][0].shape[1]
    if any(w[0].shape[1] != nbk for w in weights):
        raise ValueError("the weights of one warp-specialised launch must share their input width")
    Ns = [w[3] for w in weights]
    caches = caches or [None] * len(weights)
    cfg = dict(pick_config(M, max(Ns), K), **(config or {}))
    BM, NWG, stages, KB = cfg["BM"], cfg["NWG"], cfg["STAGES"], cfg["KB"]
    launch = {"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}
    if outs is None:
        outs = [torch.empty((M, n), dtype=x2.dtype, device=x2.device) for n in Ns]
    mt = triton.cdiv(M, BM)
    rpw = cfg["RPW"]
    tiles = [triton.cdiv(w[0].shape[0] * 16, 64 * NWG * rpw) for w in weights]
    n_tiles = sum(tiles)
    iters = triton.cdiv(nbk, KB)
    split_k = split_k or cfg.get("split")
    if split_k is None:
        want = cfg["waves"] * common.num_sms(x2.device) / max(n_tiles * mt, 1)
        split_k = 1
        while split_k * 2 <= min(want, 8, iters // 4):
            split_k *= 2
    ips = triton.cdiv(iters, split_k)
    split = triton.cdiv(iters, ips)
    ws, cnt = common.workspace(x2.device, 0 if split == 1 else split * M * sum(Ns),
                               n_tiles * mt * NWG if split > 1 else 0)
    if cfg.get("PAD") and M % BM:  # whole tiles for the bulk copies; rows past M give outputs never stored
        xp = x2.new_empty((mt * BM, K))
        xp[:M].copy_(x2)
        x2 = xp
    per = [(*_w_descs(w[0], w[1], c, rpw), w[2] if w[2] is not None else w[1], o)
           for w, c, o in zip(weights, caches, outs)]
    per += [per[-1]] * (3 - len(per))  # absent weights repeat the last one (their branch is never taken)
    args = [_x_desc(x2, BM), *(a for p in per for a in p)]
    Np = Ns + [0] * (3 - len(Ns))
    _ws_kernel[(n_tiles * mt, split)](
        *args, ws, cnt, M, Np[0], Np[1], Np[2], tiles[0], tiles[1] if len(tiles) > 1 else 0, nbk, ips, mt,
        IS_NV=is_nv, NWG=NWG, BM=BM, STAGES=stages, KB=KB, ASM=mma._ASM,
        REGS=cfg["REGS"], IN_FLIGHT=bool(cfg["in_flight"]), num_warps=4, RPW=rpw, NG=len(weights), **launch,
        **common.pdl_args(x2.device))
    return outs


# The M ranges this kernel serves in the dispatch (the door, Plan, one-weight grouped launches): where it
# beat the other kernels on the layers measured (results/kernels/NOTES.md). 17-32 rows in either form;
# with its MMAs in flight also 38-256 rows (at 33-37 the mma kernel measured faster, and the waited form
# lost to it from 33 rows on).
SERVED_M = ((17, 32), (38, 256)) if MMA_IN_FLIGHT else ((17, 32),)


def serves(x2: torch.Tensor) -> bool:
    """Whether the dispatch sends this bf16 activation block [M, K] here: M in SERVED_M on an sm_90 GPU
    where the kernel passed its self-test (the caller has checked what the mma kernel's ``applies``
    checks: dtype, alignment, no autograd)."""
    M = x2.shape[0]
    return any(lo <= M <= hi for lo, hi in SERVED_M) and x2.is_cuda and available(x2.device)


_AVAILABLE: dict = {}


def available(device: torch.device) -> bool:
    """Gluon with warp_specialize, an sm_90 GPU, and the kernel through its self-test (once)."""
    if not HAVE_WS or device.type != "cuda":
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
    """The kernel against the fp32 reference on a ragged 200 x 320 weight, at 5 and 70 rows (one and
    several row tiles), both formats (mma.self_test)."""
    return mma.self_test(device, lambda x, pc, sc, gs, n, k, nv: linear(x, pc, sc, gs, n, k, nv),
                         "warp-specialised fp4 kernel", "the other kernels serve its calls", n=200, k=320, Ms=(5, 70))
