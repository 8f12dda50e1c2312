"""Launches of the FP4 Triton kernels by M, and the torch.library custom ops around them.

``launch_linear`` picks a family per call: the GEMV (qerl.kernels.gemv) for M <= GEMV_MAX_M, the
tiled tensor-core kernel (qerl.kernels.dot) up to the scratch threshold, the decode + cuBLAS path
(qerl.kernels.scratch) above it; ``launch_grad_input`` the scratch path (or the tiled backward
kernel when asked for). The custom ops (one forward and one grad-input op per scale mode, with
fake and autograd registrations) make them opaque to torch.compile and CUDA-graph capturable (no
host syncs, no allocations once warm).
"""

from __future__ import annotations

import torch
import triton

from qerl.kernels import common, scratch
from qerl.kernels.common import INTERPRETED, as_rows, check_input, int32_words, scale_bytes, scale_mode
from qerl.kernels.dot import _bwd_dot_kernel, _fwd_dot_kernel
from qerl.kernels.gemv import _fwd_gemv_kernel

# ----------------------------------------------------------------------------------------------
# configs

# Largest M served by the packed-decode GEMV kernel, and by the 16-row tensor-core kernel.
GEMV_MAX_M = 2  # H100: the GEMV took 218 / 228 us for the 7B layer at M = 3 / 4, the 16-row kernel 151 at M = 8
SKINNY_MAX_M = 16
# Split-K of the tensor-core kernel: about WAVES * sms programs for 16-row tiles (M <= SKINNY_MAX_M),
# WAVES_MID * sms for larger tiles, at most MAX_SPLIT_MID splits above 16 rows, and at least
# MIN_TILES_PER_SPLIT K tiles per split (the last program of a tile sums every split's partial, so
# many thin splits cost more than they hide). From an H100 split sweep (results/kernels/NOTES.md,
# 12 shapes of three families, M = 8-64): at M = 64,
# k/v [512, 3584] 29.7 -> 14.4 us, q/o 30.7 -> 20.1, [1024, 4096] 41.2 -> 15.2 against the old rule
# (WAVES * sms programs, one K tile per split allowed). The GEMV keeps WAVES and one tile: its
# partials are single rows, and the most splits won on the small matrices (k/v at M = 1: 5.7 us).
MAX_SPLIT_MID = 8
MIN_TILES_PER_SPLIT = 4


def pick_config(kind: str, M: int, N: int, K: int, is_nv: bool) -> dict:
    """Heuristic launch config for ``kind`` in {"gemv", "dot", "bwd"} (overridable)."""
    # Winners of the H100 sweep of 2026-11-22 (benchmarks/bench_kernels.py --sweep-only, Qwen2.5-7B
    # shapes, results/kernels/h100_sweep.json); "large" = N * K >= 2^25 (the 7B-32B MLP matrices).
    large = N * K >= (1 << 25)
    if kind == "gemv":
        bm = 1 if M <= 1 else triton.next_power_of_2(M)
        # 64 columns a tile on the large matrices (gate/up 22.9 vs 25.3 us, down 23.7 vs 26.7 at 7B),
        # 128 on the attention ones (q/o 7.7 vs 7.8 us).
        return dict(BLOCK_M=bm, BLOCK_N=64 if large else 128, GROUPS=8 if is_nv else 4, ACC_F32=False,
                    num_warps=4, num_stages=2)
    if kind == "dot":
        if M <= SKINNY_MAX_M:  # M = 8: down 36.3 (x @ W^T) vs 39.3 us (swap); q/o 11.8 (64x64 swap) vs 13.2
            if large:
                return dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=64, GROUP_M=1, SWAP_AB=False, num_warps=4, num_stages=4)
            return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, GROUP_M=1, SWAP_AB=True, num_warps=4, num_stages=4)
        if M <= 64:
            return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, SWAP_AB=True, num_warps=4, num_stages=4)
        if M >= 1024 and N >= 16384:  # gate/up at M = 2048: 734 vs 781 us (down, N = 3584: 961 vs 882)
            return dict(BLOCK_M=256, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, SWAP_AB=True, num_warps=8, num_stages=3)
        return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, SWAP_AB=True, num_warps=4, num_stages=4)
    if kind == "bwd":
        # the kernel's own config (the H100 sweep timed a rewrite of it, since reverted)
        return dict(BLOCK_M=128, BLOCK_K=64, BLOCK_R=64, GROUP_M=8, num_warps=4, num_stages=4)
    raise ValueError(f"kind must be one of ('gemv', 'dot', 'bwd'), got {kind!r}")


