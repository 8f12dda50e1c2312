"""4-bit weight formats in pure torch: NVFP4, MXFP4 and NF4 (../shared/FORMATS.md).

Dispatch by format name; tensor names are those stored on disk:
    nvfp4: weight_packed uint8 [out, in/2], weight_scale float8_e4m3fn [out, in/16],
           weight_global_scale float32 [1] (a DIVISOR, compressed-tensors convention)
    mxfp4: weight_packed uint8 [out, in/2], weight_scale uint8 E8M0 [out, in/32]
    nf4:   weight_packed uint8 [out, in/2] (HIGH nibble first), weight_absmax float32 [out*in/64]

Everything is vectorised torch and runs on whatever device the weight is on.
"""

import torch

from qerl.formats import mxfp4, nf4, nvfp4
from qerl.formats.nvfp4 import fused_global_scale, nvfp4_global_scale

FORMATS = ("nvfp4", "mxfp4", "nf4")
BLOCK_SIZE = {"nvfp4": nvfp4.BLOCK_SIZE, "mxfp4": mxfp4.BLOCK_SIZE, "nf4": nf4.BLOCK_SIZE}
_MODULES = {"nvfp4": nvfp4, "mxfp4": mxfp4, "nf4": nf4}
# Storage per weight: 4 bits + the scale's bits spread over its block (+ a negligible
# per-tensor global scale for nvfp4; nf4 without double quantization).
_BITS_PER_WEIGHT = {"nvfp4": 4 + 8 / 16, "mxfp4": 4 + 8 / 32, "nf4": 4 + 32 / 64}

__all__ = [
    "FORMATS",
    "BLOCK_SIZE",
    "quantize",
    "dequantize",
    "check_shape",
    "bits_per_weight",
    "nvfp4_global_scale",
    "fused_global_scale",
    "sqnr_db",
]


def _module(fmt: str):
    if fmt not in _MODULES:
        raise ValueError(f"unknown format {fmt!r}; expected one of {FORMATS}")
    return _MODULES[fmt]


def check_shape(shape, fmt: str) -> None:
    """ValueError unless `shape` is a 2-D [out, in] whose `in` is a multiple of fmt's block."""
    _module(fmt).check_shape(shape)


def quantize(w: torch.Tensor, fmt: str, global_scale: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Quantize a Linear weight [out, in] to `fmt`; returns the on-disk tensors by name.

    `global_scale` (fp32 [1] divisor) is for nvfp4 only, e.g. fused_global_scale([q, k, v]).
    """
    return _module(fmt).quantize(w, global_scale=global_scale)


def dequantize(tensors: dict[str, torch.Tensor], fmt: str, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Decode the tensors returned by quantize(..., fmt) to a dense [out, in] of `dtype`."""
    return _module(fmt).dequantize(tensors, dtype=dtype)


def bits_per_weight(fmt: str) -> float:
    """Storage bits per weight: nvfp4 4.5, mxfp4 4.25, nf4 4.5 (no double quantization)."""
    _module(fmt)
    return _BITS_PER_WEIGHT[fmt]


def sqnr_db(w: torch.Tensor, w_hat: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio 10*log10(sum w^2 / sum (w - w_hat)^2), in dB (fp64)."""
    w = w.double()
    err = (w - w_hat.double()).pow(2).sum()
    return float(10 * torch.log10(w.pow(2).sum() / err))
