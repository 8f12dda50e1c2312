"""The architectures qerl runs: one table that loading, quantizing, the engine, export and the
benchmarks read.

    SUPPORTED_MODEL_TYPES      HF model_type values whose decoder layers qerl knows (Llama, Qwen2/2.5, Qwen3)
    PROJECTIONS                the Linear modules of a decoder layer, under their parent (self_attn, mlp)
    LINEAR_NAMES               the seven projection names (the paper's LoRA and quantization targets)
    FUSED_GROUPS               projections vLLM (and qerl's fast engine) fuse into one GEMM; they share
                               one global scale in formats that have one
    NORM_NAMES                 the RMSNorms of a decoder layer (AQN's noise, train_norms)
    QWEN25_CONFIGS             the paper's Qwen2.5-{3B,7B,14B,32B}-Instruct architectures, by hub id
    PAPER_MODELS               short name ("qwen2.5-7b") -> hub id
    linear_shapes(name)        {projection: (out, in)} of one decoder layer of a known model

Plain data, no torch: importing it is free.
"""

from __future__ import annotations

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
FAMILIES = "Llama, Qwen2/Qwen2.5, Qwen3"

PROJECTIONS = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}
LINEAR_NAMES = tuple(name for names in PROJECTIONS.values() for name in names)
PARENT = {name: parent for parent, names in PROJECTIONS.items() for name in names}
FUSED_GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))
# The RMSNorms of a decoder layer: input_layernorm feeds q/k/v, post_attention_layernorm gate/up
# (AQN perturbs them; train_norms trains them).
NORM_NAMES = ("input_layernorm", "post_attention_layernorm")


def check_supported(model_type, what: str = "qerl supports", detail: str = "") -> None:
    """ValueError unless `model_type` is one qerl knows, naming the supported families."""
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unsupported architecture model_type={model_type!r}{detail}; {what} "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)} ({FAMILIES})")


# Architecture values of the paper's models, copied from the public hub files
#   https://huggingface.co/Qwen/Qwen2.5-{3B,7B,14B,32B}-Instruct/blob/main/config.json
# (checked against copies of those files in public repositories; the Instruct files use
# rms_norm_eps 1e-6 for all four sizes, unlike the 14B/32B base models' 1e-5). Only the fields
# that shape the network are kept; sliding-window fields are left out because Qwen2.5 ships with
# use_sliding_window=false.
_QWEN25_COMMON = dict(
    model_type="qwen2",
    architectures=["Qwen2ForCausalLM"],
    hidden_act="silu",
    rope_theta=1000000.0,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    bos_token_id=151643,
    eos_token_id=151645,
    attention_dropout=0.0,
    initializer_range=0.02,
    use_sliding_window=False,
)
QWEN25_CONFIGS = {
    "Qwen/Qwen2.5-3B-Instruct": dict(
        _QWEN25_COMMON, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
        num_attention_heads=16, num_key_value_heads=2, vocab_size=151936,
        tie_word_embeddings=True),
    "Qwen/Qwen2.5-7B-Instruct": dict(
        _QWEN25_COMMON, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
        tie_word_embeddings=False),
    "Qwen/Qwen2.5-14B-Instruct": dict(
        _QWEN25_COMMON, hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
        num_attention_heads=40, num_key_value_heads=8, vocab_size=152064,
        tie_word_embeddings=False),
    "Qwen/Qwen2.5-32B-Instruct": dict(
        _QWEN25_COMMON, hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
        num_attention_heads=40, num_key_value_heads=8, vocab_size=152064,
        tie_word_embeddings=False),
}
# "qwen2.5-7b" -> "Qwen/Qwen2.5-7B-Instruct": the names the benchmarks and their results use.
PAPER_MODELS = {hub.removeprefix("Qwen/").removesuffix("-Instruct").lower(): hub for hub in QWEN25_CONFIGS}

# The embedded default (SmolLM2-135M-Instruct, a Llama): its layer shapes, for the kernel tests.
SMOLLM2_135M = dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True)

# Models whose decoder-layer Linear shapes the kernel tests and benchmark use, by short name.
LAYER_CONFIGS = {"smollm2-135m": SMOLLM2_135M, **{short: QWEN25_CONFIGS[hub] for short, hub in PAPER_MODELS.items()}}


def linear_shapes(model: str) -> dict[str, tuple[int, int]]:
    """{projection: (out_features N, in_features K)} of one decoder layer of `model` (a LAYER_CONFIGS key)."""
    if model not in LAYER_CONFIGS:
        raise ValueError(f"model must be one of {tuple(LAYER_CONFIGS)}, got {model!r}")
    c = LAYER_CONFIGS[model]
    hidden, inter = c["hidden_size"], c["intermediate_size"]
    kv = hidden // c["num_attention_heads"] * c["num_key_value_heads"]
    return {
        "q_proj": (hidden, hidden),
        "k_proj": (kv, hidden),
        "v_proj": (kv, hidden),
        "o_proj": (hidden, hidden),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }
