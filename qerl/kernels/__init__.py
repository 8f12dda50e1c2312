"""The one door to qerl's kernels: W4A16 matmuls on 4-bit packed weights, the decode, the fused
decode-step ops and the sampler. No module outside qerl/kernels imports a submodule of it.

Public API (see CONTRACTS.md):

    linear(x, fmt, tensors, out_features, in_features, backend="auto", cache=None)      -> y  = x W^T
    grad_input(dy, fmt, tensors, out_features, in_features, backend="auto", cache=None) -> dx = dy W
    grouped_linear(x, weights)       -> [x W_i^T] of 1-3 Weights sharing x in one launch, or None
    make_plan(weight, device)        -> Plan (per-weight launch state) or None off the Triton backend
    decode(fmt, tensors, dtype, rows=None, cols=None, out=None) -> W (or a block of it), dense
    linear_tuned, grad_input_tuned, kernel_name   heuristics overridden / named (benchmarks); linear_tuned's
                                     kind picks a family ("gemv", "dot", "scratch", "mma", "warpspec");
                                     mma_config the "mma" family's rule config, parts overridden
    MMA_IN_FLIGHT                    whether the installed Triton keeps register-A MMAs in flight (>= 3.7)
    lora_a_tuned, lora_out_tuned, lora_a_config   the same for the decode step's LoRA kernels
    scratch_bytes(device=None), buffer_bytes(), release_scratch(), resolve_backend(backend, fmt, device)
    rmsnorm, add_rmsnorm, add_rmsnorm_lora_a, rope_cache_write, silu_mul, lora_a, lora_out,
    lora_silu_mul(_lora_a)           the fused decode step's ops (qerl.kernels.fused)
    decode_attention(q, k, v, key_valid, cpos, scale)   one query token a sequence over its KV cache,
                                     (decode_attention_lora_a: with the LoRA A product of o_proj's input),
                                     split over the keys (qerl.kernels.attention); its fp32 torch reference
                                     decode_attention_reference
    gumbel_argmax(x, keys, t)        the rollout's Gumbel-max draw in one kernel; uniform_noise,
                                     fmix32, gumbel_argmax_torch its torch reference (no Triton)
    pdl(device), set_pdl(on)         programmatic dependent launch of the decode step's kernels (sm_90: on
                                     unless QERL_PDL=0); set_pdl for A/B timings (new launches only)

``tensors`` holds the on-disk buffers of one quantized Linear, named as its format's spec in the
registry says (qerl.formats.get(fmt).tensor_names, in the order the kernels take them); a ``Weight``
bundles them with the shape, backend and kernel cache (QuantLinear.kernel_weight()). The weight is
never materialised densely on the Triton path; the reference path dequantizes it (CPU tests, and
the definition of correct). The kernels branch on the format's properties (its code and scale kind,
qerl.kernels.common.scale_mode), never on its name.

Backends:
  - "reference": qerl.formats.dequantize to fp32, matmul in fp32, result cast to x.dtype.
  - "triton": fused dequantize-and-multiply kernels, for the formats whose spec lists "triton"
    (E2M1 codes with E4M3 or E8M0 scales): the tensor-core kernel of qerl.kernels.mma on the
    compute layout for decode batches (with a cache; on sm_90 the warp-specialised kernel of
    qerl.kernels.warpspec on the same layout at the rows it serves: warpspec.SERVED_M), the GEMV (qerl.kernels.gemv) and tiled
    kernels (qerl.kernels.dot) for small and mid M, decode + cuBLAS (qerl.kernels.scratch) from
    M = 128 and for grad-input (launched by qerl.kernels.ops).
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
objects a backend builds from the buffers (the bitsandbytes QuantState, the compute layout)
across calls.

``linear`` is differentiable with respect to x on both backends (the Triton ops carry a
registered autograd formula whose backward is ``grad_input``); the packed weights get no
gradient.

The Triton modules are imported on first use (triton.jit reads TRITON_INTERPRET when a kernel
module is imported), so importing this package needs neither Triton nor a GPU.
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass

import torch

from qerl import formats
from qerl.kernels import bnb
from qerl.kernels.gumbel import M32, fmix32, gumbel_argmax_torch, uniform_noise

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
    scratch = sys.modules.get("qerl.kernels.scratch")
    return 0 if scratch is None else scratch.scratch_bytes(device)


def buffer_bytes() -> dict[str, int]:
    """Bytes of the kernels' module-level buffers: the decode scratch, the live split-K workspaces and
    the retired ones that captured CUDA graphs may still use (0 each before any Triton call)."""
    def nbytes(tensors):
        return sum(t.numel() * t.element_size() for t in tensors)

    scratch, common = sys.modules.get("qerl.kernels.scratch"), sys.modules.get("qerl.kernels.common")
    return {"scratch": 0 if scratch is None else scratch.scratch_bytes(),
            "workspace": 0 if common is None else sum(nbytes(pair) for pair in common._WORKSPACE.values()),
            "retired": 0 if common is None else nbytes(common.RETIRED)}


def release_scratch() -> None:
    """Free the decode scratch buffers (those no CUDA graph captured) and the plans' launches into them."""
    scratch = sys.modules.get("qerl.kernels.scratch")
    if scratch is not None:
        scratch.release_scratch()


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


@dataclass(frozen=True)
class Weight:
    """One packed weight as the kernels take it: its format, on-disk tensors (by name), shape, the
    backend to run and the owner's kernel cache (QuantLinear.kernel_weight() makes one)."""

    fmt: str
    tensors: dict
    out_features: int
    in_features: int
    backend: str = "auto"
    cache: dict | None = None


def _mma_linear(x: torch.Tensor, fmt: str, tensors: dict, out_features: int, in_features: int,
                cache: dict, kind: str | None = None, config: dict | None = None,
                split_k: int | None = None) -> torch.Tensor | None:
    """x W^T through a tensor-core kernel on the compute layout kept in ``cache``, or None where none
    applies (M, dtype or layout of x; a weight without an exact layout). ``kind`` "mma" / "warpspec"
    names the kernel (linear_tuned) instead of the choice by M, with ``config`` / ``split_k``."""
    from qerl.kernels import common, layout, mma, warpspec

    if kind is None and not mma.applies(x, in_features):
        return None
    is_nv = common.scale_mode(fmt)
    w = layout.weight_args(cache, tensors, is_nv, out_features)
    if w is None:
        return None
    x2 = common.as_rows(x, in_features)
    if kind == "warpspec" or (kind is None and warpspec.serves(x2)):  # the rows warpspec.SERVED_M names
        y = warpspec.linear(x2, w[0], w[1], w[2], out_features, in_features, is_nv, config=config, split_k=split_k,
                            cache=cache)
    else:
        y = mma.grouped_linear(x2, [w], in_features, is_nv, config=config, split_k=split_k)[0]
    return y.view(*x.shape[:-1], out_features)


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
    if cache is not None:  # small M: the compute-layout mma kernel
        y = _mma_linear(x, fmt, tensors, out_features, in_features, cache)
        if y is not None:
            return y
    from qerl.kernels import ops

    return ops.linear(x, fmt, *_triton_args(spec, tensors))


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
    from qerl.kernels import ops

    return ops.grad_input(dy, fmt, *_triton_args(spec, tensors))


# Rows from which 2-3 weights sharing x run as one warp-specialised launch over the group (where that
# kernel serves) rather than one grouped launch of the mma kernel. 7B layer as the decode step runs it
# (benchmarks.grouped_rule, H200, Triton 3.7.1, two runs: results/kernels/h200_grouped_rule*.json): the
# warp-specialised group launch was the faster at every M measured from 32 to 256 (M 64: 124 vs 128 us,
# M 128: 163 vs 194, M 256: 285 vs 337) but M 160, a tie (280 vs 281, then 293 vs 282), so it takes every
# M it serves. Benchmarks set it to compare them.
GROUPED_WARPSPEC_MIN_M = 1


