"""Linear-layer shapes (out_features N, in_features K) of the models qerl targets.

From each model's config.json: hidden_size, intermediate_size, num_attention_heads,
num_key_value_heads (head_dim = hidden / heads). Used by the kernel tests and the benchmark.
"""

# name -> (hidden, intermediate, heads, kv_heads)
MODEL_DIMS = {
    "smollm2-135m": (576, 1536, 9, 3),
    "qwen2.5-3b": (2048, 11008, 16, 2),
    "qwen2.5-7b": (3584, 18944, 28, 4),
    "qwen2.5-14b": (5120, 13824, 40, 8),
    "qwen2.5-32b": (5120, 27648, 40, 8),
}

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def linear_shapes(model: str) -> dict[str, tuple[int, int]]:
    """{projection: (N, K)} for the seven linears of one decoder layer of ``model``."""
    if model not in MODEL_DIMS:
        raise ValueError(f"model must be one of {tuple(MODEL_DIMS)}, got {model!r}")
    hidden, inter, heads, kv_heads = MODEL_DIMS[model]
    kv = hidden // heads * kv_heads
    return {
        "q_proj": (hidden, hidden),
        "k_proj": (kv, hidden),
        "v_proj": (kv, hidden),
        "o_proj": (hidden, hidden),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }
