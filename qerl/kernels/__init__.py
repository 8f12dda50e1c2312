"""W4A16 matmuls on 4-bit packed weights: one dispatch point for every caller.

Public API (see CONTRACTS.md):

    linear(x, fmt, tensors, out_features, in_features, backend="auto", cache=None)      -> y  = x W^T
    grad_input(dy, fmt, tensors, out_features, in_features, backend="auto", cache=None) -> dx = dy W

``tensors`` holds the on-disk buffers of one quantized Linear, named as its format's spec in the
registry says (qerl.formats.get(fmt).tensor_names, in the order the kernels take them). The
weight is never materialised densely on the Triton path; the reference path dequantizes it (CPU
tests, and the definition of correct).

Backends:
  - "reference": qerl.formats.dequantize to fp32, matmul in fp32, result cast to x.dtype.
  - "triton": fused dequantize-and-multiply kernels (qerl.kernels.fp4), for the formats whose
    spec lists "triton" (nvfp4 and mxfp4).
    Raises RuntimeError when it cannot run (tensors not on CUDA and TRITON_INTERPRET unset,
    triton missing, fmt without a kernel): asking for the fast path never silently gets the
    slow one.
  - "bitsandbytes": formats whose spec lists it (nf4): bitsandbytes.matmul_4bit on a QuantState
    that views qerl's buffers (qerl.kernels.bnb; qerl's NF4 bytes are bitsandbytes' bytes), any
    device bitsandbytes runs on. RuntimeError for other formats or when bitsandbytes cannot be imported.
  - "auto": on CUDA, the first kernel the format's spec lists: "triton" (if it can run), or
    "bitsandbytes" (nf4: the QLoRA baseline must be bitsandbytes' kernels; if bitsandbytes is
    missing this is an error naming backend='reference', never a silent fallback); else
    "reference".

``cache`` (optional, a dict owned by the caller, e.g. one per QuantLinear) keeps per-weight
objects a backend builds from the buffers (the bitsandbytes QuantState) across calls.

``linear`` is differentiable with respect to x on both backends (the Triton ops carry a
registered autograd formula whose backward is ``grad_input``); the packed weights get no
gradient.
"""

from __future__ import annotations

import os

import torch

from qerl import formats
from qerl.kernels import bnb

BACKENDS = ("auto", "triton", "reference", "bitsandbytes")


def _check_args(fmt: str, tensors: dict, out_features: int, in_features: int, backend: str):
    """Validate the arguments; returns fmt's FormatSpec."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    spec = formats.lookup(fmt)
    if spec is None:
        raise ValueError(f"fmt must be one of {formats.names()}, got {fmt!r}")
    required = spec.tensor_names
    missing = [k for k in required if k not in tensors]
    if missing:
        raise ValueError(f"fmt {fmt!r} needs tensors {required}; missing {missing}")
    packed = tensors["weight_packed"]
    if packed.numel() * 2 != out_features * in_features:
        raise ValueError(
            f"weight_packed has {packed.numel()} bytes, expected out_features*in_features/2 = "
            f"{out_features * in_features // 2} for a [{out_features}, {in_features}] weight"
        )
    if "triton" in spec.kernels and tuple(packed.shape) != (out_features, in_features // 2):
        raise ValueError(
            f"{fmt} weight_packed must be [out, in/2] = [{out_features}, {in_features // 2}], "
            f"got {list(packed.shape)}"
        )
    return spec


def triton_available(device: torch.device) -> tuple[bool, str]:
    """Whether the Triton kernels can run on tensors of ``device``, and why not if they cannot."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False, "triton is not installed"
    if device.type == "cuda":
        return True, ""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return True, ""
    return False, f"tensors are on {device.type!r}, not CUDA, and TRITON_INTERPRET=1 is not set"


def _resolve_backend(backend: str, fmt: str, device: torch.device, spec=None) -> str:
    if backend == "reference":
        return "reference"
    kernels = (spec or formats.get(fmt)).kernels  # the spec's fast backends, in preference order
    if backend == "bitsandbytes":
        if "bitsandbytes" not in kernels:
            raise RuntimeError(f"backend='bitsandbytes' runs {', '.join(formats.with_kernel('bitsandbytes'))} only, not {fmt!r}; "
                               "use 'auto', 'triton' or 'reference'")
        bnb.require()
        return "bitsandbytes"
    if backend == "auto":
        if device.type == "cuda":
            for kernel in kernels:
                if kernel == "bitsandbytes":
                    bnb.require()  # raises, naming backend='reference', when bitsandbytes is missing
                    return "bitsandbytes"
                if kernel == "triton" and triton_available(device)[0]:
                    return "triton"
        return "reference"
    # backend == "triton": never fall back silently.
    if "triton" not in kernels:
        raise RuntimeError(
            f"backend='triton' has kernels for {', '.join(formats.with_kernel('triton'))} only, not {fmt!r}; "
            "use backend='reference' (or backend='bitsandbytes' for nf4)"
        )
    ok, why = triton_available(device)
    if not ok:
        raise RuntimeError(f"backend='triton' cannot run: {why}")
    return "triton"


