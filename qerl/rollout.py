"""Rollout: batched sampling from the training model itself (no copy, no weight sync).

``GenerateEngine`` is the simple reference engine: a token-by-token loop over the HF model with
its dynamic KV cache, left-padded prompts with explicit position ids (so a sequence's positions
do not depend on its padding, the same convention as the training forward in qerl.train), and
per-token log-probs and entropies of the sampling distribution computed on the fly, so no
[batch, length, vocab] logits tensor is ever kept. A faster engine (static cache, CUDA graphs)
implements the same ``generate`` signature.

Log-probs and entropy are those of softmax(logits / temperature), TRL's convention, so they are
directly comparable with the training forward; top-k / top-p only restrict what is sampled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RolloutOutput:
    prompt_ids: torch.Tensor  # [B, P] left-padded
    prompt_mask: torch.Tensor  # [B, P] 1 for real tokens
    completion_ids: torch.Tensor  # [B, C] right-padded with pad_id
    completion_mask: torch.Tensor  # [B, C] 1 up to and including EOS
    logprobs: torch.Tensor  # [B, C] fp32, log-prob of each sampled token under softmax(logits / T)
    entropy: torch.Tensor  # [B, C] fp32, entropy of that distribution at each step
    truncated: torch.Tensor  # [B] bool: no EOS within max_new_tokens

    @property
    def num_completion_tokens(self) -> int:
        return int(self.completion_mask.sum())


def left_pad(seqs: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists into (ids, mask)."""
    if not seqs or any(len(s) == 0 for s in seqs):
        raise ValueError("every prompt needs at least one token")
    n = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), n), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, n - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[i, n - len(s):] = 1
    return ids.to(device), mask.to(device)


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Position ids that ignore left padding: 0 at each sequence's first real token."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Mask logits outside the top-k / top-p (nucleus) set with -inf."""
    if top_k and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True, dim=-1)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        remove = cum - sorted_logits.softmax(-1) > top_p  # keep the token that crosses top_p
        remove = remove.scatter(-1, idx, remove)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits


class GenerateEngine:
    """Reference rollout engine on an HF causal LM (any qerl-quantized model included)."""

    def __init__(self, model, tokenizer, eos_token_ids: list[int] | None = None):
        self.model, self.tokenizer = model, tokenizer
        eos = eos_token_ids if eos_token_ids is not None else _eos_ids(model, tokenizer)
        if not eos:
            raise ValueError("no EOS token id: pass eos_token_ids")
        self.eos = torch.tensor(sorted(set(eos)))
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else int(self.eos[0])

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
                 top_k: int = 0, greedy: bool = False, generator: torch.Generator | None = None) -> RolloutOutput:
        from transformers import DynamicCache

        model = self.model
        device = next(model.parameters()).device
        ids, mask = left_pad(prompts, self.pad_id, device)
        eos = self.eos.to(device)
        B = ids.size(0)
        cache = DynamicCache()
        out_ids = torch.full((B, max_new_tokens), self.pad_id, dtype=torch.long, device=device)
        out_lp = torch.zeros((B, max_new_tokens), dtype=torch.float32, device=device)
        out_ent = torch.zeros_like(out_lp)
        done = torch.zeros(B, dtype=torch.bool, device=device)
        lengths = torch.full((B,), max_new_tokens, dtype=torch.long, device=device)
        pos = positions_from_mask(mask)
        inp, attn = ids, mask
        t = 0
        for t in range(max_new_tokens):
            logits = model(input_ids=inp, attention_mask=attn, position_ids=pos, past_key_values=cache, use_cache=True,
                           logits_to_keep=1).logits[:, -1].float()
            logp_all = torch.log_softmax(logits / max(temperature, 1e-6), dim=-1)
            ent = -(logp_all.exp() * logp_all).sum(-1)
            if greedy:
                nxt = logits.argmax(-1)
            else:
                probs = filter_logits(logits / temperature, top_k, top_p).softmax(-1)
                nxt = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
            nxt = torch.where(done, torch.full_like(nxt, self.pad_id), nxt)
            out_ids[:, t] = nxt
            out_lp[:, t] = torch.where(done, 0.0, logp_all.gather(-1, nxt[:, None]).squeeze(-1))
            out_ent[:, t] = torch.where(done, 0.0, ent)
            hit = torch.isin(nxt, eos) & ~done
            lengths = torch.where(hit, t + 1, lengths)
            done |= hit
            if bool(done.all()):  # one host sync per token: this is the simple engine
                break
            inp = nxt[:, None]
            attn = torch.cat([attn, torch.ones((B, 1), dtype=attn.dtype, device=device)], dim=1)
            pos = pos[:, -1:] + 1
        C = t + 1
        ar = torch.arange(C, device=device)[None]
        cmask = (ar < lengths[:, None]).long()
        return RolloutOutput(ids, mask, out_ids[:, :C] * cmask + self.pad_id * (1 - cmask), cmask,
                             out_lp[:, :C] * cmask, out_ent[:, :C] * cmask, ~done)


def _eos_ids(model, tokenizer) -> list[int]:
    ids = set()
    for src in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        e = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(e, int):
            ids.add(e)
        elif e:
            ids.update(int(x) for x in e)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    for tok in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
        tid = tokenizer.convert_tokens_to_ids(tok) if tok in tokenizer.get_vocab() else None
        if tid is not None:
            ids.add(int(tid))
    return sorted(ids)


def sequence_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature: float = 1.0,
                      with_entropy: bool = False):
    """Per-token log-probs (and entropies) of the completion under the model: the training forward.

    Only the completion positions' logits are computed (logits_to_keep), in the model dtype,
    then converted to fp32 per micro-batch.
    """
    ids = torch.cat([prompt_ids, completion_ids], dim=1)
    mask = torch.cat([prompt_mask, completion_mask], dim=1)
    C = completion_ids.size(1)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask),
                   use_cache=False, logits_to_keep=C + 1).logits[:, :-1]
    logits = logits.float() / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, completion_ids[..., None]).squeeze(-1)
    ent = None
    if with_entropy:
        with torch.no_grad():
            ent = -(logp_all.exp() * logp_all).sum(-1)
    return logp, ent

