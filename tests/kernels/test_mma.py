"""The compute layout of the tensor-core kernel (qerl.kernels.layout, qerl.kernels.mma) (CPU: exact inverse, the kernel's arithmetic in torch)
and the kernel itself (GPU: against the fp32 reference, groups, repeatability, the plan's launches)."""

import re

import pytest
import torch

from qerl import formats
from qerl.kernels import layout, mma

SHAPES = [(48, 128), (200, 352), (64, 1024), (17, 64)]  # ragged: N % 16, K % 64 != 0


def _weight(n, k, fmt, seed=0, zero_rows=()):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    for r in zero_rows:
        w[r] = 0  # all-zero blocks: zero scales
    w[0, :16] *= 1e-5  # tiny blocks: subnormal E4M3 scales
    return formats.quantize(w, fmt)


@pytest.mark.parametrize("chunk_rows", [1024, 32])  # 32: several row chunks, the last one ragged
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("n,k", SHAPES)
def test_compute_layout_round_trip_is_exact(fmt, n, k, chunk_rows, monkeypatch):
    monkeypatch.setattr(layout, "LAYOUT_CHUNK_ROWS", chunk_rows)
    t = _weight(n, k, fmt, zero_rows=(n - 1,))
    nv = fmt == "nvfp4"
    p, s = t["weight_packed"], t["weight_scale"]
    assert layout.compute_layout_ok(p, s, nv) is None
    pc, sc = layout.to_compute_layout(p, s, nv)
    assert pc.shape == (-(-n // 16), -(-k // 64), 8, 4, 16) and sc.shape == (-(-n // 16), -(-k // 64), 8, 4, 4)
    assert pc.numel() * 2 == -(-n // 16) * 16 * -(-k // 64) * 64  # 4 bits a weight, padding only
    p2, s2 = layout.from_compute_layout(pc, sc, n, k, nv)
    assert torch.equal(p2, p) and torch.equal(s2, s.view(torch.uint8))


def test_rotation_layout_uses_every_bit_once_and_the_asm_follows_it():
    """The 8 codes of a word fill its 32 bits exactly; rotating the word left by ROT_MAG[r] (ROT_SIGN[r])
    brings register r's magnitudes to bf16 bits 6-8 (signs to bit 15) of each half; the decode's PTX
    rotates by those amounts: 5 rotations, 8 ANDs / ORs (6 LOP3 in SASS) and 4 multiplies."""
    bits = []
    for r in range(4):
        for e in range(2):
            m, sb = layout.mag_bit(r, e), layout.sign_bit(r, e)
            bits += [(m + j) % 32 for j in range(3)] + [sb]
            assert (m + layout.ROT_MAG[r]) % 32 == 6 + 16 * e and (sb + layout.ROT_SIGN[r]) % 32 == 15 + 16 * e
    assert sorted(bits) == list(range(32))
    asm = mma.decode_asm()
    rots = [int(x) for x in re.findall(r"shf\.l\.wrap\.b32 \w+, \$4, \$4, (\d+);", asm)]
    assert sorted(rots) == sorted(set(layout.ROT_MAG + layout.ROT_SIGN) - {0})  # r1, r2: one rotation each
    assert asm.count("fma.rn.bf16x2") == 4 and asm.count("and.b32") + asm.count("or.b32") == 8


def every_code_every_scale(nv: bool) -> dict:
    """A weight [scales, 64] whose row i has the i-th scale code (NVFP4: every E4M3 byte but the NaNs: zero,
    subnormals, negatives; MXFP4: every E8M0 byte the layout takes) and every E2M1 code in each block."""
    scales = [c for c in range(256) if c & 0x7F != 0x7F] if nv else list(range(64, 191))
    n, k, B = len(scales), 64, 16 if nv else 32
    codes = torch.arange(k).remainder(16).to(torch.uint8).repeat(n, 1)  # every code, twice a 32-block
    p = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()
    s = torch.tensor(scales, dtype=torch.uint8)[:, None].repeat(1, k // B).contiguous()
    t = {"weight_packed": p, "weight_scale": s.view(torch.float8_e4m3fn) if nv else s}
    if nv:
        t["weight_global_scale"] = torch.tensor([1.0])
    return t


def test_every_code_times_every_scale_decodes_exactly():
    """decode_reference (the kernel's arithmetic: rotations, masks, bf16 multiply by the layout's scale,
    the epilogue's power of two) on a weight holding each E2M1 code under each E4M3 scale code (zero,
    subnormals, negatives) and each E8M0 scale the layout takes, against the formats' dequantization."""
    for nv in (True, False):
        t = every_code_every_scale(nv)
        p, s = t["weight_packed"], t["weight_scale"].view(torch.uint8)
        (n, k), fmt = t["weight_packed"].shape, "nvfp4" if nv else "mxfp4"
        k *= 2
        assert layout.compute_layout_ok(p, s, nv) is None
        pc, sc = layout.to_compute_layout(p, s, nv)
        got = layout.decode_reference(pc, sc, n, k, nv, t.get("weight_global_scale"))
        want = formats.dequantize(t, fmt, dtype=torch.float32)
        assert torch.equal(got, want), fmt


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("n,k", SHAPES)
def test_kernel_arithmetic_gives_the_dequantized_weight(fmt, n, k):
    """decode_reference (the kernel's bit placement, scale bf16 and epilogue factor, in torch) on the
    compute layout equals qerl.formats.dequantize on the original tensors."""
    t = _weight(n, k, fmt, seed=1, zero_rows=(1,))
    nv = fmt == "nvfp4"
    pc, sc = layout.to_compute_layout(t["weight_packed"], t["weight_scale"], nv)
    got = layout.decode_reference(pc, sc, n, k, nv, t.get("weight_global_scale"))
    want = formats.dequantize(t, fmt, dtype=torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


def test_lanes_hold_their_mma_fragments_in_natural_column_order():
    """The layout's promise, from the PTX definition of mma.m16n8k16's A fragment (a0: row g,
    columns 2c, 2c+1; a1: row g+8; a2: row g, columns 2c+8, 2c+9; a3: row g+8, those columns): lane
    (g, c)'s word t, its register r's bits read at the layout's positions, is the fragment of the
    16-column step t of the block, and its scale word is the bf16 pair of rows g and g+8 at that step
    (one code and scale per weight, read from the original tensors, not from the layout code)."""
    n, k = 40, 192
    t = _weight(n, k, "nvfp4", seed=3)
    pc, sc = layout.to_compute_layout(t["weight_packed"], t["weight_scale"], True)
    p = t["weight_packed"]
    codes = torch.stack([p & 0xF, p >> 4], -1).view(n, k)  # natural [N, K] codes
    sbf = layout.scale_bf16(t["weight_scale"].view(torch.uint8), True)  # [N, K/16]
    rng = torch.Generator().manual_seed(0)
    for _ in range(200):
        nb, kb = int(torch.randint(3, (1,), generator=rng)), int(torch.randint(3, (1,), generator=rng))
        g, c, tt = (int(v) for v in torch.randint(0, 8, (1,), generator=rng).tolist() + torch.randint(
            0, 4, (2,), generator=rng).tolist())
        word = int.from_bytes(bytes(pc[nb, kb, g, c, 4 * tt:4 * tt + 4].tolist()), "little")
        frag = [(0, 0), (1, 0), (0, 8), (1, 8)]  # (row + 8 h, column offset) of a0 .. a3
        for r, (h, dq) in enumerate(frag):
            for e in range(2):
                nib = ((word >> layout.mag_bit(r, e)) & 0x7) | (((word >> layout.sign_bit(r, e)) & 1) << 3)
                row, col = 16 * nb + 8 * h + g, 64 * kb + 16 * tt + dq + 2 * c + e
                want = int(codes[row, col]) if row < n and col < k else 0
                assert nib == want, (nb, kb, g, c, tt, r, e)
        pair = sc[nb, kb, g, tt].view(torch.bfloat16)
        for h in range(2):
            row = 16 * nb + 8 * h + g
            want = sbf[row, (64 * kb + 16 * tt) // 16] if row < n else torch.zeros((), dtype=torch.bfloat16)
            assert pair[h].view(torch.int16) == want.view(torch.int16)


def test_weights_without_an_exact_layout_are_refused():
    t = _weight(32, 64, "nvfp4")
    p, s = t["weight_packed"].clone(), t["weight_scale"].clone()
    s.view(torch.uint8)[0, 0] = 0  # zero scale, codes still non-zero: exact (bf16 zero), kept
    assert layout.compute_layout_ok(p, s, True) is None
    s.view(torch.uint8)[0, 0] = 0x7F
    assert "NaN" in layout.compute_layout_ok(p, s, True)
    assert layout.cached_layout({}, p, s, True) is None
    m = _weight(32, 64, "mxfp4")
    for byte, why in ((0xFF, "NaN"), (191, "above 2^63"), (63, "below 2^-63")):
        sm = m["weight_scale"].clone()
        sm.view(torch.uint8)[0, 0] = byte
        assert why in layout.compute_layout_ok(m["weight_packed"], sm, False)
    pz = m["weight_packed"].clone()
    pz[0, :16] = 0x88  # all codes of that block zero (signed): any scale decodes it exactly
    assert layout.compute_layout_ok(pz, sm, False) is None


def test_cached_layout_follows_in_place_changes():
    t = _weight(32, 64, "nvfp4")
    p, s = t["weight_packed"].clone(), t["weight_scale"].clone()
    cache = {}
    a = layout.cached_layout(cache, p, s, True)
    assert layout.cached_layout(cache, p, s, True) is a
    ptrs = [t.data_ptr() for t in a]
    p.bitwise_xor_(0x11)  # an in-place change bumps the version: remade, into the same storage
    b = layout.cached_layout(cache, p, s, True)
    assert [t.data_ptr() for t in b] == ptrs
    assert torch.equal(layout.from_compute_layout(*b, 32, 64, True)[0], p)


def test_does_not_apply_on_the_cpu_or_with_autograd():
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    assert not mma.applies(x, 64)


gpu = pytest.mark.skipif(not mma.available(), reason="needs a CUDA GPU (sm_80+) and Gluon")


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("n,k", [(512, 3584), (18944, 3584), (3584, 18944), (200, 352), (1000, 4128)])
def test_kernel_matches_the_reference_gpu(fmt, n, k):
    t = {kk: v.cuda() for kk, v in _weight(n, k, fmt, zero_rows=(3,)).items()}
    nv = fmt == "nvfp4"
    pc, sc = layout.to_compute_layout(t["weight_packed"], t["weight_scale"], nv)
    wd = formats.dequantize(t, fmt, dtype=torch.float32)
    wg = mma.has_wgmma(torch.device("cuda"))
    cases = [(m, None) for m in (1, 3, 8, 16, 32)] + [(64, mma.pick_config(64, n, k))]  # mma.sync
    # the activations straight into the B operand (no shared memory, no CTA barrier), K steps of 1 and 2 blocks
    cases += [(m, {**mma.pick_config(m, n, k), "X_DIRECT": True, "KB": kb, "REPS": reps})
              for m in (1, 3, 16) for kb in (1, 2) for reps in (1, 2, 4)]
    if wg:  # the warpgroup-MMA variant: one tile, ragged tiles, several row tiles of x
        cases += [(m, None) for m in (40, 64, 100, 128, 256, 300)]
    for m, cfg in cases:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        y = mma.linear(x, pc, sc, t.get("weight_global_scale"), n, k, nv, config=cfg)
        assert _rel(y, x.float() @ wd.T) < 1e-2, (m, cfg, _rel(y, x.float() @ wd.T))
        # split-K in a fixed order: the same bits every call
        assert torch.equal(y, mma.linear(x, pc, sc, t.get("weight_global_scale"), n, k, nv, config=cfg))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_every_code_times_every_scale_is_exact_gpu(fmt):
    """Each E2M1 code under each scale code (every_code_every_scale: E4M3 zero, subnormals and negatives
    included) through the kernels that decode the compute layout, one weight column at a time (one-hot
    activation rows): every output is the dequantized weight, bit for bit (each product has at most 6
    significant bits; one product a sum). mma.sync at 1, 8 and 16 rows, the warpgroup MMA at 64, the
    warp-specialised kernel at 32 and 64 rows where it serves."""
    from qerl.kernels import warpspec

    nv = fmt == "nvfp4"
    t = {kk: v.cuda() for kk, v in every_code_every_scale(nv).items()}
    n, k = t["weight_packed"].shape[0], t["weight_packed"].shape[1] * 2
    pc, sc = layout.to_compute_layout(t["weight_packed"], t["weight_scale"], nv)
    want = formats.dequantize(t, fmt, dtype=torch.float32).T.contiguous()  # [k, n]: row j = column j of W
    eye = torch.eye(k, device="cuda", dtype=torch.bfloat16)
    gs = t.get("weight_global_scale")
    dev = torch.device("cuda")
    runs = [("mma", m, lambda x: mma.linear(x, pc, sc, gs, n, k, nv)) for m in (1, 8, 16)]
    runs += [("mma X_DIRECT", m, lambda x, m=m: mma.linear(x, pc, sc, gs, n, k, nv, config={
        **mma.pick_config(m, n, k), "X_DIRECT": True, "KB": 1, "REPS": 2})) for m in (1, 8)]
    if mma.has_wgmma(dev):
        runs.append(("wgmma", 64, lambda x: mma.linear(x, pc, sc, gs, n, k, nv, config=mma.pick_config(64, n, k, True))))
    if warpspec.available(dev):
        runs += [("warpspec", m, lambda x: warpspec.linear(x, pc, sc, gs, n, k, nv)) for m in (32, 64)]
    for name, m, run in runs:
        for j0 in range(0, k, m):
            y = run(eye[j0:j0 + m].contiguous())
            bad = (y.float() != want[j0:j0 + m]).nonzero()
            assert bad.numel() == 0, (name, m, j0, bad[:4].tolist())


@pytest.mark.gpu
@gpu
def test_grouped_launch_equals_separate_launches_gpu():
    k = 3584
    ts = [{kk: v.cuda() for kk, v in _weight(n, k, "nvfp4", seed=i).items()} for i, n in enumerate((3584, 512, 512))]
    ws = [(*layout.to_compute_layout(t["weight_packed"], t["weight_scale"], True), t["weight_global_scale"], n)
          for t, n in zip(ts, (3584, 512, 512))]
    for m in (1, 8, 32) + ((64, 200) if mma.has_wgmma(torch.device("cuda")) else ()):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        for y, t in zip(mma.grouped_linear(x, ws, k, True), ts):
            ref = x.float() @ formats.dequantize(t, "nvfp4", dtype=torch.float32).T
            assert _rel(y, ref) < 1e-2


@pytest.mark.gpu
@gpu
def test_plan_direct_launch_of_the_mma_kernel_gpu():
    """Plan keeps the first mma launch and relaunches it directly: later calls with new inputs,
    outputs and a grown workspace give what a normal launch gives."""
    from qerl.kernels.plan import Plan

    t = {kk: v.cuda() for kk, v in _weight(1024, 4096, "nvfp4").items()}
    plan = Plan(t["weight_packed"], t["weight_scale"], t["weight_global_scale"], True)
    wd = formats.dequantize(t, "nvfp4", dtype=torch.float32)
    with torch.no_grad():
        for i in range(4):
            x = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16)
            if i == 2:  # a larger launch elsewhere grows the shared workspace
                mma.linear(torch.randn(32, 4096, device="cuda", dtype=torch.bfloat16),
                           *plan._mma_layout(), t["weight_global_scale"], 1024, 4096, True, split_k=16)
            y = plan.linear(x)
            assert _rel(y, x.float() @ wd.T) < 1e-2
            assert torch.equal(y, mma.linear(x, *plan._mma_layout(), t["weight_global_scale"], 1024, 4096, True))
    assert any(k[0] == "mma" and v is not None for k, v in plan._direct.items())


@pytest.mark.gpu
@gpu
def test_strided_and_unaligned_activations_gpu():
    """Rows with a stride (a slice of a wider tensor) are copied right; activations the 16-byte
    copies cannot take (K or the row stride not a multiple of 8, a misaligned start) are not sent
    to the kernel by ``applies`` and refused by ``grouped_linear`` with the reason."""
    n, k = 256, 512
    t = {kk: v.cuda() for kk, v in _weight(n, k, "nvfp4").items()}
    pc, sc = layout.to_compute_layout(t["weight_packed"], t["weight_scale"], True)
    wd = formats.dequantize(t, "nvfp4", dtype=torch.float32)
    for m in (5, 100):
        wide = torch.randn(m, k + 64, device="cuda", dtype=torch.bfloat16)
        x = wide[:, :k]  # row stride k + 64
        assert mma.applies(x, k) or m > mma.MMA_MAX_M
        if m <= mma.MMA_MAX_M or mma.has_wgmma(x.device):
            y = mma.linear(x, pc, sc, t["weight_global_scale"], n, k, True)
            assert _rel(y, x.float() @ wd.T) < 1e-2
        if m <= 16:  # the activations loaded straight into the B operand take the row stride too
            y = mma.linear(x, pc, sc, t["weight_global_scale"], n, k, True,
                           config={**mma.pick_config(m, n, k), "X_DIRECT": True})
            assert _rel(y, x.float() @ wd.T) < 1e-2
        odd = torch.randn(m, k + 1, device="cuda", dtype=torch.bfloat16)[:, 1:]  # start 2 bytes off
        assert not mma.applies(odd, k)
        with pytest.raises(ValueError, match="16 bytes"):
            mma.linear(odd, pc, sc, t["weight_global_scale"], n, k, True)


def test_a_failing_self_test_turns_the_kernel_off_with_a_warning():
    """Where the kernel cannot compile or run (here: CPU tensors), the self-test says so and returns
    False, so that available() sends every call to the Triton kernels."""
    with pytest.warns(UserWarning, match="failed its self-test"):
        assert mma._self_test(torch.device("cpu")) is False


def test_the_rule_takes_the_direct_activations_up_to_its_rows(monkeypatch):
    """X_DIRECT (activations straight into the B operand) is the rule's config up to X_DIRECT_MAX_M rows (at
    most the 16-row tiles), never by default."""
    assert mma.X_DIRECT_MAX_M == 0 or "QERL_MMA_X_DIRECT" in __import__("os").environ
    monkeypatch.setattr(mma, "X_DIRECT_MAX_M", 8)
    for m in (1, 8):
        cfg = mma.pick_config(m, 3584, 3584)
        assert cfg["X_DIRECT"] and cfg["BM"] == 8 and cfg["KB"] == mma.X_DIRECT_KB and cfg["REPS"] == mma.X_DIRECT_REPS
    for m in (9, 16, 32):
        assert not mma.pick_config(m, 3584, 3584).get("X_DIRECT")
    monkeypatch.setattr(mma, "X_DIRECT_MAX_M", 0)
    assert not mma.pick_config(1, 3584, 3584).get("X_DIRECT")


def test_wgmma_split_rule():
    """A power of two from 1 to 4, never more splits than K blocks; more splits for fewer tiles and
    for longer K."""
    for tiles in (1, 8, 56, 224, 1184):
        for iters in (1, 3, 56, 296):
            s = mma.wgmma_split(tiles, iters, 132)
            assert s in (1, 2, 4) and s <= max(iters, 1)
    assert mma.wgmma_split(8, 56, 132) == 4 and mma.wgmma_split(592, 56, 132) == 1
    assert mma.wgmma_split(224, 296, 132) > mma.wgmma_split(224, 56, 132)
