"""NF4 against bitsandbytes itself (quantize_4bit / dequantize_4bit, quant_type="nf4",
blocksize=64, on the CPU): packed codes, absmax, decoded values, and the midpoint rule.

Run: .venv/bin/python -m pytest tests/formats/test_nf4.py -q      (CPU, a few seconds)
"""

import pytest
import torch

from qerl import formats
from qerl.formats import nf4

try:
    import bitsandbytes.functional as bnbf
except ImportError:  # the self-contained tests below still run
    bnbf = None
needs_bnb = pytest.mark.skipif(bnbf is None, reason="bitsandbytes not installed")


def bnb_quantize(w: torch.Tensor):
    packed, state = bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4")
    return packed, state


def weight(kind: str, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(["gaussian", "heavy_tail", "zeros", "outlier"].index(kind))
    w = torch.randn(48, 256, generator=g) * 0.02
    if kind == "heavy_tail":
        w = w / torch.rand(48, 256, generator=g).clamp(min=0.02)
    elif kind == "zeros":
        w[1] = 0
        w[2, 64:128] = 0
    elif kind == "outlier":
        w[4, 3] = 1e4
        w[5, 70:80] *= 1e-7
    return w.to(dtype)


@needs_bnb
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["gaussian", "heavy_tail", "zeros", "outlier"])
def test_same_codes_and_absmax_as_bitsandbytes(kind, dtype):
    w = weight(kind, dtype)
    packed, state = bnb_quantize(w)
    t = formats.quantize(w, "nf4")
    assert set(t) == {"weight_packed", "weight_absmax"}
    assert t["weight_packed"].dtype == torch.uint8 and t["weight_packed"].shape == (48, 128)
    assert t["weight_absmax"].dtype == torch.float32 and t["weight_absmax"].shape == (48 * 256 // 64,)
    # bitsandbytes stores [n/2, 1] over the flattened tensor: same bytes in row-major order.
    assert torch.equal(t["weight_packed"].reshape(-1), packed.reshape(-1))
    assert torch.equal(t["weight_absmax"], state.absmax)
    # bitsandbytes decodes to the input's dtype (its CPU kernel for fp32/bf16).
    ref = bnbf.dequantize_4bit(packed, state)
    assert ref.dtype == dtype
    assert torch.equal(formats.dequantize(t, "nf4", dtype=dtype), ref)


@needs_bnb
def test_code_table_is_bitsandbytes():
    from bitsandbytes.functional import get_4bit_type

    assert torch.equal(torch.tensor(nf4.NF4_CODE, dtype=torch.float32), get_4bit_type("nf4", device="cpu"))


@needs_bnb
def test_midpoints_go_to_the_lower_code():
    code = torch.tensor(nf4.NF4_CODE, dtype=torch.float32)
    mid = (code[:-1] + code[1:]) / 2  # fp32, as bitsandbytes computes them
    w = torch.zeros(1, 64)
    w[0, 0] = 1.0  # absmax 1: scaled values are the inputs themselves
    w[0, 1:16] = mid
    w[0, 16:31] = torch.nextafter(mid, torch.full_like(mid, 2.0))  # just above: upper code
    t = formats.quantize(w, "nf4")
    idx = torch.stack((t["weight_packed"][0] >> 4, t["weight_packed"][0] & 0xF), -1).reshape(-1)
    assert idx[1:16].tolist() == list(range(0, 15))
    assert idx[16:31].tolist() == list(range(1, 16))
    packed, _ = bnb_quantize(w)
    assert torch.equal(t["weight_packed"].reshape(-1), packed.reshape(-1))


def test_high_nibble_first():
    w = torch.zeros(1, 64)
    w[0, 0], w[0, 1] = -1.0, 1.0  # codes 0 and 15
    t = formats.quantize(w, "nf4")
    assert t["weight_packed"][0, 0].item() == 0x0F
    assert t["weight_packed"][0, 1].item() == 0x77  # zeros are code 7


def test_zero_block_and_errors():
    t = formats.quantize(torch.zeros(2, 64), "nf4")
    assert (t["weight_absmax"] == 0).all() and (t["weight_packed"] == 0x77).all()
    assert (formats.dequantize(t, "nf4") == 0).all()
    with pytest.raises(ValueError, match=r"nf4.*64"):
        formats.quantize(torch.randn(4, 96), "nf4")
    with pytest.raises(ValueError, match="global scale"):
        formats.quantize(torch.randn(4, 64), "nf4", global_scale=torch.tensor([1.0]))


def test_sqnr_sane():
    w = torch.randn(64, 512, generator=torch.Generator().manual_seed(3)) * 0.02
    d = formats.dequantize(formats.quantize(w, "nf4"), "nf4", dtype=torch.float32)
    assert 18 < formats.sqnr_db(w, d) < 24  # NF4 on Gaussian weights: ~20-21 dB
