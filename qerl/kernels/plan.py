"""Per-weight launch state of the FP4 Triton kernels: what does not change between calls, resolved once.

A ``Plan`` (QuantLinear keeps one per device) holds one packed weight's checked buffers, their
int32 / uint8 views, the launch parameters per small M, and the launches it has made once, which it
relaunches through the compiled kernel's own launcher (qerl.kernels.common.DirectLaunch): the host
overhead of eager calls. Under torch.compile the custom ops of qerl.kernels.ops are used instead.
"""

from __future__ import annotations

import torch

from qerl.kernels import layout, mma, scratch, warpspec
from qerl.kernels.common import (
    DirectLaunch,
    aligned,
    as_rows,
    check_input,
    check_weight,
    int32_words,
    scale_bytes,
    workspace,
)
from qerl.kernels.ops import launch_grad_input, linear_call, linear_launch


class Plan:
    """One packed weight's launch state, built once per (weight tensors, device): the checked
    buffers, their int32 / uint8 views, and the launch parameters per small M. ``linear`` and
    ``grad_input`` skip the per-call checks and the custom-op dispatch (eager calls; under
    torch.compile the custom ops are used instead)."""

    __slots__ = ("packed", "scale", "gs", "is_nv", "N", "K", "w32", "scale_u8", "gs_arg", "device", "_launch",
                 "_decode", "_direct", "_mma", "__weakref__")
    autograd_fn = None  # PlannedLinear, set below

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, gs: torch.Tensor | None, is_nv: bool,
                 cache: dict | None = None):
        check_weight(packed, scale, is_nv)
        if is_nv and gs is None:
            raise ValueError("a plan for E4M3 scales needs weight_global_scale")
        self.packed, self.scale, self.gs, self.is_nv = packed, scale, gs, is_nv
        self.N, self.K = packed.shape[0], 2 * packed.shape[1]
        self.w32 = int32_words(packed)
        self.scale_u8 = scale_bytes(scale)
        self.gs_arg = gs if gs is not None else packed
        self.device = packed.device
        self._launch: dict = {}
        self._decode: dict = {}  # dtype -> (DirectLaunch, the scratch buffer it writes) or None
        self._direct: dict = {}  # (M, dtype, x row stride) -> DirectLaunch of the small-M kernel or None
        # the compute layout of qerl.kernels.mma, made on the first small-M bf16 call; in the owner's kernel cache
        # when given (QuantLinear.kernel_cache, which the fused decode step's grouped launches also read)
        self._mma: dict = cache if cache is not None else {}

    def decoded(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole weight decoded into the device's scratch (one decode launch); valid until the
        next decode into that scratch. The launch is kept per dtype as a DirectLaunch (host time of
        the training path: every large-M forward and grad-input) and remade when the scratch buffer
        is a new one; it holds the scratch only through its argument list, and release_scratch()
        clears the plans' launches (Plan.release) so that the memory goes."""
        N, K = self.N, self.K
        buf = scratch.scratch(self.device, dtype, N * K)
        st = self._decode.get(dtype)
        if st is not None and st[1] is buf:
            st[0](st[0].values)
            return buf[: N * K].view(N, K)
        w = buf[: N * K].view(N, K)
        kern, grid, args, kw = scratch.decode_launch(w, self.packed, self.scale_u8, self.gs_arg, self.is_nv, 0, 0, N, K,
                                                     scratch.DECODE_CONFIG[self.is_nv])
        direct = DirectLaunch.first(kern, grid, args, kw, self.device)
        self._decode[dtype] = (direct, buf) if direct is not None else None
        if direct is not None:
            scratch.HOLDERS.add(self)
        return w

    def _mma_layout(self):
        return layout.cached_layout(self._mma, self.packed, self.scale_u8, self.is_nv)

    def _mma_linear(self, x2: torch.Tensor, out: torch.Tensor, cl: tuple) -> None:
        """out = x2 W^T through qerl.kernels.mma on the compute layout cl; its launch kept as a DirectLaunch per
        (M, row stride), like the small-M Triton kernels (host time of eager calls)."""
        if warpspec.serves(x2):  # the rows the warp-specialised Hopper kernel serves (warpspec.SERVED_M)
            warpspec.linear(x2, cl[0], cl[1], self.gs, self.N, self.K, self.is_nv, out=out, cache=self._mma)
            return
        dkey = ("mma", x2.shape[0], x2.stride(0), cl[0].data_ptr())
        st = self._direct.get(dkey)
        if st is not None and aligned(x2) and aligned(out):
            d, need = st
            ws, cnt = workspace(x2.device, *need)
            v = list(d.values)
            v[mma.ARG_X] = x2
            for i in mma.ARG_OUTS:
                v[i] = out
            v[mma.ARG_WS], v[mma.ARG_CNT] = ws, cnt
            d(v)
            return
        fn, grid, args, kwargs, need = mma.grouped_linear(x2, [(cl[0], cl[1], self.gs, self.N)], self.K,
                                                             self.is_nv, [out], describe=True)
        if dkey not in self._direct and aligned(x2) and aligned(out):
            d = DirectLaunch.first(fn, grid, args, kwargs, x2.device)
            self._direct[dkey] = None if d is None else (d, need)
            if d is not None:  # keep no activation, output or workspace of this call
                for i in (mma.ARG_X, *mma.ARG_OUTS, mma.ARG_WS, mma.ARG_CNT):
                    d.values[i] = None
        else:
            fn[grid](*args, **kwargs)

    def release(self) -> None:
        """Drop the kept launches (their argument lists reference the scratch)."""
        self._decode.clear()
        self._direct.clear()

    def _one_chunk(self) -> bool:
        return scratch.SCRATCH_CHUNK_BYTES is None

    def matches(self, packed, scale, gs) -> bool:
        return packed is self.packed and scale is self.scale and gs is self.gs

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        K, N = self.K, self.N
        if x.shape[-1] != K or x.dtype not in (torch.bfloat16, torch.float32) or x.device != self.device:
            check_input(x, self.packed, self.scale, self.gs, self.is_nv, K)  # raises with the reason
        x2 = as_rows(x, K)
        M = x2.shape[0]
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
        if M == 0:
            pass
        elif mma.applies(x2, K) and (cl := self._mma_layout()) is not None:
            self._mma_linear(x2, out, cl)
        elif scratch.use_scratch("linear", M):
            if self._one_chunk():  # decode + cuBLAS with the launch kept in the plan
                torch.mm(x2, self.decoded(x2.dtype).t(), out=out)
            else:
                scratch.scratch_linear(x2, self.packed, self.scale_u8, self.gs_arg, self.is_nv, out)
        else:
            launch = self._launch.get(M)
            if launch is None:
                launch = linear_launch(M, N, K, self.is_nv, x.device, None, None, None, self.w32 is not None)
                if M <= 256:
                    self._launch[M] = launch
            dkey = (M, x2.dtype, x2.stride(0))
            direct = self._direct.get(dkey)
            if direct is not None and aligned(x2):
                ws, cnt = workspace(x2.device, launch[3], launch[4])
                v = list(direct.values)
                if launch[0] == "gemv":  # (x, x32, w, s, gs, out, ws, cnt, ...): x32 is x's memory
                    v[0] = v[1] = x2
                    v[5], v[6], v[7] = out, ws, cnt
                else:  # (x, w, s, gs, out, ws, cnt, ...)
                    v[0], v[4], v[5], v[6] = x2, out, ws, cnt
                direct(v)
            else:
                fn, grid, args, kwargs = linear_call(x2, self.packed, self.w32, self.scale_u8, self.gs_arg, out,
                                                     launch)
                # only when the launch used x2 itself: a copy made for the GEMV has other strides
                if M <= 256 and aligned(x2) and args[0] is x2 and dkey not in self._direct:
                    d = self._direct[dkey] = DirectLaunch.first(fn, grid, args, kwargs, x2.device)
                    if d is not None:  # keep no activation, output or workspace of this call
                        for i in ((0, 1, 5, 6, 7) if launch[0] == "gemv" else (0, 4, 5, 6)):
                            d.values[i] = None
                else:
                    fn[grid](*args, **kwargs)
        return out.view(*x.shape[:-1], N)

    def grad_input(self, dy: torch.Tensor) -> torch.Tensor:
        N = self.N
        if dy.shape[-1] == N and dy.dtype in (torch.bfloat16, torch.float32) and dy.device == self.device \
                and self._one_chunk():
            dy2 = as_rows(dy, N)
            if scratch.use_scratch("grad_input", dy2.shape[0]):
                dx = torch.empty((dy2.shape[0], self.K), dtype=dy.dtype, device=dy.device)
                torch.mm(dy2, self.decoded(dy2.dtype), out=dx)
                return dx.view(*dy.shape[:-1], self.K)
        return launch_grad_input(dy, self.packed, self.scale, self.gs, self.is_nv)


class PlannedLinear(torch.autograd.Function):
    """y = plan.linear(x) with dx = plan.grad_input(dy) (the weight is frozen)."""

    @staticmethod
    def forward(ctx, x, plan):  # noqa: D401 - autograd signature
        ctx.plan = plan
        return plan.linear(x)

    @staticmethod
    def backward(ctx, dy):
        return ctx.plan.grad_input(dy), None


Plan.autograd_fn = PlannedLinear
