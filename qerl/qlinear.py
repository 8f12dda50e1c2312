"""The quantized Linear with LoRA: a frozen, packed 4-bit base weight plus trainable LoRA A/B.

One module serves both paths of qerl: the rollout (no grad) and the training forward (autograd
through LoRA). The base weight is held ONLY in its packed form, as buffers named exactly as on
disk in a compressed-tensors checkpoint (``weight_packed``, ``weight_scale``,
``weight_global_scale`` for NVFP4), so export is a state-dict filter and there is never a dense
copy. The matmul goes through one dispatch point, :func:`qerl.kernels.linear`, which the Triton
kernels fill; its backward computes only the gradient of the input (the base is frozen).

LoRA follows PEFT exactly (so a PEFT adapter exported from here reproduces our outputs):
A is kaiming-uniform(a=sqrt(5)), B is zeros, ``scaling = lora_alpha / r``, the adapter runs in
its own dtype (fp32 by default, PEFT's ``autocast_adapter_dtype``) and its output is cast back.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from qerl import formats, kernels


def base_formats() -> tuple[str, ...]:
    """The base-weight formats a QuantLinear can hold: "bf16" (dense) and every registered format."""
    return (formats.DENSE,) + formats.names()


def packed_shapes(fmt: str, out_features: int, in_features: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shapes and dtypes of the packed buffers of one weight [out, in], without computing them.

    Used to build quantized models on the meta device (model sizes of 7B-32B configs) and to
    allocate layer-by-layer builds. The format's spec in the registry says what they are.
    """
    if fmt not in formats.names():
        raise ValueError(f"unknown base format {fmt!r}; expected one of {base_formats()}")
    return formats.packed_shapes(fmt, out_features, in_features)


class _PackedMatmul(torch.autograd.Function):
    """y = x W^T with a frozen packed W: the backward returns dx = dy W only."""

    @staticmethod
    def forward(ctx, x, module):  # noqa: D401 - autograd signature
        ctx.module = module
        return kernels.linear(x, module.fmt, module.packed_tensors(), module.out_features, module.in_features,
                              backend=module.backend, cache=module.kernel_cache)

    @staticmethod
    def backward(ctx, dy):
        m = ctx.module
        dx = kernels.grad_input(dy, m.fmt, m.packed_tensors(), m.out_features, m.in_features, backend=m.backend,
                                cache=m.kernel_cache)
        return dx, None