def grouped_linear(x: torch.Tensor, weights: list[Weight]) -> list[torch.Tensor] | None:
    """[x W_i^T] for 1-3 4-bit weights of one format sharing x [M, K] (rows of stride K), in ONE
    launch: of the warp-specialised kernel where it serves (from GROUPED_WARPSPEC_MIN_M rows), else of the
    mma kernel; None where those kernels do not apply (formats or backends
    other than Triton, M or x's layout outside its range, a weight without an exact compute
    layout): the caller then runs each weight's own linear."""
    if not 1 <= len(weights) <= 3:
        return None
    fmt, K = weights[0].fmt, weights[0].in_features
    if fmt not in formats.with_kernel("triton") or any(w.fmt != fmt or w.in_features != K for w in weights):
        return None
    if x.device.type != "cuda":
        return None
    from qerl.kernels import common, layout, mma, warpspec

    if not mma.applies(x, K) or any(_resolve_backend(w.backend, fmt, x.device) != "triton" for w in weights):
        return None
    is_nv = common.scale_mode(fmt)
    args = [layout.weight_args(w.cache if w.cache is not None else {}, w.tensors, is_nv, w.out_features)
            for w in weights]
    if any(a is None for a in args):
        return None
    if warpspec.serves(x) and (len(weights) == 1 or x.shape[0] >= GROUPED_WARPSPEC_MIN_M):
        # one warp-specialised launch over the group, at the rows it serves
        return warpspec.grouped_linear(x, args, K, is_nv, caches=[w.cache for w in weights])
    return mma.grouped_linear(x, args, K, is_nv)


def make_plan(weight: Weight, device: torch.device):
    """The launch plan (qerl.kernels.plan.Plan) of ``weight`` on ``device``: what does not change
    between eager calls, resolved once (QuantLinear keeps it while its buffers are the same
    tensors); None when the weight's backend there is not Triton."""
    if resolve_backend(weight.backend, weight.fmt, device) != "triton":
        return None
    from qerl.kernels import common
    from qerl.kernels.plan import Plan

    t = weight.tensors
    return Plan(t["weight_packed"], t["weight_scale"], t.get("weight_global_scale"), common.scale_mode(weight.fmt),
                cache=weight.cache)


