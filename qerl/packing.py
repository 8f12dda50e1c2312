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
  ``packed_hidden`` runs the decoder's own layers (and HF's gradient checkpointing) over the packed
  sequence; their attention calls reach it through HF's attention functions, which qerl wraps once to
  take a packed sequence (``_dispatching``: a call without one runs HF's own function unchanged).
- ``plan_forwards``: the rows of a training pass sorted by length and cut into forwards of at most
  ``token_budget`` tokens (a longer row alone). The loss normalisation never depends on this cut
  (qerl.step: each row keeps its micro-batch's normaliser, as across data-parallel ranks).
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F


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


PACK_ALIGN = 16  # packed lengths are rounded up to a multiple of this: GEMM row counts keep one divisibility


def pack_rows(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
              completion_mask: torch.Tensor, align: int = PACK_ALIGN) -> PackedRows:
    """Pack rows as the module docstring says. Prompts may be padded on either side (their mask
    says which tokens are real); a row with completion tokens needs at least one prompt token.
    ``align``: the packed sequence is filled up to a multiple of it by one last segment of filler
    tokens (attending only among themselves, no log-prob read there): fewer than ``align`` tokens,
    and the kernels see row counts of one divisibility (the Triton kernels specialise on M % 16)."""
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
    flat_ids, flat_pos = ids[keep], pos[keep]
    T = flat_ids.numel()
    fill = (-T) % align if T else 0
    if fill:
        flat_ids = torch.cat([flat_ids, flat_ids.new_zeros(fill)])
        flat_pos = torch.cat([flat_pos, torch.arange(fill, device=dev, dtype=flat_pos.dtype)])
        cu = torch.cat([cu, cu.new_tensor([T + fill])])
    max_len = max(int(seq.max()) if B else 0, fill)
    return PackedRows(flat_ids[None], flat_pos[None], cu, max_len, logit_pos, completion_ids[rows, cols], rows, cols)


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


def _packed_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      sliding_window=None, **kwargs):
    """query [1, Hq, T, D], key / value [1, Hkv, T, D] of a packed sequence (``qerl_cu_seqlens``) ->
    ([1, T, Hq, D], None), as HF's own attention functions return."""
    if query.size(0) != 1:
        raise ValueError(f"a packed sequence is one row, got a batch of {query.size(0)}")
    if dropout:
        raise ValueError("packed attention has no dropout (the training forward runs without it)")
    max_len = int(kwargs["qerl_max_len"])
    if sliding_window is not None and sliding_window < max_len:
        raise ValueError(f"sliding-window attention ({sliding_window} < a row of {max_len} tokens) is not supported "
                         "by the packed forward")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    return varlen_attention(q, k, v, kwargs["qerl_cu_seqlens"], max_len, scaling)[None], None


def _dispatching(inner):
    """An HF attention function that runs ``_packed_attention`` when the layer was called with a packed
    sequence's ``qerl_cu_seqlens`` (also when gradient checkpointing recomputes the layer in the
    backward: the kwargs are bound to the recomputation), else ``inner`` unchanged."""
    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        if kwargs.get("qerl_cu_seqlens") is not None:
            return _packed_attention(module, query, key, value, attention_mask, *args, **kwargs)
        kwargs.pop("qerl_cu_seqlens", None)
        kwargs.pop("qerl_max_len", None)
        return inner(module, query, key, value, attention_mask, *args, **kwargs)

    attention.qerl_inner = inner
    return attention


PACKED_IMPLEMENTATIONS = ("sdpa", "eager")  # the model's own attention that the packed forward runs beside


def _register() -> None:
    """Once: HF's "sdpa" and "eager" attention functions, wrapped by ``_dispatching``."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama.modeling_llama import eager_attention_forward

    for name in PACKED_IMPLEMENTATIONS:
        cur = ALL_ATTENTION_FUNCTIONS.get(name, eager_attention_forward if name == "eager" else None)
        if cur is not None and not hasattr(cur, "qerl_inner"):
            AttentionInterface.register(name, _dispatching(cur))


def packed_hidden(dec, pk: PackedRows) -> torch.Tensor:
    """The decoder's last hidden states [T, H] over a packed sequence: embeddings, rotary at the packed
    positions, every decoder layer (attention within each row; HF's gradient checkpointing as
    configured), the final norm. ``dec``: the decoder stack (``qerl.forward.decoder_and_head``). No attention
    mask is built (none is needed)."""
    impl = getattr(dec.config, "_attn_implementation", None)
    if impl not in PACKED_IMPLEMENTATIONS:
        raise ValueError(f"the packed forward runs beside the model's own attention, which must be one of "
                         f"{PACKED_IMPLEMENTATIONS}; this model uses {impl!r} (load it with attn_implementation='sdpa')")
    for name in ("embed_tokens", "rotary_emb", "layers", "norm"):
        if not hasattr(dec, name):
            raise ValueError(f"{type(dec).__name__} has no {name}: the packed forward needs a Llama/Qwen-style decoder")
    _register()
    h = dec.embed_tokens(pk.input_ids)
    pos_emb = dec.rotary_emb(h, pk.position_ids)
    kw = {"qerl_cu_seqlens": pk.cu_seqlens, "qerl_max_len": pk.max_len}
    for layer in dec.layers[: dec.config.num_hidden_layers]:
        out = layer(h, attention_mask=None, position_ids=pk.position_ids, position_embeddings=pos_emb, **kw)
        h = out[0] if isinstance(out, tuple) else out
    return dec.norm(h)[0]


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
