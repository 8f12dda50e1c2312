"""NVFP4 in pure torch, bit-exact with compressed-tensors' "nvfp4-pack-quantized" (0.20).

Layout (docs/formats.md, "NVFP4"): E2M1 elements in blocks of 16 along the last dim of a
Linear weight [out, in]; one float8_e4m3fn scale per block; one fp32 per-tensor global scale
stored as a DIVISOR, gs = 448 * 6 / amax. Element j of a row is in the LOW nibble of byte j//2
when j is even.

Order of operations and dtypes follow compressed-tensors exactly (its `generate_gparam`,
`calculate_qparams`, `quantize`, `NVFP4PackedCompressor.decompress`):
  gs     = fp32( (448 * 6) / max(amax, tiny) )   computed in the WEIGHT's dtype, so for bf16
           weights gs is a bf16 value; inf/nan -> 1.0
  s      = fp8_e4m3( clamp(gs * (block_amax / 6), -448, 448) )   the /6 is in the weight's
           dtype (a bf16 rounding for bf16 weights), the product in fp32; s == 0 -> 0.125
  q      = e2m1( x / (s / gs) )                  fp32 arithmetic, nearest-even, saturating
  x_hat  = q * (s / gs)                          fp32, then cast to the requested dtype
Computing gs or the block amax/6 in fp32 for a bf16 weight gives slightly different scales,
so do not "simplify" these casts.
"""

import torch

from qerl.formats.e2m1 import F4_E2M1_MAX, decode_packed_e2m1, pack_e2m1, round_to_e2m1_codes
from qerl.formats.registry import FormatSpec, compressed_tensors_config

BLOCK_SIZE = 16
F8_E4M3_MAX = 448.0
# compressed-tensors replaces a block scale that rounds to 0 by the E4M3 "eps" 0.125,
# so x / (s / gs) never divides by zero.
ZERO_SCALE_REPLACEMENT = 0.125


def check_shape(shape) -> None:
    """ValueError unless `shape` is 2-D [out, in] with in % 16 == 0."""
    shape = tuple(shape)
    if len(shape) != 2:
        raise ValueError(f"nvfp4 quantizes 2-D Linear weights [out, in], got shape {shape}")
    if shape[1] % BLOCK_SIZE != 0:
        raise ValueError(
            f"nvfp4 needs in_features % {BLOCK_SIZE} == 0 (block size {BLOCK_SIZE} along the "
            f"last dim), got shape {shape}"
        )


def nvfp4_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """Per-tensor global scale (a divisor) from the tensor's amax: fp32 [1] = 448 * 6 / amax.

    Computed in amax's dtype, as compressed-tensors' `generate_gparam` does with the
    observer's min/max (bf16 for bf16 weights); pass `w.abs().amax()` without casting to
    match it. A zero or non-finite result becomes 1.0 (compressed-tensors' fallback).
    """
    amax = torch.as_tensor(amax)
    if not amax.is_floating_point():
        amax = amax.float()
    amax = amax.clamp(min=torch.finfo(amax.dtype).tiny)
    gs = (F8_E4M3_MAX * F4_E2M1_MAX) / amax
    gs = torch.nan_to_num(gs, nan=1.0, posinf=1.0, neginf=1.0)
    return gs.to(torch.float32).reshape(1)


def fused_global_scale(weights: list[torch.Tensor]) -> torch.Tensor:
    """One global scale for a fused group ((q,k,v) or (gate,up)): from the max amax of all.

    vLLM fuses these projections into one GEMM and reads a single global scale (the max over
    partitions), so every member must be quantized with this value:
    `quantize(w, "nvfp4", global_scale=fused_global_scale([wq, wk, wv]))`.
    """
    if len(weights) == 0:
        raise ValueError("fused_global_scale needs at least one weight")
    amax = weights[0].abs().amax()
    for w in weights[1:]:
        amax = torch.maximum(amax, w.abs().amax().to(amax.device))
    return nvfp4_global_scale(amax)


