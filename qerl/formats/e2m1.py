"""E2M1, the 4-bit float element shared by NVFP4 and MXFP4 (docs/formats.md, "E2M1").

1 sign bit, 2 exponent bits (bias 1), 1 mantissa bit, no Inf/NaN. Codes 0..7 are
0, 0.5, 1, 1.5, 2, 3, 4, 6; codes 8..15 are their negatives (0x8 is -0).

Packing (NVFP4 and MXFP4, as in compressed-tensors, torchao, modelopt and Triton's
`tl.dot_scaled`): byte j of a row holds element 2j in the LOW nibble and 2j+1 in the HIGH
nibble. NF4 packs the other way round and has its own code in nf4.py.
"""

import functools

import torch

F4_E2M1_MAX = 6.0

# Magnitudes of codes 0..7; the table is tiny, so it is copied to the input's device per call.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


# Rounding thresholds on |v|: nearest-even means a tie at 0.25, 1.25, 2.5 or 5.0 rounds DOWN
# (to the even code below) and a tie at 0.75, 1.75 or 3.5 rounds UP. `torch.bucketize` counts
# boundaries strictly below |v|, so the round-up thresholds are moved one fp32 ulp down
# (|v| >= t  <=>  |v| > nextafter(t, 0) for fp32 |v|). These are exactly compressed-tensors'
# `cast_to_fp4` comparisons, so codes agree bit for bit.
_TIES_DOWN = (0.25, 1.25, 2.5, 5.0)
_THRESHOLDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _boundaries(device) -> torch.Tensor:
    t = torch.tensor(_THRESHOLDS, dtype=torch.float32, device=device)
    below = torch.nextafter(t, torch.zeros_like(t))
    down = torch.tensor([x in _TIES_DOWN for x in _THRESHOLDS], device=device)
    return torch.where(down, t, below)


def round_to_e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """Round already-scaled fp32 values to E2M1 codes (uint8 in 0..15), same shape as `v`.

    Nearest, ties to even, saturating at +-6 (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2,
    3.5->4, 5->4, >5->6), identical to compressed-tensors' `cast_to_fp4`. The sign bit is set
    for v < 0, including values that round to zero (-0 = 0x8), again as compressed-tensors
    does; v == -0.0 gets +0. NaN (undefined here) gets the code of 6.
    """
    v = v.float()
    idx = torch.bucketize(v.abs(), _boundaries(v.device), out_int32=True).to(torch.uint8)
    return idx | ((v < 0).to(torch.uint8) << 3)


@functools.lru_cache(maxsize=None)
def _code_table(device) -> torch.Tensor:
    """fp32 values of codes 0..15 (code 8 is -0.0, as compressed-tensors decodes it)."""
    mag = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return torch.cat((mag, -mag))


def e2m1_codes_to_float(codes: torch.Tensor) -> torch.Tensor:
    """Decode E2M1 codes (any integer dtype, values 0..15) to float32 values."""
    return _code_table(codes.device)[(codes & 0xF).long()]


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
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def pair_table(values: torch.Tensor, high_first: bool = False) -> torch.Tensor:
    """[256, 2] table: the two decoded elements of every byte, in element order.

    Decoding packed bytes through it is one gather instead of unpack + lookup.
    """
    byte = torch.arange(256, device=values.device)
    low, high = values[byte & 0xF], values[byte >> 4]
    return torch.stack((high, low) if high_first else (low, high), dim=-1)


def gather_pairs(table: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """The rows of a pair_table for packed bytes [..., m] -> [..., 2m]. index_select on the flat bytes is the
    same gather as table[packed.long()], ~3x faster on the CPU (the reference path decodes per call)."""
    return torch.index_select(table, 0, packed.reshape(-1).long()).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def decode_packed_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., m] packed as pack_e2m1 -> fp32 values [..., 2m]."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"decode_packed_e2m1 expects uint8, got {packed.dtype}")
    return gather_pairs(pair_table(_code_table(packed.device)), packed)
