"""The tensor-core FP4 kernel for small M (decode batches) on the compute layout (qerl.kernels.layout).

Exactness: the kernel decodes an E2M1 code c to the bf16 c * 2^-126 (the layout's bits rotated into
place, subnormal for 0.5: 15 instructions per 8 weights, ``decode_asm``) and multiplies it by the
scale's bf16 (E4M3 * 2^119 or 2^(e - 63), stored so in the layout) with one bf16x2 multiply per two
weights: the weight times 2^-7 (2^-62), exactly. The powers of two and the global divisor
come off in the epilogue; the tensor cores accumulate in fp32.

The kernel (Gluon, Triton's explicit-layout dialect): the activation tiles (and from BM = 32 the
weight and scale bytes) go through a ring of shared-memory buffers filled by asynchronous 16-byte
copies; each lane decodes its 16 weight bytes with inline PTX straight into the MMA's A operand
(every layout conversion free: the sm_90 compile check shows no shuffles). Up to M = 32 it
multiplies with ``mma_v2`` (mma.sync; activations by ldmatrix); above, on sm_90, with the
warpgroup MMA (A from registers, B the shared activation tile), waited at once (left in flight
across the next decode, its register operand came out corrupted: results/kernels/NOTES.md).
Split-K partial sums are reduced in a fixed order. ``grouped_linear`` runs up to three weights that
share an input in one launch. Dispatch (``applies``): bf16 inputs, K and row stride multiples of 8,
16-byte aligned, no autograd through x, not while torch.compile traces; 1 <= M <= MMA_MAX_M on
sm_80+, up to WGMMA_MAX_M on sm_90. Measurements: results/kernels/NOTES.md.

Requires Gluon (triton >= 3.6) and a GPU with mma.sync bf16 (sm_80+); ``available()`` says whether
it can run. Not run under TRITON_INTERPRET: the CPU tests check the layout, its inverse and a torch
emulation of the kernel's arithmetic (``layout.decode_reference``); the GPU tests the kernel
against the fp32 reference.
"""

from __future__ import annotations

import os

import torch
import triton

from qerl.kernels import common
from qerl.kernels.layout import ROT_MAG, ROT_SIGN, to_compute_layout

try:  # Gluon: triton >= 3.6
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

    HAVE_GLUON = True
    # a CTA barrier: gl.thread_barrier in Triton 3.6, gl.barrier in later versions
    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    # the cp.async copy into shared memory: async_copy_global_to_shared up to Triton 3.7, async_load from 3.8
    _cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
except ImportError:  # pragma: no cover - older triton
    HAVE_GLUON = False


# ----------------------------------------------------------------------------------------------
# the kernel (Gluon)

def decode_asm() -> str:
    """The decode of one code word (8 weights) and its scale word into four bf16x2 registers of the A
    fragment (r = h + 2 q: (h0, q0), (h1, q0) the first output's two registers, (h0, q1), (h1, q1) the
    second's), for the rotation layout of ``qerl.kernels.layout``: per register one left rotation and an
    AND, or two rotations merged by two LOP3s where the magnitude and sign rotations differ, then the
    multiply by the row's scale half (.H0_H0 / .H1_H1 operands: rows g, g + 8). fma with -0 is what
    ptxas turns into HMUL2 (mul.bf16x2 needs sm_90; the mma.sync form also runs on sm_80)."""
    lines = [".reg .b32 p<4>, m, t, s0, s1, z;", ".reg .b16 sl, sh;", "mov.b32 z, 0x80008000;",
             "mov.b32 {sl, sh}, $5;", "mov.b32 s0, {sl, sl};", "mov.b32 s1, {sh, sh};"]

    def rot(dst, n):
        return f"shf.l.wrap.b32 {dst}, $4, $4, {n};" if n else f"mov.b32 {dst}, $4;"

    for r, (a, b) in enumerate(zip(ROT_MAG, ROT_SIGN)):
        if a == b:
            lines += [rot(f"p{r}", a), f"and.b32 p{r}, p{r}, 0x81C081C0;"]
        else:
            lines += [rot("m", a), rot("t", b), "and.b32 t, t, 0x80008000;", "and.b32 m, m, 0x01C001C0;",
                      f"or.b32 p{r}, m, t;"]
    lines += [f"fma.rn.bf16x2 ${r}, p{r}, s{r & 1}, z;" for r in range(4)]
    return "{\n" + "\n".join(lines) + "\n}\n"


