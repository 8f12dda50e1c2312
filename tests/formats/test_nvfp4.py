"""NVFP4 against compressed-tensors itself: codes, packed bytes, E4M3 scales, global scale.

The reference is compressed-tensors' own path, composed as llm-compressor does it:
generate_gparam(min, max of the weight, in the weight's dtype) -> calculate_qparams(block
min/max, global_scale) -> NVFP4PackedCompressor.compress -> NVFP4PackedCompressor.decompress.

Run: .venv/bin/python -m pytest tests/formats/test_nvfp4.py -q      (CPU, a few seconds)
"""

import pytest
import torch

from qerl import formats
from qerl.formats import e2m1

try:
    from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam
except ImportError:  # e.g. on a GPU box without it: the self-contained tests still run
    NVFP4PackedCompressor = None
needs_ct = pytest.mark.skipif(NVFP4PackedCompressor is None, reason="compressed-tensors not installed")

if NVFP4PackedCompressor is not None:
    # The NVFP4A16 preset's weight args (scale_dtype makes calculate_qparams round to E4M3).
    CT_ARGS = QuantizationArgs(
        num_bits=4, type="float", strategy="tensor_group", group_size=16, symmetric=True,
        dynamic=False, scale_dtype=torch.float8_e4m3fn,
    )
    CT_SCHEME = QuantizationScheme(targets=["Linear"], weights=CT_ARGS)
    # The scheme ../shared/FORMATS.md names for decompressing what qerl writes.
    DISK_SCHEME = QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(num_bits=4, type="float", strategy="tensor_group", group_size=16,
                                 symmetric=True, dynamic=False),
    )


