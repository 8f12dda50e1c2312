"""The decode kernel (bit-exact against qerl.formats.dequantize), the decode + cuBLAS scratch path
(large M, grad-input), the per-layer launch plan (eager host overhead), deterministic split-K.

CPU: the kernels under TRITON_INTERPRET=1 (tests/kernels/conftest.py) at small sizes.
GPU (marker gpu): bit-exactness on large shapes, and a seeded rollout that repeats token for token.
"""

import pytest
import torch

from qerl import formats, kernels

INTERPRET = __import__("os").environ.get("TRITON_INTERPRET", "0") == "1"
if INTERPRET:
    import qerl.kernels.ops  # noqa: F401  (jit while TRITON_INTERPRET=1)
needs_kernels = pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(),
                                   reason="needs TRITON_INTERPRET=1 or a GPU")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _bits(t):
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def _same_bits(a, b):
    """Bit for bit, except that any NaN equals any NaN (payloads may differ)."""
    return a.shape == b.shape and bool(((_bits(a) == _bits(b)) | (a.isnan() & b.isnan())).all())


def _special(t, fmt):
    """Edge scales: NaN, the smallest E4M3 subnormal, E8M0 2^-127. (Not the E4M3 -0 scale 0x80,
    which the quantizer never writes: torch's CUDA cast of it gives +0.0, its CPU cast -0.0, so
    dequantize itself differs by device in the sign of those zeros; the kernel gives -0.0.)"""
    s = t["weight_scale"].view(torch.uint8)
    if fmt == "nvfp4":
        s[1, 1], s[2, 0] = 0x7F, 0x01  # NaN, the smallest subnormal
    else:
        s[0, 0], s[1, 1] = 0, 255  # 2^-127, NaN
    return t


def _decode_configs(fmt):
    """Both decode kernels: element stores (PAIRS off) and int32 pair stores (PAIRS on, bf16 only)."""
    from qerl.kernels import scratch

    base = scratch.DECODE_CONFIG[fmt == "nvfp4"]
    return [dict(base, PAIRS=False), dict(base, PAIRS=True)]


@needs_kernels
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("n,k", [(48, 128), (37, 192), (130, 256)])
@pytest.mark.parametrize("pairs", [False, True])
def test_decode_is_dequantize_bit_for_bit(fmt, n, k, pairs):
    from qerl.kernels import scratch

    t = _special(formats.quantize(torch.randn(n, k, device=DEV) * 0.02, fmt), fmt)
    args = (t["weight_packed"], t["weight_scale"], t.get("weight_global_scale"), fmt == "nvfp4")
    blk = 16 if fmt == "nvfp4" else 32
    cfg = _decode_configs(fmt)[pairs]
    for dt in (torch.bfloat16, torch.float32):
        ref = formats.dequantize(t, fmt, dtype=dt)
        assert _same_bits(scratch.decode(*args, dtype=dt, config=cfg), ref)
        sub = scratch.decode(*args, dtype=dt, rows=(3, n - 1), cols=(blk, k - blk), config=cfg)
        assert _same_bits(sub, ref[3:n - 1, blk:k - blk])
        # into a strided slice of a wider buffer (the scratch's column chunks are such views)
        wide = torch.full((n, k + 2 * blk), float("nan"), dtype=dt, device=DEV)
        scratch.decode(*args, dtype=dt, cols=(blk, k), out=wide[:, 2 * blk:k + blk], config=cfg)
        assert _same_bits(wide[:, 2 * blk:k + blk], ref[:, blk:])
        assert wide[:, :2 * blk].isnan().all() and wide[:, k + blk:].isnan().all()  # nothing written outside
    with pytest.raises(ValueError, match="blocks"):
        scratch.decode(*args, cols=(1, k))


@needs_kernels
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("chunk", [None, 64 * 128 * 4])
def test_scratch_path_matches_reference_and_reuses_one_buffer(fmt, chunk, monkeypatch):
    from qerl.kernels import ops, scratch

    monkeypatch.setattr(scratch, "SCRATCH_CHUNK_BYTES", chunk)
    scratch.release_scratch()
    dt = torch.bfloat16 if DEV == "cuda" else torch.float32
    n, k = 200, 384
    t = formats.quantize(torch.randn(n, k, device=DEV) * 0.02, fmt)
    args = (t["weight_packed"], t["weight_scale"], t.get("weight_global_scale"), fmt == "nvfp4")
    w = formats.dequantize(t, fmt, dtype=torch.float32).double()
    x = torch.randn(2, 5, k, device=DEV, dtype=dt)
    dy = torch.randn(2, 5, n, device=DEV, dtype=dt)
    y = ops.launch_linear(x, *args, kind="scratch")
    dx = ops.launch_grad_input(dy, *args, kind="scratch")
    tol = 1e-2 if dt == torch.bfloat16 else 1e-6
    for out, ref in ((y, x.double() @ w.T), (dx, dy.double() @ w)):
        assert out.shape == ref.shape and out.dtype == dt
        assert float((out.double() - ref).norm() / ref.norm()) < tol
    held = scratch.scratch_bytes(DEV)
    elem = torch.tensor([], dtype=dt).element_size()
    assert 0 < held <= n * k * elem  # one buffer, at most the whole weight
    if chunk is not None:
        assert held < n * k * elem  # chunked: smaller than the weight
    ops.launch_linear(x, *args, kind="scratch")
    assert scratch.scratch_bytes(DEV) == held  # reused, not grown
    scratch.release_scratch()
    assert scratch.scratch_bytes(DEV) == 0