_ASM = decode_asm()

if HAVE_GLUON:

    @gluon.jit
    def pdl_enter(PDL: gl.constexpr):
        """common.pdl_enter for Gluon kernels: wait for the kernel before this one (griddepcontrol.wait;
        launched through common.pdl_args)."""
        if PDL:
            gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _axes5(D0: gl.constexpr, D1: gl.constexpr, D2: gl.constexpr, D3: gl.constexpr, D4: gl.constexpr,
               L: gl.constexpr):
        """The five index vectors of a [D0, .., D4] tensor of layout L, each expanded to rank 5."""
        i0 = gl.arange(0, D0, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, L)))))
        i1 = gl.arange(0, D1, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, L)))))
        i2 = gl.arange(0, D2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, gl.SliceLayout(4, L)))))
        i3 = gl.arange(0, D3, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(4, L)))))
        i4 = gl.arange(0, D4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, L)))))
        return (i0[:, None, None, None, None], i1[None, :, None, None, None], i2[None, None, :, None, None],
                i3[None, None, None, :, None], i4[None, None, None, None, :])

    @gluon.jit
    def _w_loads(w_ptr, s_ptr, w_off, s_off, wk, sk, kb0, kb_lim):
        """Weights and scales of the KB column blocks from block kb0 (masked at kb_lim)."""
        wq = gl.load(w_ptr + (w_off + kb0 * 512), mask=(kb0 + wk) < kb_lim, other=0)
        sq = gl.load(s_ptr + (s_off + kb0 * 128), mask=(kb0 + sk) < kb_lim, other=0)
        return wq, sq

    @gluon.jit
    def _w_copy(w_dst, s_dst, w_ptr, s_ptr, w_off, s_off, wk, sk, kb0, kb_lim):
        """Asynchronous copies of the weights and scales of the KB column blocks from block kb0 (of
        this thread's layout: 16 contiguous bytes each); not committed (the activations' copy is)."""
        _cp_async(w_dst, w_ptr + (w_off + kb0 * 512), mask=(kb0 + wk) < kb_lim)
        _cp_async(s_dst, s_ptr + (s_off + kb0 * 128), mask=(kb0 + sk) < kb_lim)

    @gluon.jit
    def _x_copy(x_smem, x_ptr, x_off, xr, xc, M, K, kb0, kb_lim):
        """Asynchronous copy of the activation tile from column block kb0 into x_smem (16 bytes a
        copy; rows >= M, columns >= K and blocks past kb_lim zero-filled); one commit group."""
        kc = kb0 * 64 + xc
        _cp_async(x_smem, x_ptr + (x_off + kb0 * 64), mask=(xr < M) & (kc < K) & (kc < kb_lim * 64))
        async_copy.commit_group()

    @gluon.jit
    def _x_load(x_ptr, xd_off, xdm, xdk, M, K, kb0, kb_lim):
        """The activation tile from column block kb0 loaded straight into the B operand's registers
        ([BK, BM], x transposed; rows >= M, columns >= K and blocks past kb_lim zero)."""
        kc = kb0 * 64 + xdk
        return gl.load(x_ptr + (xd_off + kb0 * 64), mask=(xdm < M) & (kc < K) & (kc < kb_lim * 64), other=0.0)

    @gluon.jit
    def _mma_kernel(x_ptr, w0, s0, g0, o0, w1, s1, g1, o1, w2, s2, g2, o2, ws_ptr, cnt_ptr,
                    M, N0, N1, N2, T0, T1, K, NB_K, stride_xm, iters_per_split, MT,
                    IS_NV: gl.constexpr, NM: gl.constexpr, BM: gl.constexpr, REPS: gl.constexpr,
                    KB: gl.constexpr, ASM: gl.constexpr, PREFETCH: gl.constexpr, STAGES: gl.constexpr,
                    WGMMA: gl.constexpr, W_RING: gl.constexpr, num_warps: gl.constexpr, PDL: gl.constexpr = False,
                    X_DIRECT: gl.constexpr = False):
        """out_i[M, N_i] = x W_i^T for NM (1-3) weights sharing x (q/k/v, gate/up: one launch).
        Grid ((T0 + T1 + T2) MT, split): member i's T_i row tiles, one after the other, each with
        its MT tiles of BM rows of x next to each other (they share the weight tile in L2). A program:
        REPS 16-row blocks per warp (BN = 64 REPS rows), BM (8-256) rows of x, KB 64-column blocks an
        iteration. The activation tiles go through a ring of STAGES shared-memory buffers filled by
        asynchronous copies; the weights are decoded in registers into the A operand of mma.sync
        (mma_v2) or, with WGMMA (sm_90), of the warpgroup MMA, whose B operand is the shared tile.
        Outputs are contiguous [M, N_i]. X_DIRECT (mma.sync, weights in registers): no shared memory and no
        CTA barrier; each warp loads the activations straight into its B operand, one iteration ahead."""
        pdl_enter(PDL)
        pid0 = gl.program_id(0)
        pid = pid0 // MT  # row tile of all members
        m0 = (pid0 % MT) * BM  # first row of x
        # this program's member (pointers chosen per program; scalars only)
        if NM == 1 or pid < T0:
            w_ptr, s_ptr, gs_ptr, out_ptr, N, pid_n, col0 = w0, s0, g0, o0, N0, pid, 0
        elif NM == 2 or pid < T0 + T1:
            w_ptr, s_ptr, gs_ptr, out_ptr, N, pid_n, col0 = w1, s1, g1, o1, N1, pid - T0, N0
        else:
            w_ptr, s_ptr, gs_ptr, out_ptr, N, pid_n, col0 = w2, s2, g2, o2, N2, pid - T0 - T1, N0 + N1
        NTOT = N0 + N1 + N2
        R: gl.constexpr = num_warps * REPS  # 16-row blocks of a program (a warp takes REPS of them)
        BN: gl.constexpr = 16 * R
        BK: gl.constexpr = 64 * KB
        if WGMMA:
            mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                          instr_shape=[16, BM, 16])
            x_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        else:
            mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[num_warps, 1],
                                                          instr_shape=[16, 8])
            x_sl: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0])
        a_l: gl.constexpr = gl.DotOperandLayout(0, mma, 2)
        b_l: gl.constexpr = gl.DotOperandLayout(1, mma, 2)
        # weights [R, 8 (g), 4 (c), KB, 16 bytes]: 16 contiguous bytes a lane, warps over row blocks
        w_l: gl.constexpr = gl.BlockedLayout([1, 1, 1, 1, 16], [1, 8, 4, 1, 1], [num_warps, 1, 1, 1, 1], [4, 3, 2, 1, 0])
        # scales [R, 8, 4 (c), KB, 16 (t, bf16 pair)]: 16 contiguous bytes a lane, word t the scale pair of
        # code word t (the four lanes c of a row read the same ones): the layout of the codes
        s_l: gl.constexpr = w_l
        # activation copies: [BM, BK] in 16-byte pieces, a warp along K
        TK: gl.constexpr = BK // 8 if BK // 8 < 32 else 32
        x_ld: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TK, TK], [num_warps, 1], [1, 0])

        pid_k = gl.program_id(1)
        nb0 = pid_n * R
        wr, wg, wc, wk, wb = _axes5(R, 8, 4, KB, 16, w_l)
        NBN = gl.cdiv(N, 16)
        nbc = gl.minimum(nb0 + wr, NBN - 1).to(gl.int64)
        w_off = ((nbc * NB_K) * 512 + wk * 512) + (wg * 64 + wc * 16) + wb
        sr, sg, sc, sk, sb = _axes5(R, 8, 4, KB, 16, s_l)
        snb = gl.minimum(nb0 + sr, NBN - 1).to(gl.int64)
        s_off = ((snb * NB_K) * 128 + sk * 128) + sg * 16 + sb + sc * 0
        xr = m0 + gl.arange(0, BM, layout=gl.SliceLayout(1, x_ld))[:, None]
        xc = gl.arange(0, BK, layout=gl.SliceLayout(0, x_ld))[None, :]
        # (stride_xm // 8) * 8: the host guarantees 8 | stride (16-byte copies); this tells the compiler
        x_off = gl.minimum(xr, M - 1).to(gl.int64) * ((stride_xm // 8) * 8) + xc
        if X_DIRECT:  # [BK, BM] offsets of x^T in the B operand's layout
            xdk = gl.arange(0, BK, layout=gl.SliceLayout(1, b_l))[:, None]
            xdm = m0 + gl.arange(0, BM, layout=gl.SliceLayout(0, b_l))[None, :]
            xd_off = gl.minimum(xdm, M - 1).to(gl.int64) * ((stride_xm // 8) * 8) + xdk
        else:
            x_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, BK], x_sl)
        if W_RING:  # weights and scales ride in the ring too (16- and 8-byte copies, no swizzle needed)
            w_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, R, 8, 4, KB, 16], gl.SwizzledSharedLayout(
                vec=16, per_phase=1, max_phase=1, order=[4, 3, 2, 1, 0]))
            s_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, R, 8, 4, KB, 16], gl.SwizzledSharedLayout(
                vec=16, per_phase=1, max_phase=1, order=[4, 3, 2, 1, 0]))

        acc = gl.zeros([BN, BM], gl.float32, layout=mma)
        n_iter = gl.cdiv(NB_K, KB)
        i0 = pid_k * iters_per_split
        i1 = gl.minimum(i0 + iters_per_split, n_iter)
        kb_lim = gl.minimum(NB_K, i1 * KB)  # blocks of this split (copies / loads past it: none)
        if X_DIRECT:
            xq = _x_load(x_ptr, xd_off, xdm, xdk, M, K, i0 * KB, kb_lim)
        else:
            for p in gl.static_range(STAGES - 1):  # the ring's first tiles
                kb0 = (i0 + p) * KB
                if W_RING:
                    _w_copy(w_smem.index(p), s_smem.index(p), w_ptr, s_ptr, w_off, s_off, wk, sk, kb0, kb_lim)
                _x_copy(x_smem.index(p), x_ptr, x_off, xr, xc, M, K, kb0, kb_lim)
        if PREFETCH and not W_RING:
            wq, sq = _w_loads(w_ptr, s_ptr, w_off, s_off, wk, sk, i0 * KB, kb_lim)
        for it in range(i0, i1):
            j = it - i0
            if not W_RING:
                if PREFETCH:  # the next iteration's weights go out before this one's decode
                    nwq, nsq = _w_loads(w_ptr, s_ptr, w_off, s_off, wk, sk, (it + 1) * KB, kb_lim)
                else:
                    wq, sq = _w_loads(w_ptr, s_ptr, w_off, s_off, wk, sk, it * KB, kb_lim)
            if X_DIRECT:  # the next iteration's activations go out before this one's decode
                nxq = _x_load(x_ptr, xd_off, xdm, xdk, M, K, (it + 1) * KB, kb_lim)
            else:
                # tile j landed (this thread's copies; visible to the async proxy for WGMMA), and every
                # warp is done with the buffer of iteration j - 1
                async_copy.wait_group(STAGES - 2)
                if WGMMA:
                    fence_async_shared()
                _cta_barrier()
                # refill that buffer
                kb1 = (it + STAGES - 1) * KB
                sn = (j + STAGES - 1) % STAGES
                if W_RING:
                    _w_copy(w_smem.index(sn), s_smem.index(sn), w_ptr, s_ptr, w_off, s_off, wk, sk, kb1, kb_lim)
                    wq = w_smem.index(j % STAGES).load(w_l)
                    sq = s_smem.index(j % STAGES).load(s_l)
                _x_copy(x_smem.index(sn), x_ptr, x_off, xr, xc, M, K, kb1, kb_lim)
            lo, hi = gl.inline_asm_elementwise(ASM, "=r,=r,=r,=r,r,r", [wq, sq],
                                               dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=4)
            # [R, g, c, KB, 16 = (t, h, e)] x 2 (q) -> [R, h, g, KB, t, q, c, e] -> [BN, BK]
            wv = gl.join(lo, hi)
            wv = gl.reshape(wv, [R, 8, 4, KB, 4, 2, 2, 2])  # [nb, g, c, kb, t, h, e, q]
            wv = gl.permute(wv, [0, 5, 1, 3, 4, 7, 2, 6])  # [nb, h, g, kb, t, q, c, e]
            a = gl.convert_layout(gl.reshape(wv, [BN, BK]), a_l)
            if X_DIRECT:
                acc = mma_v2(a, xq, acc)
                xq = nxq
            elif WGMMA:
                xs = x_smem.index(j % STAGES).permute((1, 0))  # [BK, BM]
                # waited at once: with the MMA left in flight across the next decode (register A operand),
                # results came out wrong on the H100 (Triton 3.6; results/kernels/NOTES.md)
                acc = warpgroup_mma(a, xs, acc, is_async=True)
                acc = warpgroup_mma_wait(0, deps=[acc])
            else:
                acc = mma_v2(a, x_smem.index(j % STAGES).permute((1, 0)).load(b_l), acc)
            if PREFETCH and not W_RING:
                wq, sq = nwq, nsq
        if not X_DIRECT:
            async_copy.wait_group(0)
        if IS_NV:
            alpha = 128.0 / gl.load(gs_ptr)
        else:
            alpha = 4611686018427387904.0
        acc = acc * alpha
        # epilogue: acc [BN (n), BM (m)] -> out[m, n]; split-K reduced in a fixed order
        offs_n = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
        offs_m = m0 + gl.arange(0, BM, layout=gl.SliceLayout(0, mma))
        mask = (offs_n[:, None] < N) & (offs_m[None, :] < M)
        o_off = offs_m[None, :].to(gl.int64) * N + offs_n[:, None]
        n_split = gl.num_programs(1)
        if n_split == 1:
            gl.store(out_ptr + o_off, acc.to(out_ptr.dtype.element_ty), mask=mask)
        else:  # workspace [split, M, NTOT], member i in columns col0 .. col0 + N_i
            mn = (pid_k.to(gl.int64) * 0 + M) * NTOT
            w_offs = offs_m[None, :].to(gl.int64) * NTOT + (col0 + offs_n[:, None])
            gl.store(ws_ptr + pid_k.to(gl.int64) * mn + w_offs, acc, mask=mask)
            # every warp's partial is stored before the one counter update releases them (Gluon adds
            # no barrier of its own; without it other programs read partial tiles)
            _cta_barrier()
            count = gl.atomic_add(cnt_ptr + pid0, 1, sem="acq_rel")
            if count == n_split - 1:
                total = gl.zeros([BN, BM], gl.float32, layout=mma)
                for i in range(0, n_split):  # fixed order: bitwise the same every call
                    total += gl.load(ws_ptr + i * mn + w_offs, mask=mask, other=0.0, cache_modifier=".cg")
                gl.store(out_ptr + o_off, total.to(out_ptr.dtype.element_ty), mask=mask)
                gl.atomic_xchg(cnt_ptr + pid0, 0)


