"""Random-weight models built straight into a format, layer by layer (qerl.models.build_quantized_model),
the builder the speed experiments (Tables 3, 5-9) use for the 7B-32B architectures.

Run: OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_build.py -q   (about 10 s)
"""

import weakref

import pytest
import torch
from transformers import AutoModelForCausalLM

from qerl import models
from qerl.qlinear import QuantLinear
from qerl.quantize import QuantizeConfig, quantize_

FMTS = ["bf16", "nvfp4", "mxfp4", "nf4"]


def _as_comparable(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("model_type", ["qwen2", "llama"])
def test_equals_quantizing_the_dense_model(tiny_config, fmt, model_type):
    """Same seed: built layer by layer == quantize_ of the whole dense model, tensor for tensor."""
    cfg = tiny_config(model_type)
    qc = QuantizeConfig(fmt=fmt, lora_rank=4)
    built = models.build_quantized_model(cfg, qc, device="cpu", seed=7)
    dense = models.build_random_model(cfg, device="cpu", seed=7)
    quantize_(dense, qc)
    a, b = built.state_dict(), dense.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        if ".lora_" in k:  # PEFT init from different generators; shapes and B = 0 must agree
            assert a[k].shape == b[k].shape and a[k].dtype == b[k].dtype
            continue
        assert torch.equal(_as_comparable(a[k]), _as_comparable(b[k])), k
    x = torch.randint(3, cfg.vocab_size, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(built(x).logits, dense(x).logits, rtol=0, atol=0)
    if cfg.tie_word_embeddings:
        assert built.lm_head.weight is built.model.embed_tokens.weight


def test_random_model_is_an_ordinary_hf_model(tiny_config):
    """Rotary tables, norms and embeddings materialised as from_config would have them."""
    cfg = tiny_config("qwen2")
    m = models.build_random_model(cfg, device="cpu", seed=1)
    ref = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    ref.load_state_dict(m.state_dict())
    x = torch.randint(3, cfg.vocab_size, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(m(x).logits, ref(x).logits, rtol=0, atol=0)
    assert torch.equal(m.model.rotary_emb.inv_freq, ref.model.rotary_emb.inv_freq)
    assert float(m.model.layers[0].input_layernorm.weight.detach().float().mean()) == 1.0


@pytest.mark.parametrize("fmt", ["nvfp4", "nf4"])
def test_no_dense_weight_outlives_its_layer(tiny_config, monkeypatch, fmt):
    """Instrumented: every dense weight drawn for layer i is freed before layer i+1 starts, at most one
    fused group is alive at a time, and the finished model holds no dense decoder weight."""
    cfg = tiny_config("qwen2", num_hidden_layers=3)
    alive, max_alive, real = [], [0], models.random_tensor

    def tracked(name, shape, dtype, device, seed, std):
        t = real(name, shape, dtype, device, seed, std)
        if name.startswith("model.layers.") and len(shape) == 2:
            alive.append((name, weakref.ref(t)))
            max_alive[0] = max(max_alive[0], sum(r() is not None for _, r in alive))
        return t

    def after_layer(i):
        left = [n for n, r in alive if r() is not None]
        assert not left, f"dense weights still alive after layer {i}: {left}"

    monkeypatch.setattr(models, "random_tensor", tracked)
    m = models.build_quantized_model(cfg, QuantizeConfig(fmt=fmt, lora_rank=2), device="cpu", on_layer=after_layer)
    assert len(alive) == 3 * 7 and max_alive[0] <= 3  # (q, k, v) is the largest group drawn together
    for name, mod in m.named_modules():
        if isinstance(mod, QuantLinear):
            assert not hasattr(mod, "weight") and mod.weight_packed.dtype == torch.uint8, name
    dense = [n for n, p in m.named_parameters() if p.dim() == 2 and ".lora_" not in n]
    assert dense == ["model.embed_tokens.weight"]  # tied lm_head; embeddings stay 16-bit


def test_lora_is_peft_init_and_the_only_trainable_part(tiny_config):
    from qerl.quantize import lora_parameters

    m = models.build_quantized_model(tiny_config("llama"), QuantizeConfig(fmt="nvfp4", lora_rank=4, lora_alpha=8),
                                     device="cpu")
    q = m.model.layers[0].self_attn.q_proj
    assert q.r == 4 and q.scaling == 2.0 and q.lora_A.weight.dtype == torch.float32
    assert torch.count_nonzero(q.lora_B.weight) == 0 and q.lora_A.weight.abs().max() <= 1 / q.in_features ** 0.5
    assert all(p.requires_grad == (".lora_" in n) for n, p in m.named_parameters())  # as after quantize_
    assert len(lora_parameters(m)) == 2 * 7 * 2 and m.config.use_cache


def test_paper_config_structure_on_meta():
    """The 32B architecture: the builder's skeleton has the paper's shapes (no memory touched)."""
    cfg = models.model_config("qwen2.5-32b-instruct")
    m = models.build_model_from_config(cfg, device="meta")
    quantize_(m, QuantizeConfig(fmt="nvfp4"))
    q = m.model.layers[63].mlp.gate_proj
    assert (q.out_features, q.in_features) == (27648, 5120) and q.weight_packed.shape == (27648, 2560)
