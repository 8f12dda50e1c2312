"""NF4 (QLoRA's 4-bit NormalFloat) in pure torch, code-for-code with bitsandbytes.

Follows bitsandbytes' `quantize_4bit(quant_type="nf4", blocksize=64)` (its default torch
backend, docs/formats.md "NF4"):
  - blocks of 64 over the FLATTENED row-major tensor, fp32 absmax per block;
  - scaled = clamp(x * (1 / max(absmax, 1e-38)), -1, 1)   (a reciprocal multiply, in fp32);
  - code = nearest of the 16 NF4 values; a value exactly on a midpoint goes to the LOWER code
    (`torch.bucketize(..., right=False)` over the fp32 midpoints);
  - packing is the OPPOSITE of NVFP4/MXFP4: element 2j in the HIGH nibble.
No double quantization (the absmax stays fp32): 4 + 32/64 = 4.5 bits per weight. The honest
QLoRA baseline is bitsandbytes itself; this module is the CPU/GPU reference and the format the
`nf4` QuantLinear stores.
"""

import functools

import torch

from qerl.formats.e2m1 import gather_pairs, pair_table
from qerl.formats.registry import FormatSpec

BLOCK_SIZE = 64
# bitsandbytes' name for this code (its quant_type argument): the NF4 bytes are bitsandbytes' bytes
BNB_QUANT_TYPE = "nf4"

NF4_CODE = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)


def check_shape(shape) -> None:
    """ValueError unless `shape` is 2-D [out, in] with in % 64 == 0.

    bitsandbytes blocks the flattened tensor, so only out*in % 64 matters to it; qerl asks for
    in % 64 == 0 so that every block lies inside one row and the packed tensor is [out, in/2].
    """
    shape = tuple(shape)
    if len(shape) != 2:
        raise ValueError(f"nf4 quantizes 2-D Linear weights [out, in], got shape {shape}")
    if shape[1] % BLOCK_SIZE != 0:
        raise ValueError(
            f"nf4 needs in_features % {BLOCK_SIZE} == 0 (block size {BLOCK_SIZE}), got shape {shape}"
        )


@functools.lru_cache(maxsize=None)
def _code(device) -> torch.Tensor:
    # Cached per device: building it is a host-to-device copy, i.e. a sync on every matmul.
    return torch.tensor(NF4_CODE, dtype=torch.float32, device=device)


def quantize(w: torch.Tensor, global_scale: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Quantize a weight [out, in] to NF4.

    Returns {"weight_packed": uint8 [out, in/2] (high nibble first over the flattened
    tensor), "weight_absmax": float32 [out*in/64]}. NF4 has no global scale.
    """
    if global_scale is not None:
        raise ValueError("nf4 has no global scale (only nvfp4 does); pass global_scale=None")
    check_shape(w.shape)
    if not w.is_floating_point():
        raise ValueError(f"nf4 quantize expects a floating-point weight, got {w.dtype}")
    out_f, in_f = w.shape
    blocks = w.reshape(-1, BLOCK_SIZE).float()
    absmax = blocks.abs().amax(dim=-1)
    scaled = torch.clamp(blocks * (1.0 / absmax.clamp(min=1e-38)).unsqueeze(-1), -1, 1)
    code = _code(w.device)
    midpoints = (code[:-1] + code[1:]) / 2
    q = torch.bucketize(scaled, midpoints, out_int32=True).to(torch.uint8).reshape(out_f, in_f)
    return {
        "weight_packed": (q[:, 0::2] << 4) | q[:, 1::2],
        "weight_absmax": absmax,
    }


def dequantize(tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Decode {"weight_packed", "weight_absmax"} to a dense [out, in]: code * absmax in fp32."""
    packed = tensors["weight_packed"]
    absmax = tensors["weight_absmax"].to(torch.float32).reshape(-1)
    out_f, half = packed.shape
    in_f = 2 * half
    if absmax.numel() * BLOCK_SIZE != out_f * in_f:
        raise ValueError(
            f"nf4 weight_absmax has {absmax.numel()} blocks, expected {out_f * in_f // BLOCK_SIZE} "
            f"for weight_packed {tuple(packed.shape)}"
        )
    # One gather through a [256, 2] table (high nibble first) instead of unpack + lookup.
    table = pair_table(_code(packed.device), high_first=True)
    values = gather_pairs(table, packed).reshape(-1, BLOCK_SIZE) * absmax.unsqueeze(-1)
    return values.reshape(out_f, in_f).to(dtype)


def packed_shapes(out_features: int, in_features: int) -> dict:
    """{name: (shape, dtype)} of the packed tensors of one weight [out, in]."""
    return {
        "weight_packed": ((out_features, in_features // 2), torch.uint8),
        "weight_absmax": ((out_features * in_features // BLOCK_SIZE,), torch.float32),
    }


def export_config(targets, ignore) -> dict:
    """A qerl-specific quantization_config: vLLM and transformers do not read nf4 checkpoints."""
    return {
        "quant_method": "qerl", "format": "nf4-pack-quantized",
        "block_size": BLOCK_SIZE, "double_quant": False,
        "packing": "two codes per byte, element 2j in the HIGH nibble (bitsandbytes order) "
                   "over the flattened row-major weight; weight_absmax float32 per block",
        "targets": list(targets), "ignore": list(ignore),
        "note": "qerl-specific: vLLM and transformers do not read this format; load it "
                "with qerl (qerl.formats.dequantize(..., 'nf4')).",
    }


SPEC = FormatSpec(
    name="nf4", block_size=BLOCK_SIZE,
    bits_per_weight=4 + 32 / BLOCK_SIZE,  # fp32 absmax per block, no double quantization
    tensor_names=("weight_packed", "weight_absmax"),
    packed_shapes=packed_shapes, quantize=quantize, dequantize=dequantize, export_config=export_config,
    kernels=("bitsandbytes",), check_shape=check_shape,
    code="nf4", scale_kind="absmax",
)