# ----------------------------------------------------------------------------------------------
# launch

_AVAILABLE: dict = {}


def available(device: torch.device | None = None) -> bool:
    """Gluon importable and a CUDA device with bf16 mma.sync (sm_80+)."""
    if not HAVE_GLUON:
        return False
    if device is not None and device.type != "cuda":
        return False
    idx = device.index if device is not None and device.index is not None else None
    ok = _AVAILABLE.get(idx)
    if ok is None:
        ok = torch.cuda.is_available() and torch.cuda.get_device_capability(
            torch.device("cuda", idx) if idx is not None else None) >= (8, 0)
        if ok and not torch.cuda.is_current_stream_capturing():
            ok = _self_test(torch.device("cuda", idx if idx is not None else torch.cuda.current_device()))
        _AVAILABLE[idx] = ok
    return ok


def _self_test(device: torch.device, M: int = 3, config: dict | None = None, what: str = "tensor-core FP4 kernel",
               instead: str = "the Triton kernels serve every 4-bit call instead") -> bool:
    """This kernel through ``self_test`` on a 40 x 192 weight at M rows (``config``: a launch config)."""
    return self_test(device, lambda x, pc, sc, gs, n, k, nv: linear(x, pc, sc, gs, n, k, nv, config=config),
                     what, instead, Ms=(M,))


