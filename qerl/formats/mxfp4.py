"""MXFP4 (OCP Microscaling v1.0) in pure torch, FLOOR scale rule.

Layout (docs/formats.md, "MXFP4"), as compressed-tensors' "mxfp4-pack-quantized":
E2M1 elements in blocks of 32 along the last dim of a Linear weight [out, in], packed two per
byte (element 2j in the LOW nibble); one E8M0 scale per block stored as uint8, value
2^(byte - 127) (0xFF is NaN and never produced here). No global scale.

Scale rule: FLOOR, the OCP spec's and torchao's default:
    e = floor(log2(block_amax)) - 2      (2 = floor(log2(6)), E2M1's largest exponent)
    e = clamp(e, -127, 127); byte = e + 127; a zero block gets byte 0
    q = e2m1(x * 2^-e)                   nearest-even, saturating at +-6
With FLOOR, block amaxes in [6, 8) * 2^e saturate to 6 (up to 25% error on the largest
element); compressed-tensors' EVEN rule instead rounds the amax up first. qerl uses FLOOR.
All arithmetic is fp32 and every power of two is built from its bits, so it is exact on CPU
and GPU alike.
"""

import torch

from qerl.formats.e2m1 import decode_packed_e2m1, pack_e2m1, round_to_e2m1_codes
from qerl.formats.registry import FormatSpec, compressed_tensors_config

BLOCK_SIZE = 32
E8M0_BIAS = 127
# floor(log2(6)): the exponent of E2M1's largest normal value.
E2M1_EMAX = 2


def check_shape(shape) -> None:
    """ValueError unless `shape` is 2-D [out, in] with in % 32 == 0."""
    shape = tuple(shape)
    if len(shape) != 2:
        raise ValueError(f"mxfp4 quantizes 2-D Linear weights [out, in], got shape {shape}")
    if shape[1] % BLOCK_SIZE != 0:
        raise ValueError(
            f"mxfp4 needs in_features % {BLOCK_SIZE} == 0 (block size {BLOCK_SIZE} along the "
            f"last dim), got shape {shape}"
        )


def _exp2_int(k: torch.Tensor) -> torch.Tensor:
    """Exact fp32 2^k for integer k in [-149, 127], built from the bit pattern.

    Avoids relying on exp2/pow being exact (they need not be on every device), and covers
    the fp32 subnormals that 2^-127 needs.
    """
    k = k.to(torch.int32)
    normal = (k + 127).clamp(min=1) << 23
    subnormal = torch.ones_like(k) << (k + 149).clamp(0, 22)
    bits = torch.where(k >= -126, normal, subnormal)
    return bits.view(torch.float32)


def quantize(w: torch.Tensor, global_scale: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Quantize a weight [out, in] to MXFP4 (FLOOR rule).

    Returns {"weight_packed": uint8 [out, in/2], "weight_scale": uint8 E8M0 [out, in/32]}.
    `global_scale` is not part of MXFP4; passing one is an error.
    """
    if global_scale is not None:
        raise ValueError("mxfp4 has no global scale (only nvfp4 does); pass global_scale=None")
    check_shape(w.shape)
    if not w.is_floating_point():
        raise ValueError(f"mxfp4 quantize expects a floating-point weight, got {w.dtype}")
    out_f, in_f = w.shape
    blocks = w.reshape(out_f, in_f // BLOCK_SIZE, BLOCK_SIZE).float()
    amax = blocks.abs().amax(dim=-1)
    # frexp: amax = m * 2^E with m in [0.5, 1), so floor(log2(amax)) = E - 1, exactly
    # (log2 in floating point can land on the wrong side of a power of two).
    _, exponent = torch.frexp(amax)
    e = (exponent.to(torch.int32) - 1 - E2M1_EMAX).clamp(-E8M0_BIAS, E8M0_BIAS)
    e = torch.where(amax == 0, torch.full_like(e, -E8M0_BIAS), e)
    codes = round_to_e2m1_codes(blocks * _exp2_int(-e).unsqueeze(-1)).reshape(out_f, in_f)
    return {
        "weight_packed": pack_e2m1(codes),
        "weight_scale": (e + E8M0_BIAS).to(torch.uint8),
    }


def dequantize(tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Decode {"weight_packed", "weight_scale"} to a dense [out, in]: q * 2^(byte-127) in fp32.

    A scale byte of 0xFF (E8M0 NaN) decodes its whole block to NaN.
    """
    packed = tensors["weight_packed"]
    scale = tensors["weight_scale"]
    out_f, half = packed.shape
    in_f = 2 * half
    if scale.shape != (out_f, in_f // BLOCK_SIZE) or scale.dtype != torch.uint8:
        raise ValueError(
            f"mxfp4 weight_scale must be uint8 {(out_f, in_f // BLOCK_SIZE)} for weight_packed "
            f"{tuple(packed.shape)}, got {scale.dtype} {tuple(scale.shape)}"
        )
    q = decode_packed_e2m1(packed).reshape(out_f, in_f // BLOCK_SIZE, BLOCK_SIZE)
    step = _exp2_int(scale.to(torch.int32) - E8M0_BIAS)
    step = torch.where(scale == 0xFF, torch.full_like(step, float("nan")), step)
    return (q * step.unsqueeze(-1)).reshape(out_f, in_f).to(dtype)


def packed_shapes(out_features: int, in_features: int) -> dict:
    """{name: (shape, dtype)} of the packed tensors of one weight [out, in]."""
    return {
        "weight_packed": ((out_features, in_features // 2), torch.uint8),
        "weight_scale": ((out_features, in_features // BLOCK_SIZE), torch.uint8),
    }


def export_config(targets, ignore) -> dict:
    """compressed-tensors "mxfp4-pack-quantized" (docs/formats.md)."""
    weights = {"num_bits": 4, "type": "float", "strategy": "group", "group_size": BLOCK_SIZE,
               "symmetric": True, "dynamic": False, "scale_dtype": "uint8"}
    return compressed_tensors_config("mxfp4", weights, ignore)


SPEC = FormatSpec(
    name="mxfp4", block_size=BLOCK_SIZE, bits_per_weight=4 + 8 / BLOCK_SIZE,
    tensor_names=("weight_packed", "weight_scale"),
    packed_shapes=packed_shapes, quantize=quantize, dequantize=dequantize, export_config=export_config,
    kernels=("triton",), check_shape=check_shape,
    code="e2m1", scale_kind="e8m0",
)
