"""NF4 through bitsandbytes (qerl.kernels.bnb and the "bitsandbytes" backend of the dispatch).

qerl's NF4 buffers are bitsandbytes' bytes, so a QuantState built around them must give exactly
what bitsandbytes gives on its own quantized weight. CPU tests use bitsandbytes' CPU build; the
GPU tests (marked gpu) check backend "auto" on CUDA, the gradient and CUDA-graph capture.

Run: OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/kernels/test_bnb.py -q   (a few seconds)
"""

import pytest
import torch

from qerl import formats, kernels
from qerl.kernels import bnb as qbnb
from qerl.qlinear import QuantLinear
from qerl.quantize import QuantizeConfig

bitsandbytes = pytest.importorskip("bitsandbytes")
import bitsandbytes.functional as bf  # noqa: E402

N, K = 96, 192


def nf4_weight(n=N, k=K, device="cpu"):
    w = torch.randn(n, k, device=device) * 0.02
    return w, formats.quantize(w, "nf4")


def test_quant_state_views_qerl_buffers():
    _, t = nf4_weight()
    st = qbnb.quant_state(t, N, K, torch.bfloat16)
    assert st.absmax.data_ptr() == t["weight_absmax"].data_ptr()  # shared, not copied
    assert tuple(st.shape) == (N, K) and st.blocksize == 64 and st.quant_type == "nf4"
    assert st.dtype == torch.bfloat16 and not st.nested
    assert torch.equal(st.code, bf.get_4bit_type("nf4", device="cpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_equals_bitsandbytes_on_its_own_quantization(dtype):
    w, t = nf4_weight()
    packed, state = bf.quantize_4bit(w, quant_type="nf4", blocksize=64, compress_statistics=False)
    state.dtype = dtype
    x = torch.randn(2, 5, K, dtype=dtype)
    want = bitsandbytes.matmul_4bit(x, packed, quant_state=state)
    got = kernels.linear(x, "nf4", t, N, K, backend="bitsandbytes")
    assert got.dtype == dtype and torch.equal(got, want)


def test_linear_and_grad_input_match_reference():
    _, t = nf4_weight()
    x = torch.randn(3, K, requires_grad=True)
    y = kernels.linear(x, "nf4", t, N, K, backend="bitsandbytes")
    ref = kernels.linear_reference(x.detach(), "nf4", t, N, K)
    torch.testing.assert_close(y.detach(), ref, rtol=1e-5, atol=1e-6)
    dy = torch.randn(3, N)
    y.backward(dy)  # bnb.matmul_4bit's own backward
    dx = kernels.grad_input(dy, "nf4", t, N, K, backend="bitsandbytes")
    torch.testing.assert_close(dx, x.grad, rtol=0, atol=0)  # same computation as bnb's backward
    torch.testing.assert_close(dx, kernels.grad_input_reference(dy, "nf4", t, N, K), rtol=1e-5, atol=1e-6)


def test_quantlinear_bitsandbytes_matches_reference_and_caches_state():
    torch.manual_seed(0)
    lin = torch.nn.Linear(K, N, bias=True)
    q_ref = QuantLinear.from_linear(lin, "nf4", lora_rank=4, backend="reference")
    q_bnb = QuantLinear.from_linear(lin, "nf4", lora_rank=4, backend="bitsandbytes")
    q_bnb.load_state_dict(q_ref.state_dict())
    x = torch.randn(4, K, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    y_ref, y_bnb = q_ref(x), q_bnb(x2)
    torch.testing.assert_close(y_bnb, y_ref, rtol=1e-5, atol=1e-5)
    y_ref.square().sum().backward()
    y_bnb.square().sum().backward()
    torch.testing.assert_close(x2.grad, x.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(q_bnb.lora_A.weight.grad, q_ref.lora_A.weight.grad, rtol=1e-4, atol=1e-5)
    # one QuantState per (module, dtype), reused across calls ...
    (key, (absmax, state)), = q_bnb.kernel_cache.items()
    q_bnb(x2)
    assert q_bnb.kernel_cache[key][1] is state and absmax is q_bnb.weight_absmax
    # ... and rebuilt when the buffer is replaced (e.g. after .to())
    q_bnb.weight_absmax = q_bnb.weight_absmax.clone()
    q_bnb(x2)
    assert q_bnb.kernel_cache[key][1] is not state


def test_dispatch_rules(monkeypatch):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert kernels._resolve_backend("auto", "nf4", cuda) == "bitsandbytes"
    assert kernels._resolve_backend("auto", "nf4", cpu) == "reference"
    assert kernels._resolve_backend("reference", "nf4", cuda) == "reference"
    assert kernels._resolve_backend("bitsandbytes", "nf4", cpu) == "bitsandbytes"
    with pytest.raises(RuntimeError, match="nf4 only"):
        kernels._resolve_backend("bitsandbytes", "nvfp4", cuda)
    assert QuantizeConfig(fmt="nf4", backend="bitsandbytes").backend == "bitsandbytes"


def test_missing_bitsandbytes_on_cuda_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(qbnb, "available", lambda: (False, "ImportError: No module named 'bitsandbytes'"))
    with pytest.raises(RuntimeError, match="backend='reference'"):
        kernels._resolve_backend("auto", "nf4", torch.device("cuda"))
    with pytest.raises(RuntimeError, match="pip install bitsandbytes"):
        kernels._resolve_backend("bitsandbytes", "nf4", torch.device("cpu"))
    # the reference path needs no bitsandbytes, and auto on the CPU never asks for it
    assert kernels._resolve_backend("reference", "nf4", torch.device("cuda")) == "reference"
    assert kernels._resolve_backend("auto", "nf4", torch.device("cpu")) == "reference"


# ----------------------------------------------------------------------------------------------
# GPU



@pytest.mark.parametrize("m", [1, 8, 256])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_auto_on_cuda_runs_bitsandbytes(m, monkeypatch):
    calls = []
    real = qbnb.linear
    monkeypatch.setattr(qbnb, "linear", lambda *a: calls.append(1) or real(*a))
    n, k = 3584, 18944 // 4
    w, t = nf4_weight(n, k, device="cuda")
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    y = kernels.linear(x, "nf4", t, n, k)  # backend auto
    assert calls, "auto did not go through bitsandbytes"
    ref = kernels.linear_reference(x, "nf4", t, n, k)
    assert float((y.float() - ref.float()).norm() / ref.float().norm()) < 1e-2
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    dx = kernels.grad_input(dy, "nf4", t, n, k)
    dref = kernels.grad_input_reference(dy, "nf4", t, n, k)
    assert float((dx.float() - dref.float()).norm() / dref.float().norm()) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_quantlinear_nf4_cuda_graph_capture():
    lin = torch.nn.Linear(1024, 2048, device="cuda", dtype=torch.bfloat16)
    q = QuantLinear.from_linear(lin, "nf4", lora_rank=8)
    for m in (1, 8):
        x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            eager = q(x)
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                q(x)  # warm-up on a side stream, as torch.cuda.graphs recommends
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = q(x)
            g.replay()
            torch.cuda.synchronize()
        torch.testing.assert_close(out, eager, rtol=0, atol=0)
