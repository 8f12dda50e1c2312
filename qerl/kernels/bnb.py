"""NF4 through bitsandbytes' own kernels: the honest QLoRA baseline on the GPU.

qerl's NF4 buffers are byte-exact with bitsandbytes ``quantize_4bit(quant_type=BNB_QUANT_TYPE,
blocksize=64, compress_statistics=False)`` (qerl/formats/nf4.py): ``weight_packed`` [out, in/2]
holds bitsandbytes' packed bytes in the same order, ``weight_absmax`` [out*in/64] its fp32 absmax.
So a bitsandbytes ``QuantState`` can be built AROUND qerl's buffers (no copy of the weight, no
re-quantization), and ``bitsandbytes.matmul_4bit`` runs on them as it would inside a QLoRA
``Linear4bit``.

    state = quant_state(tensors, out_features, in_features, dtype)   # cheap; cache it per module
    y  = linear(x, tensors, state)        # bnb.matmul_4bit (differentiable in x)
    dx = grad_input(dy, tensors, state)   # what bnb's MatMul4Bit.backward computes

``grad_input`` is the body of ``bitsandbytes.autograd._functions.MatMul4Bit.backward`` (0.50):
``dy @ dequantize_4bit(B, state).to(dy.dtype)``, written out so that qerl's own autograd node
(qerl.qlinear._PackedMatmul) can call it.
"""

from __future__ import annotations

import functools

import torch

from qerl.formats.nf4 import BNB_QUANT_TYPE

BLOCK_SIZE = 64


def available() -> tuple[bool, str]:
    """Whether bitsandbytes can be imported, and why not if it cannot."""
    try:
        import bitsandbytes  # noqa: F401
    except Exception as e:  # noqa: BLE001 - ImportError, or a broken CUDA build raising at import
        return False, f"{type(e).__name__}: {e}"
    return True, ""


def require() -> None:
    ok, why = available()
    if not ok:
        raise RuntimeError(
            "nf4 on CUDA runs bitsandbytes' kernels (the QLoRA baseline), but bitsandbytes cannot be "
            f"imported ({why}). Install it (`pip install bitsandbytes`) or pass backend='reference' "
            "(qerl's dequantize-then-matmul in fp32: correct but slow)")


@functools.lru_cache(maxsize=None)
def _nf4_code(device: torch.device) -> torch.Tensor:
    # One tensor per device: building it is a host-to-device copy (a sync if done per call).
    from bitsandbytes.functional import get_4bit_type

    return get_4bit_type(BNB_QUANT_TYPE, device=device, blocksize=BLOCK_SIZE)


def quant_state(tensors: dict, out_features: int, in_features: int, dtype: torch.dtype):
    """A bitsandbytes QuantState that views qerl's nf4 buffers (absmax shared, nothing copied)."""
    from bitsandbytes.functional import QuantState

    absmax = tensors["weight_absmax"]
    if absmax.dtype != torch.float32:
        raise ValueError(f"weight_absmax must be float32 (bitsandbytes' absmax), got {absmax.dtype}")
    return QuantState(absmax=absmax.reshape(-1), shape=torch.Size([out_features, in_features]),
                      code=_nf4_code(absmax.device), blocksize=BLOCK_SIZE, quant_type=BNB_QUANT_TYPE, dtype=dtype)


def cached_quant_state(tensors: dict, out_features: int, in_features: int, dtype: torch.dtype,
                       cache: dict | None):
    """quant_state(...), reused from ``cache`` (a dict the caller owns, e.g. one per QuantLinear).

    The entry is keyed by dtype and is rebuilt when the absmax buffer is a different tensor (the
    module was moved with .to() or its buffers were reassigned).
    """
    if cache is None:
        return quant_state(tensors, out_features, in_features, dtype)
    absmax = tensors["weight_absmax"]
    key = ("bnb_nf4", dtype)
    hit = cache.get(key)
    if hit is not None and hit[0] is absmax:
        return hit[1]
    state = quant_state(tensors, out_features, in_features, dtype)
    cache[key] = (absmax, state)
    return state


def _packed(tensors: dict) -> torch.Tensor:
    # bitsandbytes' canonical layout of the packed weight is [(out*in)/2, 1]: the same bytes.
    return tensors["weight_packed"].view(-1, 1)


def linear(x: torch.Tensor, tensors: dict, state) -> torch.Tensor:
    """y = x W^T via bitsandbytes.matmul_4bit (differentiable with respect to x)."""
    import bitsandbytes as bnb

    return bnb.matmul_4bit(x, _packed(tensors), quant_state=state)


def grad_input(dy: torch.Tensor, tensors: dict, state) -> torch.Tensor:
    """dx = dy W as bitsandbytes' MatMul4Bit.backward computes it (dequantize_4bit + matmul)."""
    from bitsandbytes.functional import dequantize_4bit

    return torch.matmul(dy, dequantize_4bit(_packed(tensors), state).to(dy.dtype))