def ct_quantize(w: torch.Tensor, global_scale: torch.Tensor | None = None) -> dict:
    """compressed-tensors' quantization of w (what an llm-compressor NVFP4A16 export holds)."""
    if global_scale is None:
        mn, mx = torch.aminmax(w)
        global_scale = generate_gparam(mn.reshape(1), mx.reshape(1))
    blocks = w.unflatten(-1, (w.shape[-1] // 16, 16))
    scale, zp = calculate_qparams(blocks.amin(-1), blocks.amax(-1), CT_ARGS, global_scale=global_scale)
    return NVFP4PackedCompressor.compress(
        {"weight": w, "weight_scale": scale, "weight_global_scale": global_scale,
         "weight_zero_point": zp},
        CT_SCHEME,
    )


def adversarial_weight(kind: str, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(KINDS.index(kind))
    w = torch.randn(64, 256, generator=g) * 0.02
    if kind == "gaussian":
        pass
    elif kind == "heavy_tail":  # student-t like, as in real LLM weights
        w = w / torch.rand(64, 256, generator=g).clamp(min=0.02)
    elif kind == "zeros":  # zero rows and zero blocks
        w[3] = 0
        w[5, :16] = 0
        w[6, 240:] = 0
    elif kind == "outlier":  # one huge outlier: most blocks get tiny E4M3 scales
        w[9, 100] = 1e4
        w[10, 17] = -3e3
    elif kind == "tiny_blocks":  # blocks ~1e-6 below the rest: E4M3 scale underflows to 0
        w[7, 32:48] *= 1e-6
        w[8, :64] *= 1e-4
        w[11, 64:80] *= 1e-9
    elif kind == "ties":  # every element exactly on an E2M1 rounding tie (step == 1)
        ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0,
                             5.5, 0.1, 6.0])
        w = ties.repeat(64, 16)
        w[1::2] = -w[1::2]
    elif kind == "all_zero":
        w.zero_()
    else:
        raise ValueError(kind)
    return w.to(dtype)


KINDS = ["gaussian", "heavy_tail", "zeros", "outlier", "tiny_blocks", "ties", "all_zero"]


@needs_ct
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("kind", KINDS)
def test_bit_exact_with_compressed_tensors(kind, dtype):
    w = adversarial_weight(kind, dtype)
    ref = ct_quantize(w)
    got = formats.quantize(w, "nvfp4")
    assert set(got) == {"weight_packed", "weight_scale", "weight_global_scale"}
    assert got["weight_packed"].dtype == torch.uint8 and got["weight_packed"].shape == (64, 128)
    assert got["weight_scale"].dtype == torch.float8_e4m3fn and got["weight_scale"].shape == (64, 16)
    assert got["weight_global_scale"].dtype == torch.float32 and got["weight_global_scale"].shape == (1,)
    assert torch.equal(got["weight_global_scale"], ref["weight_global_scale"])
    assert torch.equal(got["weight_scale"].view(torch.uint8), ref["weight_scale"].view(torch.uint8))
    # Decoded values first (the contract), then bytes: qerl also copies compressed-tensors'
    # sign rule (values < 0 that round to 0 become -0 = 0x8), so the bytes match too.
    ref_dec = NVFP4PackedCompressor.decompress(ref, DISK_SCHEME)["weight"]
    assert torch.equal(formats.dequantize(got, "nvfp4", dtype=torch.bfloat16), ref_dec)
    assert torch.equal(got["weight_packed"], ref["weight_packed"])


@needs_ct
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_decompress_round_trip(dtype):
    """What qerl writes, compressed-tensors reads back to the same values qerl decodes."""
    w = (torch.randn(96, 320, generator=torch.Generator().manual_seed(1)) * 0.05).to(dtype)
    got = formats.quantize(w, "nvfp4")
    dec = NVFP4PackedCompressor.decompress(dict(got), DISK_SCHEME)["weight"]
    assert torch.equal(formats.dequantize(got, "nvfp4", dtype=dec.dtype), dec)
    # And the decoded weight is a faithful 4-bit approximation (random normal: ~20 dB).
    assert formats.sqnr_db(w.float(), dec.float()) > 18


def test_bf16_global_scale_is_computed_in_bf16():
    """For a bf16 weight, compressed-tensors computes 2688/amax in bf16: qerl must too."""
    w = torch.tensor([[0.3] + [0.0] * 15], dtype=torch.bfloat16)
    gs = formats.quantize(w, "nvfp4")["weight_global_scale"]
    assert gs.item() == (torch.tensor(2688.0, dtype=torch.bfloat16) / w.abs().amax()).float().item()
    assert gs.item() != pytest.approx(2688.0 / w.abs().amax().float().item(), rel=1e-5)


def test_e2m1_rounding_table():
    x = torch.tensor([0.0, 0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.01, 6.0, 7.0, 1e9,
                      -0.25, -0.75, -2.5, -5.0, -6.5, -0.1])
    expect = torch.tensor([0.0, 0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 6.0, 6.0,
                           -0.0, -1.0, -2.0, -4.0, -6.0, -0.0])
    codes = e2m1.round_to_e2m1_codes(x)
    assert torch.equal(e2m1.e2m1_codes_to_float(codes), expect)
    # -0.25 and -0.1 round to zero but keep the sign bit (compressed-tensors' encoding).
    assert codes[13].item() == 0x8 and codes[-1].item() == 0x8 and codes[0].item() == 0x0


def test_packing_low_nibble_first():
    # Row amax 6 -> gs = 448, block scale 448, step 1: values are their own E2M1 values.
    w = torch.zeros(1, 16)
    w[0, 0], w[0, 1], w[0, 15] = 0.5, 6.0, -1.0
    t = formats.quantize(w, "nvfp4")
    assert t["weight_global_scale"].item() == 448.0
    assert t["weight_scale"].float()[0, 0].item() == 448.0
    assert t["weight_packed"][0, 0].item() == 0x71  # 0.5 (code 1) low, 6.0 (code 7) high
    assert t["weight_packed"][0, 7].item() == 0xA0  # element 14 = 0 low, -1.0 (0xA) high


@needs_ct
def test_fused_global_scale_matches_ct_and_uses_max_amax():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(64, 128, generator=g) * s for s in (0.02, 0.5, 0.05))
    gs = formats.fused_global_scale([q, k, v])
    assert torch.equal(gs, formats.nvfp4_global_scale(k.abs().amax()))
    for w in (q, k, v):
        got = formats.quantize(w, "nvfp4", global_scale=gs)
        ref = ct_quantize(w, global_scale=gs)
        assert torch.equal(got["weight_global_scale"], gs)
        assert torch.equal(got["weight_scale"].view(torch.uint8), ref["weight_scale"].view(torch.uint8))
        assert torch.equal(got["weight_packed"], ref["weight_packed"])
    # The member with the largest amax reaches the top of the E4M3 range; the others do not.
    assert formats.quantize(k, "nvfp4", global_scale=gs)["weight_scale"].float().max() == 448
    assert formats.quantize(q, "nvfp4", global_scale=gs)["weight_scale"].float().max() < 448