def _fit(cfg: dict, K: int) -> dict:
    """Shrink the K tile for small K (tiles must stay >= 16 for tl.dot)."""
    cfg = dict(cfg)
    if "BLOCK_K" in cfg:
        cfg["BLOCK_K"] = max(32, min(cfg["BLOCK_K"], triton.next_power_of_2(K)))
    return cfg


# ----------------------------------------------------------------------------------------------
# launches


def linear_launch(M: int, N: int, K: int, is_nv: bool, device: torch.device, kind: str | None,
                   config: dict | None, split_k: int | None, has_words: bool) -> tuple:
    """(kind, grid, tiles_per_split, ws_numel, n_tiles, meta, num_warps, num_stages) of one launch."""
    if kind is None:
        kind = "gemv" if M <= GEMV_MAX_M and has_words else "dot"
    cfg = _fit(config or pick_config(kind, M, N, K, is_nv), K)
    sms = common.num_sms(device)
    meta = {k: v for k, v in cfg.items() if k not in ("num_warps", "num_stages")}
    if kind == "gemv":
        if M > cfg["BLOCK_M"] or cfg["BLOCK_M"] > 16:
            raise ValueError(f"the gemv kernel serves M <= BLOCK_M <= 16, got M={M}, BLOCK_M={cfg['BLOCK_M']}")
        if not has_words:
            raise ValueError("the gemv kernel reads weight_packed as int32 words: it must be contiguous")
        wpb = 2 if is_nv else 4
        k_tiles = triton.cdiv(K // 8 // wpb, cfg["GROUPS"])
        n_tiles = triton.cdiv(N, cfg["BLOCK_N"])
        split = split_k or common.split(n_tiles, k_tiles, sms)
    elif kind == "dot":
        k_tiles = triton.cdiv(K, cfg["BLOCK_K"])
        n_tiles = triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"])
        if split_k is None:  # split K only when the output tiles alone cannot fill the GPU
            skinny = cfg["BLOCK_M"] <= SKINNY_MAX_M
            split = (common.split(n_tiles, k_tiles, sms, None if skinny else MAX_SPLIT_MID,
                                  common.WAVES if skinny else common.WAVES_MID, MIN_TILES_PER_SPLIT)
                     if n_tiles < 2 * sms else 1)
        else:
            split = split_k
        meta.setdefault("SWAP_AB", True)  # configs written before these options existed
        meta["EVEN_K"] = K % cfg["BLOCK_K"] == 0
        meta["F32_DOT"] = INTERPRETED
    else:
        raise ValueError(f"kind must be one of ('gemv', 'dot'), got {kind!r}")
    tps = triton.cdiv(k_tiles, split)
    split = triton.cdiv(k_tiles, tps)
    # (without a split the kernel never touches the workspace: do not grow it for big GEMMs)
    ws_numel = 0 if split == 1 else split * M * N
    meta["IS_NV"] = is_nv
    return kind, (n_tiles, split), tps, ws_numel, (n_tiles if split > 1 else 0), meta, cfg["num_warps"], cfg["num_stages"]


def linear_call(x2, packed, w32, scale_u8, gs_arg, out, launch) -> tuple:
    """(kernel, grid, args, kwargs) of one fused forward launch."""
    kind, grid, tps, ws_numel, n_cnt, meta, warps, stages = launch
    M, K = x2.shape
    N = packed.shape[0]
    ws, cnt = common.workspace(x2.device, ws_numel, n_cnt)
    if kind == "gemv":
        acc_f32 = bool(meta.get("ACC_F32", False) or x2.dtype == torch.float32)
        x32 = x2
        if not acc_f32:
            if x2.stride(0) % 2 or x2.storage_offset() % 2:
                x2 = x2.clone(memory_format=torch.contiguous_format)  # contiguous() keeps an odd offset
            x32 = x2.view(torch.int32)
        args = (x2, x32, w32, scale_u8, gs_arg, out, ws, cnt, M, N, K, x2.stride(0), x32.stride(0), out.stride(0),
                w32.stride(0), tps)
        return _fwd_gemv_kernel, grid, args, dict(meta, ACC_F32=acc_f32, USE_ASM=not INTERPRETED,
                                                   num_warps=warps, num_stages=stages)
    args = (x2, packed, scale_u8, gs_arg, out, ws, cnt, M, N, K, x2.stride(0), out.stride(0), tps)
    # fp32 activations never take the swapped (register-A) order: Triton leaves a split tf32
    # register-A MMA in flight with its A registers unprotected (qerl.kernels.dot, "Operand order").
    swap = bool(meta["SWAP_AB"]) and x2.dtype != torch.float32
    return _fwd_dot_kernel, grid, args, dict(meta, SWAP_AB=swap, num_warps=warps, num_stages=stages)


def _run_linear(x2, packed, w32, scale_u8, gs_arg, is_nv, out, launch) -> None:
    fn, grid, args, kwargs = linear_call(x2, packed, w32, scale_u8, gs_arg, out, launch)
    fn[grid](*args, **kwargs)


def launch_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, gs: torch.Tensor | None,
                  is_nv: bool, kind: str | None = None, config: dict | None = None,
                  split_k: int | None = None) -> torch.Tensor:
    """y = x W^T. ``kind`` ("gemv", "dot", "scratch") / ``config`` / ``split_k`` override the
    heuristics (benchmarks, tests)."""
    N, KH = packed.shape
    K = 2 * KH
    check_input(x, packed, scale, gs, is_nv, K)
    lead = x.shape[:-1]
    x2 = as_rows(x, K)
    M = x2.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return out.reshape(*lead, N)
    scale_u8 = scale_bytes(scale)
    gs_arg = gs if gs is not None else packed  # unused when not NVFP4
    if kind == "scratch" or (kind is None and config is None and scratch.use_scratch("linear", M)):
        scratch.scratch_linear(x2, packed, scale_u8, gs_arg, is_nv, out)
        return out.reshape(*lead, N)
    w32 = int32_words(packed)
    launch = linear_launch(M, N, K, is_nv, x.device, kind, config, split_k, w32 is not None)
    _run_linear(x2, packed, w32, scale_u8, gs_arg, is_nv, out, launch)
    return out.reshape(*lead, N)


