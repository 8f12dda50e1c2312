"""The fast rollout engine: static KV cache, whole decode steps replayed as CUDA graphs.

It runs the training model's own modules (the QuantLinears with their packed 4-bit buffers and
LoRA adapters, the RMSNorms whose weights AQN perturbs in place), so there is no copy of the
weights and no weight sync; a new AQN sigma or an optimizer step is seen by the next replay with
no re-capture. Supported: the Llama, Qwen2/Qwen2.5 and Qwen3 families (``SUPPORTED``).

One ``generate`` call:
1. Buffers for batch B and cache length L (a multiple of 256 that holds prompt + completion)
   are allocated once and reused while B and L fit: per layer K and V [B, kv_heads, L, head_dim],
   a key-validity mask [B, L], and the decode state (next token, positions, cache position, step,
   done flags, lengths, per-sequence sampling keys, output rows).
2. Prefill: the left-padded prompts [B, P] go through the layers in one pass (the 4-bit GEMM
   kernel), K/V land in cache[:, :, :P], and the first token is sampled.
3. Decode: one CUDA graph per attention window w (256, 512, 1024, ... up to L; the step at
   cache position c replays the smallest w > c, so attention reads only the first w cache slots).
   A graph holds the whole step: embedding, every layer, fp32 logits, sampling (temperature,
   top-k, top-p, seeded Gumbel-max, see common.py), the write of token / log-prob / entropy, EOS
   bookkeeping, and the advance of the step counters. The host only replays; it reads the done
   flags every ``sync_every`` steps to stop early, compact and apply stop strings, never per token.
   Graphs are keyed by (B, L, bucket, window, sampling settings) and captured on first use (a
   warm-up pass, then the capture) into one shared memory pool, so the first call at a new batch
   size is slower: time the second.
4. Finished sequences leave the batch (``compact=True``, the default). At each host check the
   engine counts the sequences still running; when they fit a smaller bucket (the batch, then the
   powers of two below it: 64, 32, ..., 1), it packs their rows, K/V cache slots and decode state
   into the first rows and replays that bucket's graphs from then on (rows left over in the bucket
   copy a running row and write to a scratch sequence). The cache rows are moved, not indexed, so
   a bucket's graphs read contiguous rows and the attention kernel is the static engine's. Rows
   write their tokens, log-probs and lengths to their sequence's place, so the output is laid out
   as the prompts were. A sequence samples from its own keys (seed, seq_id, t), so compaction does
   not change what it samples, given the same logits (the 4-bit kernels differ by rounding between
   batch sizes: a near tie may break differently, as between any two batch sizes). Each sequence
   may have its own cap (``max_new_tokens`` as a list), which is how the benchmarks force a mix of
   completion lengths. ``last_stats`` says how many decode steps ran at each bucket.
5. More prompts than rows (``max_batch``): at each host check the rows whose sequences ended take
   the waiting prompts (``refill=True``, the default). Every row writes the same cache slot each step
   (one cursor, as in the static batch), so a refilled prompt is prefilled into its row's slots just
   before the cursor, its own positions starting at 0, and decodes on with the others; no kernel needs
   per-row cache positions. When the cursor would pass the cache's end, every row's live slots move
   back to the start (``_rebase``): a running sequence spans at most prompt + cap slots, so a cache of
   prompt + cap + sync_every slots suffices however many prompts wait. Once none waits, the rows
   compact as in 4. ``refill=False`` runs the prompts in waves of max_batch instead.

Without CUDA (CPU tests) the same step function runs eagerly; ``cuda_graphs=False`` does the same
on a GPU (for debugging and for measuring what the graphs buy).

Fused decode (``fused=True``, the default on CUDA): the decode step's layers run through the
fused Triton kernels of qerl.kernels instead of the HF-order torch ops: residual add + RMSNorm
(+ the stacked LoRA-A product of the Linears it feeds) in one kernel, q/k norm + rotary + KV-cache
write in one, one bias/LoRA-B launch per group of Linears that share an input (q/k/v; gate/up,
which also applies SiLU(gate) * up), and LoRA-A + B launches for o_proj and down_proj
(rollout/fused_linear.py). Its attention (``attention="qerl"``) is qerl.kernels.decode_attention: split over
the keys, so a few rows over a long cache still fill the GPU, and reading only up to the cursor (a device
tensor), so a window's graph does no work past it; ``attention="sdpa"`` keeps torch SDPA (A/B). Every
weight is still read live from the modules, so LoRA and AQN updates reach the captured graphs as before.
Same arithmetic, different reduction order: tokens may differ from the unfused path where logits nearly
tie (tested with a tolerance). Prefill stays
unfused. On the CPU ``fused=True`` needs TRITON_INTERPRET=1 (tests); the default there is off, so
the eager CPU path stays op for op HF.

Numerics follow the HF modules op for op (RMSNorm, rotary embedding, SDPA attention with the
HF scaling, residual order), so greedy decoding reproduces ``model.generate`` (tested on the
embedded model in bf16 and NVFP4 with ``logits_fp32=False``, which rounds the logits to the model
dtype as HF does; the default fp32 logits are what the trainer uses, see common.py).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from qerl.arch import FUSED_GROUPS, SUPPORTED_MODEL_TYPES
from qerl.forward import lm_logits, positions_from_mask
from qerl.kernels import (
    add_rmsnorm,
    add_rmsnorm_lora_a,
    decode_attention,
    decode_attention_lora_a,
    lora_a,
    lora_rope_cache_write,
    rmsnorm,
    rope_cache_write,
)
from qerl.rollout.common import (
    RolloutOutput,
    apply_stop_strings,
    as_token_lists,
    batch_keys,
    caps_list,
    eos_ids,
    left_pad,
    sample_tokens,
)
from qerl.rollout.fused_linear import grouped_linears, lora_group, silu_mlp_input, stacked_A

SUPPORTED = SUPPORTED_MODEL_TYPES  # qerl.arch: every family qerl loads
WINDOW = 256  # cache length granularity and the smallest attention window
# Largest batch whose decode step multiplies the LoRA A's inside the norm kernel (add_rmsnorm_lora_a:
# a program per row and two A rows, each recomputing its row's norm); larger batches run the plain
# norm and then one lora_a launch tiled over rows.
NORM_LORA_A_MAX_M = 16
# Largest batch whose decode step multiplies a Linear's LoRA A inside the kernel that produces its input:
# o_proj's in the attention kernel (decode_attention_lora_a: the program that writes a KV head's query heads
# adds their columns' share), down_proj's in the SiLU * up kernel (lora_silu_mul_lora_a: a column block's
# share a program); those Linears then need no lora_a launch. 0 (off) until a GPU measurement says where it
# pays; QERL_PRODUCER_LORA_A=<rows> (read at import) sets it for A/B runs.
PRODUCER_LORA_A_MAX_M = int(os.environ.get("QERL_PRODUCER_LORA_A", "0") or 0)
# Largest batch whose decode step adds q/k/v's bias and LoRA inside the rotary + KV-cache launch
# (lora_rope_cache_write: lora_out's arithmetic and roundings; q/k/v's lora_out launch goes). 0 (off) until
# measured; QERL_ROPE_LORA_OUT=<rows> (read at import) sets it. From 16 rows it was slower (55597b5).
ROPE_LORA_OUT_MAX_M = int(os.environ.get("QERL_ROPE_LORA_OUT", "0") or 0)
# The fused decode step's attention: "qerl" (qerl.kernels.decode_attention, split over the keys, reads
# up to the cursor) or "sdpa" (torch's scaled_dot_product_attention over the whole window; A/B runs).
ATTENTION = ("qerl", "sdpa")


def _fused_groups(layer) -> tuple[list, list]:
    """The attention and MLP projections of a decoder layer that share an input ([q, k, v], [gate, up]),
    as qerl.arch.FUSED_GROUPS lists them."""
    groups = {parent: [getattr(getattr(layer, parent), name) for name in names] for parent, names in FUSED_GROUPS}
    return groups["self_attn"], groups["mlp"]


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


@dataclass
class _Buffers:
    """The engine's state. Row tensors ([B, ...]) hold the sequences being decoded, packed into the first
    rows (a bucket's CUDA graphs read rows [:bucket]); sequence tensors ([S + 1, ...], S >= B the sequences
    a call may have) are indexed by the sequence's place in the call's prompt list, their last row (S) a
    scratch row that padding rows and finished rows write to."""
    B: int
    S: int
    L: int
    k: list
    v: list
    key_valid: torch.Tensor  # rows [B, L] bool
    tok: torch.Tensor  # rows [B] next input token
    pos: torch.Tensor  # rows [B] its position id
    keys: torch.Tensor  # rows [B] sampling keys
    rowseq: torch.Tensor  # rows [B] the sequence a row decodes (S: a padding row)
    col: torch.Tensor  # rows [B] index of the token the row's next step samples (its sequence's tokens so far)
    cpos: torch.Tensor  # [1] the cache slot the next step writes (one for every row)
    done: torch.Tensor  # sequences [S + 1] bool: ended (EOS, stop string or its cap)
    eos: torch.Tensor  # sequences [S + 1] bool: ended by EOS or a stop string (not truncated)
    lengths: torch.Tensor  # sequences [S + 1]
    cap: torch.Tensor  # sequences [S + 1] its max_new_tokens
    out_ids: torch.Tensor  # sequences [S + 1, L]
    out_lp: torch.Tensor  # sequences [S + 1, L] fp32
    out_ent: torch.Tensor  # sequences [S + 1, L] fp32

    def rows(self, n: int) -> _Buffers:
        """The same state with the row tensors cut to the first n rows (a bucket's view)."""
        if n == self.B:
            return self
        cut = {f: getattr(self, f)[:n] for f in ("key_valid", "tok", "pos", "keys", "rowseq", "col")}
        return replace(self, k=[x[:n] for x in self.k], v=[x[:n] for x in self.v], **cut)


def _prefill_mask(mask: torch.Tensor) -> torch.Tensor:
    """The prefill's attention mask [B, 1, P, P] of left-padded prompts (mask [B, P]): causal over the real
    tokens; each position also sees itself, so a padding row's softmax has a key."""
    P = mask.shape[1]
    causal = torch.ones((P, P), dtype=torch.bool, device=mask.device).tril()
    return (causal[None, None] & mask.bool()[:, None, None, :]) | torch.eye(P, dtype=torch.bool, device=mask.device)[None, None]


def buckets(batch: int) -> list[int]:
    """The batch sizes a call of ``batch`` sequences decodes at: the batch itself, then the powers of two
    below it, largest first (64 -> [64, 32, 16, 8, 4, 2, 1]; 48 -> [48, 32, ..., 1])."""
    return [batch] + [1 << i for i in range(batch.bit_length() - 1, -1, -1) if (1 << i) < batch]


class FastEngine:
    """Batched generation on the training model's own weights. See the module docstring.

    Args:
        model: an HF Llama / Qwen2 / Qwen3 causal LM (any qerl format, LoRA or not).
        tokenizer: for EOS ids, the pad id and stop strings (optional if eos_token_ids is given).
        eos_token_ids, pad_id: override what the model/tokenizer say.
        max_seq_len: cache length to allocate up front (prompt + completion); else per call.
        cuda_graphs: replay decode steps as CUDA graphs (default: on CUDA).
        sync_every: decode steps between host checks of the done flags.
        logits_fp32: fp32 logits (default; what training uses). False rounds logits to the model
            dtype as HF does, for exact greedy parity tests.
        fused: decode through the fused Triton kernels (default: on CUDA when the model allows it,
            i.e. a SiLU MLP; True on the CPU needs TRITON_INTERPRET=1).
        max_batch: the most sequences decoded at once (the cache's rows; default: every prompt of a
            call). A call with more prompts gives each row whose sequence ended to the next waiting
            prompt (``refill``, the default), or runs them in waves of max_batch (``refill=False``),
            each compacting as its sequences end.
        refill: with more prompts than max_batch, freed rows take waiting prompts at each host check:
            the prompt is prefilled into the row's cache just before the shared cache cursor and joins
            the decode; the cursor moves back when the cache fills. Once none waits, rows compact.
        compact: finished sequences leave the batch (default): when the sequences still running fit a
            smaller bucket (``buckets``), they are packed into its rows and its graphs replay. False
            keeps the static batch: every row runs until the last sequence ends.

    ``stats`` counts over the engine's life (graph captures, replays, host syncs, compactions);
    ``last_stats`` describes the last ``generate`` call: decode steps in all and at each bucket
    (``bucket_steps``), compactions and the seconds their moves took (``compaction_s``, timed
    on the GPU), the useful (non-pad) completion tokens, the waves of max_batch, the sequences that
    started in a freed row (``refills``) and the cache cursor's moves back (``rebases``).
    """

    def __init__(self, model, tokenizer=None, eos_token_ids: list[int] | None = None, pad_id: int | None = None,
                 max_seq_len: int | None = None, cuda_graphs: bool | None = None, sync_every: int = 16,
                 logits_fp32: bool = True, fused: bool | None = None, compact: bool = True,
                 max_batch: int | None = None, refill: bool = True, attention: str = "qerl"):
        cfg = model.config
        if attention not in ATTENTION:
            raise ValueError(f"attention must be one of {ATTENTION}, got {attention!r}")
        if getattr(cfg, "model_type", None) not in SUPPORTED:
            raise ValueError(f"FastEngine supports model types {SUPPORTED}, got {getattr(cfg, 'model_type', None)!r}; "
                             "use the reference engine (make_engine(kind='hf')) for other architectures")
        if getattr(cfg, "use_sliding_window", False):
            raise ValueError("FastEngine does not implement sliding-window attention (config.use_sliding_window=True)")
        self.model, self.tokenizer = model, tokenizer
        self.inner = model.get_decoder()
        self.layers = list(self.inner.layers)
        self.head = model.get_output_embeddings()
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.scaling = getattr(self.layers[0].self_attn, "scaling", self.head_dim ** -0.5)
        eos = eos_token_ids if eos_token_ids is not None else eos_ids(model, tokenizer)
        if not eos:
            raise ValueError("no EOS token id: pass eos_token_ids")
        self.eos_list = sorted(set(int(e) for e in eos))
        if pad_id is None:
            pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
            pad_id = int(pad) if pad is not None else self.eos_list[0]
        self.pad_id = int(pad_id)
        self.device = self.head.weight.device
        self.dtype = self.inner.embed_tokens.weight.dtype
        self.cuda_graphs = (self.device.type == "cuda") if cuda_graphs is None else bool(cuda_graphs)
        if self.cuda_graphs and self.device.type != "cuda":
            raise ValueError("cuda_graphs=True needs the model on a CUDA device")
        self.sync_every = max(1, int(sync_every))
        self.logits_fp32 = logits_fp32
        self.fused = self._resolve_fused(fused, cfg)
        self.eos = torch.tensor(self.eos_list, device=self.device)
        self.max_seq_len = max_seq_len
        self.buf: _Buffers | None = None
        self.graphs: dict = {}
        self._pool = None
        self.compact = bool(compact)
        if max_batch is not None and max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.max_batch = max_batch
        self.refill = bool(refill)
        self.attention = attention
        self.stats = {"captures": 0, "replays": 0, "host_syncs": 0, "compactions": 0}
        self.last_stats: dict = {}

    def _resolve_fused(self, fused, cfg) -> bool:
        why = None
        if getattr(cfg, "hidden_act", "silu") != "silu":
            why = f"hidden_act={cfg.hidden_act!r} (the fused MLP kernel is SiLU)"
        elif self.device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
            why = f"the model is on {self.device.type!r}: the Triton kernels need CUDA or TRITON_INTERPRET=1"
        if fused is None:
            return why is None and self.device.type == "cuda"
        if fused and why:
            raise ValueError(f"fused=True cannot run: {why}")
        return bool(fused)

    # ------------------------------------------------------------------------------ buffers
    def _ensure_buffers(self, B: int, need: int, S: int | None = None) -> _Buffers:
        """Buffers for B rows, S sequences (default B) and at least ``need`` cache slots (kept while they fit)."""
        S = B if S is None else S
        L = max(self.max_seq_len or 0, need)
        L = WINDOW * math.ceil(L / WINDOW)
        b = self.buf
        if b is not None and b.B == B and b.S >= S and b.L >= L:
            return b
        self.buf, self.graphs, self._pool = None, {}, None  # free the old cache and graphs first
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        dev, dt = self.device, self.dtype
        shape = (B, self.n_kv, L, self.head_dim)

        def z(*size, dtype=torch.long):
            return torch.zeros(size, dtype=dtype, device=dev)

        self.buf = _Buffers(
            B=B, S=S, L=L,
            k=[torch.zeros(shape, dtype=dt, device=dev) for _ in self.layers],
            v=[torch.zeros(shape, dtype=dt, device=dev) for _ in self.layers],
            key_valid=z(B, L, dtype=torch.bool), tok=z(B), pos=z(B), keys=z(B), rowseq=z(B), col=z(B), cpos=z(1),
            done=z(S + 1, dtype=torch.bool), eos=z(S + 1, dtype=torch.bool), lengths=z(S + 1), cap=z(S + 1),
            out_ids=z(S + 1, L), out_lp=z(S + 1, L, dtype=torch.float32), out_ent=z(S + 1, L, dtype=torch.float32))
        return self.buf

    def cache_bytes(self) -> int:
        b = self.buf
        return 0 if b is None else sum(t.numel() * t.element_size() for t in b.k + b.v)

    # ------------------------------------------------------------------------------ the model
    def _layers(self, b, h, pos, write, attn_mask, window):
        """Every decoder layer on h [B, T, H] (B = the rows of ``b``); K/V written by ``write(i, k, v)``;
        attention over cache[:w]."""
        B, T, _ = h.shape
        cos, sin = self.inner.rotary_emb(h, pos)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(B, T, -1, self.head_dim)
            k = attn.k_proj(x).view(B, T, -1, self.head_dim)
            v = attn.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
            if getattr(attn, "q_norm", None) is not None:  # Qwen3
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            q = (q * cos) + (_rotate_half(q) * sin)
            k = (k * cos) + (_rotate_half(k) * sin)
            write(i, k, v)
            kk, vv = b.k[i][:, :, :window], b.v[i][:, :, :window]
            o = F.scaled_dot_product_attention(q, kk, vv, attn_mask=attn_mask, scale=self.scaling,
                                               enable_gqa=self.n_kv != self.n_heads)
            h = h + attn.o_proj(o.transpose(1, 2).reshape(B, T, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return h

    def _fused_layers(self, b, h, window, mask):
        """The decode step's layers through the fused kernels (see the module docstring) on h [B, 1, H]
        (B = the rows of ``b``); returns the final-normed hidden state [B, H] (the final norm fused with
        the last residual add)."""
        B = h.shape[0]
        cos, sin = self.inner.rotary_emb(h, b.pos[:, None])
        cos, sin = cos.reshape(B, -1).contiguous(), sin.reshape(B, -1).contiguous()
        if self.attention == "sdpa":  # an additive float mask, once per step (SDPA converts a bool one per call)
            mask = torch.zeros(mask.shape, dtype=h.dtype, device=h.device).masked_fill_(~mask, float("-inf"))
        res, delta = h.reshape(B, -1), None
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            qkv, gate_up = _fused_groups(layer)
            res, x, ha = self._fused_norm(res, delta, layer.input_layernorm, qkv)
            qn, kn = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
            norms = (None if qn is None else qn.weight, None if kn is None else kn.weight,
                     1e-6 if qn is None else qn.variance_epsilon)
            grp = lora_group(qkv) if B <= ROPE_LORA_OUT_MAX_M else None
            if grp is not None:  # q/k/v's bias + LoRA with the rotary and the cache write: one launch
                As, Bs, biases, scaling = grp
                q, k, v = grouped_linears(x, qkv, epilogue=False)
                q = lora_rope_cache_write(q, k, v, ha if ha is not None else lora_a(x, As), Bs, biases, scaling,
                                          cos, sin, b.k[i], b.v[i], b.cpos, *norms)
            else:
                q, k, v = grouped_linears(x, qkv, ha)
                q = rope_cache_write(q, k, v, cos, sin, b.k[i], b.v[i], b.cpos, *norms)
            # one query token: the G = n_heads / n_kv query heads of a KV head are G query rows of it
            # (HF's repeat_kv order), so no copy of K/V per query head (enable_gqa's math path makes one)
            ho = None
            Ao = stacked_A([attn.o_proj]) if self.attention == "qerl" and B <= PRODUCER_LORA_A_MAX_M else None
            if Ao is not None:  # o_proj's LoRA A product in the attention launch (partial sums a KV head)
                o, ho = decode_attention_lora_a(q.view(B, self.n_heads, self.head_dim), b.k[i][:, :, :window],
                                                b.v[i][:, :, :window], b.key_valid, b.cpos, self.scaling, Ao[0])
            elif self.attention == "qerl":
                o = decode_attention(q.view(B, self.n_heads, self.head_dim), b.k[i][:, :, :window],
                                     b.v[i][:, :, :window], b.key_valid, b.cpos, self.scaling)
            else:
                o = F.scaled_dot_product_attention(q.view(B, self.n_kv, -1, self.head_dim), b.k[i][:, :, :window],
                                                   b.v[i][:, :, :window], attn_mask=mask,
                                                   scale=self.scaling).reshape(B, -1)
            (delta,) = grouped_linears(o, [attn.o_proj], ho)
            res, x, hm = self._fused_norm(res, delta, layer.post_attention_layernorm, gate_up)
            Ad = stacked_A([layer.mlp.down_proj]) if B <= PRODUCER_LORA_A_MAX_M else None
            if Ad is not None:  # down_proj's LoRA A product in the SiLU * up launch (where that launch runs)
                act, hd = silu_mlp_input(x, *gate_up, hm, next_A=Ad[0])
                (delta,) = grouped_linears(act, [layer.mlp.down_proj], hd)
            else:
                (delta,) = grouped_linears(silu_mlp_input(x, *gate_up, hm), [layer.mlp.down_proj])
        return self._fused_norm(res, delta, self.inner.norm, [])[1]

    @staticmethod
    def _fused_norm(res, delta, norm, feeds):
        """(res + delta, its RMSNorm x, x times the stacked LoRA A of the Linears ``feeds`` or None), one launch."""
        w, eps = norm.weight, norm.variance_epsilon
        # the norm kernel's LoRA-A product recomputes the row's norm in every program: above
        # NORM_LORA_A_MAX_M rows, the plain norm and one tiled lora_a launch (grouped_linears) are faster
        As = stacked_A(feeds) if feeds and res.shape[0] <= NORM_LORA_A_MAX_M else None
        if As is not None:
            return add_rmsnorm_lora_a(res, delta, w, eps, As)
        if delta is None:
            return res, rmsnorm(res, w, eps), None
        return (*add_rmsnorm(res, delta, w, eps), None)

    def _logits(self, h, normed=False):
        if not normed:
            h = self.inner.norm(h)
        if self.logits_fp32:
            return lm_logits(h, self.head.weight)
        return self.head(h).float()

    def _sample_and_record(self, b, logits, sampling):
        """Sample each row's next token (its sequence's token ``col``), write it with its log-prob and
        entropy to the row's sequence, update the sequence's end state (EOS, cap), advance the rows'
        columns. Padding rows and rows whose sequence has ended write to the scratch sequence (S), which
        is always done."""
        temperature, top_k, top_p, greedy, ignore_eos = sampling
        seq = b.rowseq
        done = b.done[seq]
        tok, lp, ent = sample_tokens(logits, temperature, top_k, top_p, greedy, b.keys, b.col)
        tok = torch.where(done, torch.full_like(tok, self.pad_id), tok)
        dst = torch.where(done, torch.full_like(seq, b.S), seq)  # an ended sequence's tokens stay as they are
        col = b.col.clamp(max=b.L - 1)  # an ended row's column runs on; it writes to the scratch sequence
        b.out_ids.index_put_((dst, col), tok)
        b.out_lp.index_put_((dst, col), torch.where(done, 0.0, lp))
        b.out_ent.index_put_((dst, col), torch.where(done, 0.0, ent))
        ended = done | (b.col + 1 >= b.cap[seq])
        if not ignore_eos:
            hit = (tok[:, None] == self.eos[None, :]).any(-1) & ~done
            b.lengths.index_put_((seq,), torch.where(hit, b.col + 1, b.lengths[seq]))
            b.eos.index_put_((seq,), b.eos[seq] | hit)
            ended = ended | hit
        b.done.index_put_((seq,), ended)
        b.tok.copy_(tok)
        b.col.add_(1)

    @torch.no_grad()
    def _decode_step(self, window, sampling, n: int | None = None):
        """One decode step of the first n rows (default: all) on the state buffers (what a CUDA graph holds). No
        autograd, also when called outside ``generate`` (graph warm-up and capture): the fused
        epilogues write into the base outputs in place, which autograd forbids on a custom op's
        output view."""
        b = self.buf.rows(self.buf.B if n is None else n)

        def write(i, k, v):
            b.k[i].index_copy_(2, b.cpos, k)
            b.v[i].index_copy_(2, b.cpos, v)

        b.key_valid.index_fill_(1, b.cpos, True)
        h = self.inner.embed_tokens(b.tok[:, None])
        mask = b.key_valid[:, None, None, :window]
        if self.fused:
            logits = self._logits(self._fused_layers(b, h, window, mask), normed=True)
        else:
            logits = self._logits(self._layers(b, h, b.pos[:, None], write, mask, window)[:, -1])
        self._sample_and_record(b, logits, sampling)
        b.pos.add_(1)
        b.cpos.add_(1)

    def _graph(self, window, sampling, n: int | None = None):
        """The CUDA graph of one decode step of the first n rows (default: all) over attention window
        ``window``, captured on first use (warm-up pass, state restored, then the capture)."""
        n = self.buf.B if n is None else n
        key = (self.buf.B, self.buf.L, n, window, sampling)
        g = self.graphs.get(key)
        if g is None:
            st = torch.cuda.Stream()
            st.wait_stream(torch.cuda.current_stream())
            saved = [t.clone() for t in self._state()]
            with torch.cuda.stream(st):  # warm-up: Triton compiles/launch caches, split-K workspaces
                self._decode_step(window, sampling, n)
            torch.cuda.current_stream().wait_stream(st)
            for t, s in zip(self._state(), saved):
                t.copy_(s)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self._pool):  # records the step; nothing runs
                self._decode_step(window, sampling, n)
            self.graphs[key] = g
            self.stats["captures"] += 1
        return g

    def _state(self):
        """What a decode step changes besides the cache rows it writes and the outputs at column t."""
        b = self.buf
        return [b.tok, b.pos, b.cpos, b.col, b.done, b.eos, b.lengths, b.key_valid]

    # ------------------------------------------------------------------------------ generate
    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int | list[int], temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, greedy: bool = False, seed: int = 0,
                 seq_ids: list[int] | None = None, ignore_eos: bool = False,
                 stop_strings: list[str] | None = None) -> RolloutOutput:
        """Sample (or greedily decode) up to ``max_new_tokens`` tokens for each prompt (an int, or one cap
        per prompt: sequence i then ends after max_new_tokens[i] tokens, truncated unless it met EOS
        first). Same contract as GenerateEngine.generate: sequence i's sampling is keyed by
        (seed, seq_ids[i]), so its tokens do not depend on the batch, the bucket or the row it runs in."""
        if stop_strings and self.tokenizer is None:
            raise ValueError("stop_strings need a tokenizer")
        if not (temperature > 0 or greedy):
            raise ValueError("temperature must be > 0 (or pass greedy=True)")
        prompts = as_token_lists(prompts)
        caps = caps_list(max_new_tokens, len(prompts))
        sids = list(range(len(prompts))) if seq_ids is None else [int(i) for i in seq_ids]
        if len(sids) != len(prompts):
            raise ValueError(f"seq_ids has {len(sids)} ids for {len(prompts)} prompts")
        kw = dict(temperature=temperature, top_p=top_p, top_k=top_k, greedy=greedy, seed=seed, ignore_eos=ignore_eos,
                  stop_strings=stop_strings)
        W = self.max_batch or len(prompts)
        if len(prompts) <= W or self.refill:  # one batch; more prompts than rows: freed rows take the waiting ones
            return self._generate(prompts, caps, rows=min(W, len(prompts)), seq_ids=sids, **kw)
        outs, stats = [], []
        for lo in range(0, len(prompts), W):  # waves of max_batch sequences (refill=False)
            outs.append(self._generate(prompts[lo:lo + W], caps[lo:lo + W], rows=min(W, len(prompts) - lo),
                                       seq_ids=sids[lo:lo + W], **kw))
            stats.append(self.last_stats)
        self.last_stats = merge_stats(stats)
        return concat_outputs(outs, self.pad_id)

    def _generate(self, prompts, caps, rows, temperature, top_p, top_k, greedy, seed, seq_ids, ignore_eos,
                  stop_strings) -> RolloutOutput:
        """``generate`` on ``rows`` decode rows: the first ``rows`` prompts start; when there are more, each
        host check gives the rows whose sequences ended to the waiting prompts, in order (``_refill``)."""
        N = len(prompts)
        ids, mask = left_pad(prompts, self.pad_id, self.device)  # every prompt, left-padded to the longest
        B, P = rows, ids.shape[1]
        M = max(caps)
        waiting = list(range(B, N))  # sequences that wait for a row
        # refill places a prompt just before the shared cache cursor; the cursor moves back when the cache
        # fills (``_rebase``), which needs room for one more host check's steps
        b = self._ensure_buffers(B, P + M + (self.sync_every if waiting else 0), N)
        sampling = (float(temperature), int(top_k), float(top_p), bool(greedy), bool(ignore_eos))
        keys = batch_keys(seed, seq_ids, N, self.device)
        # ---- state: row i decodes sequence i until the first compaction or refill
        b.keys.copy_(keys[:B])
        b.rowseq.copy_(torch.arange(B, device=self.device))
        b.col.zero_()
        b.key_valid.zero_()
        b.key_valid[:, :P] = mask[:B].bool()
        b.cap.fill_(1)
        b.cap[:N] = torch.tensor(caps, device=self.device)
        b.lengths.copy_(b.cap)
        b.done.fill_(True)  # the scratch sequence of padding and ended rows (and the capacity past N)
        b.done[:N] = False
        b.eos.zero_()
        # ---- prefill (eager: one pass over the prompts through the GEMM path)
        pos = positions_from_mask(mask[:B])
        pmask = _prefill_mask(mask[:B])

        def write(i, k, v):
            b.k[i][:, :, :P] = k
            b.v[i][:, :, :P] = v

        h = self._layers(b, self.inner.embed_tokens(ids[:B]), pos, write, pmask, P)
        self._sample_and_record(b, self._logits(h[:, -1]), sampling)
        b.pos.copy_(pos[:, -1] + 1)
        b.cpos.fill_(P)
        # ---- decode: the first n rows run; at each host check, finished rows take waiting prompts
        # (``_refill``) or, when none waits, leave the batch (``_compact``)
        windows = sorted({min(b.L, WINDOW * 2 ** i) for i in range(32) if WINDOW * 2 ** (i - 1) < b.L})
        # the host looks at the done flags every sync_every steps when sequences can end before M
        check = not ignore_eos or bool(stop_strings) or min(caps) < M or bool(waiting)
        cur, g, horizon = P, 1, M  # cache cursor; steps of the first rows (their next token); every row done by g = horizon
        n, decode_steps, at_bucket, compactions, compact_s, refills, rebases = B, 0, {}, 0, 0.0, 0, 0
        from qerl.logging import progress

        bar = progress(max(M, -(-sum(caps) // B)), "rollout", unit="tok", unit_scale=B)  # batch tokens and tokens/s
        bar.update(1)
        while g < horizon or waiting:
            if check and (g % self.sync_every == 0 or (waiting and g >= horizon)):
                running = self._check_done(stop_strings, n)
                if waiting and running.numel() < n:  # rows whose sequence ended take waiting prompts
                    free = sorted(set(range(n)) - set(running.tolist()))[:len(waiting)]
                    seqs, waiting = waiting[:len(free)], waiting[len(free):]
                    self._refill(free, seqs, [prompts[s] for s in seqs], keys, cur, sampling)
                    horizon = max([horizon] + [g + caps[s] - 1 for s in seqs])
                    refills += len(seqs)
                    running = self._check_done(None, n)  # a cap of 1 ends at its first token
                if running.numel() == 0 and not waiting:
                    break
                if self.compact and not waiting:
                    m = next(k for k in reversed(buckets(B)) if k >= running.numel())
                    if m < n:
                        t0 = time.perf_counter()
                        self._compact(running, m, cur)
                        if self.device.type == "cuda":  # the host just synced: time the moves alone
                            torch.cuda.synchronize(self.device)
                        n, compactions, compact_s = m, compactions + 1, compact_s + time.perf_counter() - t0
                if cur + self.sync_every > b.L:  # the steps to the next check would pass the cache's end
                    cur, rebases = self._rebase(n, cur, P), rebases + 1
            if self.cuda_graphs:
                window = next(w for w in windows if w > cur)
                self._graph(window, sampling, n).replay()
                self.stats["replays"] += 1
            else:  # eager: attend over exactly the slots so far, as HF's dynamic cache does
                self._decode_step(cur + 1, sampling, n)
            at_bucket[n] = at_bucket.get(n, 0) + 1
            cur, g, decode_steps = cur + 1, g + 1, decode_steps + 1
            bar.update(1)
        bar.close()
        if stop_strings:
            self._check_done(stop_strings, n)
        # completions as wide as the longest (the static batch: the steps it ran, as before refill existed)
        C = int(b.lengths[:N].max()) if refills else g
        lengths = b.lengths[:N].clamp(max=C)
        cmask = (torch.arange(C, device=self.device)[None] < lengths[:, None]).long()
        self.stats["compactions"] += compactions
        self.last_stats = {"decode_steps": decode_steps, "bucket_steps": at_bucket, "compactions": compactions,
                           "compaction_s": compact_s, "useful_tokens": int(lengths.sum()), "waves": 1,
                           "refills": refills, "rebases": rebases}
        return RolloutOutput(ids, mask, b.out_ids[:N, :C] * cmask + self.pad_id * (1 - cmask), cmask,
                             b.out_lp[:N, :C] * cmask, b.out_ent[:N, :C] * cmask, ~b.eos[:N].clone())

    def _check_done(self, stop_strings, n: int) -> torch.Tensor:
        """Host check every sync_every steps: apply stop strings to the running sequences (each over its
        tokens so far); the rows (of the first n) still running."""
        b = self.buf
        self.stats["host_syncs"] += 1
        if stop_strings:
            counts = [0] * (b.S + 1)  # each sequence's tokens so far: those of the row decoding it
            for s, c in zip(b.rowseq[:n].tolist(), b.col[:n].tolist()):
                counts[s] = c
            counts[b.S] = 0  # the scratch sequence
            ended = b.done.clone()
            apply_stop_strings(self.tokenizer, b.out_ids, ended, b.lengths, counts, stop_strings)
            b.eos |= ended & ~b.done
            b.done |= ended
        return torch.nonzero(~b.done[b.rowseq[:n]]).flatten()

    def _compact(self, running: torch.Tensor, m: int, used: int) -> None:
        """Pack the running rows into rows [:m] (the bucket m >= len(running)) with their cache slots
        [:used]; the rows left over copy the first running row and decode the scratch sequence."""
        b = self.buf
        r = running.numel()
        idx = torch.cat([running, running[:1].expand(m - r)])
        for x in (b.tok, b.pos, b.keys, b.rowseq, b.col):
            x[:m] = x[idx]
        b.rowseq[r:m] = b.S
        b.key_valid[:m, :used] = b.key_valid[idx, :used]
        for cache in (*b.k, *b.v):  # moves, not indexes: the bucket's graphs read contiguous rows
            cache[:m, :, :used] = cache[idx, :, :used]

    def _refill(self, rows: list[int], seqs: list[int], prompts: list[list[int]], keys: torch.Tensor, cur: int,
                sampling) -> None:
        """Rows ``rows`` (their sequences ended) take the waiting sequences ``seqs``: the prompts, left-padded
        to the longest of them (pn <= cur), are prefilled eagerly into cache slots [cur - pn, cur) of those
        rows, so that they decode on at the shared cursor with every other row; their first token is
        sampled here. A sequence samples from its own keys and token index, as in any batch."""
        b, dev = self.buf, self.device
        ids, mask = left_pad(prompts, self.pad_id, dev)
        k, pn = ids.shape
        r, sq = torch.tensor(rows, device=dev), torch.tensor(seqs, device=dev)
        b.rowseq[r], b.keys[r], b.col[r] = sq, keys[sq], 0
        b.key_valid[r] = False
        b.key_valid[r, cur - pn:cur] = mask.bool()
        shape = (k, self.n_kv, pn, self.head_dim)
        tmp = replace(b, k=[torch.empty(shape, dtype=self.dtype, device=dev) for _ in self.layers],
                      v=[torch.empty(shape, dtype=self.dtype, device=dev) for _ in self.layers])

        def write(i, kk, vv):
            tmp.k[i].copy_(kk)
            tmp.v[i].copy_(vv)

        pos = positions_from_mask(mask)
        h = self._layers(tmp, self.inner.embed_tokens(ids), pos, write, _prefill_mask(mask), pn)
        for i in range(len(self.layers)):
            b.k[i][r, :, cur - pn:cur] = tmp.k[i]
            b.v[i][r, :, cur - pn:cur] = tmp.v[i]
        sub = replace(b, tok=b.tok[r], keys=b.keys[r], rowseq=b.rowseq[r], col=b.col[r])  # the rows' own copies
        self._sample_and_record(sub, self._logits(h[:, -1]), sampling)
        b.tok[r], b.col[r], b.pos[r] = sub.tok, sub.col, pos[:, -1] + 1

    def _rebase(self, n: int, cur: int, P: int) -> int:
        """Move every row's cache slots [lo, cur) to [0, cur - lo), lo the first slot a running sequence (of
        the first n rows, as they are now) still attends to, and at most cur - P, so that a waiting prompt
        still fits before the cursor; returns the new cursor. Each running sequence spans at most P + its
        cap slots, so the cursor falls to at most P + max(caps) and the cache (P + max(caps) + sync_every
        slots) has room for the next steps."""
        b = self.buf
        running = torch.nonzero(~b.done[b.rowseq[:n]]).flatten()
        lo = cur - P
        if running.numel():
            first = b.key_valid[running, :cur].float().argmax(1)  # each running row's first valid slot
            lo = min(lo, int(first.min()))
        if lo <= 0:
            raise RuntimeError(f"the cache ({b.L} slots) cannot hold the running sequences past slot {cur}")
        n = cur - lo
        for cache in (*b.k, *b.v):
            cache[:, :, :n] = cache[:, :, lo:cur].clone()
        b.key_valid[:, :n] = b.key_valid[:, lo:cur].clone()
        b.key_valid[:, n:] = False
        b.cpos.fill_(n)
        return n


def merge_stats(stats: list[dict]) -> dict:
    """``last_stats`` of several waves as one: steps, compactions and tokens summed, per bucket too."""
    out = {"decode_steps": 0, "bucket_steps": {}, "compactions": 0, "compaction_s": 0.0, "useful_tokens": 0,
           "waves": len(stats), "refills": 0, "rebases": 0}
    for st in stats:
        for k in ("decode_steps", "compactions", "compaction_s", "useful_tokens", "refills", "rebases"):
            out[k] += st.get(k, 0)
        for n, k in st["bucket_steps"].items():
            out["bucket_steps"][n] = out["bucket_steps"].get(n, 0) + k
    out["bucket_steps"] = dict(sorted(out["bucket_steps"].items(), reverse=True))
    return out


def concat_outputs(outs: list[RolloutOutput], pad_id: int) -> RolloutOutput:
    """RolloutOutputs of consecutive prompt groups as one: prompts left-padded, completions right-padded
    to the longest."""
    P = max(o.prompt_ids.shape[1] for o in outs)
    C = max(o.completion_ids.shape[1] for o in outs)

    def left(x, fill):
        return F.pad(x, (P - x.shape[1], 0), value=fill)

    def right(x, fill):
        return F.pad(x, (0, C - x.shape[1]), value=fill)

    return RolloutOutput(torch.cat([left(o.prompt_ids, pad_id) for o in outs]),
                         torch.cat([left(o.prompt_mask, 0) for o in outs]),
                         torch.cat([right(o.completion_ids, pad_id) for o in outs]),
                         torch.cat([right(o.completion_mask, 0) for o in outs]),
                         torch.cat([right(o.logprobs, 0.0) for o in outs]),
                         torch.cat([right(o.entropy, 0.0) for o in outs]),
                         torch.cat([o.truncated for o in outs]))
