"""Rollout: batched sampling from the training model itself (no copy of the weights, no sync).

Two engines with one contract, ``generate(prompts, max_new_tokens, temperature, top_p, top_k,
greedy, seed, seq_ids, ignore_eos, stop_strings) -> RolloutOutput``:

- ``FastEngine`` (fast.py): static KV cache, whole decode steps as CUDA graphs, no host sync per
  token, finished sequences leaving the batch (a graph per batch bucket); Llama / Qwen2 / Qwen3. The
  trainer's default.
- ``GenerateEngine`` (hf.py): the reference loop over the HF model with its dynamic cache; any
  causal LM; what the fast engine is tested against.

Sampling, fp32 logits and the output record live in common.py. The training forward over given
completions is ``qerl.logprobs.sequence_logprobs``.
"""

from __future__ import annotations

from qerl.forward import decoder_and_head, lm_logits, positions_from_mask
from qerl.kernels import uniform_noise
from qerl.rollout.common import (
    RolloutOutput,
    filter_logits,
    left_pad,
    sample_tokens,
    sequence_keys,
)
from qerl.rollout.fast import SUPPORTED, FastEngine
from qerl.rollout.hf import GenerateEngine

ENGINES = ("auto", "fast", "hf")

__all__ = ["ENGINES", "FastEngine", "GenerateEngine", "RolloutOutput", "SUPPORTED", "decoder_and_head",
           "filter_logits", "left_pad", "lm_logits", "make_engine", "positions_from_mask", "sample_tokens",
           "sequence_keys", "uniform_noise"]


def make_engine(model, tokenizer=None, kind: str = "auto", **kw):
    """The rollout engine for ``model``: "fast", "hf" (reference), or "auto" (fast where supported).

    Keyword arguments go to the engine (eos_token_ids, pad_id; FastEngine also max_seq_len,
    cuda_graphs, sync_every, logits_fp32, compact, max_batch, refill, which the reference engine
    ignores). "fast" on an unsupported architecture raises.
    """
    if kind not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {kind!r}")
    if kind == "auto":
        kind = "fast" if getattr(model.config, "model_type", None) in SUPPORTED else "hf"
    if kind == "fast":
        return FastEngine(model, tokenizer, **kw)
    return GenerateEngine(model, tokenizer, eos_token_ids=kw.get("eos_token_ids"), pad_id=kw.get("pad_id"))