def self_test(device: torch.device, run, what: str, instead: str, n: int = 40, k: int = 192,
              Ms: tuple = (3,)) -> bool:
    """Compile and run a compute-layout kernel once, ``run(x, packed_c, scales_c, gs, N, K, is_nv) -> y``,
    on a small [n, k] weight (both formats, each M of ``Ms``) against the fp32 reference. On another
    Triton whose Gluon API or compiler differs, a failure turns the kernel off with a warning naming
    ``what`` and who serves ``instead`` (the same format and arithmetic up to rounding)."""
    import warnings

    from qerl import formats

    try:
        g = torch.Generator(device=device).manual_seed(0)
        for fmt in formats.with_kernel("triton"):  # the formats with Triton (and this) kernels
            is_nv = common.scale_mode(fmt)
            t = formats.quantize(torch.randn(n, k, device=device, generator=g) * 0.02, fmt)
            pc, sc = to_compute_layout(t["weight_packed"], t["weight_scale"], is_nv)
            ref_w = formats.dequantize(t, fmt, dtype=torch.float32)
            for M in Ms:
                x = torch.randn(M, k, device=device, dtype=torch.bfloat16, generator=g)
                y = run(x, pc, sc, t.get("weight_global_scale"), n, k, is_nv).float()
                ref = x.float() @ ref_w.T
                err = float((y - ref).norm() / ref.norm())
                if not err < 1e-2:
                    raise RuntimeError(f"{fmt} M={M}: relative error {err:.2e} against the fp32 reference")
        return True
    except Exception as e:  # noqa: BLE001 - any failure: off, said once
        msg = str(e)  # a CompilationError starts with the source context; its cause is at the end
        msg = msg if len(msg) <= 500 else f"{msg[:150]} ... {msg[-350:]}"
        warnings.warn(f"qerl: the {what} failed its self-test on {device} ({type(e).__name__}: "
                      f"{msg}); {instead}", stacklevel=3)
        return False


