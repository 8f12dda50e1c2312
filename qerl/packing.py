"""Padding-free training forwards: rows packed into one sequence, and forwards cut by a token budget.

A rollout's rows are left-padded prompts and right-padded completions ([B, P] and [B, C]). Run as a
padded batch, a forward computes B x (P + C) positions, about half of them padding for RL's length
mix (results/table3/NOTES.md). Here the forward runs over the real tokens only:

- ``pack_rows``: each row's prompt without its padding, then its completion up to its last real
  token; the rows concatenated into one sequence [1, T]; positions restarting at 0 in each row
  (what rotary sees is the padded forward's position ids); ``cu_seqlens`` marks the rows.
- ``varlen_attention``: attention causal within each row and blind across rows. On CUDA it is
  PyTorch's own ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention-2 over cu_seqlens, in the
  torch wheel: no extra package, no [T, T] mask, no FLOP spent across rows). Elsewhere (the CPU
  tests and CI) the same packed layout and the same call run SDPA row by row: one code path, only
  the kernel differs. docs/design.md says why this and not FlexAttention or a padded mask.
  It is an HF attention function (``ATTN_IMPLEMENTATION``), switched on for one forward by
  ``packed_forward``: the decoder's own layers (and gradient checkpointing) run unchanged.
- ``plan_forwards``: the rows of a training pass sorted by length and cut into forwards of at most
  ``token_budget`` tokens (a longer row alone). The loss normalisation never depends on this cut
  (qerl.step: each row keeps its micro-batch's normaliser, as across data-parallel ranks).
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

ATTN_IMPLEMENTATION = "qerl_varlen"


@dataclass
class PackedRows:
    """B rows packed into one sequence of T real tokens.

    ``input_ids`` / ``position_ids`` [1, T]; ``cu_seqlens`` int32 [n + 1] over the n packed rows
    (rows with no completion token are left out); ``logit_pos`` [N]: the packed position whose hidden
    state predicts each completion token; ``target_ids`` [N] those tokens; ``rows`` / ``cols`` [N]:
    where each sits in the [B, C] completion tensors.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_len: int
    logit_pos: torch.Tensor
    target_ids: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor

    @property
    def n_tokens(self) -> int:
        return self.input_ids.size(1)

    def attn_kwargs(self) -> dict:
        """What the decoder's forward passes on to ``varlen_attention`` (FlashAttention's kwarg names)."""
        return {"cu_seq_lens_q": self.cu_seqlens, "cu_seq_lens_k": self.cu_seqlens,
                "max_length_q": self.max_len, "max_length_k": self.max_len}

    def unpack(self, flat: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        """Per-token values [N] back into a [B, C] tensor (zeros where there is no completion token)."""
        out = flat.new_zeros(shape)
        return out.index_put((self.rows, self.cols), flat)


def completion_lengths(completion_mask: torch.Tensor) -> torch.Tensor:
    """Each row's completion length up to and including its last real token [B] (0: none)."""
    C = completion_mask.size(1)
    pos = torch.arange(1, C + 1, device=completion_mask.device)
    return (completion_mask.bool() * pos).amax(1) if C else completion_mask.new_zeros(completion_mask.size(0))


def row_tokens(prompt_mask: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """Tokens each row contributes to a packed forward [B] (0 for a row with no completion token)."""
    c = completion_lengths(completion_mask)
    return torch.where(c > 0, prompt_mask.sum(1) + c, torch.zeros_like(c))


def pack_rows(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
              completion_mask: torch.Tensor) -> PackedRows:
    """Pack rows as the module docstring says. Prompts may be padded on either side (their mask
    says which tokens are real); a row with completion tokens needs at least one prompt token."""
    if prompt_ids.shape != prompt_mask.shape or completion_ids.shape != completion_mask.shape:
        raise ValueError(f"ids and masks must have the same shapes: prompt {tuple(prompt_ids.shape)} / "
                         f"{tuple(prompt_mask.shape)}, completion {tuple(completion_ids.shape)} / "
                         f"{tuple(completion_mask.shape)}")
    B, P = prompt_ids.shape
    C = completion_ids.size(1)
    dev = completion_ids.device
    c_len = completion_lengths(completion_mask)
    p_len = prompt_mask.sum(1)
    live = c_len > 0
    if bool((live & (p_len == 0)).any()):
        raise ValueError("a row with completion tokens has no prompt token: its first token has no position to "
                         "be predicted from")
    keep = torch.cat([prompt_mask.bool() & live[:, None], torch.arange(C, device=dev)[None, :] < c_len[:, None]], 1)
    ids = torch.cat([prompt_ids, completion_ids], 1)
    pos = (keep.long().cumsum(1) - 1).clamp(min=0)
    seq = keep.sum(1)
    starts = torch.cumsum(seq, 0) - seq  # each row's first packed index
    lens = seq[live].to(torch.int32)
    cu = torch.zeros(lens.numel() + 1, dtype=torch.int32, device=dev)
    cu[1:] = torch.cumsum(lens, 0)
    # completion token (i, k), k < c_len[i], sits at starts[i] + p_len[i] + k; the position before predicts it
    ccol = torch.arange(C, device=dev)[None, :].expand(B, C)
    cm = ccol < c_len[:, None]
    rows = torch.arange(B, device=dev)[:, None].expand(B, C)[cm]
    cols = ccol[cm]
    logit_pos = (starts + p_len)[rows] + cols - 1
    return PackedRows(ids[keep][None], pos[keep][None], cu, int(seq.max()) if B else 0, logit_pos,
                      completion_ids[rows, cols], rows, cols)


# ----------------------------------------------------------------------------------------------
# attention within each row


def _varlen_cuda():
    """torch's varlen_attn and how to ask it for a causal mask and GQA (its signature has changed
    across releases: ``is_causal`` up to 2.12, ``window_size`` since; ``enable_gqa`` since 2.13)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    return varlen_attn, causal, "enable_gqa" in params, "scale" in params


_VARLEN = None
_warned = False


def _rows_sdpa(q, k, v, cu: list[int], scale: float | None) -> torch.Tensor:
    """Reference: SDPA over each row [L, H, D] -> causal, KV heads repeated for GQA."""
    rep = q.size(1) // k.size(1)
    out = []
    for a, b in zip(cu[:-1], cu[1:]):
        qi, ki, vi = (t[a:b].transpose(0, 1) for t in (q, k, v))
        if rep > 1:
            ki, vi = ki.repeat_interleave(rep, 0), vi.repeat_interleave(rep, 0)
        out.append(F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale).transpose(0, 1))
    return torch.cat(out) if out else q.new_zeros(q.shape)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int,
                     scale: float | None = None) -> torch.Tensor:
    """Causal attention within each row of a packed sequence: q [T, Hq, D], k / v [T, Hkv, D] -> [T, Hq, D]."""
    global _VARLEN, _warned
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
        if _VARLEN is None:
            _VARLEN = _varlen_cuda() or False
        if _VARLEN:
            fn, causal, has_gqa, has_scale = _VARLEN
            if k.size(1) != q.size(1) and not has_gqa:
                rep = q.size(1) // k.size(1)
                k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            kw = dict(causal)
            if has_gqa and k.size(1) != q.size(1):
                kw["enable_gqa"] = True
            if scale is not None and has_scale:
                kw["scale"] = scale
            elif scale is not None and abs(scale - q.size(-1) ** -0.5) > 1e-12:
                q = q * (scale * q.size(-1) ** 0.5)
            return fn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, **kw)
        if not _warned:
            _warned = True
            warnings.warn("torch.nn.attention.varlen is missing in this torch: packed attention runs SDPA row by "
                          "row (same values, slower)", stacklevel=2)
    return _rows_sdpa(q, k, v, cu_seqlens.tolist(), scale)


def hf_varlen_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                        sliding_window=None, **kwargs):
    """The HF attention-interface entry: query [1, Hq, T, D], key / value [1, Hkv, T, D] of a packed
    sequence, the rows given by ``cu_seq_lens_q``; returns ([1, T, Hq, D], None) as HF's sdpa does."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        raise ValueError(f"attention {ATTN_IMPLEMENTATION!r} needs a packed sequence (qerl.packing.packed_forward)")
    if query.size(0) != 1:
        raise ValueError(f"a packed sequence is one row, got a batch of {query.size(0)}")
    if dropout:
        raise ValueError("packed attention has no dropout (the training forward runs without it)")
    max_len = int(kwargs["max_length_q"])
    if sliding_window is not None and sliding_window < max_len:
        raise ValueError(f"sliding-window attention ({sliding_window} < a row of {max_len} tokens) is not supported "
                         "by the packed forward")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    out = varlen_attention(q, k, v, cu, max_len, scaling)
    return out[None], None


_registered = False


def _register() -> None:
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(ATTN_IMPLEMENTATION, hf_varlen_attention)
        _registered = True


def _configs(model):
    """Every config object of the model whose ``_attn_implementation`` the layers read."""
    seen, out = set(), []
    for m in model.modules():
        c = getattr(m, "config", None)
        if c is not None and id(c) not in seen and hasattr(c, "_attn_implementation"):
            seen.add(id(c))
            out.append(c)
    return out


@contextlib.contextmanager
def packed_forward(model):
    """Context: the model's attention layers run ``hf_varlen_attention`` (restored after)."""
    _register()
    cfgs = _configs(model)
    prev = [c._attn_implementation for c in cfgs]
    try:
        for c in cfgs:
            c._attn_implementation = ATTN_IMPLEMENTATION
        yield
    finally:
        for c, p in zip(cfgs, prev):
            c._attn_implementation = p


# ----------------------------------------------------------------------------------------------
# forwards by a token budget


def plan_forwards(tokens: list[int], token_budget: int) -> list[list[int]]:
    """Row indices of each forward: rows sorted longest first, each forward filled with rows while
    its tokens stay within ``token_budget`` (first fit over the open forwards); a row longer than the
    budget runs alone. Rows with 0 tokens are left out. Deterministic."""
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    order = sorted((i for i, t in enumerate(tokens) if t > 0), key=lambda i: (-tokens[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        t = tokens[i]
        j = next((j for j, r in enumerate(room) if r >= t), None)
        if j is None:
            bins.append([i])
            room.append(token_budget - t)
        else:
            bins[j].append(i)
            room[j] -= t
    return bins
