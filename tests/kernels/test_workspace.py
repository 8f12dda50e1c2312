"""The split-K workspace must outlive every CUDA graph that captured it.

A captured graph keeps the raw pointer of the workspace it was recorded with. Before this was
fixed, a later, larger launch (the training forward) replaced the workspace and freed the old one,
so the rollout engine's decode graphs replayed their split-K partial sums into memory the
allocator had handed to other tensors: wrong log-probs on the GPU (gap 0.3-0.4 nats, max 37) for
every NVFP4 / MXFP4 run. CPU: the bookkeeping (interpreter). GPU: the failure itself.
"""

import pytest
import torch

from qerl import formats, kernels
from qerl.kernels import common, ops


def test_outgrown_workspace_is_retired_not_freed():
    dev = torch.device("cpu")
    ws, cnt = common.workspace(dev, 0, 0)
    ptrs = (ws.data_ptr(), cnt.data_ptr())
    ws2, cnt2 = common.workspace(dev, ws.numel() + 1, cnt.numel() + 1)
    assert ws2.numel() >= 2 * ws.numel() and cnt2.numel() >= 2 * cnt.numel()
    del ws, cnt
    retired = {t.data_ptr() for t in common.RETIRED}
    assert set(ptrs) <= retired, "an outgrown workspace was dropped (a captured graph may still use it)"
    assert common.workspace(dev, 1, 1)[0].data_ptr() == ws2.data_ptr()  # smaller requests reuse the live one


@pytest.mark.parametrize("fmt", ["nvfp4"])
def test_unsplit_launch_does_not_grow_workspace(fmt):
    if not common.INTERPRETED and not torch.cuda.is_available():
        pytest.skip("needs the Triton interpreter or a GPU")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    n, k = 96, 128
    t = formats.quantize(torch.randn(n, k, device=dev) * 0.02, fmt)
    before = common.workspace(dev, 0, 0)[0].data_ptr()
    x = torch.randn(4096, k, device=dev, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32)
    y = kernels.linear(x, fmt, t, n, k, backend="triton")  # 4096 x 96 outputs > the initial workspace
    assert y.shape == (4096, n)
    assert common.workspace(dev, 0, 0)[0].data_ptr() == before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_graph_replay_survives_workspace_growth(fmt):
    n, k = 4096, 4096
    t = formats.quantize(torch.randn(n, k, device="cuda") * 0.02, fmt)
    ref_w = formats.dequantize(t, fmt, dtype=torch.float32)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    kernels.linear(x, fmt, t, n, k, backend="triton")  # warm-up: compiles, allocates the workspace
    g, out = torch.cuda.CUDAGraph(), None
    with torch.cuda.graph(g):
        out = kernels.linear(x, fmt, t, n, k, backend="triton")
    args = (t["weight_packed"], t["weight_scale"], t.get("weight_global_scale"), fmt == "nvfp4")
    for m in (64, 256, 1024):  # split-K launches with more outputs: the workspace grows
        ops.launch_linear(torch.randn(m, k, device="cuda", dtype=torch.bfloat16), *args, kind="dot", split_k=4)
    assert common.RETIRED, "the workspace did not grow: the test does not exercise the failure"
    junk = [torch.full((1 << 22,), 1e4, device="cuda") for _ in range(16)]  # reuse any freed memory
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    ref = x.float() @ ref_w.T
    err = float((out.float() - ref).norm() / ref.norm())
    assert err < 1e-2, f"graph replay after workspace growth: rel err {err:.3g}"
    del junk