@needs_kernels
def test_scratch_is_chosen_by_m(monkeypatch):
    from qerl.kernels import ops, scratch

    calls = []
    monkeypatch.setattr(scratch, "scratch_linear", lambda *a: calls.append("linear") or a[-1])
    monkeypatch.setattr(scratch, "scratch_grad_input", lambda *a: calls.append("grad") or a[-1])
    t = formats.quantize(torch.randn(64, 128, device=DEV) * 0.02, "nvfp4")
    args = (t["weight_packed"], t["weight_scale"], t["weight_global_scale"], True)
    big = scratch.SCRATCH_MIN_M["linear"]
    ops.launch_linear(torch.randn(big, 128, device=DEV), *args)
    ops.launch_grad_input(torch.randn(scratch.SCRATCH_MIN_M["grad_input"], 64, device=DEV), *args)
    assert calls == ["linear", "grad"]
    ops.launch_linear(torch.randn(1, 128, device=DEV), *args)
    assert calls == ["linear", "grad"]


@needs_kernels
@pytest.mark.parametrize("m", [1, 3, 20])
def test_quantlinear_plan_path(m, monkeypatch):
    """QuantLinear's cached plan: same output as the dispatch point, autograd only when needed,
    rebuilt when the buffers are replaced."""
    from qerl.kernels.plan import Plan
    from qerl.qlinear import QuantLinear

    dt = torch.bfloat16 if DEV == "cuda" else torch.float32
    lin = torch.nn.Linear(128, 48, bias=True, device=DEV, dtype=dt)
    q = QuantLinear.from_linear(lin, "nvfp4", backend="triton")
    x = torch.randn(2, m, 128, device=DEV, dtype=dt)
    ref = kernels.linear(x, "nvfp4", q.packed_tensors(), 48, 128, backend="triton") + q.bias
    y = q(x)
    assert torch.equal(y, ref) and y.grad_fn is not None or not y.requires_grad
    plan = q.__dict__["_plan_state"][2]
    assert isinstance(plan, Plan)
    q(x)
    assert q.__dict__["_plan_state"][2] is plan  # cached
    xg = x.clone().requires_grad_(True)
    q(xg).float().sum().backward()
    dx = kernels.grad_input(torch.ones(2, m, 48, device=DEV, dtype=dt), "nvfp4", q.packed_tensors(), 48, 128,
                            backend="triton")
    assert torch.allclose(xg.grad.float(), dx.float(), rtol=1e-2, atol=1e-3)
    q.weight_packed = q.weight_packed.clone()  # a replaced buffer: a new plan
    q(x)
    assert q.__dict__["_plan_state"][2] is not plan


@needs_kernels
def test_split_k_is_deterministic():
    """Split-K sums the partials in split order: repeated calls agree bit for bit."""
    from qerl.kernels import ops
    n, k = 40, 512
    t = formats.quantize(torch.randn(n, k, device=DEV) * 0.02, "nvfp4")
    args = (t["weight_packed"], t["weight_scale"], t["weight_global_scale"], True)
    x = torch.randn(3, k, device=DEV)
    ys = [ops.launch_linear(x, *args, kind="dot", split_k=4,
                            config=dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, GROUP_M=1, num_warps=4, num_stages=1))
          for _ in range(3)]
    assert all(torch.equal(ys[0], y) for y in ys)


