"""What both rollout engines share: the output record, padding, logits, and seeded sampling.

Sampling is keyed per sequence. The random numbers that pick token t of a sequence are a pure
function of (seed, seq_id, t, vocabulary index), computed on the device with a counter-based hash
(murmur3's 32-bit finaliser), and the token is drawn by the Gumbel-max trick over the
temperature-scaled, top-k/top-p-filtered logits. Hence a sequence samples the same tokens whatever
batch, engine or data-parallel rank it is generated in (given the same logits), with no generator
state and no host sync. Gumbel-max is exact: argmax(log p_i + G_i) with G_i = -log(-log U_i) is a
draw from p. The noise and the torch draw are qerl.kernels' (``uniform_noise``,
``gumbel_argmax_torch``); on a GPU the draw runs as one kernel (``qerl.kernels.gumbel_argmax``: the
same noise bits and the same token; ``sample_tokens(..., fused=False)`` keeps the torch ops).

Log-probs and entropies are those of softmax(logits / temperature), TRL's convention, so they
compare directly with the training forward; top-k / top-p only restrict what is sampled.

Logits are computed in fp32 (``qerl.forward.lm_logits``, which the training forward uses too).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

from qerl.kernels import M32 as _M32
from qerl.kernels import fmix32 as _fmix32
from qerl.kernels import gumbel_argmax_torch


@dataclass
class RolloutOutput:
    prompt_ids: torch.Tensor  # [B, P] left-padded
    prompt_mask: torch.Tensor  # [B, P] 1 for real tokens
    completion_ids: torch.Tensor  # [B, C] right-padded with pad_id
    completion_mask: torch.Tensor  # [B, C] 1 up to and including EOS (or the stop string's last token)
    logprobs: torch.Tensor  # [B, C] fp32, log-prob of each sampled token under softmax(logits / T)
    entropy: torch.Tensor  # [B, C] fp32, entropy of that distribution at each step
    truncated: torch.Tensor  # [B] bool: no EOS / stop string within max_new_tokens

    @property
    def num_completion_tokens(self) -> int:
        return int(self.completion_mask.sum())


def as_token_lists(prompts) -> list[list[int]]:
    """Prompts as lists of token ids: lists, 1-D tensors, or tokenizer outputs with ``input_ids``
    (what ``apply_chat_template`` returns in transformers 5); text is an error (tokenize first)."""
    out = []
    for p in prompts:
        if isinstance(p, str):
            raise TypeError("prompts must be token ids, not text: tokenize them first "
                            "(tokenizer.apply_chat_template(..., add_generation_prompt=True))")
        if hasattr(p, "keys") and "input_ids" in p:
            p = p["input_ids"]
        if torch.is_tensor(p):
            p = p.reshape(-1).tolist()
        p = list(p)
        if p and isinstance(p[0], (list, tuple)):  # a batch of one from a tokenizer
            if len(p) != 1:
                raise ValueError("each prompt must be one sequence of token ids")
            p = list(p[0])
        out.append([int(t) for t in p])
    return out


def left_pad(seqs, pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad prompts (any form ``as_token_lists`` takes) into (ids, mask) [B, longest]."""
    seqs = as_token_lists(seqs)
    if not seqs or any(len(s) == 0 for s in seqs):
        raise ValueError("every prompt needs at least one token")
    n = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), n), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, n - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[i, n - len(s):] = 1
    return ids.to(device), mask.to(device)


def caps_list(max_new_tokens, batch: int) -> list[int]:
    """``max_new_tokens`` (an int, or one int per sequence) as one cap per sequence, each >= 1."""
    if isinstance(max_new_tokens, numbers.Integral):
        caps = [int(max_new_tokens)] * batch
    else:
        caps = [int(c) for c in max_new_tokens]
    if len(caps) != batch:
        raise ValueError(f"max_new_tokens has {len(caps)} caps for {batch} prompts")
    if min(caps) < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {min(caps)}")
    return caps