def launch_grad_input(dy: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, gs: torch.Tensor | None,
                      is_nv: bool, config: dict | None = None, kind: str | None = None) -> torch.Tensor:
    """dx = dy W. ``kind`` "fused" or "scratch" overrides the choice by M."""
    N, KH = packed.shape
    K = 2 * KH
    check_input(dy, packed, scale, gs, is_nv, N)
    lead = dy.shape[:-1]
    dy2 = as_rows(dy, N)
    M = dy2.shape[0]
    dx = torch.empty((M, K), dtype=dy.dtype, device=dy.device)
    if M == 0:
        return dx.reshape(*lead, K)
    gs_arg = gs if gs is not None else packed
    if kind == "scratch" or (kind is None and config is None and scratch.use_scratch("grad_input", M)):
        scratch.scratch_grad_input(dy2, packed, scale_bytes(scale), gs_arg, is_nv, dx)
        return dx.reshape(*lead, K)
    if kind not in (None, "fused"):
        raise ValueError(f"kind must be None, 'fused' or 'scratch', got {kind!r}")
    cfg = _fit(config or pick_config("bwd", M, N, K, is_nv), K)
    if M <= 16:
        cfg["BLOCK_M"] = 16  # a 128-row tile would be mostly padding
    if dy2.dtype == torch.float32 and not INTERPRETED:
        # Triton 3.6 fails to compile this kernel for sm_90 with fp32 tiles of 64 rows or more
        # (TritonGPUOptimizeDotOperands; seen on an H200, reproduced by compiling on the CPU);
        # 32 rows compile. fp32 is for checks and tests, not for speed.
        cfg["BLOCK_M"] = min(cfg["BLOCK_M"], 32)
    if N < cfg["BLOCK_R"]:
        cfg["BLOCK_R"] = max(16, triton.next_power_of_2(N))
    meta = {k: v for k, v in cfg.items() if k not in ("num_warps", "num_stages")}
    grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(K, cfg["BLOCK_K"]),)
    _bwd_dot_kernel[grid](
        dy2, packed, scale_bytes(scale), gs_arg, dx,
        M, N, K, dy2.stride(0), dx.stride(0),
        IS_NV=is_nv, F32_DOT=INTERPRETED, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **meta)
    return dx.reshape(*lead, K)



# ----------------------------------------------------------------------------------------------
# custom ops: opaque to torch.compile, graph-capturable (no host syncs, no allocations once warm)


# One op pair per scale mode: E4M3 scales with a global divisor (the weight's three tensors), E8M0
# scales (two tensors).


