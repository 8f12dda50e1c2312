"""Decode attention for the fast rollout engine: one query token a sequence over its KV cache,
split over the keys (flash-decoding) so that a few sequences over a long cache still fill the GPU.

A decode step's attention reads every cached key and value once. With a few rows and a long cache
(the tail of a rollout: 4-32 sequences at 2,000 tokens) a kernel with one program per (sequence,
KV head) runs 16-128 programs, each walking the whole cache alone; it is bound by one SM's
latency, not by the bytes. Here each (sequence, KV head) is split into chunks of the cache, each
chunk a program, and the last program of a (sequence, KV head) to finish combines the chunks'
partial softmaxes in chunk order (found by a counter, no float atomics: bitwise repeatable, as the
split-K GEMMs of qerl.kernels.common are).

The G = n_heads / n_kv query heads of one KV head are the rows of one tile (HF's repeat_kv order),
so K and V are read once for all of them. Keys are valid where ``key_valid`` says so and at slots
up to the cursor read from a device tensor (``cpos``: the slot this step wrote), so one CUDA graph
serves every cursor within its window and chunks past the cursor end at once.

Arithmetic: scores q k^T in fp32, the online softmax in fp32, the probabilities rounded to the
value dtype for p V (as flash attention does), the output rounded once at the end; fp32 inputs
multiply in IEEE fp32 (no TF32). A row with no valid key gives zeros (SDPA gives NaN).

``decode_attention_lora_a`` also multiplies each output by the LoRA A of the projection it feeds (o_proj) in
the same launch: the program that writes a (sequence, KV head)'s G query heads adds their columns' share of
o A^T, one partial sum a KV head ([n_kv, B, r], fp32), which ``lora_out`` adds in KV-head order (so o_proj's
LoRA needs no ``lora_a`` launch of its own).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qerl.kernels.common import INTERPRETED, num_sms, pdl_args, pdl_enter, rnd, workspace

BLOCK_N = 64  # keys a loop step
MIN_CHUNK = 128  # fewest keys a split program walks
WAVES = 2  # about WAVES * SMs programs in all


@triton.jit
def _lora_a_part(y, a_ptr, h_ptr, b, h, R, offs_g, offs_d, mg, md, G: tl.constexpr, D: tl.constexpr,
                 NKV: tl.constexpr, RB: tl.constexpr):
    """KV head h's partial sum of (sequence b's output row) A^T: y [BLOCK_G, BLOCK_D] (as stored) times A's
    columns of the G query heads, into h_ptr[h, b, :R] (fp32), RB rows of A at a time."""
    cols = (h * G + offs_g)[:, None] * D + offs_d[None, :]
    om = mg[:, None] & md[None, :]
    yf = y.to(tl.float32)
    n_b = tl.num_programs(0) // NKV
    rb = tl.arange(0, RB)
    for r0 in range(0, R, RB):
        rr = r0 + rb
        a = tl.load(a_ptr + rr[:, None, None].to(tl.int64) * (NKV * G * D) + cols[None, :, :],
                    mask=(rr < R)[:, None, None] & om[None, :, :], other=0.0).to(tl.float32)
        part = tl.sum(tl.sum(a * yf[None, :, :], axis=2), axis=1)
        tl.store(h_ptr + ((h * n_b + b) * R + rr), part, mask=rr < R)


@triton.jit
def _decode_attn_kernel(q_ptr, k_ptr, v_ptr, valid_ptr, cpos_ptr, out_ptr, ws_ptr, cnt_ptr,
                        s_kb, s_kh, s_kl, s_vb, s_vh, s_vl, s_vm, window, chunk, scale, a_ptr, h_ptr, R,
                        NKV: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
                        BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr = False,
                        HAS_A: tl.constexpr = False, RB: tl.constexpr = 4):
    pdl_enter(PDL)
    bh = tl.program_id(0)
    split = tl.program_id(1)
    n_split = tl.num_programs(1)
    b = (bh // NKV).to(tl.int64)
    h = bh % NKV
    TY: tl.constexpr = out_ptr.dtype.element_ty
    VT: tl.constexpr = v_ptr.dtype.element_ty
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mg, md = offs_g < G, offs_d < D
    # q [B, NKV * G, D] contiguous: this KV head's G query rows
    q = tl.load(q_ptr + (b * NKV * G + h * G + offs_g)[:, None] * D + offs_d[None, :],
                mask=mg[:, None] & md[None, :], other=0.0)
    end = tl.minimum(window, tl.load(cpos_ptr) + 1)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, end)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    k_base = k_ptr + b * s_kb + h * s_kh
    v_base = v_ptr + b * s_vb + h * s_vh
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mn = offs_n < hi
        ok = tl.load(valid_ptr + b * s_vm + offs_n, mask=mn, other=0) != 0
        kt = tl.load(k_base + offs_n[None, :].to(tl.int64) * s_kl + offs_d[:, None], mask=mn[None, :] & md[:, None],
                     other=0.0)  # K^T [BLOCK_D, BLOCK_N]
        if IEEE:
            s = tl.dot(q.to(tl.float32), kt.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, kt)
        s = tl.where(ok[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid key yet: nothing to rescale
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + offs_n[:, None].to(tl.int64) * s_vl + offs_d[None, :], mask=mn[:, None] & md[None, :],
                    other=0.0)
        if IEEE:  # fp32 inputs, or the interpreter (whose 16-bit dots are not exact): IEEE fp32
            pv = tl.dot(rnd(p, VT).to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:  # the probabilities rounded to the value dtype, as flash attention does
            pv = tl.dot(rnd(p, VT), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out_ptrs = out_ptr + (b * NKV * G + h * G + offs_g)[:, None] * D + offs_d[None, :]
    om = mg[:, None] & md[None, :]
    if n_split == 1:
        y = rnd(acc / tl.where(l_i > 0, l_i, 1.0)[:, None], TY)
        tl.store(out_ptrs, y, mask=om)
        if HAS_A:
            _lora_a_part(y, a_ptr, h_ptr, b, h, R, offs_g, offs_d, mg, md, G, D, NKV, RB)
    else:
        # partials: acc [n_split, BH, BLOCK_G, BLOCK_D], then (m, l) [n_split, BH, 2, BLOCK_G]
        bh64 = bh.to(tl.int64)
        n_bh = tl.num_programs(0).to(tl.int64)
        tile = BLOCK_G * BLOCK_D
        acc_off = offs_g[:, None] * BLOCK_D + offs_d[None, :]
        ml_base = ws_ptr + n_split * n_bh * tile
        tl.store(ws_ptr + (split * n_bh + bh64) * tile + acc_off, acc)
        tl.store(ml_base + (split * n_bh + bh64) * 2 * BLOCK_G + offs_g, m_i)
        tl.store(ml_base + (split * n_bh + bh64) * 2 * BLOCK_G + BLOCK_G + offs_g, l_i)
        # acq_rel: this program's partial is visible before its count; the last arriver sees them all
        count = tl.atomic_add(cnt_ptr + bh, 1, sem="acq_rel")
        if count == n_split - 1:
            m_all = tl.full([BLOCK_G], float("-inf"), tl.float32)
            for i in range(0, n_split):
                m_all = tl.maximum(m_all, tl.load(ml_base + (i * n_bh + bh64) * 2 * BLOCK_G + offs_g,
                                                  cache_modifier=".cg"))
            m_all = tl.where(m_all == float("-inf"), 0.0, m_all)
            total = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
            l_all = tl.zeros([BLOCK_G], tl.float32)
            for i in range(0, n_split):  # chunk order, whoever arrives last: bitwise repeatable
                w = tl.exp(tl.load(ml_base + (i * n_bh + bh64) * 2 * BLOCK_G + offs_g, cache_modifier=".cg") - m_all)
                l_all += w * tl.load(ml_base + (i * n_bh + bh64) * 2 * BLOCK_G + BLOCK_G + offs_g,
                                     cache_modifier=".cg")
                total += w[:, None] * tl.load(ws_ptr + (i * n_bh + bh64) * tile + acc_off, cache_modifier=".cg")
            y = rnd(total / tl.where(l_all > 0, l_all, 1.0)[:, None], TY)
            tl.store(out_ptrs, y, mask=om)
            if HAS_A:
                _lora_a_part(y, a_ptr, h_ptr, b, h, R, offs_g, offs_d, mg, md, G, D, NKV, RB)
            tl.atomic_xchg(cnt_ptr + bh, 0)


def decode_attention_splits(B: int, n_kv: int, window: int, sms: int) -> int:
    """Chunks a (sequence, KV head) is split into: about WAVES * sms programs in all, each walking
    at least MIN_CHUNK keys of the window."""
    return max(1, min(triton.cdiv(window, MIN_CHUNK), triton.cdiv(WAVES * sms, B * n_kv)))


def _launch(q, k, v, key_valid, cpos, scale, out, A=None, h=None):
    B, n_kv, window, D = k.shape
    G = q.shape[1] // n_kv
    S = decode_attention_splits(B, n_kv, window, num_sms(q.device))
    chunk = triton.cdiv(triton.cdiv(window, S), BLOCK_N) * BLOCK_N
    S = triton.cdiv(window, chunk)
    BLOCK_G, BLOCK_D = max(16, triton.next_power_of_2(G)), max(16, triton.next_power_of_2(D))
    IEEE = q.dtype == torch.float32 or INTERPRETED
    ws, cnt = workspace(q.device, S * B * n_kv * BLOCK_G * (BLOCK_D + 2) if S > 1 else 1, B * n_kv)
    _decode_attn_kernel[(B * n_kv, S)](
        q, k, v, key_valid, cpos, out, ws, cnt, k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
        v.stride(2), key_valid.stride(0), window, chunk, scale, A if A is not None else out,
        h if h is not None else out, A.shape[0] if A is not None else 1, NKV=n_kv, G=G, BLOCK_G=BLOCK_G, D=D,
        BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, IEEE=IEEE, num_warps=4, num_stages=3,
        **pdl_args(q.device), **({"HAS_A": True} if A is not None else {}))


def _check(q, k, v, key_valid, cpos):
    if q.dim() != 3 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"decode_attention: q [B, H, D], k and v [B, n_kv, window, D]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    B, n_kv, window, D = k.shape
    if q.shape[0] != B or q.shape[2] != D or q.shape[1] % n_kv:
        raise ValueError(f"decode_attention: q {tuple(q.shape)} does not match k {tuple(k.shape)} "
                         "(query heads a multiple of the KV heads)")
    if k.stride(3) != 1 or v.stride(3) != 1:
        raise ValueError("decode_attention: k and v need a contiguous last dimension")
    if key_valid.dtype != torch.bool or key_valid.dim() != 2 or key_valid.shape[0] != B or key_valid.shape[1] < window:
        raise ValueError(f"decode_attention: key_valid must be bool [B, >= window]; got {key_valid.dtype} "
                         f"{tuple(key_valid.shape)}")
    if key_valid.stride(1) != 1 or cpos.numel() != 1:
        raise ValueError("decode_attention: key_valid needs contiguous rows, cpos one element")


@torch.library.custom_op("qerl::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor,
                     cpos: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of one query token a sequence: q [B, H, D] (contiguous), k and v [B, n_kv, window, D]
    (the cache up to the window; any strides but the last), key_valid bool [B, >= window], cpos [1]
    int (keys past cpos are not read). Returns [B, H * D] in q.dtype: softmax(scale q k^T) v over the
    valid keys, the G = H / n_kv query heads of a KV head sharing it."""
    _check(q, k, v, key_valid, cpos)
    out = torch.empty((q.shape[0], q.shape[1] * q.shape[2]), dtype=q.dtype, device=q.device)
    _launch(q.contiguous(), k, v, key_valid, cpos, scale, out)
    return out


