"""QuantLinear: outputs and gradients equal a PEFT LoRA on the dequantized dense weight.

Run: python -m pytest tests/test_qlinear.py -q
"""

import copy

import pytest
import torch
import torch.nn as nn

from qerl import formats
from qerl.qlinear import QuantLinear, packed_shapes

FMTS = ["bf16", "nvfp4", "mxfp4", "nf4"]


def _peft_on_dense(q: QuantLinear):
    """A PEFT LoRA wrapping an nn.Linear whose weight is q's dequantized base, with q's A/B."""
    from peft import LoraConfig, get_peft_model

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(q.in_features, q.out_features, bias=q.bias is not None, dtype=torch.bfloat16)

        def forward(self, x):
            return self.proj(x)

    m = M()
    m.proj.weight.data.copy_(q.dequantized_weight(torch.bfloat16))
    if q.bias is not None:
        m.proj.bias.data.copy_(q.bias.data)
    pm = get_peft_model(m, LoraConfig(r=q.r, lora_alpha=q.lora_alpha, target_modules=["proj"], lora_dropout=0.0))
    layer = pm.base_model.model.proj
    layer.lora_A["default"].weight.data.copy_(q.lora_A.weight.data)
    layer.lora_B["default"].weight.data.copy_(q.lora_B.weight.data)
    return pm


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("bias", [False, True])
def test_matches_peft_forward_and_backward(fmt, bias):
    torch.manual_seed(0)
    lin = nn.Linear(128, 64, bias=bias, dtype=torch.bfloat16)
    q = QuantLinear.from_linear(lin, fmt, lora_rank=8, lora_alpha=16, backend="reference")
    with torch.no_grad():
        q.lora_B.weight.normal_(0, 0.02)  # B = 0 at init would hide errors in the adapter path
    pm = _peft_on_dense(q)
    x = torch.randn(3, 5, 128, dtype=torch.bfloat16)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = q(x1), pm(x2)
    assert y1.dtype == y2.dtype == torch.bfloat16
    # our base matmul accumulates in fp32 (reference kernel), nn.Linear in bf16: allow bf16 rounding
    torch.testing.assert_close(y1.float(), y2.float(), rtol=2e-2, atol=2e-2)
    g = torch.randn_like(y1)
    y1.backward(g)
    y2.backward(g)
    torch.testing.assert_close(x1.grad.float(), x2.grad.float(), rtol=2e-2, atol=2e-2)
    layer = pm.base_model.model.proj
    for ours, theirs in [(q.lora_A.weight, layer.lora_A["default"].weight), (q.lora_B.weight, layer.lora_B["default"].weight)]:
        assert ours.grad is not None
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=3e-2, atol=1e-3)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "nf4"])
def test_no_dense_copy_and_only_lora_trainable(fmt):
    lin = nn.Linear(64, 32, bias=False)
    q = QuantLinear.from_linear(lin, fmt, lora_rank=4)
    names = {n for n, _ in q.named_buffers()}
    assert names == set(packed_shapes(fmt, 32, 64))
    assert not any(t.numel() == 32 * 64 and t.is_floating_point() and t.dtype != torch.float8_e4m3fn
                   for t in q.buffers()), "a dense-sized float buffer would be a dense copy"
    assert {n for n, p in q.named_parameters() if p.requires_grad} == {"lora_A.weight", "lora_B.weight"}
    # the packed base equals the format's own quantization of the weight
    ref = formats.quantize(lin.weight.detach(), fmt)
    for k, v in ref.items():
        assert torch.equal(getattr(q, k).view(torch.uint8), v.view(torch.uint8)), k


def test_disable_adapters_gives_base_output():
    lin = nn.Linear(64, 32, bias=False, dtype=torch.bfloat16)
    q = QuantLinear.from_linear(lin, "nvfp4", lora_rank=4, backend="reference")
    nn.init.normal_(q.lora_B.weight)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    with q.disable_adapters():
        y0 = q(x)
    ref = (x.float() @ q.dequantized_weight(torch.float32).T).to(torch.bfloat16)
    torch.testing.assert_close(y0, ref)
    assert not torch.equal(q(x), y0)


def test_bad_inputs():
    with pytest.raises(ValueError, match="unknown base format"):
        QuantLinear(64, 32, fmt="int3")
    with pytest.raises(ValueError, match="16"):
        QuantLinear(40, 32, fmt="nvfp4")
    with pytest.raises(ValueError, match="lora_rank"):
        QuantLinear(64, 32, fmt="nvfp4", lora_rank=-1)


def test_lora_init_matches_peft():
    torch.manual_seed(0)
    q = QuantLinear.from_linear(nn.Linear(64, 32), "bf16", lora_rank=8)
    assert torch.count_nonzero(q.lora_B.weight) == 0
    bound = 1 / 64 ** 0.5  # kaiming_uniform(a=sqrt(5)) on fan_in 64
    assert q.lora_A.weight.abs().max() <= bound and q.lora_A.weight.std() > bound / 3
    _ = copy.deepcopy(q)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@pytest.mark.parametrize("M", [5, 40, 1000])
def test_fused_lora_training_path_matches_the_torch_path(fmt, M):
    """CUDA, bf16 activations, fp32 adapters: the fused LoRA (lora_a / lora_out kernels forward, exact
    bf16 splits on the tensor cores backward) against the torch path (fp32 copies, fp32 GEMMs): the
    output and dx to bf16 rounding, the adapters' gradients to fp32 rounding."""
    from qerl import qlinear

    torch.manual_seed(M)
    lin = torch.nn.Linear(256, 384, bias=True, dtype=torch.bfloat16, device="cuda")
    q = QuantLinear.from_linear(lin, fmt, lora_rank=16, lora_alpha=32)
    with torch.no_grad():
        q.lora_B.weight.normal_(0, 0.05)
    x0 = torch.randn(2, M, 256, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(2, M, 384, device="cuda", dtype=torch.bfloat16)
    res = []
    for fused in (True, False):
        qlinear.FUSED_LORA = fused
        try:
            x = x0.clone().requires_grad_(True)
            q.zero_grad(set_to_none=True)
            y = q(x)
            y.backward(dy)
            res.append((y.detach().float(), x.grad.float(), q.lora_A.weight.grad.clone(), q.lora_B.weight.grad.clone()))
        finally:
            qlinear.FUSED_LORA = True
    (yf, dxf, dAf, dBf), (yt, dxt, dAt, dBt) = res
    torch.testing.assert_close(yf, yt, atol=2e-2, rtol=1e-2)
    assert (yf != yt).float().mean() < 0.02  # one rounding of (almost) the same fp32 sum
    torch.testing.assert_close(dxf, dxt, atol=2e-2, rtol=1e-2)
    for a, b in ((dAf, dAt), (dBf, dBt)):
        assert float((a - b).norm() / b.norm()) < 1e-5
