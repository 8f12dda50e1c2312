"""qerl.kernels Triton kernels on a CUDA GPU against the fp32 reference (dequantize + matmul):
every linear shape of SmolLM2-135M and Qwen2.5-3B/7B/14B/32B and shapes that are not multiples
of the tiles, M in {1, 2, 3, 4, 8, 16, 64, 256, 2048}, forward and grad-input, plus CUDA-graph
capture and torch.compile. Skipped without CUDA.

Run: python -m pytest tests/kernels/test_kernels_gpu.py -q -m gpu   (about 2 min on one H100)
"""

import pytest
import torch

from qerl import formats, kernels
from qerl.arch import LAYER_CONFIGS, linear_shapes

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

M_VALUES = (1, 2, 3, 4, 8, 16, 64, 256, 2048)
ODD_SHAPES = [(200, 352), (1000, 4128), (48, 96)]  # N, K: not multiples of any tile
TOL = 1e-2


def rel_err(out, ref):
    out, ref = out.detach().float(), ref.detach().float()
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).norm() / ref.norm())


def check_shapes(fmt, shapes):
    """Every (N, K) x M for forward and grad-input; returns the list of failures."""
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference is true fp32
    failures, worst = [], 0.0
    for n, k in sorted(set(shapes)):
        w = torch.randn(n, k, device="cuda") * 0.02
        t = formats.quantize(w, fmt)
        wd = formats.dequantize(t, fmt, dtype=torch.float32)
        for m in M_VALUES:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            e = rel_err(kernels.linear(x, fmt, t, n, k, backend="triton"), x.float() @ wd.T)
            dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
            eg = rel_err(kernels.grad_input(dy, fmt, t, n, k, backend="triton"), dy.float() @ wd)
            worst = max(worst, e, eg)
            if not (e < TOL and eg < TOL):
                failures.append((fmt, n, k, m, e, eg))
    print(f"{fmt}: worst rel err {worst:.2e} over {len(set(shapes))} shapes x {len(M_VALUES)} M")
    return failures


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_every_model_linear_shape(fmt):
    shapes = [s for model in LAYER_CONFIGS for s in linear_shapes(model).values()]
    failures = check_shapes(fmt, shapes + ODD_SHAPES)
    assert not failures, f"rel err >= {TOL} (fmt, N, K, M, fwd, grad): {failures[:20]}"


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_gemv_paths(fmt):
    """The packed-decode GEMV kernel at every M it can serve: bf16 activations (bf16x2 FMAs) and
    fp32 activations (fp32 FMAs, held to a tighter tolerance), odd shapes, forced split-K."""
    from qerl.kernels import ops

    torch.backends.cuda.matmul.allow_tf32 = False
    for n, k in [(3584, 3584), (512, 3584), (1000, 4128), (48, 96)]:
        t = formats.quantize(torch.randn(n, k, device="cuda") * 0.02, fmt)
        wd = formats.dequantize(t, fmt, dtype=torch.float32)
        args = (t["weight_packed"], t["weight_scale"], t.get("weight_global_scale"), fmt == "nvfp4")
        for m in (1, 2, 3, 4, 8, 16):
            for dtype, tol in ((torch.bfloat16, TOL), (torch.float32, 1e-5)):
                x = torch.randn(m, k, device="cuda", dtype=dtype)
                ref = x.float() @ wd.T
                for split in (None, 3):
                    y = ops.launch_linear(x, *args, kind="gemv", split_k=split)
                    assert rel_err(y, ref) < tol, (n, k, m, dtype, split)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_dot_paths(fmt):
    """The tensor-core kernels in each operand order (SWAP_AB), ragged shapes, skinny (split-K)
    and tiled M, bf16 and fp32 x; grad-input in bf16 and fp32."""
    from qerl.kernels import ops

    torch.backends.cuda.matmul.allow_tf32 = False
    for n, k in [(3584, 3584), (1000, 4128), (200, 352)]:
        t = formats.quantize(torch.randn(n, k, device="cuda") * 0.02, fmt)
        wd = formats.dequantize(t, fmt, dtype=torch.float32)
        args = (t["weight_packed"], t["weight_scale"], t.get("weight_global_scale"), fmt == "nvfp4")
        for m in (5, 16, 64, 300):
            for dtype in (torch.bfloat16, torch.float32):
                x = torch.randn(m, k, device="cuda", dtype=dtype)
                dy = torch.randn(m, n, device="cuda", dtype=dtype)
                ref = x.float() @ wd.T
                ref_g = dy.float() @ wd
                for swap in (True, False):
                    cfg = ops.pick_config("dot", m, n, k, fmt == "nvfp4")
                    cfg.update(SWAP_AB=swap)
                    y = ops.launch_linear(x, *args, kind="dot", config=cfg)
                    assert rel_err(y, ref) < TOL, (n, k, m, dtype, swap)
                g = ops.launch_grad_input(dy, *args)  # fp32: 32-row tiles (Triton 3.6 limit)
                assert rel_err(g, ref_g) < TOL, ("grad", n, k, m, dtype)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_cuda_graph_replay(fmt):
    n, k = 1000, 4128
    t = formats.quantize(torch.randn(n, k, device="cuda") * 0.02, fmt)
    wd = formats.dequantize(t, fmt, dtype=torch.float32)
    for m in (1, 8, 64):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        kernels.linear(x, fmt, t, n, k)  # warm-up: compile, allocate the split-K workspace
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = kernels.linear(x, fmt, t, n, k)
        for _ in range(3):  # fresh inputs each replay
            x.copy_(torch.randn_like(x))
            g.replay()
            torch.cuda.synchronize()
            assert rel_err(y, x.float() @ wd.T) < TOL


def test_torch_compile_and_autograd():
    n, k = 512, 1024
    t = formats.quantize(torch.randn(n, k, device="cuda") * 0.02, "nvfp4")
    wd = formats.dequantize(t, "nvfp4", dtype=torch.float32)

    def f(x):
        return torch.nn.functional.silu(kernels.linear(x, "nvfp4", t, n, k))

    cf = torch.compile(f, fullgraph=True)
    x = torch.randn(4, 64, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = cf(x)
    ref = torch.nn.functional.silu(x.detach().float() @ wd.T)
    assert rel_err(y, ref) < TOL
    y.float().sum().backward()
    xr = x.detach().float().requires_grad_()
    torch.nn.functional.silu(xr @ wd.T).sum().backward()
    assert rel_err(x.grad, xr.grad) < TOL