@torch.library.custom_op("qerl::fp4_e4m3_linear", mutates_args=())
def fp4_e4m3_linear(x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                    weight_global_scale: torch.Tensor) -> torch.Tensor:
    """y = x W^T for an FP4 weight with E4M3 block scales and a global divisor (compressed-tensors layout)."""
    return launch_linear(x, weight_packed, weight_scale, weight_global_scale, True)


@torch.library.custom_op("qerl::fp4_e8m0_linear", mutates_args=())
def fp4_e8m0_linear(x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """y = x W^T for an FP4 weight with E8M0 block scales (compressed-tensors layout)."""
    return launch_linear(x, weight_packed, weight_scale, None, False)


@torch.library.custom_op("qerl::fp4_e4m3_grad_input", mutates_args=())
def fp4_e4m3_grad_input(dy: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                        weight_global_scale: torch.Tensor) -> torch.Tensor:
    """dx = dy W for an FP4 weight with E4M3 block scales and a global divisor."""
    return launch_grad_input(dy, weight_packed, weight_scale, weight_global_scale, True)


@torch.library.custom_op("qerl::fp4_e8m0_grad_input", mutates_args=())
def fp4_e8m0_grad_input(dy: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """dx = dy W for an FP4 weight with E8M0 block scales."""
    return launch_grad_input(dy, weight_packed, weight_scale, None, False)


@fp4_e4m3_linear.register_fake
def _(x, weight_packed, weight_scale, weight_global_scale):
    return x.new_empty((*x.shape[:-1], weight_packed.shape[0]))


@fp4_e8m0_linear.register_fake
def _(x, weight_packed, weight_scale):
    return x.new_empty((*x.shape[:-1], weight_packed.shape[0]))


@fp4_e4m3_grad_input.register_fake
def _(dy, weight_packed, weight_scale, weight_global_scale):
    return dy.new_empty((*dy.shape[:-1], weight_packed.shape[1] * 2))


@fp4_e8m0_grad_input.register_fake
def _(dy, weight_packed, weight_scale):
    return dy.new_empty((*dy.shape[:-1], weight_packed.shape[1] * 2))


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[1:])  # packed buffers: frozen, no gradient, no copies


def _e4m3_backward(ctx, dy):
    return torch.ops.qerl.fp4_e4m3_grad_input(dy, *ctx.saved_tensors), None, None, None


def _e8m0_backward(ctx, dy):
    return torch.ops.qerl.fp4_e8m0_grad_input(dy, *ctx.saved_tensors), None, None


fp4_e4m3_linear.register_autograd(_e4m3_backward, setup_context=_setup_context)
fp4_e8m0_linear.register_autograd(_e8m0_backward, setup_context=_setup_context)

# (forward op, grad-input op) by scale mode (is_nv)
_OPS = {True: (torch.ops.qerl.fp4_e4m3_linear, torch.ops.qerl.fp4_e4m3_grad_input),
        False: (torch.ops.qerl.fp4_e8m0_linear, torch.ops.qerl.fp4_e8m0_grad_input)}


def linear(x: torch.Tensor, fmt: str, *tensors: torch.Tensor) -> torch.Tensor:
    """y = x W^T through the custom op of fmt's scale mode (the tensors in the spec's order)."""
    return _OPS[scale_mode(fmt)][0](x, *tensors)


def grad_input(dy: torch.Tensor, fmt: str, *tensors: torch.Tensor) -> torch.Tensor:
    """dx = dy W through the custom op of fmt's scale mode."""
    return _OPS[scale_mode(fmt)][1](dy, *tensors)


def kernel_name(op: str, x: torch.Tensor, in_features: int, cached: bool = True) -> str:
    """Which family a Triton ``op`` ("linear" / "grad_input") on x runs by default: "mma" / "warpspec" / "wgmma"
    (the compute-layout kernel, when the caller passes a kernel cache), "gemv", "dot-splitk",
    "dot", "scratch" (decode + cuBLAS) or "bwd-dot" (benchmark rows)."""
    M = x.numel() // max(x.shape[-1], 1)
    if op == "grad_input":
        return "scratch" if scratch.use_scratch("grad_input", M) else "bwd-dot"
    from qerl.kernels import mma, warpspec

    if cached and mma.applies(x, in_features):
        if warpspec.serves(x.reshape(-1, in_features)):
            return "warpspec"
        return "mma" if M <= mma.MMA_MAX_M else "wgmma"
    if scratch.use_scratch("linear", M):
        return "scratch"
    return "gemv" if M <= GEMV_MAX_M else ("dot-splitk" if M <= SKINNY_MAX_M else "dot")