_WGMMA_OK: dict = {}  # device index -> the warpgroup-MMA variant passed its self-test


def has_wgmma(device: torch.device) -> bool:
    """sm_90 (Hopper), the kernel available and its warpgroup-MMA variant through a self-test (made
    once, at the first call). (sm_100 has no register-A wgmma; it takes the mma.sync path.)"""
    if device.type != "cuda":
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    ok = _WGMMA_OK.get(idx)
    if ok is None:
        # (after available(): its own self-test runs with M <= MMA_MAX_M, which never asks this)
        ok = torch.cuda.get_device_capability(idx)[0] == 9 and available(device)
        if ok:
            if torch.cuda.is_current_stream_capturing():
                return False  # no self-test inside a capture: not yet (asked again after it)
            M = 8 + MMA_MAX_M
            ok = _self_test(torch.device("cuda", idx), M=M, config=pick_config(M, 40, 192, wgmma=True),
                            what="warpgroup-MMA variant of the tensor-core FP4 kernel",
                            instead=f"the mma.sync variant serves M <= {MMA_MAX_M}, the Triton kernels the rest")
        _WGMMA_OK[idx] = ok
    return ok


def pick_config(M: int, N: int, K: int, wgmma: bool = False) -> dict:
    """Launch config by rule. mma.sync (an H100 sweep over the 7B and Llama-3-8B shapes,
    results/kernels/NOTES.md): BM the smallest of 8 / 16 / 32 / 64 holding M;
    KB (64-column blocks an iteration) so that a lane holds <= 64 activations of the B operand,
    one 16-row block a warp at BM = 16 (7B layer M = 16 111.9 us against 135.4 with two, every 7B
    shape faster; H100, results/kernels/NOTES.md). From
    BM = 32 the weights go through the shared-memory ring with the activations (W_RING, 4 stages):
    7B layer at M = 32 178 us against 208 with register loads (H100, results/kernels/NOTES.md).
    Warpgroup MMA (``wgmma``, sm_90, M > 32): 64 weight rows x 64 rows of x a program (row tiles of x
    in the grid), weights and activations through a 4-deep ring: 7B layer M = 64 178 us (mma.sync 244),
    M = 128 251 (BM = 128: 301), M = 256 414 (BM = 128: 479) in the same run. Split-K (in
    ``grouped_linear``): mma.sync for about 4 waves of programs (2 waves and <= 8 splits at BM = 64),
    the warpgroup variant by ``wgmma_split``. ``X_DIRECT`` (mma.sync with the weights in registers: the
    activations loaded straight into the B operand, no shared memory, no CTA barrier in the loop; sm_90
    SASS at M = 1, KB 1: 49 registers against 84, 30.5 instructions per 8 weights against 22.7; two row blocks a
    warp, REPS 2: 64 registers, 24.2; REPS 4: 95, 20.8): the rule
    takes it up to X_DIRECT_MAX_M rows (0: never, until measured; ``benchmarks.kernel_families --mma
    NAME:X_DIRECT=1,KB=1`` times it beside the rule)."""
    if wgmma and M > MMA_MAX_M:
        return dict(BM=64, KB=1, REPS=1, num_warps=4, PREFETCH=False, STAGES=4, WGMMA=True, W_RING=True)
    BM = 8 if M <= 8 else 16 if M <= 16 else 32 if M <= 32 else 64
    if M <= X_DIRECT_MAX_M and BM <= 16:
        return dict(BM=BM, KB=X_DIRECT_KB, REPS=X_DIRECT_REPS, num_warps=4, PREFETCH=False, X_DIRECT=True)
    if BM == 32:  # weights through the ring, two row blocks a warp
        return dict(BM=32, KB=1, REPS=2, num_warps=4, PREFETCH=False, STAGES=4, W_RING=True)
    pf = BM >= PREFETCH_MIN_BM
    return dict(BM=BM, KB=max(1, 32 // BM), REPS=2 if BM == 64 else 1, num_warps=4, PREFETCH=pf)


# The activations straight into the B operand (X_DIRECT) up to this many rows (at most 16), KB column blocks an
# iteration; 0 until a GPU measurement says where it pays. QERL_MMA_X_DIRECT=<rows> (read at import, like QERL_PDL)
# sets it for A/B runs of the decode step.
X_DIRECT_MAX_M = min(16, int(os.environ.get("QERL_MMA_X_DIRECT", "0") or 0))
# KB and REPS (16-row weight blocks a warp: their loads in flight together over one activation operand) of that
# config; QERL_MMA_X_DIRECT_CFG="KB,REPS" sets them for A/B runs (KB 4 with REPS 1 holds the baseline's bytes in
# flight but costs 164 registers; KB 1 with REPS 2 half of them at 64).
X_DIRECT_KB, X_DIRECT_REPS = (int(v) for v in (os.environ.get("QERL_MMA_X_DIRECT_CFG") or "1,2").split(","))

# Software prefetch of the weights in registers (the next iteration's loads issued before this one's
# decode), where the weights do not ride in the ring (now: the BM = 64 mma.sync config only): it
# doubles the registers (62 -> 138 a thread at BM = 8), and the lost occupancy cost more than the
# loads in flight gained at small M. H100, 7B layer (results/kernels/NOTES.md):
# M = 1 88.2 us without vs 116.9 with, M = 16 117.3 vs 140.2, M = 32 264.3 vs 220.9.
PREFETCH_MIN_BM = 32


def wgmma_split(n_tiles: int, k_iters: int, sms: int) -> int:
    """Split-K of the warpgroup-MMA variant: a power of two <= 4 near 2 sms / n_tiles programs, scaled
    up for long K (k_iters / 128). From the H100 sweep over the 7B and Llama-3-8B shapes at M = 64 /
    128 / 256 (results/kernels/NOTES.md): within 3% of the best split
    everywhere but one shape (11%), where the older waves rule was up to 15% off on five."""
    want = 2 * sms / max(n_tiles, 1) * max(1.0, k_iters / 128)
    s = 1
    while s * 2 <= min(want, 4, k_iters):
        s *= 2
    return s


def linear(x2: torch.Tensor, packed_c: torch.Tensor, scales_c: torch.Tensor, gs: torch.Tensor | None, N: int,
           K: int, is_nv: bool, out: torch.Tensor | None = None, config: dict | None = None,
           split_k: int | None = None) -> torch.Tensor:
    """y [M, N] = x2 [M, K] W^T with W in the compute layout (``to_compute_layout``); bf16 x2."""
    return grouped_linear(x2, [(packed_c, scales_c, gs, N)], K, is_nv, [out] if out is not None else None,
                          config, split_k)[0]


def grouped_linear(x2: torch.Tensor, weights: list, K: int, is_nv: bool, outs: list | None = None,
                   config: dict | None = None, split_k: int | None = None, describe: bool = False):
    """[x2 W_i^T] for 1-3 weights (packed_c, scales_c, gs, N) of one format sharing x2, one launch.
    ``describe``: launch nothing, return (kernel, grid, args, kwargs, (workspace floats, counters))."""
    M = x2.shape[0]
    if not 1 <= len(weights) <= 3:
        raise ValueError(f"the mma kernel takes 1 to 3 weights a launch, got {len(weights)}")
    if x2.dtype != torch.bfloat16:
        raise ValueError(f"the mma kernel takes bfloat16 activations, got {x2.dtype}")
    if x2.stride(-1) != 1:
        raise ValueError("the mma kernel takes activations with contiguous rows")
    if K % 8 or (M > 1 and x2.stride(0) % 8) or x2.data_ptr() % 16:
        raise ValueError("the mma kernel copies activations 16 bytes at a time: K and the row stride must be "
                         "multiples of 8, the data 16-byte aligned")
    Ns = [w[3] for w in weights]
    if outs is None:
        outs = [torch.empty((M, n), dtype=x2.dtype, device=x2.device) for n in Ns]
    cfg = dict(config or pick_config(M, max(Ns), K, M > MMA_MAX_M and has_wgmma(x2.device)))
    warps = cfg.pop("num_warps", 4)
    maxnreg = cfg.pop("maxnreg", None)
    launch = {"maxnreg": maxnreg} if maxnreg else {}
    cfg.setdefault("PREFETCH", cfg["BM"] >= PREFETCH_MIN_BM)
    cfg.setdefault("STAGES", 2)
    cfg.setdefault("WGMMA", False)
    cfg.setdefault("W_RING", False)
    if not cfg["WGMMA"] and M > MAX_M:
        raise ValueError(f"the mma kernel's mma.sync path serves M <= {MAX_M}, got {M}")
    rows = warps * cfg["REPS"]  # 16-row blocks a program
    mt = triton.cdiv(M, cfg["BM"])  # row tiles of x, next to each other in the grid
    tiles = [triton.cdiv(w[0].shape[0], rows) for w in weights]
    n_tiles = sum(tiles) * mt
    nbk = weights[0][0].shape[1]
    iters = triton.cdiv(nbk, cfg["KB"])
    if split_k is None:
        if cfg["WGMMA"]:
            split_k = wgmma_split(n_tiles, iters, common.num_sms(x2.device))
        else:
            wide = cfg["BM"] >= 64
            split_k = common.split(n_tiles, iters, common.num_sms(x2.device), 8 if wide else None,
                                   common.WAVES_MID if wide else common.WAVES, 2)
    ips = triton.cdiv(iters, split_k)
    split = triton.cdiv(iters, ips)
    ws_need = (0 if split == 1 else split * M * sum(Ns), n_tiles if split > 1 else 0)
    ws, cnt = common.workspace(x2.device, *ws_need)
    args = [x2]
    for i in range(3):
        pc, sc, gs, _ = weights[min(i, len(weights) - 1)]
        args += [pc, sc, gs if gs is not None else sc, outs[min(i, len(weights) - 1)]]
    Np = Ns + [0] * (3 - len(Ns))
    Tp = tiles + [0] * (3 - len(tiles))
    args += [ws, cnt, M, Np[0], Np[1], Np[2], Tp[0], Tp[1], K, nbk, x2.stride(0), ips, mt]
    kwargs = dict(IS_NV=is_nv, NM=len(weights), ASM=_ASM, num_warps=warps, **launch, **cfg,
                  **common.pdl_args(x2.device))
    if describe:  # (kernel, grid, args, kwargs, workspace need): for Plan's DirectLaunch
        return _mma_kernel, (n_tiles, split), tuple(args), kwargs, ws_need
    _mma_kernel[(n_tiles, split)](*args, **kwargs)
    return outs


# argument positions a DirectLaunch of _mma_kernel replaces per call
ARG_X, ARG_OUTS, ARG_WS, ARG_CNT = 0, (4, 8, 12), 13, 14


# ----------------------------------------------------------------------------------------------
# use from the dispatch paths

MAX_M = 64  # largest M the mma.sync path accepts (B-operand registers grow with M); the wgmma path: any M

# Served M (activation rows) by the mma.sync variant: at M = 64 it was no faster than the Triton
# tensor-core kernel (7B layer 273 vs 289 us); on sm_90 the warpgroup-MMA variant takes over above.
MMA_MAX_M = 32
# Served M on sm_90 by the warpgroup-MMA variant (M > MMA_MAX_M).
WGMMA_MAX_M = 256


def applies(x: torch.Tensor, in_features: int) -> bool:
    """Whether a forward of x should take this kernel: bf16 on a capable GPU, 1 <= M <=
    MMA_MAX_M (WGMMA_MAX_M on sm_90), rows the 16-byte copies can take (K and every row stride
    multiples of 8, 16-byte aligned), no autograd through x (the kernel has no backward of its own),
    not being traced."""
    if x.dtype != torch.bfloat16 or x.device.type != "cuda":
        return False
    M = x.numel() // max(in_features, 1)
    if M < 1 or (torch.is_grad_enabled() and x.requires_grad) or in_features % 8 or x.data_ptr() % 16:
        return False
    if any(x.stride(d) % 8 for d in range(x.dim() - 1) if x.shape[d] > 1):  # the rows of x.reshape(-1, K)
        return False
    if M > MMA_MAX_M and not (M <= WGMMA_MAX_M and has_wgmma(x.device)):
        return False
    if torch.compiler.is_compiling():
        return False
    return available(x.device)
