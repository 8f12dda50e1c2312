"""What the 4-bit kernel families share: split-K, workspaces, launch helpers, SM counts, checks.

Weights stay exactly as on disk (CONTRACTS.md): ``weight_packed`` uint8 [N, K/2] (element 2j in
the low nibble of byte j), ``weight_scale`` [N, K/B] (E4M3 scales: float8_e4m3fn, B=16, with an
fp32 ``weight_global_scale`` [1], a divisor; E8M0 scales: uint8, B=32). The kernels take a bool
``is_nv`` (their constexpr ``IS_NV``): True for E4M3 scales with a global divisor, False for E8M0
ones; ``scale_mode`` maps a format's spec to it.

Split-K partial sums are reduced without extra launches and in a fixed order: each program stores
its fp32 partial tile in its own slice of a per-device workspace, bumps a per-tile counter, and the
last program to arrive sums the slices in split order, stores the output in x.dtype and resets the
counter, so results are bitwise repeatable. Workspaces grow (a fresh allocation, the old one
retired, never freed) only when a larger launch is seen, so warm up once before capturing a CUDA
graph.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from qerl import formats

# triton.jit reads TRITON_INTERPRET when a kernel module is imported, not when a kernel runs.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

# The (scale kind, block size) pairs the FP4 kernels decode: E4M3 scales of 16 weights with a global
# divisor (IS_NV), E8M0 scales of 32.
_SCALE_MODES = {("e4m3", 16, True): True, ("e8m0", 32, False): False}


def scale_mode(fmt: str) -> bool:
    """``is_nv`` of the FP4 kernels for a registered format: True for E4M3 block scales of 16 with a
    global divisor, False for E8M0 scales of 32; ValueError for a format they cannot decode."""
    spec = formats.get(fmt)
    mode = _SCALE_MODES.get((spec.scale_kind, spec.block_size, spec.has_global_scale))
    if spec.code != "e2m1" or mode is None:
        raise ValueError(f"the FP4 kernels decode E2M1 codes with E4M3 scales of 16 and a global scale, or E8M0 "
                         f"scales of 32; format {fmt!r} has code={spec.code!r}, scale_kind={spec.scale_kind!r}, "
                         f"block_size={spec.block_size}, global scale: {spec.has_global_scale}")
    return mode


# ----------------------------------------------------------------------------------------------
# shared Triton helpers: scale decoding, the split-K epilogue


@triton.jit
def decode_scale(s, IS_NV: tl.constexpr):
    """Scale bytes -> fp32: E4M3 value times 2^-8 (NVFP4) or 2^(e-127) (MXFP4 E8M0)."""
    s = s.to(tl.int32)
    if IS_NV:
        h = (((s & 0x7F) << 7) | ((s & 0x80) << 8)).to(tl.int16).to(tl.float16, bitcast=True)
        return h.to(tl.float32)
    else:
        return (s << 23).to(tl.float32, bitcast=True)


@triton.jit
def rnd(x, TY: tl.constexpr):
    """fp32 -> TY, round to nearest even. bf16 by integer ops: the same bits on the GPU and under
    the interpreter (whose own float->bf16 cast truncates), so the CPU tests can check exactness."""
    if TY == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        y = b.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        y = x.to(TY)
    return y


@triton.jit
def splitk_epilogue(acc, out_ptr, ws_ptr, cnt_ptr, offs_m, offs_n, M, N, stride_om, tile_id):
    """Store acc [BM, BN] (already scaled) directly, or reduce it across the split-K programs.

    Each split stores its partial tile in its own slice of the fp32 workspace [split, M, N], bumps
    the tile's counter, and the last program to arrive adds the slices in split order 0, 1, ...
    (the same order whoever arrives last), so the result is bitwise repeatable."""
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    n_split = tl.num_programs(1)
    if n_split == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        pid_k = tl.program_id(1).to(tl.int64)
        mn = (pid_k * 0 + M) * N  # int64 (M may be the constant 1 when Triton specialises it)
        offs = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
        tl.store(ws_ptr + pid_k * mn + offs, acc, mask=mask)
        # acq_rel: our partial is visible before the count; the last arriver sees every partial.
        count = tl.atomic_add(cnt_ptr + tile_id, 1, sem="acq_rel")
        if count == n_split - 1:
            total = tl.zeros_like(acc)
            for i in range(0, n_split):  # fixed order: bitwise the same result every call
                total += tl.load(ws_ptr + i * mn + offs, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(cnt_ptr + tile_id, 0)


# ----------------------------------------------------------------------------------------------
# programmatic dependent launch (sm_90+)
#
# A kernel launched with ``launch_pdl=True`` may be scheduled while the kernel before it on the stream is
# still running: its programs wait (``griddepcontrol.wait``, which returns once that kernel has finished
# and its writes are visible) before they touch global memory. What this hides is the gap between two
# dependent kernels (launch, programs placed on SMs), which the decode step pays ~400 times. The wait precedes every load and store, so the math and the bits are unchanged.
# The rule: a kernel gets ``launch_pdl=True`` only together with its constexpr ``PDL=True`` (``pdl_args``);
# a PDL launch of a kernel without the wait could read its inputs before they are written.
# QERL_PDL=0 (read at import, like TRITON_INTERPRET) turns it off, for A/B timings.

try:
    from triton.language.extra.cuda import gdc_wait
    _HAVE_GDC = True
except ImportError:  # a Triton without grid dependency control
    _HAVE_GDC = False

PDL = _HAVE_GDC and not INTERPRETED and os.environ.get("QERL_PDL", "1") != "0"
_PDL_DEVICE: dict = {}


def set_pdl(on: bool) -> bool:
    """PDL on or off for launches made from now on (never on without grid dependency control or under the
    interpreter); returns the previous setting."""
    global PDL
    before, PDL = PDL, bool(on) and _HAVE_GDC and not INTERPRETED
    return before


def pdl(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with programmatic dependent launch: PDL on, a CUDA GPU of
    compute capability 9.0 or newer (griddepcontrol is sm_90 PTX)."""
    if not PDL or device.type != "cuda":
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _PDL_DEVICE:
        _PDL_DEVICE[idx] = torch.cuda.get_device_capability(idx)[0] >= 9
    return _PDL_DEVICE[idx]