def _fused_lora_applies(x: torch.Tensor, m) -> bool:
    """The Triton LoRA path (``_FusedLoRA``): CUDA, bf16 activations, fp32 adapters, no dropout, eager."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and x.numel() > 0
            and m.lora_A.weight.dtype == torch.float32 and isinstance(m.lora_dropout, nn.Identity)
            and not torch.compiler.is_compiling() and FUSED_LORA)


FUSED_LORA = True  # the training forward's LoRA through _FusedLoRA on CUDA (False: the torch path, A/B runs)


def _split3(t: torch.Tensor) -> torch.Tensor:
    """An fp32 [rows, c] tensor as three bf16 parts side by side [rows, 3c] whose sum is t exactly
    (8 significant bits each; a bf16 x bf16 product is exact in fp32)."""
    hi = t.to(torch.bfloat16)
    r1 = t - hi.float()
    mid = r1.to(torch.bfloat16)
    lo = (r1 - mid.float()).to(torch.bfloat16)
    return torch.cat([hi, mid, lo], dim=1)


def _mm_fp32(a16: torch.Tensor, b_split: torch.Tensor) -> torch.Tensor:
    """a16 [M, K] (bf16) times an fp32 [K, c] given as ``_split3``'s [K, 3c]: fp32 [M, c],
    three exact bf16 products on the tensor cores, summed in fp32 (fp32 math, another order of sums)."""
    c = b_split.shape[1] // 3
    if a16.is_cuda:
        p = torch.mm(a16, b_split, out_dtype=torch.float32)
    else:  # the same exact products and fp32 sums (CPU checks of this function under TRITON_INTERPRET)
        p = torch.mm(a16.float(), b_split.float())
    return p[:, :c] + p[:, c:2 * c] + p[:, 2 * c:]


class _FusedLoRA(torch.autograd.Function):
    """y + scaling * (x A^T) B^T for fp32 adapters on bf16 activations, the arithmetic of the torch
    path (x upcast, fp32 products and sums, one rounding to y's dtype) without its fp32 copies of x and y
    and its fp32 SIMT GEMMs: forward by the fused kernels of the decode step (``lora_a``: A split into
    exact bf16 parts on the tensor cores; ``lora_out_to``: y plus the rank-r product, tf32x3, a new tensor);
    backward by bf16 GEMMs over exact bf16 splits of the fp32 operands (``_mm_fp32``). dx of the
    adapter is rounded to x's dtype and added to the base's dx by autograd, as in the torch path."""

    @staticmethod
    def forward(ctx, x, y, A, B, scaling):
        K, N = x.shape[-1], y.shape[-1]
        x2 = x.reshape(-1, K)
        x2 = x2 if x2.is_contiguous() else x2.contiguous()
        y2 = y.reshape(-1, N)
        y2 = y2 if y2.is_contiguous() else y2.contiguous()
        h = kernels.lora_a(x2, [A])
        h = h if h.shape[0] == 1 else h.sum(0, keepdim=True)  # final sums [1, M, r]
        out = kernels.lora_out_to(y2, h, B, float(scaling))
        ctx.save_for_backward(x2, h[0], A, B)
        ctx.scaling, ctx.x_shape = float(scaling), x.shape
        return out.view(y.shape)

    @staticmethod
    def backward(ctx, dout):
        x2, h, A, B = ctx.saved_tensors
        s = ctx.scaling
        d2 = dout.reshape(-1, dout.shape[-1])
        d2 = d2 if d2.is_contiguous() else d2.contiguous()
        dh = _mm_fp32(d2, _split3(B)) * s  # [M, r]
        dB = _mm_fp32(d2.t(), _split3(h)) * s if ctx.needs_input_grad[3] else None  # [N, r]
        dA = _mm_fp32(x2.t(), _split3(dh)).t().contiguous() if ctx.needs_input_grad[2] else None  # dh^T x: [r, K]
        dx = None
        if ctx.needs_input_grad[0]:  # dh A rounded to x's dtype: lora_out_to on zeros (tf32x3, no fp32 [M, K] copy)
            if dh.is_cuda:
                zero = torch.zeros(x2.shape, dtype=x2.dtype, device=x2.device)
                dx = kernels.lora_out_to(zero, dh[None], A.t().contiguous(), 1.0).view(ctx.x_shape)
            else:
                dx = torch.mm(dh, A).to(x2.dtype).view(ctx.x_shape)
        return dx, dout, dA, dB, None


class QuantLinear(nn.Module):
    """A Linear with a frozen base weight in ``fmt`` and an optional trainable LoRA adapter.

    Args:
        fmt: "bf16" (dense frozen weight, the BF16-LoRA rows) or a 4-bit format of qerl.formats.
        lora_rank: r; 0 means no adapter. lora_alpha: scaling numerator (scaling = alpha / r).
        backend: kernel dispatch for the 4-bit matmul ("auto", "triton", "reference").
    """

    def __init__(self, in_features: int, out_features: int, fmt: str = formats.QERL_FORMAT, bias: bool = False,
                 lora_rank: int = 0, lora_alpha: float | None = None, lora_dropout: float = 0.0,
                 dtype: torch.dtype = torch.bfloat16, lora_dtype: torch.dtype = torch.float32,
                 device=None, backend: str = "auto"):
        super().__init__()
        if fmt not in base_formats():
            raise ValueError(f"unknown base format {fmt!r}; expected one of {base_formats()}")
        if lora_rank < 0:
            raise ValueError(f"lora_rank must be >= 0, got {lora_rank}")
        self.in_features, self.out_features, self.fmt, self.backend = in_features, out_features, fmt, backend
        self.dtype = dtype
        if formats.is_dense(fmt):
            self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device),
                                       requires_grad=False)
        else:
            for name, (shape, dt) in packed_shapes(fmt, out_features, in_features).items():
                self.register_buffer(name, torch.empty(shape, dtype=dt, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None
        self.r = lora_rank
        self.lora_alpha = float(lora_alpha if lora_alpha is not None else lora_rank)
        self.scaling = self.lora_alpha / lora_rank if lora_rank else 0.0
        self._adapters_enabled = True
        if lora_rank:
            self.lora_A = nn.Linear(in_features, lora_rank, bias=False, device=device, dtype=lora_dtype)
            self.lora_B = nn.Linear(lora_rank, out_features, bias=False, device=device, dtype=lora_dtype)
            self.lora_dropout = nn.Dropout(lora_dropout) if lora_dropout > 0 else nn.Identity()
            self.reset_lora_parameters()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: str, global_scale: torch.Tensor | None = None, **kw) -> "QuantLinear":
        """Quantize a dense nn.Linear into a QuantLinear on the same device (the dense weight is not kept).

        The dense (bf16) base keeps the linear's dtype, the model's compute dtype (``--dtype float32``: an
        fp32 base, so that x @ W runs in one dtype); a 4-bit base records bf16 for an fp32 linear (its
        kernels return x's dtype whatever this is)."""
        w = linear.weight.detach()
        kw.setdefault("dtype", w.dtype if formats.is_dense(fmt) or w.dtype != torch.float32 else torch.bfloat16)
        q = cls(linear.in_features, linear.out_features, fmt=fmt, bias=linear.bias is not None,
                device="meta", **kw)
        q.to_empty(device=w.device)
        if q.r:
            q.reset_lora_parameters()
        if formats.is_dense(fmt):
            q.weight.data.copy_(w)
        elif w.device.type != "meta":
            for name, t in formats.quantize(w, fmt, global_scale=global_scale).items():
                getattr(q, name).copy_(t)
        if linear.bias is not None:
            q.bias.data.copy_(linear.bias.detach())
        return q

    def reset_lora_parameters(self):
        if self.r and self.lora_A.weight.device.type != "meta":
            nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
            nn.init.zeros_(self.lora_B.weight)

    # ------------------------------------------------------------------ accessors
    @property
    def kernel_cache(self) -> dict:
        """Objects a kernel backend builds once per weight (the bitsandbytes QuantState, the compute layout)."""
        cache = self.__dict__.get("_kernel_cache")
        if cache is None:
            cache = self.__dict__["_kernel_cache"] = {}
        return cache

    def _plan(self, x: torch.Tensor):
        """The Triton launch plan of this weight on x's device (kernels.make_plan), built once and
        kept while the buffers are the same tensors; None when the backend is not Triton."""
        packed = self._buffers["weight_packed"]
        st = self.__dict__.get("_plan_state")
        if st is not None and st[0] is packed and st[1] == x.device:
            return st[2]
        plan = kernels.make_plan(self.kernel_weight(), x.device)
        self.__dict__["_plan_state"] = (packed, x.device, plan)
        return plan

    def kernel_weight(self) -> kernels.Weight | None:
        """The packed base as the kernels take it (format, tensors, shape, backend, kernel cache);
        None for the dense bf16 base."""
        if formats.is_dense(self.fmt):
            return None
        return kernels.Weight(self.fmt, self.packed_tensors(), self.out_features, self.in_features, self.backend,
                              self.kernel_cache)

    @property
    def adapters_active(self) -> bool:
        """Whether forward adds the LoRA adapter (it has one and it is not disabled)."""
        return bool(self.r and self._adapters_enabled)

    def packed_tensors(self) -> dict[str, torch.Tensor]:
        """The packed base tensors by their on-disk names (empty for the bf16 base)."""
        if formats.is_dense(self.fmt):
            return {}
        return {name: getattr(self, name) for name in formats.get(self.fmt).tensor_names}

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A dense copy of the base weight, for tests and export only (never used in forward)."""
        dtype = dtype or self.dtype
        if formats.is_dense(self.fmt):
            return self.weight.detach().to(dtype)
        return formats.dequantize(self.packed_tensors(), self.fmt, dtype=dtype)

    def base_nbytes(self) -> int:
        """Bytes of the frozen base (packed buffers or the dense weight, plus bias)."""
        ts = [self.weight] if formats.is_dense(self.fmt) else list(self.packed_tensors().values())
        if self.bias is not None:
            ts.append(self.bias)
        return sum(t.numel() * t.element_size() for t in ts)

    @contextlib.contextmanager
    def disable_adapters(self):
        prev, self._adapters_enabled = self._adapters_enabled, False
        try:
            yield
        finally:
            self._adapters_enabled = prev

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if formats.is_dense(self.fmt):  # bias inside F.linear: bit-exact with nn.Linear (one rounding)
            y = F.linear(x, self.weight, self.bias)
        else:
            plan = None if torch.compiler.is_compiling() else self._plan(x)
            if plan is None:  # reference / bitsandbytes, or tracing: the dispatch point and its custom ops
                y = _PackedMatmul.apply(x, self)
            elif x.requires_grad and torch.is_grad_enabled():
                y = plan.autograd_fn.apply(x, plan)
            else:
                y = plan.linear(x)
            if self.bias is not None:
                y = y + self.bias
        if self.r and self._adapters_enabled and _fused_lora_applies(x, self):
            y = _FusedLoRA.apply(x, y, self.lora_A.weight, self.lora_B.weight, self.scaling)
        elif self.r and self._adapters_enabled:
            # y + scaling * B(A(x)) in the adapter dtype, the scaled add fused into the B GEMM's
            # epilogue (addmm): the same fp32 arithmetic as PEFT's separate multiply and add when
            # scaling is a power of two (alpha = 2r), two fewer kernels per Linear.
            a = self.lora_A.weight
            h = self.lora_A(self.lora_dropout(x.to(a.dtype)))
            y2 = y.reshape(-1, y.shape[-1]).to(a.dtype)
            out = torch.addmm(y2, h.reshape(-1, h.shape[-1]), self.lora_B.weight.t(), alpha=self.scaling)
            y = out.reshape(y.shape).to(y.dtype)
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}, "
                f"r={self.r}, lora_alpha={self.lora_alpha:g}, bias={self.bias is not None}")
