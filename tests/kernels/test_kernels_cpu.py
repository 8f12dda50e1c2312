"""qerl.kernels on the CPU: the reference path, dispatch errors, and the Triton kernels under
TRITON_INTERPRET=1 (set by tests/kernels/conftest.py when there is no CUDA) at small shapes,
including shapes that are not multiples of the tiles and forced split-K.

Run: .venv/bin/python -m pytest tests/kernels/test_kernels_cpu.py -q   (about 30 s on 2 cores)
"""

import os

import pytest
import torch

from qerl import formats, kernels

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
if INTERPRET:
    # Import (and jit) the kernels now, while TRITON_INTERPRET=1: a test below unsets it.
    import qerl.kernels.ops  # noqa: F401
needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 (CPU run)")


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all()
    return float((out - ref).norm() / ref.norm())


def quantized(fmt, n, k):
    w = torch.randn(n, k) * 0.02
    t = formats.quantize(w, fmt)
    return t, formats.dequantize(t, fmt, dtype=torch.float32).double()


# ----------------------------------------------------------------------------------------------
# reference path


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "nf4"])
def test_reference_is_dequantize_then_matmul(fmt):
    n, k = 48, 128
    t, w = quantized(fmt, n, k)
    x = torch.randn(2, 3, k, dtype=torch.bfloat16)
    y = kernels.linear(x, fmt, t, n, k, backend="reference")
    assert y.shape == (2, 3, n) and y.dtype == torch.bfloat16
    assert rel_err(y, x.double() @ w.T) < 4e-3  # only the final rounding to bf16
    dy = torch.randn(2, 3, n, dtype=torch.float32)
    dx = kernels.grad_input(dy, fmt, t, n, k, backend="reference")
    assert dx.shape == (2, 3, k) and dx.dtype == torch.float32
    assert rel_err(dx, dy.double() @ w) < 1e-6


def test_reference_linear_is_differentiable_in_x():
    n, k = 32, 64
    t, w = quantized("nvfp4", n, k)
    x = torch.randn(5, k, requires_grad=True)
    kernels.linear(x, "nvfp4", t, n, k, backend="reference").pow(2).sum().backward()
    y = x.detach().double() @ w.T
    assert rel_err(x.grad, (2 * y) @ w) < 1e-5


# ----------------------------------------------------------------------------------------------
# dispatch


def test_dispatch_rejects_bad_arguments():
    t, _ = quantized("nvfp4", 32, 64)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="backend must be one of"):
        kernels.linear(x, "nvfp4", t, 32, 64, backend="cuda")
    with pytest.raises(ValueError, match="fmt must be one of"):
        kernels.linear(x, "int4", t, 32, 64)
    with pytest.raises(ValueError, match="missing"):
        kernels.linear(x, "nvfp4", {"weight_packed": t["weight_packed"]}, 32, 64)
    with pytest.raises(ValueError, match="in_features"):
        kernels.linear(torch.randn(2, 32), "nvfp4", t, 32, 64)
    with pytest.raises(ValueError, match=r"\[out, in/2\]"):
        kernels.linear(x, "nvfp4", t, 64, 32)


def test_triton_backend_never_falls_back(monkeypatch):
    t, _ = quantized("nf4", 32, 64)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="kernels for"):
        kernels.linear(x, "nf4", t, 32, 64, backend="triton")
    t, _ = quantized("nvfp4", 32, 64)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        kernels.linear(x, "nvfp4", t, 32, 64, backend="triton")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        kernels.grad_input(torch.randn(2, 32), "nvfp4", t, 32, 64, backend="triton")


def test_auto_uses_reference_on_cpu(monkeypatch):
    from qerl.kernels import ops

    def boom(*a, **k):
        raise AssertionError("auto must not pick triton for CPU tensors")

    monkeypatch.setattr(ops, "linear", boom)
    t, w = quantized("mxfp4", 32, 64)
    x = torch.randn(2, 64)
    assert rel_err(kernels.linear(x, "mxfp4", t, 32, 64), x.double() @ w.T) < 1e-6


# ----------------------------------------------------------------------------------------------
# Triton kernels in the interpreter

SHAPES = [(40, 96), (72, 160), (16, 32)]  # N, K: neither a multiple of the default tiles


@needs_interpreter
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("n,k", SHAPES)
def test_triton_matches_reference(fmt, n, k):
    t, w = quantized(fmt, n, k)
    for m in (1, 3, 6, 20):
        x = torch.randn(m, k)
        ref = x.double() @ w.T
        # fp32 activations: the interpreter multiplies exactly, so any decode slip shows.
        assert rel_err(kernels.linear(x, fmt, t, n, k, backend="triton"), ref) < 1e-5
        xb = x.bfloat16()
        yb = kernels.linear(xb, fmt, t, n, k, backend="triton")
        assert yb.dtype == torch.bfloat16 and yb.shape == (m, n)
        assert rel_err(yb, xb.double() @ w.T) < 1e-2
        dy = torch.randn(m, n)
        assert rel_err(kernels.grad_input(dy, fmt, t, n, k, backend="triton"), dy.double() @ w) < 1e-5