def test_block_scale_saturates_instead_of_nan():
    """A global scale too large for a weight (e.g. a wrong fused scale) clamps to 448, no NaN."""
    w = torch.randn(4, 32, generator=torch.Generator().manual_seed(3))
    t = formats.quantize(w, "nvfp4", global_scale=torch.tensor([1e6]))
    s = t["weight_scale"].float()
    assert torch.isfinite(s).all() and (s == 448).all()


def test_all_zero_weight():
    t = formats.quantize(torch.zeros(8, 32), "nvfp4")
    assert t["weight_global_scale"].item() == 1.0  # compressed-tensors' fallback for inf
    assert (t["weight_scale"].float() == 0.125).all()
    assert (t["weight_packed"] == 0).all()
    assert (formats.dequantize(t, "nvfp4") == 0).all()


def test_shape_and_format_errors():
    with pytest.raises(ValueError, match=r"nvfp4.*16"):
        formats.quantize(torch.randn(4, 40), "nvfp4")
    with pytest.raises(ValueError, match=r"nvfp4.*16"):
        formats.check_shape((4, 8), "nvfp4")
    with pytest.raises(ValueError, match="2-D"):
        formats.quantize(torch.randn(64), "nvfp4")
    with pytest.raises(ValueError, match=r"'int4'.*nvfp4.*mxfp4.*nf4"):
        formats.quantize(torch.randn(4, 64), "int4")
    with pytest.raises(ValueError, match="nvfp4"):
        formats.dequantize({"weight_packed": torch.zeros(4, 8, dtype=torch.uint8)}, "fp8")
    formats.check_shape((4, 48), "nvfp4")  # no error


def test_bits_per_weight():
    assert formats.bits_per_weight("nvfp4") == 4.5
    assert formats.bits_per_weight("mxfp4") == 4.25
    assert formats.bits_per_weight("nf4") == 4.5
    with pytest.raises(ValueError, match="nvfp4"):
        formats.bits_per_weight("fp16")


def test_large_weight_is_fast():
    """Vectorised: a 2048 x 5632 weight (a 1B model's MLP) quantizes in seconds on a CPU."""
    import time

    w = torch.randn(2048, 5632, dtype=torch.bfloat16)
    t0 = time.perf_counter()
    t = formats.quantize(w, "nvfp4")
    formats.dequantize(t, "nvfp4")
    assert time.perf_counter() - t0 < 10.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "nf4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_matches_cpu(fmt, dtype):
    """Every format gives the same bytes and decoded values on CUDA as on the CPU."""
    kinds = ["heavy_tail", "zeros", "outlier", "tiny_blocks", "ties", "all_zero"]
    w = torch.cat([adversarial_weight(k, dtype) for k in kinds])
    cpu = formats.quantize(w, fmt)
    gpu = formats.quantize(w.cuda(), fmt)
    assert set(cpu) == set(gpu)
    for name, t in cpu.items():
        assert gpu[name].device.type == "cuda"
        g = gpu[name].cpu()
        if t.dtype == torch.float8_e4m3fn:
            t, g = t.view(torch.uint8), g.view(torch.uint8)
        assert torch.equal(t, g), name
    assert torch.equal(formats.dequantize(cpu, fmt), formats.dequantize(gpu, fmt).cpu())
    gs = formats.fused_global_scale([w.cuda(), 2 * w.cuda()])
    assert gs.device.type == "cuda"
    if fmt == "nvfp4":
        assert torch.equal(formats.quantize(w.cuda(), fmt, global_scale=gs)["weight_packed"].cpu(),
                           formats.quantize(w, fmt, global_scale=gs.cpu())["weight_packed"])