def pdl_args(device: torch.device) -> dict:
    """The launch keywords of a kernel that calls ``pdl_enter(PDL)`` first (its constexpr ``PDL``
    defaults to False): its constexpr and Triton's launch option together, or nothing."""
    return {"PDL": True, "launch_pdl": True} if pdl(device) else {}


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """First statement of a kernel launched through ``pdl_args``: wait for the kernel before it (a no-op
    without PDL). No early ``launch_dependents``: the next kernel then launches as this one's programs
    exit, onto SMs this one has freed, rather than onto whichever SMs had room while it ran (that
    skewed the split-K 4-bit kernels' placement: 7B NVFP4 step at 4 / 16 rows 4.01 / 5.18 -> 4.83 / 6.10
    ms; results/decode_profile/NOTES.md)."""
    if PDL:
        gdc_wait()


# ----------------------------------------------------------------------------------------------
# split-K and SM counts

# Split-K: about WAVES * sms programs for skinny tiles, WAVES_MID * sms for larger ones (the last
# program of a tile sums every split's partial, so many thin splits cost more than they hide).
WAVES = 4
WAVES_MID = 2

_SM_COUNT: dict = {}


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (4 off CUDA: small interpreter grids that still split K)."""
    if device.type != "cuda":
        return 4  # interpreter: small grids keep the CPU tests fast while still splitting K
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def split(n_tiles: int, k_tiles: int, sms: int, max_split: int | None = None, waves: int = WAVES,
          min_tiles: int = 1) -> int:
    """Split K so that about waves * sms programs run, at most max_split splits and at least
    min_tiles K tiles a split (never more splits than K tiles)."""
    want = max(1, -(-waves * sms // max(n_tiles, 1)))
    if max_split is not None:
        want = min(want, max_split)
    return max(1, min(want, k_tiles // max(min_tiles, 1)))


# ----------------------------------------------------------------------------------------------
# workspaces

_WORKSPACE: dict = {}
# Workspaces replaced by larger ones. Never freed: a CUDA graph captured earlier (the rollout engine's
# decode steps) holds raw pointers to the buffer it was captured with and keeps replaying into it;
# freeing it would let the allocator hand that memory to other tensors while replays still write
# split-K partial sums there (it did: wrong rollout log-probs, see LOG.md 2026-11-22). Their
# counters stay zeroed: every split-K launch leaves them as it found them.
RETIRED: list = []


def workspace(device: torch.device, n_out: int, n_tiles: int, lane: str = "main") -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 split-K workspace and (zeroed) tile counters for this device and ``lane``.

    split * M * N floats (one slice per split, overwritten each call). One pair per device and lane, not
    per stream, so that a CUDA graph captured on a side stream reuses the one allocated during
    warm-up; split-K launches of one lane must therefore not run concurrently. Lane "main": the
    matmuls and attention, in stream order; lane "lora_a": the tiled lora_a, which the fused decode step
    runs beside the base matmuls (qerl.rollout.fused_linear). A buffer that is outgrown is retired, not
    freed (``RETIRED``); growth doubles, so the retired ones sum to less than the live one.
    """
    key = (str(device), lane)
    ws, cnt = _WORKSPACE.get(key, (None, None))
    if ws is None or ws.numel() < n_out:
        if ws is not None:
            RETIRED.append(ws)
        ws = torch.zeros(max(n_out, 2 * (ws.numel() if ws is not None else 0), 1 << 16),
                         dtype=torch.float32, device=device)
    if cnt is None or cnt.numel() < n_tiles:
        if cnt is not None:
            RETIRED.append(cnt)
        cnt = torch.zeros(max(n_tiles, 2 * (cnt.numel() if cnt is not None else 0), 1 << 12),
                          dtype=torch.int32, device=device)
    _WORKSPACE[key] = (ws, cnt)
    return ws, cnt


