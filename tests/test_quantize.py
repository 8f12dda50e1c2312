"""quantize_: which modules are swapped, fused global scales, errors, sizes on the meta device.

Run: python -m pytest tests/test_quantize.py -q
"""

import pytest
import torch
import torch.nn as nn
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from qerl import formats
from qerl.arch import LINEAR_NAMES as DEFAULT_TARGETS
from qerl.qlinear import QuantLinear
from qerl.quantize import QuantizeConfig, lora_parameters, model_size_bytes, quantize_

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, max_position_embeddings=128)


def tiny(arch="llama"):
    torch.manual_seed(0)
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(**TINY)).to(torch.bfloat16)
    return Qwen2ForCausalLM(Qwen2Config(**TINY)).to(torch.bfloat16)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4", "mxfp4", "nf4"])
def test_swaps_targets_only(arch, fmt):
    m = tiny(arch)
    dense = {n: mod.weight.detach().clone() for n, mod in m.named_modules() if isinstance(mod, nn.Linear)}
    rep = quantize_(m, QuantizeConfig(fmt=fmt, lora_rank=4, backend="reference"))
    q = {n: mod for n, mod in m.named_modules() if isinstance(mod, QuantLinear)}
    assert rep["num_quantized"] == len(q) == 2 * len(DEFAULT_TARGETS)
    assert all(n.split(".")[-1] in DEFAULT_TARGETS for n in q)
    assert isinstance(m.lm_head, nn.Linear) and m.lm_head.weight.dtype == torch.bfloat16
    if arch == "qwen2":
        assert q["model.layers.0.self_attn.q_proj"].bias is not None
    trainable = lora_parameters(m)
    assert {n for n, p in m.named_parameters() if p.requires_grad} == {
        n for n, _ in m.named_parameters() if ".lora_" in n}
    assert len(trainable) == 2 * len(q)
    # the quantized base is close to the dense weight
    for n, mod in q.items():
        w = dense[n].float()
        err = (mod.dequantized_weight(torch.float32) - w).norm() / w.norm()
        assert err < (1e-2 if fmt == "bf16" else 0.2), (n, float(err))
    out = m(torch.randint(0, 256, (2, 8))).logits
    assert torch.isfinite(out).all()


def test_fused_global_scales():
    m = tiny("llama")
    attn = m.model.layers[0].self_attn
    with torch.no_grad():
        attn.k_proj.weight.mul_(10)  # make k the group's max
    amax = max(attn.q_proj.weight.abs().max(), attn.k_proj.weight.abs().max(), attn.v_proj.weight.abs().max())
    quantize_(m, QuantizeConfig(fmt="nvfp4", lora_rank=0))
    attn = m.model.layers[0].self_attn
    gs = [attn.q_proj.weight_global_scale, attn.k_proj.weight_global_scale, attn.v_proj.weight_global_scale]
    assert torch.equal(gs[0], gs[1]) and torch.equal(gs[1], gs[2])
    torch.testing.assert_close(gs[0], formats.nvfp4_global_scale(amax.reshape(1)))
    mlp = m.model.layers[0].mlp
    assert torch.equal(mlp.gate_proj.weight_global_scale, mlp.up_proj.weight_global_scale)


def test_errors():
    class NotLM(nn.Module):
        pass

    with pytest.raises(ValueError, match="unsupported architecture"):
        quantize_(NotLM())
    with pytest.raises(ValueError, match="fmt must be one of"):
        QuantizeConfig(fmt="fp8")
    with pytest.raises(ValueError, match="unknown targets"):
        QuantizeConfig(targets=("lm_head",))
    cfg = LlamaConfig(**{**TINY, "hidden_size": 72, "num_attention_heads": 4, "intermediate_size": 136})
    with pytest.raises(ValueError, match="16"):
        quantize_(LlamaForCausalLM(cfg), QuantizeConfig(fmt="nvfp4"))


def test_meta_size_matches_real_size():
    cfg = LlamaConfig(**TINY)
    with torch.device("meta"):
        meta = LlamaForCausalLM(cfg).to(torch.bfloat16)
    quantize_(meta, QuantizeConfig(fmt="nvfp4", lora_rank=8))
    real = tiny("llama")
    quantize_(real, QuantizeConfig(fmt="nvfp4", lora_rank=8))
    assert model_size_bytes(meta) == model_size_bytes(real)
    assert model_size_bytes(real, include_lora=True) > model_size_bytes(real)
    # 7B-style accounting: a packed linear is 0.5 + 1/16 bytes per weight (+4 for the global scale)
    q = real.model.layers[0].mlp.down_proj
    assert q.base_nbytes() == q.in_features * q.out_features * 9 // 16 + 4