def quantize(w: torch.Tensor, global_scale: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Quantize a weight [out, in] (fp32/bf16/fp16) to NVFP4.

    Returns {"weight_packed": uint8 [out, in/2], "weight_scale": float8_e4m3fn [out, in/16],
    "weight_global_scale": float32 [1]} (names as on disk). `global_scale` (a divisor, fp32
    [1]) overrides the tensor's own, e.g. from fused_global_scale.
    """
    check_shape(w.shape)
    if not w.is_floating_point():
        raise ValueError(f"nvfp4 quantize expects a floating-point weight, got {w.dtype}")
    out_f, in_f = w.shape
    if global_scale is None:
        global_scale = nvfp4_global_scale(w.abs().amax())
    gs = torch.as_tensor(global_scale, dtype=torch.float32, device=w.device).reshape(1)

    blocks = w.reshape(out_f, in_f // BLOCK_SIZE, BLOCK_SIZE)
    block_amax = blocks.abs().amax(dim=-1)
    # (block_amax / 6) in the weight dtype, then the fp32 product: compressed-tensors' order.
    scale = gs * (block_amax / torch.tensor(F4_E2M1_MAX, dtype=w.dtype, device=w.device))
    # Clamp before the cast: torch's float8_e4m3fn cast does not saturate (470 -> NaN).
    scale_f8 = scale.clamp(-F8_E4M3_MAX, F8_E4M3_MAX).to(torch.float8_e4m3fn)
    repl = torch.full_like(scale_f8, ZERO_SCALE_REPLACEMENT)
    scale_f8 = torch.where(scale_f8.float() == 0, repl, scale_f8)

    step = scale_f8.float() / gs  # fp32 [out, in/16]
    codes = round_to_e2m1_codes(blocks.float() / step.unsqueeze(-1)).reshape(out_f, in_f)
    return {
        "weight_packed": pack_e2m1(codes),
        "weight_scale": scale_f8,
        "weight_global_scale": gs.clone(),
    }


def dequantize(tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Decode {"weight_packed", "weight_scale", "weight_global_scale"} to a dense [out, in].

    x_hat = q * (s / gs) in fp32, cast to `dtype`; equals compressed-tensors'
    NVFP4PackedCompressor.decompress bit for bit.
    """
    packed = tensors["weight_packed"]
    scale = tensors["weight_scale"]
    gs = tensors["weight_global_scale"].to(torch.float32).reshape(1)
    out_f, half = packed.shape
    in_f = 2 * half
    if scale.shape != (out_f, in_f // BLOCK_SIZE):
        raise ValueError(
            f"nvfp4 weight_scale shape {tuple(scale.shape)} does not match weight_packed "
            f"{tuple(packed.shape)}: expected {(out_f, in_f // BLOCK_SIZE)}"
        )
    q = decode_packed_e2m1(packed).reshape(out_f, in_f // BLOCK_SIZE, BLOCK_SIZE)
    step = scale.to(torch.float32) / gs
    return (q * step.unsqueeze(-1)).reshape(out_f, in_f).to(dtype)


def packed_shapes(out_features: int, in_features: int) -> dict:
    """{name: (shape, dtype)} of the packed tensors of one weight [out, in]."""
    return {
        "weight_packed": ((out_features, in_features // 2), torch.uint8),
        "weight_scale": ((out_features, in_features // BLOCK_SIZE), torch.float8_e4m3fn),
        "weight_global_scale": ((1,), torch.float32),
    }


def export_config(targets, ignore) -> dict:
    """compressed-tensors "nvfp4-pack-quantized" (docs/formats.md)."""
    weights = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": BLOCK_SIZE,
               "symmetric": True, "dynamic": False}
    return compressed_tensors_config("nvfp4", weights, ignore)


SPEC = FormatSpec(
    name="nvfp4", block_size=BLOCK_SIZE,
    bits_per_weight=4 + 8 / BLOCK_SIZE,  # + a negligible per-tensor global scale
    tensor_names=("weight_packed", "weight_scale", "weight_global_scale"),
    packed_shapes=packed_shapes, quantize=quantize, dequantize=dequantize, export_config=export_config,
    kernels=("triton",), fused_global_scale=fused_global_scale, check_shape=check_shape,
    code="e2m1", scale_kind="e4m3",
)