@needs_interpreter
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("kind", ["gemv", "gemv-bf16", "dot", "dot-bf16", "dot-noswap"])
def test_split_k_reduces_and_leaves_workspace_clean(fmt, kind):
    """Split-K (partials summed in split order) reduces correctly and leaves the counters zeroed."""
    from qerl.kernels import common, ops

    n, k = 40, 384
    t, w = quantized(fmt, n, k)
    args = (t["weight_packed"], t["weight_scale"], t.get("weight_global_scale"), fmt == "nvfp4")
    if kind.startswith("gemv"):
        cfg = dict(BLOCK_M=4, BLOCK_N=16, GROUPS=2, num_warps=4, num_stages=1)
    else:  # the tensor-core kernel with 16-row tiles, weight as operand A (swap) or B
        cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, GROUP_M=1, SWAP_AB=kind != "dot-noswap",
                   num_warps=4, num_stages=1)
    # *-bf16: bf16 activations (gemv: the packed-pair path, its asm emulated in fp32 here)
    x = torch.randn(3, k, dtype=torch.bfloat16 if kind.endswith("bf16") else torch.float32)
    kind = kind.split("-")[0]
    ref = x.double() @ w.T
    tol = 1e-2 if x.dtype == torch.bfloat16 else 1e-5
    for m in (1, 3):  # BLOCK_M = 1 (prefetched x words) and BLOCK_M = 4
        for _ in range(2):  # the second call sees the workspace the first one left behind
            bm = cfg["BLOCK_M"] if kind == "dot" else (1 if m == 1 else 4)
            y = ops.launch_linear(x[:m], *args, kind=kind, config=dict(cfg, BLOCK_M=bm),
                                  split_k=3)
            assert rel_err(y, ref[:m]) < tol
    _, cnt = common._WORKSPACE[(str(x.device), "main")]
    assert not cnt.any()


@needs_interpreter
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_triton_autograd_and_leading_dims(fmt):
    n, k = 24, 64
    t, w = quantized(fmt, n, k)
    x = torch.randn(2, 2, k, requires_grad=True)
    y = kernels.linear(x, fmt, t, n, k, backend="triton")
    assert y.shape == (2, 2, n)
    g = torch.randn_like(y)
    y.backward(g)
    assert rel_err(x.grad, g.double() @ w) < 1e-5


@needs_interpreter
def test_custom_ops_trace_under_torch_compile():
    n, k = 24, 64
    t, w = quantized("nvfp4", n, k)

    def f(x):
        return kernels.linear(x, "nvfp4", t, n, k, backend="triton") * 2

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    x = torch.randn(3, k)
    assert rel_err(compiled(x), 2 * (x.double() @ w.T)) < 1e-5


@needs_interpreter
def test_opcheck_e4m3_linear():
    n, k = 16, 32
    t, _ = quantized("nvfp4", n, k)
    x = torch.randn(2, k, requires_grad=True)
    torch.library.opcheck(torch.ops.qerl.fp4_e4m3_linear.default,
                          # the scale as raw bytes: opcheck's schema test multiplies inputs,
                          # which CPU torch cannot do for float8 (the op accepts either).
                          (x, t["weight_packed"], t["weight_scale"].view(torch.uint8),
                           t["weight_global_scale"]),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


@needs_interpreter
def test_triton_rejects_fp16_activations():
    t, _ = quantized("nvfp4", 16, 32)
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        kernels.linear(torch.randn(1, 32, dtype=torch.float16), "nvfp4", t, 16, 32, backend="triton")


def test_fp32_activations_never_take_the_register_a_order():
    """The swapped (register-A) tile is for 16-bit activations only: with fp32 x Triton leaves a split
    tf32 register-A MMA in flight with its operand registers unprotected (qerl.kernels.dot)."""
    from qerl.kernels import ops

    t = formats.quantize(torch.randn(64, 128) * 0.02, "nvfp4")
    packed, scale_u8 = t["weight_packed"], ops.scale_bytes(t["weight_scale"])
    cfg = dict(ops.pick_config("dot", 64, 64, 128, True), SWAP_AB=True)
    for dtype, swap in ((torch.bfloat16, True), (torch.float16, True), (torch.float32, False)):
        x = torch.zeros(64, 128, dtype=dtype)
        launch = ops.linear_launch(64, 64, 128, True, x.device, "dot", cfg, None, False)
        _, _, _, kw = ops.linear_call(x, packed, None, scale_u8, t["weight_global_scale"], torch.empty(64, 64), launch)
        assert kw["SWAP_AB"] is swap, dtype