def decode(fmt: str, tensors: dict, dtype: torch.dtype = torch.bfloat16, rows: tuple[int, int] | None = None,
           cols: tuple[int, int] | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """W[rows[0]:rows[1], cols[0]:cols[1]] of a Triton-format weight decoded to ``dtype`` by the
    decode kernel, bit for bit qerl.formats.dequantize (column bounds on whole scale blocks), into
    ``out`` (2-D, unit column stride) or a new tensor."""
    from qerl.kernels import common, scratch

    return scratch.decode(tensors["weight_packed"], tensors["weight_scale"], tensors.get("weight_global_scale"),
                          common.scale_mode(fmt), dtype, rows, cols, out)


def linear_tuned(x: torch.Tensor, fmt: str, tensors: dict, kind: str | None = None, config: dict | None = None,
                 split_k: int | None = None, cache: dict | None = None) -> torch.Tensor:
    """The Triton forward with its heuristics overridden (benchmarks, tests): ``kind`` names the family
    instead of the choice by M: "gemv", "dot" or "scratch", or on the compute layout "mma" (the
    tensor-core kernel of qerl.kernels.mma) or "warpspec" (the warp-specialised Hopper kernel; bf16 x,
    sm_90); ``config`` and ``split_k`` replace the family's launch rule. The compute-layout families keep
    the layout in ``cache`` (as a QuantLinear's kernel cache) and raise ValueError for a weight without one."""
    from qerl.kernels import common, ops

    if kind in ("mma", "warpspec"):
        N = tensors["weight_packed"].shape[0]
        y = _mma_linear(x, fmt, tensors, N, x.shape[-1], cache if cache is not None else {}, kind, config, split_k)
        if y is None:
            raise ValueError(f"kind={kind!r}: this weight has no exact compute layout")
        return y
    return ops.launch_linear(x, tensors["weight_packed"], tensors["weight_scale"], tensors.get("weight_global_scale"),
                             common.scale_mode(fmt), kind=kind, config=config, split_k=split_k)


def grad_input_tuned(dy: torch.Tensor, fmt: str, tensors: dict, kind: str | None = None,
                     config: dict | None = None) -> torch.Tensor:
    """The Triton grad-input with its heuristics overridden: ``kind`` "fused" or "scratch", a ``config``."""
    from qerl.kernels import common, ops

    return ops.launch_grad_input(dy, tensors["weight_packed"], tensors["weight_scale"],
                                 tensors.get("weight_global_scale"), common.scale_mode(fmt), config=config, kind=kind)


def kernel_name(op: str, x: torch.Tensor, in_features: int, cached: bool = True) -> str:
    """The Triton kernel family ``op`` ("linear" / "grad_input") runs on x by default (benchmark rows)."""
    from qerl.kernels import ops

    return ops.kernel_name(op, x, in_features, cached)


def mma_config(M: int, N: int, K: int, device: torch.device, **override) -> dict:
    """The launch config the compute-layout mma kernel takes at M rows by its rule (mma.sync up to
    MMA_MAX_M rows, the warpgroup-MMA variant above on sm_90); ``override`` replaces parts of it
    (benchmark sweeps: ``linear_tuned(kind="mma", config=...)``)."""
    from qerl.kernels import mma

    return {**mma.pick_config(M, N, K, M > mma.MMA_MAX_M and mma.has_wgmma(device)), **override}


def lora_a_config(M: int, K: int, n: int, device: torch.device, rank: int = 32, **override) -> dict:
    """The launch config ``lora_a`` takes from LORA_A_DOT_MIN_M rows (the tiled kernel); ``override``
    (BLOCK_M, BLOCK_K, programs) replaces parts of the rule (benchmark sweeps)."""
    from qerl.kernels import common, fused

    return fused.lora_a_tiled_config(M, K, n, common.num_sms(device), rank, **override)


def lora_a_tuned(x: torch.Tensor, As: list, config: dict) -> torch.Tensor:
    """``lora_a`` by the tiled kernel with an explicit ``config`` (BLOCK_M, BLOCK_K, K_CHUNK, num_warps,
    num_stages): h [1, M, n r], final sums."""
    from qerl.kernels import fused

    return fused._lora_a_tiled(x, As, **config)


def lora_out_tuned(ys: list, h: torch.Tensor | None, Bs: list, biases: list, scaling: float,
                   out: torch.Tensor | None = None, config: dict | None = None) -> None:
    """``lora_out`` (``out`` given: ``lora_silu_mul`` into it) with its launch rule overridden by
    ``config`` (BLOCK_N, ROWS, num_warps)."""
    from qerl.kernels import fused

    fused._lora_out_launch(ys, h, Bs, biases, scaling, out=out, **(config or {}))


# Names the door serves from the Triton modules, imported on first use.
_LAZY = {
    "Plan": "plan",
    "MMA_IN_FLIGHT": "warpspec",  # whether the installed Triton keeps register-A warpgroup MMAs in flight
    "gumbel_argmax": "sampling",
    "decode_attention": "attention",
    "decode_attention_lora_a": "attention",
    "decode_attention_reference": "attention",
    **{name: "fused" for name in ("rmsnorm", "add_rmsnorm", "add_rmsnorm_lora_a", "rope_cache_write", "silu_mul",
                                  "lora_a", "lora_out", "lora_out_to", "lora_silu_mul", "lora_silu_mul_lora_a",
                                  "lora_rope_cache_write")},
}


def pdl(device: torch.device) -> bool:
    """Whether qerl's decode-step kernels launch on ``device`` with programmatic dependent launch."""
    from qerl.kernels import common

    return common.pdl(device)


def set_pdl(on: bool) -> bool:
    """Turn programmatic dependent launch on or off for launches made from now on (a kernel launch kept
    per weight keeps its setting: build a fresh model for an A/B); returns the previous setting."""
    from qerl.kernels import common

    return common.set_pdl(on)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'qerl.kernels' has no attribute {name!r}")
    return getattr(importlib.import_module(f"qerl.kernels.{module}"), name)


__all__ = ["linear", "grad_input", "grouped_linear", "make_plan", "decode", "Weight", "resolve_backend",
           "linear_tuned", "grad_input_tuned", "kernel_name", "mma_config", "lora_a_config", "lora_a_tuned", "lora_out_tuned",
           "scratch_bytes", "buffer_bytes", "release_scratch", "linear_reference", "grad_input_reference", "dequantize_fp32",
           "triton_available", "pdl", "set_pdl", "BACKENDS", "M32", "fmix32", "uniform_noise", "gumbel_argmax_torch", *_LAZY]
