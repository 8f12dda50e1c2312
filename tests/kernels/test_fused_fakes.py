"""The fused decode-step ops (qerl.kernels.fused) under torch.compile: each ``custom_op`` has a fake
(its outputs' shapes without a launch), traces whole (fullgraph) and, compiled, returns what it
returns eagerly; ``torch.library.opcheck`` checks each fake against the kernel.

On the CPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py sets it); ``aot_eager``
traces with fake tensors, so a missing or wrong fake fails here without a GPU.

Run: OMP_NUM_THREADS=1 python -m pytest tests/kernels/test_fused_fakes.py -q   (about 20 s)
"""

import pytest
import torch
from torch._library.custom_ops import CustomOpDef

from qerl.kernels import fused

BF = torch.bfloat16
pytestmark = pytest.mark.skipif(not fused.INTERPRETED, reason="the CPU runs these kernels under TRITON_INTERPRET=1")


def _ops() -> dict[str, CustomOpDef]:
    return {n: o for n, o in vars(fused).items() if isinstance(o, CustomOpDef)}


def _lora(M, n=2, R=8, K=64, Ns=(48, 32)):
    torch.manual_seed(0)
    x = torch.randn(M, K, dtype=BF)
    As = [torch.randn(R, K) / K ** 0.5 for _ in range(n)]
    Bs = [torch.randn(N, R) for N in Ns[:n]]
    bs = [torch.randn(N, dtype=BF) for N in Ns[:n]]
    return x, As, Bs, bs