@decode_attention.register_fake
def _(q, k, v, key_valid, cpos, scale):
    return q.new_empty((q.shape[0], q.shape[1] * q.shape[2]))


@torch.library.custom_op("qerl::decode_attention_lora_a", mutates_args=())
def decode_attention_lora_a(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor,
                            cpos: torch.Tensor, scale: float, A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``decode_attention`` and, in the same launch, the LoRA A product of its output for the projection it
    feeds: (o [B, H * D], partial sums [n_kv, B, r] fp32 whose sum over the first dimension is o A^T, with
    A [r, H * D]) -- the form ``lora_out`` takes for h."""
    _check(q, k, v, key_valid, cpos)
    if A.dim() != 2 or A.shape[1] != q.shape[1] * q.shape[2]:
        raise ValueError(f"decode_attention_lora_a: A must be [r, H * D] = [r, {q.shape[1] * q.shape[2]}], got "
                         f"{tuple(A.shape)}")
    B, n_kv = k.shape[:2]
    out = torch.empty((B, q.shape[1] * q.shape[2]), dtype=q.dtype, device=q.device)
    h = torch.empty((n_kv, B, A.shape[0]), dtype=torch.float32, device=q.device)
    _launch(q.contiguous(), k, v, key_valid, cpos, scale, out, A.contiguous(), h)
    return out, h


@decode_attention_lora_a.register_fake
def _(q, k, v, key_valid, cpos, scale, A):
    B, n_kv = k.shape[:2]
    return q.new_empty((B, q.shape[1] * q.shape[2])), q.new_empty((n_kv, B, A.shape[0]), dtype=torch.float32)


def decode_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor,
                               cpos: torch.Tensor, scale: float) -> torch.Tensor:
    """The same in fp32 torch (the definition the kernel is tested against)."""
    B, n_kv, window, D = k.shape
    G = q.shape[1] // n_kv
    valid = key_valid[:, :window].clone()
    valid[:, int(cpos) + 1:] = False
    s = torch.einsum("bhgd,bhnd->bhgn", q.float().view(B, n_kv, G, D), k.float()) * scale
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhgn,bhnd->bhgd", p, v.float()).reshape(B, -1).to(q.dtype)