# ----------------------------------------------------------------------------------------------
# argument checks and views


def as_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """x as [M, n] with contiguous rows, the layout every kernel takes (a view when x already has it)."""
    x2 = x.reshape(-1, n)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def check_input(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, gs: torch.Tensor | None,
           is_nv: bool, k_dim: int) -> None:
    if x.device.type != "cuda" and not INTERPRETED:
        raise RuntimeError(
            f"triton fp4 kernels got {x.device.type} tensors, but qerl.kernels was imported "
            "without TRITON_INTERPRET=1 (set it before the first import to run on the CPU)")
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"triton fp4 kernels take bfloat16 or float32 activations, got {x.dtype}")
    check_weight(packed, scale, is_nv)
    if x.shape[-1] != k_dim:
        raise ValueError(f"last dim of the input is {x.shape[-1]}, expected {k_dim}")
    for name, t in (("weight_packed", packed), ("weight_scale", scale), ("weight_global_scale", gs)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but the input is on {x.device}")


def check_weight(packed: torch.Tensor, scale: torch.Tensor, is_nv: bool) -> None:
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(f"weight_packed must be a 2-D uint8 tensor, got {packed.dtype} {list(packed.shape)}")
    block = 16 if is_nv else 32
    N, KH = packed.shape
    if (2 * KH) % block:
        raise ValueError(f"in_features={2 * KH} must be a multiple of the block size {block}")
    if tuple(scale.shape) != (N, 2 * KH // block):
        raise ValueError(f"weight_scale must be [{N}, {2 * KH // block}], got {list(scale.shape)}")


def int32_words(packed: torch.Tensor) -> torch.Tensor | None:
    """weight_packed [N, K/2] uint8 viewed as int32 [N, K/8] (no copy), or None if it cannot be."""
    try:
        return packed.view(torch.int32) if packed.stride(-1) == 1 else None
    except RuntimeError:
        return None


def scale_bytes(scale: torch.Tensor) -> torch.Tensor:
    return scale if scale.dtype == torch.uint8 else scale.view(torch.uint8)


# ----------------------------------------------------------------------------------------------
# launches without Triton's Python launch path


class DirectLaunch:
    """A compiled Triton kernel launched again without Triton's Python launch path.

    ``kernel[grid](...)`` binds the arguments, computes the specialisation key and looks the kernel
    up on every call: ~25-35 us of host time on an H100 machine, against ~13 us for the compiled
    kernel's own launcher. A DirectLaunch keeps what a first, normal
    launch compiled and every argument of it in signature order (constexprs included, as
    ``JITFunction.run`` passes them), so a later call sets only the arguments that change and calls
    the launcher on the current stream. The caller must keep the first launch's specialisation:
    the same constexprs and integers, and changed tensors 16-byte aligned as the first ones were
    (Plan checks this per call and falls back to a normal launch otherwise). Triton's launch hooks
    (set by profilers such as proton) are not called for these launches. Not under TRITON_INTERPRET."""

    __slots__ = ("_run", "_function", "_metadata", "grid", "values", "_device")

    def __init__(self, jit_fn, compiled, args: tuple, kwargs: dict, grid: tuple, device: torch.device):
        params = list(jit_fn.signature.parameters.values())
        given = dict(zip((p.name for p in params), args))
        given.update((k, v) for k, v in kwargs.items() if k in jit_fn.signature.parameters)
        missing = [p.name for p in params if p.name not in given and p.default is p.empty]
        if missing:
            raise TypeError(f"DirectLaunch: no value for {missing}")
        self.values = [given.get(p.name, p.default) for p in params]
        self._run, self._function, self._metadata = compiled.run, compiled.function, compiled.packed_metadata
        self.grid = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
        self._device = device.index if device.index is not None else torch.cuda.current_device()

    @classmethod
    def first(cls, jit_fn, grid: tuple, args: tuple, kwargs: dict, device: torch.device) -> "DirectLaunch | None":
        """Launch normally; return the DirectLaunch of that launch (None where it cannot be made)."""
        compiled = jit_fn[grid](*args, **kwargs)
        if INTERPRETED or compiled is None:
            return None
        try:
            return cls(jit_fn, compiled, args, kwargs, grid, device)
        except (AttributeError, TypeError, ValueError):  # another Triton's internals: keep the normal path
            return None

    def __call__(self, values: list) -> None:
        g = self.grid
        self._run(g[0], g[1], g[2], torch._C._cuda_getCurrentRawStream(self._device), self._function,
                  self._metadata, None, None, None, *values)


def aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0

