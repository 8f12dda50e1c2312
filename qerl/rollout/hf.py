"""The reference rollout engine.

``GenerateEngine`` is the simple engine: a token-by-token loop over the HF model with its dynamic
KV cache, left-padded prompts with explicit position ids (so a sequence's positions do not depend
on its padding, the same convention as the training forward), per-token log-probs and entropies
computed on the fly (no [batch, length, vocab] logits are kept), one host sync per token. It is
the definition the fast engine (qerl.rollout.fast) is tested against, and it runs any causal LM.
The training forward over given completions is ``qerl.logprobs.sequence_logprobs``.
"""

from __future__ import annotations

import torch

from qerl.forward import decoder_and_head, lm_logits, positions_from_mask
from qerl.rollout.common import (
    RolloutOutput,
    apply_stop_strings,
    batch_keys,
    caps_list,
    eos_ids,
    left_pad,
    sample_tokens,
)


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
    def generate(self, prompts: list[list[int]], max_new_tokens: int | list[int], temperature: float = 1.0, top_p: float = 1.0,
                 top_k: int = 0, greedy: bool = False, seed: int = 0, seq_ids: list[int] | None = None,
                 ignore_eos: bool = False, stop_strings: list[str] | None = None) -> RolloutOutput:
        """Sample completions of up to ``max_new_tokens`` tokens (an int, or one cap per prompt). Sequence
        i draws its tokens from the keys (seed, seq_ids[i]) (see qerl.rollout.common), so its sample
        does not depend on the batch it is in."""
        from transformers import DynamicCache

        if stop_strings and self.tokenizer is None:
            raise ValueError("stop_strings need a tokenizer")
        model = self.model
        dec, head_w = decoder_and_head(model)
        device = head_w.device
        ids, mask = left_pad(prompts, self.pad_id, device)
        eos = self.eos.to(device)
        B = ids.size(0)
        caps = torch.tensor(caps_list(max_new_tokens, B), device=device)
        max_new_tokens = int(caps.max())
        keys = batch_keys(seed, seq_ids, B, device)
        cache = DynamicCache()
        out_ids = torch.full((B, max_new_tokens), self.pad_id, dtype=torch.long, device=device)
        out_lp = torch.zeros((B, max_new_tokens), dtype=torch.float32, device=device)
        out_ent = torch.zeros_like(out_lp)
        done = torch.zeros(B, dtype=torch.bool, device=device)  # ended: EOS, a stop string or the cap
        ended_eos = torch.zeros(B, dtype=torch.bool, device=device)
        lengths = caps.clone()
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
            capped = (t + 1 >= caps) & ~done
            if not ignore_eos:
                hit = torch.isin(nxt, eos) & ~done
                lengths = torch.where(hit, t + 1, lengths)
                ended_eos |= hit
            if stop_strings:
                apply_stop_strings(self.tokenizer, out_ids, ended_eos, lengths, t + 1, stop_strings)
            done |= ended_eos | capped
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
                             out_lp[:, :C] * cmask, out_ent[:, :C] * cmask, ~ended_eos)
