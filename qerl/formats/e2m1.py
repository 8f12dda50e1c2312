"""E2M1, the 4-bit float element shared by NVFP4 and MXFP4 (../shared/FORMATS.md, "E2M1").

1 sign bit, 2 exponent bits (bias 1), 1 mantissa bit, no Inf/NaN. Codes 0..7 are
0, 0.5, 1, 1.5, 2, 3, 4, 6; codes 8..15 are their negatives (0x8 is -0).

Packing (NVFP4 and MXFP4, as in compressed-tensors, torchao, modelopt and Triton's
`tl.dot_scaled`): byte j of a row holds element 2j in the LOW nibble and 2j+1 in the HIGH
nibble. NF4 packs the other way round and has its own code in nf4.py.
"""

import torch

F4_E2M1_MAX = 6.0

# Magnitudes of codes 0..7; the table is tiny, so it is copied to the input's device per call.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def round_to_e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """Round already-scaled values to E2M1 codes (uint8 in 0..15), same shape as `v`.

    Nearest, ties to even, saturating at +-6 (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2,
    3.5->4, 5->4, >5->6). The thresholds and their strict/non-strict comparisons are those of
    compressed-tensors' `cast_to_fp4`, so codes agree bit for bit. The sign bit is set for
    v < 0 (including values that round to zero, giving -0 = 0x8), again as compressed-tensors
    does; v == -0.0 gets +0. NaN maps to +0.
    """
    a = v.abs()
    # Counting the thresholds each magnitude passes gives the index into E2M1_VALUES.
    # `>` where a tie rounds down to an even code, `>=` where it rounds up to one.
    idx = (
        (a > 0.25).to(torch.uint8)
        + (a >= 0.75).to(torch.uint8)
        + (a > 1.25).to(torch.uint8)
        + (a >= 1.75).to(torch.uint8)
        + (a > 2.5).to(torch.uint8)
        + (a >= 3.5).to(torch.uint8)
        + (a > 5.0).to(torch.uint8)
    )
    return idx | ((v < 0).to(torch.uint8) << 3)


def e2m1_codes_to_float(codes: torch.Tensor) -> torch.Tensor:
    """Decode E2M1 codes (any integer dtype, values 0..15) to float32 values."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    mag = table[(codes & 0x7).long()]
    return torch.where((codes & 0x8) != 0, -mag, mag)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Pack codes [..., n] (n even) into uint8 [..., n/2]: element 2j LOW nibble, 2j+1 HIGH."""
    if codes.shape[-1] % 2 != 0:
        raise ValueError(f"pack_e2m1 needs an even last dimension, got shape {tuple(codes.shape)}")
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_e2m1: uint8 [..., m] -> codes uint8 [..., 2m]."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"unpack_e2m1 expects uint8, got {packed.dtype}")
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)
