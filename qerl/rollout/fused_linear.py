"""Linears that share an input (q/k/v, gate/up) in few launches, for the fused decode step.

``grouped_linears(x, modules)`` returns [m(x) for m in modules] computed as: the modules' base
matmuls (4-bit weights of one format at decode batches on the GPU: ONE launch of
qerl.kernels.grouped_linear for the group; else each module's 4-bit kernel or F.linear), then ONE
``lora_a`` launch for the adapters of the group (stacked A, read live from the parameters; on a GPU from
LORA_A_BESIDE_MIN_M rows on a side stream, beside the base matmuls) and ONE
``lora_out`` launch that adds bias and ``scaling * h B^T`` to every base output in place. A QuantLinear
with LoRA thus costs its base GEMV plus 2/n kernels instead of base + 5 (bias add, two casts, the
A GEMM, the B addmm). Modules the group cannot take (another Linear type, LoRA dropout in training
mode) run their own forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from qerl import formats, kernels
from qerl.kernels import lora_a, lora_out, lora_silu_mul, lora_silu_mul_lora_a, silu_mul
from qerl.qlinear import QuantLinear


@dataclass
class _Parts:
    base: object  # x [M, K] -> y [M, N] (bias included where free: F.linear)
    bias: torch.Tensor | None  # added by lora_out
    A: torch.Tensor | None
    B: torch.Tensor | None
    scaling: float

    def key(self):
        """Modules with equal keys share one lora_a / lora_out launch."""
        return (self.A is not None, self.bias is not None, None if self.A is None else (self.A.shape[0], self.A.dtype),
                self.scaling)


def _parts(m: nn.Module) -> _Parts | None:
    if isinstance(m, QuantLinear):
        lora = m.adapters_active
        if lora and m.training and not isinstance(m.lora_dropout, nn.Identity):
            return None  # dropout is live in training mode: the module's own forward
        A, B = (m.lora_A.weight, m.lora_B.weight) if lora else (None, None)
        if formats.is_dense(m.fmt):
            return _Parts(lambda x: F.linear(x, m.weight, m.bias), None, A, B, m.scaling)
        return _Parts(lambda x: kernels.linear(x, m.fmt, m.packed_tensors(), m.out_features, m.in_features,
                                               backend=m.backend, cache=m.kernel_cache), m.bias, A, B, m.scaling)
    if type(m) is nn.Linear:
        return _Parts(lambda x: F.linear(x, m.weight, m.bias), None, None, None, 0.0)
    return None


def _mma_group(x: torch.Tensor, modules: list[nn.Module]) -> list[torch.Tensor] | None:
    """The base outputs of 2-3 4-bit QuantLinears of one format on the same input in ONE launch
    (kernels.grouped_linear: decode batches on the GPU), or None where that kernel does not apply."""
    if not 2 <= len(modules) <= 3 or not all(isinstance(m, QuantLinear) for m in modules):
        return None
    weights = [m.kernel_weight() for m in modules]
    if any(w is None for w in weights):
        return None
    return kernels.grouped_linear(x, weights)


def _lora_group_parts(modules: list[nn.Module]) -> list[_Parts] | None:
    """The parts of ``modules`` if they form one LoRA group (<= 3, same rank, scaling, bias presence), else None."""
    parts = [_parts(m) for m in modules]
    if len(parts) > 3 or any(p is None or p.A is None for p in parts) or len({p.key() for p in parts}) != 1:
        return None
    return parts


def stacked_A(modules: list[nn.Module]) -> list[torch.Tensor] | None:
    """The LoRA A weights of ``modules`` if they form one LoRA group, so that their ``lora_a`` can run inside
    the kernel that feeds them (the norm, the attention, SiLU * up); else None."""
    parts = _lora_group_parts(modules)
    return None if parts is None else [p.A for p in parts]


def lora_group(modules: list[nn.Module]) -> tuple | None:
    """(As, Bs, biases, scaling) of ``modules`` if they form one LoRA group (biases [] when they have none), so
    that a fused kernel can apply their epilogue; else None."""
    parts = _lora_group_parts(modules)
    if parts is None:
        return None
    return ([p.A for p in parts], [p.B for p in parts], [p.bias for p in parts] if parts[0].bias is not None else [],
            float(parts[0].scaling))


# lora_a beside the base matmuls: both read x only, so from LORA_A_BESIDE_MIN_M rows the group's lora_a runs
# on a side stream while the current stream runs the base matmuls, and the current stream waits for it
# before lora_out. The matmuls leave room on each SM for lora_a's few small programs. 7B decode step, H200,
# Triton 3.7.1, ms, in line -> beside (results/decode_profile/NOTES.md): NVFP4 bs1 3.11 -> 3.18, bs8 3.76 ->
# 3.62, bs16 4.37 -> 3.90, bs64 6.10 -> 5.37; bf16 bs16 6.41 -> 6.09, bs64 6.85 -> 6.55. Off: in stream
# order (A/B runs).
LORA_A_BESIDE = True
LORA_A_BESIDE_MIN_M = 8
_SIDE: dict = {}


def _lora_a_start(x: torch.Tensor, As: list[torch.Tensor]):
    """Start h = lora_a(x, As); returns a function that gives h, ready on the current stream. On a GPU with
    LORA_A_BESIDE, from LORA_A_BESIDE_MIN_M rows, lora_a runs on a side stream that first waits for
    everything the current stream has queued (so it never overwrites memory that earlier work still reads);
    the caller keeps x alive until it takes h (the current stream then waits for the side stream, so x is
    read before it can be freed)."""
    if not (LORA_A_BESIDE and x.is_cuda and x.shape[0] >= LORA_A_BESIDE_MIN_M):
        h = lora_a(x, As)
        return lambda: h
    main = torch.cuda.current_stream(x.device)
    side = _SIDE.get(x.device)
    if side is None:
        side = _SIDE[x.device] = torch.cuda.Stream(x.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        h = lora_a(x, As)

    def take():
        main.wait_stream(side)
        return h
    return take


def grouped_linears(x: torch.Tensor, modules: list[nn.Module], h: torch.Tensor | None = None,
                    epilogue: bool = True) -> list[torch.Tensor]:
    """[m(x) for m in modules] for x [M, K] (outputs [M, N_i]), grouped as the module docstring says.
    ``h``: the group's ``lora_a`` output when computed already (for ``stacked_A(modules)``).
    ``epilogue`` False (a ``lora_group``): the base outputs only, for a kernel that adds bias and LoRA itself."""
    x = x.contiguous()  # the kernels take rows of stride K
    parts = [_parts(m) for m in modules]
    launches = []  # (outputs, has_lora, has_bias, scaling, h or a function that gives it); none without epilogue
    if epilogue and h is not None:  # one LoRA group (stacked_A)
        launches.append((list(range(len(parts))), True, parts[0].bias is not None, parts[0].scaling, lambda: h))
    elif epilogue:
        groups: dict = {}
        for i, p in enumerate(parts):
            if p is not None and (p.A is not None or p.bias is not None):
                groups.setdefault(p.key(), []).append(i)
        for (has_lora, has_bias, _, scaling), members in groups.items():
            for j in range(0, len(members), 3):  # the kernels take up to three outputs
                idx = members[j:j + 3]
                hs = _lora_a_start(x, [parts[i].A for i in idx]) if has_lora else None
                launches.append((idx, has_lora, has_bias, scaling, hs))
    ys = _mma_group(x, modules) if all(p is not None for p in parts) else None  # one launch for the group
    if ys is None:
        ys = [(p.base(x) if p is not None else m(x)).contiguous() for p, m in zip(parts, modules)]  # rows of stride N
    for idx, has_lora, has_bias, scaling, hs in launches:
        lora_out([ys[i] for i in idx], hs() if has_lora else None, [parts[i].B for i in idx] if has_lora else [],
                 [parts[i].bias for i in idx] if has_bias else [], float(scaling))
    return ys


def silu_mlp_input(x: torch.Tensor, gate: nn.Module, up: nn.Module, h: torch.Tensor | None = None,
                   next_A: torch.Tensor | None = None):
    """SiLU(gate(x)) * up(x) for x [M, K]: the two base matmuls, then (with LoRA or biases) one
    ``lora_a`` (unless h is given; beside the matmuls) and one ``lora_silu_mul`` launch; else ``silu_mul``.
    ``next_A`` (the LoRA A of the Linear the result feeds): returns (result, partial sums of result next_A^T
    for ``grouped_linears``' h, or None where the LoRA launch does not run and the Linear computes them)."""
    x = x.contiguous()
    pg, pu = _parts(gate), _parts(up)
    if pg is None or pu is None or pg.key() != pu.key() or (pg.A is None and pg.bias is None):
        act = silu_mul(*grouped_linears(x, [gate, up], h))
        return act if next_A is None else (act, None)
    hs = (lambda: h) if h is not None or pg.A is None else _lora_a_start(x, [pg.A, pu.A])
    gu = _mma_group(x, [gate, up])
    g, u = gu if gu is not None else (pg.base(x).contiguous(), pu.base(x).contiguous())
    h = hs()
    Bs, biases = [pg.B, pu.B] if h is not None else [], [pg.bias, pu.bias] if pg.bias is not None else []
    if next_A is not None:
        return lora_silu_mul_lora_a(g, u, h, Bs, biases, float(pg.scaling), next_A)
    return lora_silu_mul(g, u, h, Bs, biases, float(pg.scaling))
