"""4-bit weight formats in pure torch: NVFP4, MXFP4 and NF4 (docs/formats.md).

Dispatch by format name through the registry (qerl.formats.registry): each format module
declares a FormatSpec (block size, bits per weight, packed tensor names, shapes and dtypes,
quantize/dequantize, export config, kernels), and this package registers the built-in ones.
Tensor names are those stored on disk:
    nvfp4: weight_packed uint8 [out, in/2], weight_scale float8_e4m3fn [out, in/16],
           weight_global_scale float32 [1] (a DIVISOR, compressed-tensors convention)
    mxfp4: weight_packed uint8 [out, in/2], weight_scale uint8 E8M0 [out, in/32]
    nf4:   weight_packed uint8 [out, in/2] (HIGH nibble first), weight_absmax float32 [out*in/64]

Everything is vectorised torch and runs on whatever device the weight is on.
"""

import torch

from qerl.formats import mxfp4, nf4, nvfp4
from qerl.formats.nvfp4 import fused_global_scale, nvfp4_global_scale
from qerl.formats.registry import DENSE, FormatSpec, get, is_dense, lookup, names, register, unregister, with_kernel

# The built-in formats, in the order qerl lists them.
for _module in (nvfp4, mxfp4, nf4):
    register(_module.SPEC)
del _module

# The formats of the paper's two 4-bit roles: QeRL is LoRA on an NVFP4 base with AQN (the default
# base everywhere); its baseline QLoRA is LoRA on an NF4 base (bitsandbytes).
QERL_FORMAT = nvfp4.SPEC.name
QLORA_FORMAT = nf4.SPEC.name

__all__ = [
    "FormatSpec",
    "DENSE",
    "QERL_FORMAT",
    "QLORA_FORMAT",
    "is_dense",
    "register",
    "unregister",
    "get",
    "lookup",
    "names",
    "with_kernel",
    "block_size",
    "quantize",
    "dequantize",
    "check_shape",
    "packed_shapes",
    "bits_per_weight",
    "nvfp4_global_scale",
    "fused_global_scale",
    "sqnr_db",
]


def check_shape(shape, fmt: str) -> None:
    """ValueError unless `shape` is a 2-D [out, in] whose `in` is a multiple of fmt's block."""
    get(fmt).check_shape(shape)


def block_size(fmt: str) -> int:
    """Weights per scale block of `fmt` (along the last dim)."""
    return get(fmt).block_size


def packed_shapes(fmt: str, out_features: int, in_features: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{tensor name: (shape, dtype)} of the packed buffers of one weight [out, in] in `fmt`."""
    spec = get(fmt)
    spec.check_shape((out_features, in_features))
    return spec.packed_shapes(out_features, in_features)


def quantize(w: torch.Tensor, fmt: str, global_scale: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Quantize a Linear weight [out, in] to `fmt`; returns the on-disk tensors by name.

    `global_scale` is for formats with a fused global scale (nvfp4: an fp32 [1] divisor, e.g.
    fused_global_scale([q, k, v])).
    """
    return get(fmt).quantize(w, global_scale=global_scale)


def dequantize(tensors: dict[str, torch.Tensor], fmt: str, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Decode the tensors returned by quantize(..., fmt) to a dense [out, in] of `dtype`."""
    return get(fmt).dequantize(tensors, dtype=dtype)


def bits_per_weight(fmt: str) -> float:
    """Storage bits per weight: nvfp4 4.5, mxfp4 4.25, nf4 4.5 (no double quantization)."""
    return get(fmt).bits_per_weight


def sqnr_db(w: torch.Tensor, w_hat: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio 10*log10(sum w^2 / sum (w - w_hat)^2), in dB (fp64)."""
    w = w.double()
    err = (w - w_hat.double()).pow(2).sum()
    return float(10 * torch.log10(w.pow(2).sum() / err))
