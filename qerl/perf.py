"""Model FLOPs of the training phases and MFU: what Table 3 reports and the trainer logs (``perf/*``).

MFU here is the usual one (PaLM's): the FLOPs the model's math needs for the tokens trained, over the
time taken, over the GPU's dense bf16 peak. Recomputation (gradient checkpointing) is work the
hardware does but the model does not need, so it is not counted (``hfu`` counts it).

Per real token (no padding is counted: a padded position is work the model does not need either):
- forward: 2 x the weights of every linear of the decoder (q, k, v, o, gate, up, down: dense or
  4-bit alike, the LoRA A / B too); causal attention, 4 x d_attn per layer for each (query, key)
  pair of a row with the key not after the query (QK^T and PV); the lm_head, 2 x hidden x vocabulary
  on the completion tokens only (log-probs are read there only);
- backward: the gradient of the input of every frozen linear (as many FLOPs as its forward), the
  weight gradient of the trainable ones (LoRA: as many again), attention 2.5 x its forward
  (FlashAttention's backward: five matmuls to the forward's two), the lm_head's input gradient.

A step's training FLOPs are those of the forwards it ran (old / reference log-probs) and of the
update (forward + backward). ``PEAK_BF16_TFLOPS`` holds the dense bf16 peak of the GPUs we know.
"""

from __future__ import annotations

import torch

# dense bf16 tensor-core peak (TFLOP/s, no sparsity), from the vendors' datasheets
PEAK_BF16_TFLOPS = {
    "H100": 989.0,  # SXM; the PCIe card's is 756 (below)
    "H200": 989.0,
    "H800": 989.0,
    "H20": 148.0,
    "GH200": 989.0,
    "B200": 2250.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "L4": 121.0,
    "RTX 4090": 165.0,
}


def peak_tflops(name: str | None = None) -> float | None:
    """Dense bf16 peak of a GPU by its name (default: this process's CUDA device); None if unknown."""
    if name is None:
        if not torch.cuda.is_available():
            return None
        name = torch.cuda.get_device_name()
    up = name.upper()
    if "H100" in up and "PCIE" in up:
        return 756.0
    for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):  # "GH200" before "H200"
        if key in up:
            return PEAK_BF16_TFLOPS[key]
    return None


class FlopCounter:
    """FLOPs of forwards and backwards over packed rows of one model (see the module docstring)."""

    def __init__(self, model):
        from qerl.forward import decoder_and_head
        from qerl.qlinear import QuantLinear

        cfg = model.config
        cfg = getattr(cfg, "text_config", None) or cfg
        self.layers = int(cfg.num_hidden_layers)
        heads = int(cfg.num_attention_heads)
        self.d_attn = heads * int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        _, head_w = decoder_and_head(model)
        self.head = int(head_w.numel())
        self.frozen = self.trained = 0  # linear weights of the decoder, per token
        adapters = set()  # a QuantLinear's lora_A / lora_B, counted with it
        for m in model.modules():
            if isinstance(m, QuantLinear):
                self.frozen += m.in_features * m.out_features
                if m.r:
                    self.trained += m.r * (m.in_features + m.out_features)
                    adapters.update((id(m.lora_A), id(m.lora_B)))
        for m in model.modules():
            if isinstance(m, torch.nn.Linear) and not isinstance(m, QuantLinear) and id(m) not in adapters \
                    and m.weight is not head_w:
                if m.weight.requires_grad:
                    self.trained += m.weight.numel()
                else:
                    self.frozen += m.weight.numel()

    def attention(self, lengths) -> float:
        """Forward FLOPs of causal attention over rows of these lengths (all layers)."""
        pairs = sum(n * (n + 1) / 2 for n in lengths)
        return 4.0 * self.d_attn * pairs * self.layers

    def forward(self, lengths, n_logits: int) -> float:
        """One forward over rows of ``lengths`` tokens, the lm_head on ``n_logits`` of them."""
        tokens = float(sum(lengths))
        return 2.0 * (self.frozen + self.trained) * tokens + self.attention(lengths) + 2.0 * self.head * n_logits

    def backward(self, lengths, n_logits: int) -> float:
        """The backward of ``forward``: input gradients everywhere, weight gradients of the trained weights."""
        tokens = float(sum(lengths))
        return (2.0 * self.frozen * tokens + 4.0 * self.trained * tokens + 2.5 * self.attention(lengths)
                + 2.0 * self.head * n_logits)


def row_lengths(prompt_mask: torch.Tensor, completion_mask: torch.Tensor) -> tuple[list[int], int]:
    """(tokens of each row a padding-free forward computes, completion tokens) of a rollout's rows."""
    from qerl.packing import completion_lengths, row_tokens

    t = row_tokens(prompt_mask, completion_mask)
    return [int(x) for x in t.tolist() if x > 0], int(completion_lengths(completion_mask).sum())


def training_flops(model, prompt_mask, completion_mask, n_forwards: int, n_updates: int,
                   recompute: bool = False) -> dict:
    """Model FLOPs of a step's training phases over these rows: ``n_forwards`` no-grad forwards (old /
    reference log-probs) and ``n_updates`` passes of forward + backward. ``flops`` (MFU's) and
    ``hardware_flops`` (+ one forward per update when ``recompute``)."""
    counter = FlopCounter(model)
    lengths, n_logits = row_lengths(prompt_mask, completion_mask)
    fwd, bwd = counter.forward(lengths, n_logits), counter.backward(lengths, n_logits)
    flops = n_forwards * fwd + n_updates * (fwd + bwd)
    return {"flops": flops, "hardware_flops": flops + (n_updates * fwd if recompute else 0.0),
            "real_tokens": int(sum(lengths))}


def mfu(flops: float, seconds: float, peak: float | None) -> float | None:
    """FLOPs / seconds / peak (TFLOP/s); None where the peak is unknown or no time was measured."""
    if not peak or seconds <= 0:
        return None
    return flops / seconds / (peak * 1e12)