# ---------------------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("n,k", [(18944, 3584), (3584, 18944), (1000, 4128)])
def test_decode_bit_exact_gpu(fmt, n, k):
    from qerl.kernels import scratch

    t = _special(formats.quantize(torch.randn(n, k, device="cuda") * 0.02, fmt), fmt)
    args = (t["weight_packed"], t["weight_scale"], t.get("weight_global_scale"), fmt == "nvfp4")
    for dt in (torch.bfloat16, torch.float32):
        ref = formats.dequantize(t, fmt, dtype=dt)
        for cfg in _decode_configs(fmt):
            assert _same_bits(scratch.decode(*args, dtype=dt, config=cfg), ref), cfg


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_seeded_rollout_repeats_token_for_token(fmt):
    """A rollout with a fixed seed gives the same tokens (and log-probs) twice: the 4-bit kernels'
    split-K reductions run in a fixed order."""
    import importlib.util
    from pathlib import Path

    from qerl.quantize import QuantizeConfig, quantize_
    from qerl.rollout import FastEngine

    spec = importlib.util.spec_from_file_location("_qerl_tests_conftest", Path(__file__).parents[1] / "conftest.py")
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    # wide enough that the decode GEMVs split K over many programs
    model = conftest.make_tiny_model("qwen2", hidden_size=1024, intermediate_size=4096, num_attention_heads=8,
                                     num_key_value_heads=2, vocab_size=512).cuda()
    quantize_(model, QuantizeConfig(fmt=fmt, lora_rank=16))
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14], [20]] * 4
    for graphs in (False, True):
        fe = FastEngine(model, eos_token_ids=[2], pad_id=0, cuda_graphs=graphs, max_seq_len=256)
        a = fe.generate(prompts, 96, temperature=1.0, seed=7, ignore_eos=True)
        b = fe.generate(prompts, 96, temperature=1.0, seed=7, ignore_eos=True)
        assert torch.equal(a.completion_ids, b.completion_ids)
        assert torch.equal(a.logprobs, b.logprobs)


@needs_kernels
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_plan_scratch_fast_path_equals_scratch_path(fmt):
    """Plan.linear / Plan.grad_input at large M keep the decode launch in the plan: bitwise the
    results of the scratch path, the decoded weight is dequantize's, and no scratch is held
    by the plan (release_scratch frees it; the next call decodes into a new one)."""
    from qerl.kernels import ops, scratch
    from qerl.kernels.plan import Plan

    n, k = 256, 384
    t = formats.quantize(torch.randn(n, k, device=DEV) * 0.02, fmt)
    args = (t["weight_packed"], t["weight_scale"], t.get("weight_global_scale"), fmt == "nvfp4")
    plan = Plan(*args)
    for dt in (torch.float32, torch.bfloat16):
        m = max(scratch.SCRATCH_MIN_M["linear"], 130)
        x, dy = torch.randn(m, k, device=DEV).to(dt), torch.randn(m, n, device=DEV).to(dt)
        assert torch.equal(plan.linear(x), ops.launch_linear(x, *args, kind="scratch"))
        assert torch.equal(plan.grad_input(dy), ops.launch_grad_input(dy, *args, kind="scratch"))
        assert _same_bits(plan.decoded(dt), formats.dequantize(t, fmt, dtype=dt))
        scratch.release_scratch()
        assert scratch.scratch_bytes(DEV) == 0
        assert torch.equal(plan.linear(x), ops.launch_linear(x, *args, kind="scratch"))
    scratch.release_scratch()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_plan_direct_launches_gpu(fmt, monkeypatch):
    """The plan's DirectLaunch (second and later calls skip Triton's launch path): bitwise the normal
    launch at every small-M kind, with fresh inputs each call, a misaligned input (falls back), under
    CUDA-graph capture, and for the decode of the large-M path across release_scratch(). The Triton
    kernels only (the tensor-core mma kernel off; its plan launches: tests/kernels/test_mma.py)."""
    from qerl.kernels import mma, ops, scratch
    from qerl.kernels.plan import Plan

    monkeypatch.setattr(mma, "applies", lambda x, k: False)

    n, k = 1000, 4128
    t = formats.quantize(torch.randn(n, k, device="cuda") * 0.02, fmt)
    args = (t["weight_packed"], t["weight_scale"], t.get("weight_global_scale"), fmt == "nvfp4")
    plan = Plan(*args)
    for m in (1, 2, 8, 16, 64):
        for _ in range(3):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            assert torch.equal(plan.linear(x), ops.launch_linear(x, *args)), m
        assert any(key[0] == m and d is not None for key, d in plan._direct.items()), m
        big = torch.randn(m * k + 1, device="cuda", dtype=torch.bfloat16)
        xm = big[1:].view(m, k)  # 2-byte offset: not 16-byte aligned -> the normal launch
        assert torch.equal(plan.linear(xm), ops.launch_linear(xm.contiguous(), *args))
    x = torch.randn(8, k, device="cuda", dtype=torch.bfloat16)
    plan.linear(x)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = plan.linear(x)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, ops.launch_linear(x, *args))
    del g
    xb = torch.randn(300, k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(300, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):
        assert torch.equal(plan.linear(xb), ops.launch_linear(xb, *args, kind="scratch"))
        assert torch.equal(plan.grad_input(dy), ops.launch_grad_input(dy, *args, kind="scratch"))
        scratch.release_scratch()
        assert scratch.scratch_bytes("cuda") == 0 and not plan._decode
