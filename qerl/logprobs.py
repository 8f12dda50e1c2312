"""The training forward: per-token log-probs (and entropies) of given completions under the model.

The policy loss, the old log-probs and the KL reference all come from ``sequence_logprobs``. Its
logits are fp32 (``qerl.forward.lm_logits``), as in both rollout engines, so the training
and sampling log-probs of a token differ only by the kernels and the AQN noise
(``sampling/logprob_gap``).

Memory: a micro-batch's logits would be [rows, vocabulary] fp32 (8 x 2048 completion tokens of a
152k vocabulary: 9.3 GiB, and as much again for the log-softmax and for its gradient). Here only
the completion positions go through the lm_head, ``chunk_rows`` token rows at a time: lm_head,
log-softmax, gather and entropy run on one chunk, keep its [chunk_rows] results and drop its
logits. Under autograd each chunk is checkpointed (recomputed in the backward instead of kept), so
neither the forward nor the backward ever holds more than one chunk's [chunk_rows, vocabulary]
tensors, whatever the micro-batch and completion length. Values and gradients are those of the
unchunked computation.
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint

from qerl.forward import decoder_and_head, lm_logits, positions_from_mask
from qerl.packing import pack_rows, packed_hidden

# token rows of [rows, vocabulary] fp32 logits computed at a time: 1024 rows of a 152k vocabulary
# are 0.6 GB a buffer, whatever the micro-batch and completion length
LOGPROB_CHUNK_ROWS = 1024


def _chunk_logprobs(h: torch.Tensor, head_w: torch.Tensor, ids: torch.Tensor, temperature: float,
                    with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """log-probs of ``ids`` [n] and entropies [n] (detached; empty when not asked) of rows ``h`` [n, H]."""
    logits = lm_logits(h, head_w)
    if temperature != 1.0:  # x / 1.0 is x: no second [n, vocabulary] buffer at T = 1
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    del logits
    logp = logp_all.gather(-1, ids[:, None]).squeeze(-1)
    with torch.no_grad():
        ent = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else logp.new_empty(0)
    return logp, ent


def token_logprobs(hidden: torch.Tensor, head_w: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0,
                   with_entropy: bool = False, chunk_rows: int = LOGPROB_CHUNK_ROWS):
    """Log-probs of ``ids`` [...] under softmax(lm_head(hidden) / temperature), and entropies.

    ``hidden`` is [..., H] with the shape of ``ids`` in front; ``head_w`` the lm_head weight [V, H].
    lm_head, log_softmax, gather and entropy run on ``chunk_rows`` rows at a time (see the module
    docstring); entropies carry no gradient and are None unless ``with_entropy``.
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
                      with_entropy: bool = False, chunk_rows: int = LOGPROB_CHUNK_ROWS, packed: bool = True):
    """Per-token log-probs [B, C] (and entropies, detached) of the completions under the model.

    ``prompt_ids`` / ``prompt_mask`` [B, P] left-padded, ``completion_ids`` / ``completion_mask``
    [B, C] as a ``RolloutOutput`` holds them. Only the completion positions' hidden states go through
    the lm_head (``token_logprobs``).

    ``packed`` (the default): the decoder runs once over the rows' real tokens only, concatenated, with
    attention within each row and positions restarting at each row (``qerl.packing``); positions after a
    row's last real completion token are 0. ``packed=False``: the padded forward over [B, P + C] with the
    attention mask and positions that ignore the left padding, as the rollout engines see them (the
    reference the packed forward is tested against; values at padded positions are meaningless).
    """
    dec, head_w = decoder_and_head(model)
    if packed:
        pk = pack_rows(prompt_ids, prompt_mask, completion_ids, completion_mask)
        shape = tuple(completion_ids.shape)
        if pk.n_tokens == 0:
            z = head_w.new_zeros(shape, dtype=torch.float32)
            return z, (z.clone() if with_entropy else None)
        h = packed_hidden(dec, pk)
        lp, ent = token_logprobs(h.index_select(0, pk.logit_pos), head_w, pk.target_ids, temperature, with_entropy,
                                 chunk_rows)
        return pk.unpack(lp, shape), (pk.unpack(ent, shape) if with_entropy else None)
    ids = torch.cat([prompt_ids, completion_ids], dim=1)
    mask = torch.cat([prompt_mask, completion_mask], dim=1)
    C = completion_ids.size(1)
    h = dec(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask),
            use_cache=False).last_hidden_state[:, -(C + 1):-1]
    return token_logprobs(h, head_w, completion_ids, temperature, with_entropy, chunk_rows)
