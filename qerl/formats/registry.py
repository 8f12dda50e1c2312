"""The format registry: the one place that knows which 4-bit weight formats exist.

Each format module (qerl/formats/<fmt>.py) declares a :class:`FormatSpec` named ``SPEC``;
qerl.formats registers the built-in ones, and every other module (QuantLinear, the kernel
dispatch, export, the CLI, the config's method names, the plots) asks the registry instead of
keeping its own table. A new format is a new module with a SPEC (or, in a test, a SPEC passed
to :func:`register`); nothing else changes:

    1. qerl/formats/<fmt>.py: quantize, dequantize, packed_shapes, export_config and
       SPEC = FormatSpec(...); add the module to the tuple qerl/formats/__init__.py registers.
    2. It then runs everywhere on the reference path (CPU and GPU): quantize_, QuantLinear
       forward/backward, export, `python -m qerl quantize --format <fmt>`, `--method <fmt>_lora`.
    3. A fast path is a kernel in qerl/kernels plus that kernel's name in SPEC.kernels. The
       kernels branch on the spec's properties (``code``, ``scale_kind``, ``has_global_scale``),
       never on its name; declaring a kernel the properties cannot run is an error at the first
       matmul, never a silent fallback.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

# Kernel backends a format may declare (qerl.kernels implements them).
KERNELS = ("triton", "bitsandbytes")
# What a 4-bit code means (``code``): "e2m1" the FP4 values 0, 0.5, 1, 1.5, 2, 3, 4, 6 with a sign bit;
# "nf4" the 16 NormalFloat levels (a lookup table); "int4" a symmetric integer.
CODES = ("e2m1", "nf4", "int4")
# How a block's scale is stored (``scale_kind``): "e4m3" an FP8 E4M3 byte (NVFP4, with a per-tensor
# global divisor), "e8m0" a power-of-two exponent byte (MXFP4), "absmax" an fp32 block maximum (NF4),
# "step" an fp32 step.
SCALE_KINDS = ("e4m3", "e8m0", "absmax", "step")
# The dense base of QuantLinear and the configs: not a packed format (no spec), never registrable.
DENSE = "bf16"

ShapeTable = dict[str, tuple[tuple[int, ...], torch.dtype]]


def check_block_shape(name: str, block_size: int):
    """A check_shape for a format with blocks of `block_size` along the last dim of [out, in]."""

    def check(shape) -> None:
        shape = tuple(shape)
        if len(shape) != 2:
            raise ValueError(f"{name} quantizes 2-D Linear weights [out, in], got shape {shape}")
        if shape[1] % block_size != 0:
            raise ValueError(f"{name} needs in_features % {block_size} == 0 (block size {block_size} "
                             f"along the last dim), got shape {shape}")

    return check


@dataclass(frozen=True)
class FormatSpec:
    """Everything the rest of qerl needs to know about one packed weight format.

    name: the format's name everywhere (CLI, config, QuantLinear.fmt, checkpoints).
    block_size: weights per scale block, along the last dim of a Linear weight [out, in].
    bits_per_weight: storage bits per weight, scales included.
    tensor_names: the packed tensors of one weight as stored on disk, in the order the kernels
        take them (weight_packed first).
    packed_shapes(out, in): {tensor name: (shape, dtype)} of one weight [out, in], in
        tensor_names order, without computing anything (meta-device builds, allocation).
    quantize(w, global_scale=None) -> {tensor name: tensor}; dequantize(tensors, dtype) -> [out, in].
    export_config(targets, ignore) -> the `quantization_config` entry of config.json.
    kernels: the fast backends of qerl.kernels that run this format, in preference order
        ("triton", "bitsandbytes"); none means the reference path only.
    fused_global_scale(weights) -> one shared global scale for a fused group ((q,k,v), (gate,up)),
        for formats with a per-tensor scale that vLLM reads once per fused GEMM; None otherwise.
    check_shape(shape): ValueError unless `shape` can be stored; default: 2-D, in % block_size == 0.
    code: what a 4-bit code means (one of CODES), or None where no kernel needs to know.
    scale_kind: how a block scale is stored (one of SCALE_KINDS), or None likewise.
    has_global_scale (property): the weight carries a per-tensor ``weight_global_scale``.
    """

    name: str
    block_size: int
    bits_per_weight: float
    tensor_names: tuple[str, ...]
    packed_shapes: Callable[[int, int], ShapeTable]
    quantize: Callable[..., dict[str, torch.Tensor]]
    dequantize: Callable[..., torch.Tensor]
    export_config: Callable[[list[str], list[str]], dict]
    kernels: tuple[str, ...] = ()
    fused_global_scale: Callable[[list[torch.Tensor]], torch.Tensor] | None = None
    check_shape: Callable | None = field(default=None)
    code: str | None = None
    scale_kind: str | None = None

    @property
    def has_global_scale(self) -> bool:
        return "weight_global_scale" in self.tensor_names

    def __post_init__(self):
        if not self.name or not self.name.isidentifier() or self.name == DENSE:
            raise ValueError(f"a format name must be an identifier other than {DENSE!r}, got {self.name!r}")
        if self.code is not None and self.code not in CODES:
            raise ValueError(f"format {self.name!r}: unknown code {self.code!r}; known: {CODES}")
        if self.scale_kind is not None and self.scale_kind not in SCALE_KINDS:
            raise ValueError(f"format {self.name!r}: unknown scale_kind {self.scale_kind!r}; known: {SCALE_KINDS}")
        if not self.tensor_names or self.tensor_names[0] != "weight_packed":
            raise ValueError(f"format {self.name!r}: tensor_names must start with 'weight_packed', "
                             f"got {self.tensor_names}")
        bad = set(self.kernels) - set(KERNELS)
        if bad:
            raise ValueError(f"format {self.name!r}: unknown kernels {sorted(bad)}; known: {KERNELS}")
        if self.check_shape is None:
            object.__setattr__(self, "check_shape", check_block_shape(self.name, self.block_size))
        shapes = self.packed_shapes(self.block_size, self.block_size)
        if tuple(shapes) != self.tensor_names:
            raise ValueError(f"format {self.name!r}: packed_shapes gives {tuple(shapes)}, "
                             f"tensor_names says {self.tensor_names}")


_REGISTRY: dict[str, FormatSpec] = {}


def register(spec: FormatSpec) -> FormatSpec:
    """Add a format; a name that is already registered is an error (see unregister)."""
    if not isinstance(spec, FormatSpec):
        raise TypeError(f"register expects a FormatSpec, got {type(spec).__name__}")
    if spec.name in _REGISTRY:
        raise ValueError(f"format {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    """Remove a format (tests that register a toy format clean up with this)."""
    get(name)
    del _REGISTRY[name]


def names() -> tuple[str, ...]:
    """The registered formats, in registration order (qerl's own: nvfp4, mxfp4, nf4)."""
    return tuple(_REGISTRY)


# The spec of a name, or None: one dict lookup (the kernel dispatch calls it on every matmul).
def lookup(name: str) -> FormatSpec | None:
    """The spec registered under `name`, or None (a plain function: torch.compile traces it)."""
    return _REGISTRY.get(name)


def get(name: str) -> FormatSpec:
    """The spec of a registered format, or a ValueError naming the registered ones."""
    spec = _REGISTRY.get(name)
    if spec is None:
        raise ValueError(f"unknown format {name!r}; expected one of {names()}")
    return spec


def is_dense(fmt: str) -> bool:
    """Whether `fmt` names the dense base ("bf16": a plain weight, no packed format)."""
    return fmt == DENSE


def with_kernel(kernel: str) -> tuple[str, ...]:
    """The formats that declare `kernel` ("triton" or "bitsandbytes")."""
    return tuple(n for n, s in _REGISTRY.items() if kernel in s.kernels)


def compressed_tensors_config(fmt: str, weights: dict, ignore) -> dict:
    """A compressed-tensors `quantization_config` ("<fmt>-pack-quantized") for vLLM."""
    name = f"{fmt}-pack-quantized"
    return {
        "quant_method": "compressed-tensors", "format": name, "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "format": name, "weights": weights,
                                      "input_activations": None, "output_activations": None}},
        "ignore": list(ignore), "kv_cache_scheme": None,
    }