# ----------------------------------------------------------------------------------------------
# sampling
def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Mask logits outside the top-k / top-p (nucleus) set with -inf."""
    if top_k and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True, dim=-1)
        p = sorted_logits.softmax(-1)
        remove = p.cumsum(-1) - p > top_p  # keep the token that crosses top_p
        remove = remove.scatter(-1, idx, remove)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits


def sequence_keys(seed: int, seq_ids: torch.Tensor) -> torch.Tensor:
    """Per-sequence hash keys [B] (int64 in [0, 2^32)) from a run seed and global sequence ids."""
    s = _fmix32(torch.tensor(seed & _M32, dtype=torch.long, device=seq_ids.device) ^ 0x5BD1E995)
    return _fmix32(s ^ (seq_ids.long() & _M32))


def batch_keys(seed: int, seq_ids, batch: int, device) -> torch.Tensor:
    """``sequence_keys`` of a batch: seq_ids (default range(batch)) checked against its size."""
    sid = torch.arange(batch) if seq_ids is None else torch.as_tensor(seq_ids)
    if sid.numel() != batch:
        raise ValueError(f"seq_ids has {sid.numel()} ids for {batch} prompts")
    return sequence_keys(seed, sid.to(device))


def sample_tokens(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, greedy: bool,
                  keys: torch.Tensor, t, fused: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pick the next token of each row. Returns (tokens [B], logprob of each [B], entropy [B]).

    ``logits`` fp32 [B, V]; ``keys`` from ``sequence_keys``; ``t`` the step index (int or a
    0-d device tensor, so the call can sit inside a CUDA graph). ``fused``: on a GPU, the draw in one
    kernel (the same tokens in one launch instead of ~20); False keeps the torch ops (tests compare
    the two).
    """
    scaled = logits / max(temperature, 1e-6)
    logp_all = torch.log_softmax(scaled, dim=-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    if greedy:
        tok = logits.argmax(-1)
    else:
        filt = filter_logits(scaled, top_k, top_p)
        if filt.is_cuda and fused:  # the same draw in one kernel
            from qerl.kernels import gumbel_argmax

            tt = t if torch.is_tensor(t) else torch.tensor(t, dtype=torch.long, device=filt.device)
            tok = gumbel_argmax(filt.contiguous(), keys, tt)
        else:
            tok = gumbel_argmax_torch(filt, keys, t)
    return tok, logp_all.gather(-1, tok[:, None]).squeeze(-1), ent


def eos_ids(model, tokenizer) -> list[int]:
    """Every end-of-sequence id the model's configs and the tokenizer name."""
    ids = set()
    for src in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        e = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(e, int):
            ids.add(e)
        elif e:
            ids.update(int(x) for x in e)
    if tokenizer is not None:
        if tokenizer.eos_token_id is not None:
            ids.add(int(tokenizer.eos_token_id))
        vocab = tokenizer.get_vocab()
        for tok in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
            if tok in vocab:
                ids.add(int(vocab[tok]))
    return sorted(ids)


def apply_stop_strings(tokenizer, out_ids: torch.Tensor, done: torch.Tensor, lengths: torch.Tensor,
                       t: int | list[int], stop_strings: list[str]) -> None:
    """Mark rows whose first ``t`` tokens (one count for all rows, or each row's own; a row with 0 is
    skipped) contain a stop string done, with the length that ends it."""
    counts = [t] * out_ids.shape[0] if isinstance(t, int) else t
    for i in torch.nonzero(~done).flatten().tolist():
        if counts[i] <= 0:
            continue
        n = stop_length(tokenizer, out_ids[i, :counts[i]].tolist(), stop_strings)
        if n is not None:
            lengths[i], done[i] = n, True


def stop_length(tokenizer, tokens: list[int], stop_strings: list[str]) -> int | None:
    """Tokens to keep so the completion ends right after its first stop string, or None if none occurs."""
    text = tokenizer.decode(tokens, skip_special_tokens=False)
    if not any(s in text for s in stop_strings):
        return None
    lo, hi = 1, len(tokens)  # the shortest prefix whose text contains a stop string
    while lo < hi:
        mid = (lo + hi) // 2
        t = tokenizer.decode(tokens[:mid], skip_special_tokens=False)
        if any(s in t for s in stop_strings):
            hi = mid
        else:
            lo = mid + 1
    return lo
