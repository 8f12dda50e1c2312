"""The warp-specialised Hopper kernel (qerl.kernels.warpspec): its launch rule on any machine, and on an
sm_90 GPU its product against the fp32 reference at every M class it serves (and beyond), ragged
shapes, both formats, forced split-K, and bitwise repeatability."""

import pytest
import torch

from qerl import formats
from qerl.kernels import common, layout, warpspec


def test_pick_config_covers_every_m():
    for M in range(1, 600):
        cfg = warpspec.pick_config(M, 4096, 4096)
        assert cfg["BM"] in (16, 32, 64, 128)
        assert cfg["BM"] >= min(M, 64 if warpspec.MMA_IN_FLIGHT else 128)
        assert cfg["NWG"] in (1, 2) and cfg["KB"] >= 1 and cfg["STAGES"] >= 2
        assert cfg["in_flight"] is warpspec.MMA_IN_FLIGHT


def test_mma_in_flight_follows_the_installed_triton():
    """MMAs stay in flight exactly on Triton >= 3.7 (the register-A fix), whatever the environment says."""
    import triton

    major, minor = (int(p) for p in triton.__version__.split(".")[:2])
    assert warpspec.MMA_IN_FLIGHT is ((major, minor) >= (3, 7))


def test_refuses_what_the_bulk_copies_cannot_take():
    x = torch.zeros(4, 20, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiples of 8"):
        warpspec.linear(x, torch.zeros(1, 1, 8, 4, 16, dtype=torch.uint8), torch.zeros(1, 1, 8, 4, 2, dtype=torch.uint8),
                      None, 16, 20, True)
    with pytest.raises(ValueError, match="bfloat16"):
        warpspec.linear(x.float(), torch.zeros(1, 1, 8, 4, 16, dtype=torch.uint8),
                      torch.zeros(1, 1, 8, 4, 2, dtype=torch.uint8), None, 16, 20, True)


def test_a_group_launch_refuses_what_it_cannot_take():
    x = torch.zeros(4, 128, dtype=torch.bfloat16)
    w = (torch.zeros(1, 2, 512, dtype=torch.uint8), torch.zeros(1, 2, 64, dtype=torch.uint8), None, 16)
    with pytest.raises(ValueError, match="1 to 3 weights"):
        warpspec.grouped_linear(x, [w] * 4, 128, True)
    narrow = (torch.zeros(1, 1, 512, dtype=torch.uint8), torch.zeros(1, 1, 64, dtype=torch.uint8), None, 16)
    with pytest.raises(ValueError, match="share their input width"):
        warpspec.grouped_linear(x, [w, narrow], 128, True)


def test_not_available_on_the_cpu():
    assert not warpspec.available(torch.device("cpu"))
    assert not warpspec.serves(torch.zeros(20, 64, dtype=torch.bfloat16))


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9 and warpspec.HAVE_WS


sm90 = pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU and Gluon's warp_specialize")


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("n,k", [(200, 320), (1000, 1088), (512, 3584), (3584, 1024)])
@pytest.mark.parametrize("in_flight", [False, True])
def test_matches_the_reference_and_repeats_bitwise_gpu(fmt, n, k, in_flight):
    """Both forms of the consumer loop: MMAs waited at once (any Triton) and left in flight (Triton >= 3.7)."""
    if in_flight and not warpspec.MMA_IN_FLIGHT:
        pytest.skip("MMAs in flight need Triton >= 3.7")
    dev = torch.device("cuda")
    assert warpspec.available(dev)
    g = torch.Generator(device=dev).manual_seed(n + k)
    t = formats.quantize(torch.randn(n, k, device=dev, generator=g) * 0.02, fmt)
    is_nv = common.scale_mode(fmt)
    pc, sc = layout.to_compute_layout(t["weight_packed"], t["weight_scale"], is_nv)
    w = formats.dequantize(t, fmt, dtype=torch.float32)
    cfg = {"in_flight": in_flight}
    for M in (1, 9, 17, 31, 33, 64, 65, 129, 256, 300):
        x = torch.randn(M, k, device=dev, dtype=torch.bfloat16, generator=g)
        ref = x.float() @ w.T
        for split in (None, 3):
            y = warpspec.linear(x, pc, sc, t.get("weight_global_scale"), n, k, is_nv, split_k=split, config=cfg)
            err = float((y.float() - ref).norm() / ref.norm())
            assert err < 5e-3, (fmt, n, k, M, split, err)
            again = warpspec.linear(x, pc, sc, t.get("weight_global_scale"), n, k, is_nv, split_k=split, config=cfg)
            assert torch.equal(y, again), (fmt, n, k, M, split)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("nwg,stages", [(1, 6), (2, 3)])
def test_two_row_blocks_a_warpgroup_gpu(fmt, nwg, stages):
    """RPW 2: each consumer warpgroup multiplies 128 weight rows (two 64-row MMAs a block) on one activation
    tile; ragged N (a tile past the last row), 32- and 64-row activation tiles (several at 100 and 256 rows),
    forced split-K, bitwise repeatable."""
    if not warpspec.MMA_IN_FLIGHT:
        pytest.skip("RPW 2 is timed with MMAs in flight (Triton >= 3.7)")
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(7)
    n, k = 1000, 1088
    t = formats.quantize(torch.randn(n, k, device=dev, generator=g) * 0.02, fmt)
    is_nv = common.scale_mode(fmt)
    pc, sc = layout.to_compute_layout(t["weight_packed"], t["weight_scale"], is_nv)
    w = formats.dequantize(t, fmt, dtype=torch.float32)
    for M in (3, 17, 40, 64, 100, 256):
        x = torch.randn(M, k, device=dev, dtype=torch.bfloat16, generator=g)
        ref = x.float() @ w.T
        for split in (None, 3):
            cfg = {"RPW": 2, "NWG": nwg, "STAGES": stages, "BM": 32 if M <= 32 else 64, "KB": 2}
            y = warpspec.linear(x, pc, sc, t.get("weight_global_scale"), n, k, is_nv, split_k=split, config=cfg)
            err = float((y.float() - ref).norm() / ref.norm())
            assert err < 5e-3, (fmt, nwg, M, split, err)
            again = warpspec.linear(x, pc, sc, t.get("weight_global_scale"), n, k, is_nv, split_k=split, config=cfg)
            assert torch.equal(y, again), (fmt, nwg, M, split)


@pytest.mark.gpu
@sm90
def test_strided_rows_gpu():
    dev = torch.device("cuda")
    t = formats.quantize(torch.randn(384, 512, device=dev) * 0.02, "nvfp4")
    pc, sc = layout.to_compute_layout(t["weight_packed"], t["weight_scale"], True)
    big = torch.randn(24, 640, device=dev, dtype=torch.bfloat16)
    x = big[:, 64:576]  # rows of 512 at a stride of 640
    y = warpspec.linear(x, pc, sc, t["weight_global_scale"], 384, 512, True)
    ref = x.float() @ formats.dequantize(t, "nvfp4", dtype=torch.float32).T
    assert float((y.float() - ref).norm() / ref.norm()) < 5e-3


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("kind", ["mma", "warpspec"])
def test_the_door_runs_a_named_family_gpu(kind):
    """kernels.linear_tuned(kind=...) runs one compute-layout family whatever M (benchmarks compare them)."""
    from qerl import kernels

    dev = torch.device("cuda")
    t = formats.quantize(torch.randn(384, 1024, device=dev) * 0.02, "nvfp4")
    w = formats.dequantize(t, "nvfp4", dtype=torch.float32)
    cache = {}
    for M in (5, 20, 50, 130):
        x = torch.randn(M, 1024, device=dev, dtype=torch.bfloat16)
        y = kernels.linear_tuned(x, "nvfp4", t, kind=kind, cache=cache)
        ref = x.float() @ w.T
        assert float((y.float() - ref).norm() / ref.norm()) < 5e-3, (kind, M)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_one_launch_over_a_group_equals_its_weights_launches_gpu(fmt):
    """warpspec.grouped_linear over 2 and 3 weights of different widths (ragged last tiles) sharing x: each
    output bitwise the weight's own launch at the same split (none, and forced split-K: each weight's slice
    of the workspace), and against the fp32 reference; every row tile class the kernel has."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(11)
    k = 1088
    shapes = (1000, 136, 200)
    is_nv = common.scale_mode(fmt)
    ts = [formats.quantize(torch.randn(n, k, device=dev, generator=g) * 0.02, fmt) for n in shapes]
    args = [(*layout.to_compute_layout(t["weight_packed"], t["weight_scale"], is_nv), t.get("weight_global_scale"), n)
            for t, n in zip(ts, shapes)]
    for M in (20, 48, 70, 200, 256):
        x = torch.randn(M, k, device=dev, dtype=torch.bfloat16, generator=g)
        for ng in (2, 3):
            for split in (1, 3):
                ys = warpspec.grouped_linear(x, args[:ng], k, is_nv, split_k=split)
                for y, a, t in zip(ys, args, ts):
                    assert torch.equal(y, warpspec.linear(x, *a, k, is_nv, split_k=split)), (fmt, M, ng, split)
                    ref = x.float() @ formats.dequantize(t, fmt, dtype=torch.float32).T
                    assert float((y.float() - ref).norm() / ref.norm()) < 5e-3, (fmt, M, ng, split)


@pytest.mark.gpu
@sm90
def test_grouped_launch_takes_the_warp_specialised_kernel_from_its_rows_gpu():
    """kernels.grouped_linear over three weights sharing x: each output against the fp32 reference, and
    from GROUPED_WARPSPEC_MIN_M rows (Triton >= 3.7) bitwise the warp-specialised launch over the group."""
    from qerl import kernels

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(3)
    k = 512
    shapes = (384, 128, 128)
    ts = [formats.quantize(torch.randn(n, k, device=dev, generator=g) * 0.02, "nvfp4") for n in shapes]
    weights = [kernels.Weight("nvfp4", t, n, k, "triton", {}) for t, n in zip(ts, shapes)]
    for M in (20, 48, 70, 200, 240):
        x = torch.randn(M, k, device=dev, dtype=torch.bfloat16, generator=g)
        ys = kernels.grouped_linear(x, weights)
        assert ys is not None and len(ys) == 3
        for y, t in zip(ys, ts):
            ref = x.float() @ formats.dequantize(t, "nvfp4", dtype=torch.float32).T
            assert float((y.float() - ref).norm() / ref.norm()) < 5e-3, M
        if warpspec.serves(x) and M >= kernels.GROUPED_WARPSPEC_MIN_M:
            args = [layout.weight_args(w.cache, t, True, w.out_features) for w, t in zip(weights, ts)]
            for y, want in zip(ys, warpspec.grouped_linear(x, args, k, True)):
                assert torch.equal(y, want), M
