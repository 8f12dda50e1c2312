"""The reference rollout engine and the training forward.

``GenerateEngine`` is the simple engine: a token-by-token loop over the HF model with its dynamic
KV cache, left-padded prompts with explicit position ids (so a sequence's positions do not depend
on its padding, the same convention as the training forward), per-token log-probs and entropies
computed on the fly (no [batch, length, vocab] logits are kept), one host sync per token. It is
the definition the fast engine (qerl.rollout.fast) is tested against, and it runs any causal LM.

``sequence_logprobs`` is the training forward: log-probs (and entropies) of given completions,
with fp32 logits from ``lm_logits`` as in both engines.
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint

from qerl.rollout.common import (
    RolloutOutput,
    apply_stop_strings,
    batch_keys,
    eos_ids,
    left_pad,
    lm_logits,
    positions_from_mask,
    sample_tokens,
)


def decoder_and_head(model):
    """(the decoder stack returning hidden states, the lm_head weight) of an HF causal LM."""
    dec = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if dec is None or head is None:
        raise ValueError(f"{type(model).__name__}: expected an HF causal LM with a decoder and an lm_head")
    return dec, head.weight


class GenerateEngine:
    """Reference rollout engine on an HF causal LM (any qerl-quantized model included)."""

    def __init__(self, model, tokenizer=None, eos_token_ids: list[int] | None = None, pad_id: int | None = None):
        self.model, self.tokenizer = model, tokenizer
        eos = eos_token_ids if eos_token_ids is not None else eos_ids(model, tokenizer)
        if not eos:
            raise ValueError("no EOS token id: pass eos_token_ids")
        self.eos = torch.tensor(sorted(set(eos)))
        if pad_id is None:
            pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
            pad_id = pad if pad is not None else self.eos[0]
        self.pad_id = int(pad_id)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
                 top_k: int = 0, greedy: bool = False, seed: int = 0, seq_ids: list[int] | None = None,
                 ignore_eos: bool = False, stop_strings: list[str] | None = None) -> RolloutOutput:
        """Sample completions. Sequence i draws its tokens from the keys (seed, seq_ids[i]) (see
        qerl.rollout.common), so its sample does not depend on the batch it is in."""
        from transformers import DynamicCache

        if stop_strings and self.tokenizer is None:
            raise ValueError("stop_strings need a tokenizer")
        model = self.model
        dec, head_w = decoder_and_head(model)
        device = head_w.device
        ids, mask = left_pad(prompts, self.pad_id, device)
        eos = self.eos.to(device)
        B = ids.size(0)
        keys = batch_keys(seed, seq_ids, B, device)
        cache = DynamicCache()
        out_ids = torch.full((B, max_new_tokens), self.pad_id, dtype=torch.long, device=device)
        out_lp = torch.zeros((B, max_new_tokens), dtype=torch.float32, device=device)
        out_ent = torch.zeros_like(out_lp)
        done = torch.zeros(B, dtype=torch.bool, device=device)
        lengths = torch.full((B,), max_new_tokens, dtype=torch.long, device=device)
        pos = positions_from_mask(mask)
        inp, attn = ids, mask
        t = 0
        from qerl.logging import progress

        bar = progress(max_new_tokens, "rollout", unit="tok", unit_scale=B)  # batch tokens and tokens/s
        for t in range(max_new_tokens):
            bar.update(1)
            h = dec(input_ids=inp, attention_mask=attn, position_ids=pos, past_key_values=cache,
                    use_cache=True).last_hidden_state[:, -1]
            nxt, lp, ent = sample_tokens(lm_logits(h, head_w), temperature, top_k, top_p, greedy, keys, t)
            nxt = torch.where(done, torch.full_like(nxt, self.pad_id), nxt)
            out_ids[:, t] = nxt
            out_lp[:, t] = torch.where(done, 0.0, lp)
            out_ent[:, t] = torch.where(done, 0.0, ent)
            if not ignore_eos:
                hit = torch.isin(nxt, eos) & ~done
                lengths = torch.where(hit, t + 1, lengths)
                done |= hit
            if stop_strings:
                apply_stop_strings(self.tokenizer, out_ids, done, lengths, t + 1, stop_strings)
            if bool(done.all()):  # one host sync per token: this is the simple engine
                break
            inp = nxt[:, None]
            attn = torch.cat([attn, torch.ones((B, 1), dtype=attn.dtype, device=device)], dim=1)
            pos = pos[:, -1:] + 1
        bar.close()
        C = t + 1
        ar = torch.arange(C, device=device)[None]
        cmask = (ar < lengths[:, None]).long()
        return RolloutOutput(ids, mask, out_ids[:, :C] * cmask + self.pad_id * (1 - cmask), cmask,
                             out_lp[:, :C] * cmask, out_ent[:, :C] * cmask, ~done)


# rows of [tokens, vocabulary] fp32 logits computed at a time by the training forward: 1024 rows of a
# 152k vocabulary are 0.6 GB per buffer, whatever the micro-batch and completion length
LOGPROB_CHUNK_ROWS = 1024


def _chunk_logprobs(h: torch.Tensor, head_w: torch.Tensor, ids: torch.Tensor, temperature: float,
                    with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """log-probs of ``ids`` [n] and entropies [n] (detached; empty when not asked) of rows ``h`` [n, H]."""
    logp_all = torch.log_softmax(lm_logits(h, head_w) / temperature, dim=-1)
    logp = logp_all.gather(-1, ids[:, None]).squeeze(-1)
    with torch.no_grad():
        ent = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else logp.new_empty(0)
    return logp, ent


def token_logprobs(hidden: torch.Tensor, head_w: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0,
                   with_entropy: bool = False, chunk_rows: int = LOGPROB_CHUNK_ROWS):
    """Log-probs of ``ids`` [..., ] under softmax(lm_head(hidden) / temperature), and entropies.

    lm_head, log_softmax, gather and entropy run on ``chunk_rows`` rows at a time, so at most one
    chunk's fp32 logits exist at once. Under autograd each chunk is checkpointed: its logits are
    recomputed in the backward instead of kept, so the peak does not grow with rows x vocabulary
    either; values and gradients are the unchunked computation's. Entropies carry no gradient.
    """
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    shape = ids.shape
    h = hidden.reshape(-1, hidden.size(-1))
    flat = ids.reshape(-1)
    grad = torch.is_grad_enabled() and (h.requires_grad or head_w.requires_grad)
    lps, ents = [], []
    for s in range(0, h.size(0), chunk_rows):
        args = (h[s:s + chunk_rows], head_w, flat[s:s + chunk_rows], temperature, with_entropy)
        if grad:
            lp, ent = torch.utils.checkpoint.checkpoint(_chunk_logprobs, *args, use_reentrant=False)
        else:
            lp, ent = _chunk_logprobs(*args)
        lps.append(lp)
        ents.append(ent)
    logp = torch.cat(lps).view(shape) if lps else h.new_zeros(shape, dtype=torch.float32)
    ent = (torch.cat(ents).view(shape) if ents else torch.zeros_like(logp)) if with_entropy else None
    return logp, ent


def sequence_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature: float = 1.0,
                      with_entropy: bool = False, chunk_rows: int = LOGPROB_CHUNK_ROWS):
    """Per-token log-probs (and entropies) of the completion under the model: the training forward.

    Only the completion positions' logits are computed, in fp32 (``lm_logits``) as in both engines,
    ``chunk_rows`` token rows at a time (``token_logprobs``). Entropies are detached.
    """
    ids = torch.cat([prompt_ids, completion_ids], dim=1)
    mask = torch.cat([prompt_mask, completion_mask], dim=1)
    C = completion_ids.size(1)
    dec, head_w = decoder_and_head(model)
    h = dec(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask),
            use_cache=False).last_hidden_state[:, -(C + 1):-1]
    return token_logprobs(h, head_w, completion_ids, temperature, with_entropy, chunk_rows)