def resolve_backend(backend: str, fmt: str, device: torch.device) -> str:
    """The backend ``linear`` / ``grad_input`` run for these arguments (raises as they do)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return _resolve_backend(backend, fmt, device)


def scratch_bytes(device: torch.device | str | None = None) -> int:
    """Bytes of the transient bf16/fp32 decode scratch the Triton path keeps (one buffer per device
    and dtype, the size of the largest 4-bit linear decoded so far; 0 before any large-M or
    grad-input call). For the memory columns of Table 3."""
    import sys

    fp4 = sys.modules.get("qerl.kernels.fp4")
    return 0 if fp4 is None else fp4.scratch_bytes(device)


def dequantize_fp32(fmt: str, tensors: dict, out_features: int, in_features: int) -> torch.Tensor:
    """The dense fp32 weight [out, in] that the reference path multiplies with."""
    w = formats.dequantize(tensors, fmt, dtype=torch.float32)
    return w.reshape(out_features, in_features)


def linear_reference(x: torch.Tensor, fmt: str, tensors: dict, out_features: int, in_features: int) -> torch.Tensor:
    """y = x W^T with W dequantized, computed in fp32 and returned in x.dtype."""
    w = dequantize_fp32(fmt, tensors, out_features, in_features).to(x.device)
    return torch.matmul(x.float(), w.t()).to(x.dtype)


def grad_input_reference(dy: torch.Tensor, fmt: str, tensors: dict, out_features: int, in_features: int) -> torch.Tensor:
    """dx = dy W with W dequantized, computed in fp32 and returned in dy.dtype."""
    w = dequantize_fp32(fmt, tensors, out_features, in_features).to(dy.device)
    return torch.matmul(dy.float(), w).to(dy.dtype)


def _triton_args(spec, tensors: dict) -> list:
    """The packed tensors in the order the kernels take them (the spec's tensor_names)."""
    return [tensors[name] for name in spec.tensor_names]


def linear(x: torch.Tensor, fmt: str, tensors: dict, out_features: int, in_features: int,
           backend: str = "auto", cache: dict | None = None) -> torch.Tensor:
    """y[..., out] = x[..., in] @ W^T for a 4-bit weight W stored as ``tensors`` (fmt format)."""
    spec = _check_args(fmt, tensors, out_features, in_features, backend)
    if x.shape[-1] != in_features:
        raise ValueError(f"x has {x.shape[-1]} features in its last dim, expected in_features={in_features}")
    resolved = _resolve_backend(backend, fmt, x.device, spec)
    if resolved == "reference":
        return linear_reference(x, fmt, tensors, out_features, in_features)
    if resolved == "bitsandbytes":
        state = bnb.cached_quant_state(tensors, out_features, in_features, x.dtype, cache)
        return bnb.linear(x, tensors, state)
    from qerl.kernels import fp4, fp4_mma

    if cache is not None and fp4_mma.applies(x, in_features):  # small M: the compute-layout mma kernel
        w = fp4_mma.weight_args(cache, tensors, fmt, out_features)
        if w is not None:
            x2 = x.reshape(-1, in_features)
            if x2.stride(-1) != 1:
                x2 = x2.contiguous()
            y = fp4_mma.grouped_linear(x2, [w], in_features, fmt == "nvfp4")[0]
            return y.view(*x.shape[:-1], out_features)
    return fp4.linear(x, fmt, *_triton_args(spec, tensors))


def grad_input(dy: torch.Tensor, fmt: str, tensors: dict, out_features: int, in_features: int,
               backend: str = "auto", cache: dict | None = None) -> torch.Tensor:
    """dx[..., in] = dy[..., out] @ W for a 4-bit weight W stored as ``tensors`` (fmt format)."""
    spec = _check_args(fmt, tensors, out_features, in_features, backend)
    if dy.shape[-1] != out_features:
        raise ValueError(f"dy has {dy.shape[-1]} features in its last dim, expected out_features={out_features}")
    resolved = _resolve_backend(backend, fmt, dy.device, spec)
    if resolved == "reference":
        return grad_input_reference(dy, fmt, tensors, out_features, in_features)
    if resolved == "bitsandbytes":
        state = bnb.cached_quant_state(tensors, out_features, in_features, dy.dtype, cache)
        return bnb.grad_input(dy, tensors, state)
    from qerl.kernels import fp4

    return fp4.grad_input(dy, fmt, *_triton_args(spec, tensors))


__all__ = ["linear", "grad_input", "resolve_backend", "scratch_bytes", "linear_reference", "grad_input_reference", "dequantize_fp32",
           "triton_available", "BACKENDS"]
