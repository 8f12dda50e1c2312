"""MXFP4 (OCP MX v1.0, FLOOR scale rule): known answers, edge cases, an independent
brute-force reference, and the on-disk layout read back by compressed-tensors' MXFP4 compressor.

Run: .venv/bin/python -m pytest tests/formats/test_mxfp4.py -q      (CPU, a few seconds)
"""

import math

import pytest
import torch

from qerl import formats

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def brute_force_mxfp4(w: torch.Tensor) -> torch.Tensor:
    """Independent reference in float64: exponent from log2 (exact enough in float64 for fp32
    inputs), value by exhaustive nearest search over the 8 magnitudes, ties to the even code
    (mantissa bit 0: 0, 1.0, 2.0, 4.0)."""
    b = w.double().reshape(-1, 32)
    amax = b.abs().amax(dim=1, keepdim=True)
    e = (torch.floor(torch.log2(amax)) - 2).clamp(-127, 127)
    e = torch.where(amax == 0, torch.full_like(e, -127.0), e)
    v = (b / 2.0**e).abs().clamp(max=6.0)
    d = (v[..., None] - E2M1).abs()  # [blocks, 32, 8]
    nearest = d == d.min(dim=-1, keepdim=True).values
    idx = (nearest.double() * torch.tensor([2.0, 1.0] * 4, dtype=torch.float64)).argmax(dim=-1)
    return (torch.sign(b) * E2M1[idx] * 2.0**e).reshape(w.shape)


def test_known_answer_and_packing():
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1], w[0, 2], w[0, 3] = 6.0, 0.5, -1.0, 3.0
    t = formats.quantize(w, "mxfp4")
    assert set(t) == {"weight_packed", "weight_scale"}
    assert t["weight_packed"].dtype == torch.uint8 and t["weight_packed"].shape == (1, 16)
    assert t["weight_scale"].dtype == torch.uint8 and t["weight_scale"].shape == (1, 1)
    assert t["weight_scale"].item() == 127  # floor(log2 6) - 2 = 0
    assert t["weight_packed"][0, 0].item() == 0x17  # 6.0 (7) low nibble, 0.5 (1) high
    assert t["weight_packed"][0, 1].item() == 0x5A  # -1.0 (0xA) low, 3.0 (5) high
    assert torch.equal(formats.dequantize(t, "mxfp4", dtype=torch.float32), w)


def test_zero_block_gets_byte_zero():
    w = torch.randn(2, 64)
    w[0, 32:] = 0
    t = formats.quantize(w, "mxfp4")
    assert t["weight_scale"][0, 1].item() == 0
    assert (t["weight_packed"][0, 16:] == 0).all()
    assert (formats.dequantize(t, "mxfp4")[0, 32:] == 0).all()
    assert (t["weight_scale"][1] != 0).all()


def test_floor_rule_saturates_top_of_binade():
    # amax 7.9: floor(log2) = 2 -> e = 0, so 7.9 saturates to 6 (the FLOOR rule's known cost);
    # amax 8.0 moves to e = 1.
    w = torch.zeros(2, 32)
    w[0, 0], w[0, 1] = 7.9, -7.0
    w[1, 0] = 8.0
    t = formats.quantize(w, "mxfp4")
    assert t["weight_scale"][:, 0].tolist() == [127, 128]
    d = formats.dequantize(t, "mxfp4", dtype=torch.float32)
    assert d[0, 0].item() == 6.0 and d[0, 1].item() == -6.0 and d[1, 0].item() == 8.0


def test_ties_round_to_even():
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    expect = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    w = torch.zeros(1, 32)
    w[0, 0] = 6.0  # e = 0: elements are their own E2M1 values
    w[0, 1:8] = torch.tensor(ties)
    w[0, 8:15] = -torch.tensor(ties)
    d = formats.dequantize(formats.quantize(w, "mxfp4"), "mxfp4", dtype=torch.float32)
    assert d[0, 1:8].tolist() == expect
    assert d[0, 8:15].tolist() == [-x for x in expect]


def test_exponent_clamps():
    w = torch.zeros(3, 32)
    w[0, 0] = 2.0**-140  # floor(log2) - 2 = -142 -> clamped to -127 (byte 0)
    w[1, 0] = 3.0e38  # near fp32 max: e = 127 - 2 = 125
    w[2, 0] = 2.0**-125  # e = -127 exactly: 2^-125 = 4 * 2^-127
    t = formats.quantize(w, "mxfp4")
    assert t["weight_scale"][:, 0].tolist() == [0, 252, 0]
    d = formats.dequantize(t, "mxfp4", dtype=torch.float32)
    assert d[0, 0].item() == 0.0  # 2^-140 * 2^127 = 2^-13 rounds to 0
    assert d[1, 0].item() == 6.0 * 2.0**125 and math.isfinite(d[1, 0].item())
    assert d[2, 0].item() == 2.0**-125


def test_nan_scale_byte_decodes_to_nan():
    t = formats.quantize(torch.ones(1, 32), "mxfp4")
    t["weight_scale"][0, 0] = 0xFF
    assert torch.isnan(formats.dequantize(t, "mxfp4")).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_brute_force_reference(dtype):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 256, generator=g) * 0.03
    w[2] /= torch.rand(256, generator=g).clamp(min=0.01)  # heavy tail
    w[3, :32] *= 1e-30
    w = w.to(dtype)
    got = formats.dequantize(formats.quantize(w, "mxfp4"), "mxfp4", dtype=torch.float32)
    assert torch.equal(got.double(), brute_force_mxfp4(w))


def test_round_trip_is_idempotent_and_accurate():
    w = torch.randn(64, 512, generator=torch.Generator().manual_seed(1)) * 0.02
    t = formats.quantize(w, "mxfp4")
    d = formats.dequantize(t, "mxfp4", dtype=torch.float32)
    t2 = formats.quantize(d, "mxfp4")
    # Same scales and values; only the codes of -0 differ (a negative input that rounded to
    # zero keeps its sign bit, a decoded -0.0 does not).
    assert torch.equal(t2["weight_scale"], t["weight_scale"])
    assert torch.equal(formats.dequantize(t2, "mxfp4", dtype=torch.float32), d)
    differ = t2["weight_packed"] != t["weight_packed"]
    assert differ.any() and ((t2["weight_packed"] ^ t["weight_packed"])[differ] & 0x77 == 0).all()
    assert 14 < formats.sqnr_db(w, d) < 22  # MXFP4 on Gaussian weights: ~17 dB


def test_layout_matches_compressed_tensors_decompress():
    """compressed-tensors' "mxfp4-pack-quantized" reader decodes qerl's tensors identically."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.mxfp4 import MXFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationScheme, preset_name_to_scheme

    scheme = preset_name_to_scheme("MXFP4A16", ["Linear"])
    assert isinstance(scheme, QuantizationScheme)
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(2)) * 0.05
    t = formats.quantize(w, "mxfp4")
    dec = MXFP4PackedCompressor.decompress(dict(t), scheme)["weight"]
    assert torch.equal(formats.dequantize(t, "mxfp4", dtype=dec.dtype), dec)


def test_errors():
    with pytest.raises(ValueError, match=r"mxfp4.*32"):
        formats.quantize(torch.randn(4, 48), "mxfp4")
    with pytest.raises(ValueError, match="global scale"):
        formats.quantize(torch.randn(4, 64), "mxfp4", global_scale=torch.tensor([1.0]))