def _cases():
    """(op name, a function of fresh inputs calling it and returning what it wrote, the inputs)."""
    torch.manual_seed(0)
    M, N = 4, 64
    res, delta, w = torch.randn(M, N, dtype=BF), torch.randn(M, N, dtype=BF), 1 + 0.1 * torch.randn(N, dtype=BF)
    x2, As, Bs, bs = _lora(2)
    x16, As16, Bs16, _ = _lora(16)
    h16 = fused.lora_a(x16, As16)[:, :, :8].contiguous()  # the first adapter's final sums [1, 16, r]
    y16 = torch.randn(16, 48, dtype=BF)
    B, NH, NKV, D, L = 2, 4, 2, 16, 8
    q, k, v = (torch.randn(B, n * D, dtype=BF) for n in (NH, NKV, NKV))
    ang = torch.rand(B, D // 2) * 6
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(BF), torch.cat([ang.sin()] * 2, -1).to(BF)
    kc, vc = (torch.randn(B, NKV, L, D, dtype=BF) for _ in range(2))
    h = fused.lora_a(x2, As)
    g, u = torch.randn(2, 48, dtype=BF), torch.randn(2, 48, dtype=BF)
    ys = [torch.randn(2, 48, dtype=BF), torch.randn(2, 32, dtype=BF)]
    gu = [torch.randn(2, 48, dtype=BF), torch.randn(2, 48, dtype=BF)]
    Bs_gu = [torch.randn(48, 8), torch.randn(48, 8)]
    A_next = torch.randn(5, 48)  # down_proj's LoRA A

    def rope(q, k, v, cos, sin, kc, vc):
        out = fused.rope_cache_write(q, k, v, cos, sin, kc, vc, torch.tensor([5]), None, None, 1e-6)
        return out, kc, vc

    hq = torch.randn(1, B, 3 * 8)
    Bs_qkv = [torch.randn(n * D, 8) for n in (NH, NKV, NKV)]

    def lora_rope(q, k, v, kc, vc):
        out = fused.lora_rope_cache_write(q, k, v, hq, Bs_qkv, [], 2.0, cos, sin, kc, vc, torch.tensor([5]), None,
                                          None, 1e-6)
        return out, kc, vc

    def lora_out(y0, y1, h):
        fused.lora_out([y0, y1], h, Bs, bs, 2.0)
        return y0, y1

    return [
        ("rmsnorm", lambda x, w: fused.rmsnorm(x, w, 1e-6), (res, w)),
        ("add_rmsnorm", lambda r, d, w: fused.add_rmsnorm(r, d, w, 1e-6), (res, delta, w)),
        ("add_rmsnorm_lora_a", lambda r, d, w: fused.add_rmsnorm_lora_a(r, d, w, 1e-6, [a.to(BF) for a in As]),
         (torch.randn(M, 64, dtype=BF), torch.randn(M, 64, dtype=BF), 1 + 0.1 * torch.randn(64, dtype=BF))),
        ("rope_cache_write", rope, (q, k, v, cos, sin, kc, vc)),
        ("silu_mul", fused.silu_mul, (g, u)),
        ("lora_a", lambda x: fused.lora_a(x, As), (x2,)),
        ("lora_a", lambda x: fused.lora_a(x, As16), (x16,)),  # from LORA_A_DOT_MIN_M rows: the tiled kernel
        ("lora_out", lora_out, (*ys, h)),
        ("lora_out_to", lambda y, h16: fused.lora_out_to(y, h16, Bs16[0], 2.0), (y16, h16)),
        ("lora_silu_mul", lambda g, u, h: fused.lora_silu_mul(g, u, h, Bs_gu, [], 2.0), (*gu, h)),
        ("lora_rope_cache_write", lora_rope, (q, k, v, kc, vc)),
        ("lora_silu_mul_lora_a", lambda g, u, h: fused.lora_silu_mul_lora_a(g, u, h, Bs_gu, [], 2.0, A_next), (*gu, h)),
    ]


def test_every_fused_op_has_a_fake():
    ops = _ops()
    assert len(ops) >= 8
    missing = sorted(n for n, o in ops.items() if getattr(o, "_abstract_fn", None) is None)
    assert not missing, f"custom ops of qerl/kernels/fused.py without register_fake: {missing}"
    assert {name for name, _, _ in _cases()} == set(ops), "a fused op has no case in this test"


# The case names for the parametrisation: building the cases runs a kernel (lora_a), which on a GPU machine
# (no interpreter) would fail at collection on CPU tensors; there the module is skipped anyway.
_CASE_NAMES = [n for n, _, _ in _cases()] if fused.INTERPRETED else []


@pytest.mark.parametrize("case", range(len(_CASE_NAMES)), ids=[f"{n}-{i}" for i, n in enumerate(_CASE_NAMES)])
def test_fused_op_traces_under_torch_compile(case):
    """fullgraph aot_eager (fake-tensor tracing, then the kernels) returns what the eager call returns."""
    torch._dynamo.reset()
    _, fn, args = _cases()[case]
    eager = fn(*(a.clone() for a in args))
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)(*(a.clone() for a in args))
    eager, compiled = (t if isinstance(t, tuple) else (t,) for t in (eager, compiled))
    assert len(eager) == len(compiled)
    for e, c in zip(eager, compiled):
        assert e.shape == c.shape and e.dtype == c.dtype
        torch.testing.assert_close(c, e, rtol=0, atol=0)


def test_the_fakes_agree_with_the_kernels():
    """opcheck's fake-tensor test: each fake gives the kernel's output shapes, dtypes and strides."""
    x2, As, Bs, bs = _lora(2)
    h = fused.lora_a(x2, As)
    res, w = torch.randn(3, 64, dtype=BF), 1 + 0.1 * torch.randn(64, dtype=BF)
    checks = [
        (torch.ops.qerl.rmsnorm.default, (res, w, 1e-6)),
        (torch.ops.qerl.add_rmsnorm.default, (res, res.clone(), w, 1e-6)),
        (torch.ops.qerl.add_rmsnorm_lora_a.default, (res, None, w, 1e-6, [a.to(BF) for a in As])),
        (torch.ops.qerl.silu_mul.default, (res, res.clone())),
        (torch.ops.qerl.lora_a.default, (x2, As)),
        (torch.ops.qerl.lora_out.default, ([torch.randn(2, 48, dtype=BF), torch.randn(2, 32, dtype=BF)], h, Bs, bs,
                                           2.0)),
        (torch.ops.qerl.lora_silu_mul.default, (torch.randn(2, 48, dtype=BF), torch.randn(2, 48, dtype=BF), h,
                                                [Bs[0], Bs[0]], [], 2.0)),
        (torch.ops.qerl.lora_out_to.default, (torch.randn(2, 48, dtype=BF), h[:, :, :8].contiguous(), Bs[0], 2.0)),
    ]
    for op, args in checks:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
