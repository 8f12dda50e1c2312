"""Tests of qerl.noise (AQN): schedules, stages, noise injection and exact restore, Eq. 12.

Run: .venv/bin/python -m pytest tests/test_noise.py -q   (CPU, a few seconds; builds a tiny
randomly initialised Llama from a config, no download)
"""

import copy
import math
from fractions import Fraction

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from qerl.noise import (
    NORM_NAMES,
    SCHEDULES,
    AQNConfig,
    find_norms,
    noisy_norms,
    sigma_schedule,
    sigma_trend,
    stage_for_step,
)

LAYERS = 3


@pytest.fixture
def model():
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attn_implementation="eager",
    )
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial norm weights (init is all ones)
        for _, mod in m.named_modules():
            if isinstance(mod, LlamaRMSNorm):
                mod.weight.uniform_(0.5, 1.5)
    return m


def norm_weights(m):
    return {n: p.detach().clone() for n, p in m.named_parameters() if "layernorm" in n or n.endswith("norm.weight")}


def assert_bitwise_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


# ----------------------------------------------------------------------------- schedule

def reference_sigma(k, K, s0, s1, kind):
    """The docstring formulas, written out independently."""
    if k == 0:
        return 0.0
    t = 0.0 if K == 2 else (k - 1) / (K - 2)
    if kind == "exponential":
        return s0 * (s1 / s0) ** t
    if kind == "linear":
        return s0 + (s1 - s0) * t
    if kind == "cosine":
        return s1 + (s0 - s1) * 0.5 * (1 + math.cos(math.pi * t))
    return s0 + (s1 - s0) * math.log(1 + (math.e - 1) * t)


@pytest.mark.parametrize("kind", SCHEDULES)
@pytest.mark.parametrize("K", [2, 3, 5, 10])
def test_schedule_values(kind, K):
    s0, s1 = 1e-2, 5e-4
    trend = sigma_trend(K, s0, s1, kind)
    assert len(trend) == K and trend[0] == 0.0
    for k in range(K):
        assert sigma_schedule(k, K, s0, s1, kind) == pytest.approx(reference_sigma(k, K, s0, s1, kind), rel=1e-12)
    assert trend[1] == pytest.approx(s0, rel=1e-12)  # first noisy stage: sigma_start
    assert trend[-1] == pytest.approx(s0 if K == 2 else s1, rel=1e-12)  # last reaches sigma_end
    assert all(a >= b for a, b in zip(trend[1:], trend[2:]))  # decreasing when s0 > s1


def test_exponential_is_official_code_not_eq8():
    K, s0, s1 = 10, 1e-2, 1e-4
    official = [s0 * (s1 / s0) ** (i / (K - 2)) for i in range(K - 1)]
    assert sigma_trend(K, s0, s1) == pytest.approx([0.0] + official, rel=1e-12)
    eq8_last = s0 * (s1 / s0) ** ((K - 2) / (K - 1))
    assert sigma_schedule(K - 1, K, s0, s1) != pytest.approx(eq8_last, rel=1e-3)


def test_schedule_shapes_differ_midway():
    K, s0, s1 = 12, 1e-2, 5e-4  # stage 6 is t = (6-1)/(12-2) = 0.5
    mid = {kind: sigma_schedule(6, K, s0, s1, kind) for kind in SCHEDULES}
    assert mid["linear"] == pytest.approx((s0 + s1) / 2)
    assert mid["cosine"] == pytest.approx((s0 + s1) / 2)  # cosine crosses the midpoint at t = 0.5
    assert mid["exponential"] == pytest.approx(math.sqrt(s0 * s1))
    assert mid["logarithmic"] < mid["linear"]  # concave: decays faster early
    assert sigma_schedule(3, K, s0, s1, "cosine") > sigma_schedule(3, K, s0, s1, "linear")  # flat start


def test_schedule_validation():
    with pytest.raises(ValueError) as err:
        sigma_schedule(1, 10, 1e-2, 5e-4, "step")
    assert all(k in str(err.value) for k in SCHEDULES)
    for bad in [
        dict(stage=1, num_stages=1, sigma_start=1e-2, sigma_end=5e-4),
        dict(stage=10, num_stages=10, sigma_start=1e-2, sigma_end=5e-4),
        dict(stage=-1, num_stages=10, sigma_start=1e-2, sigma_end=5e-4),
        dict(stage=1, num_stages=10, sigma_start=0.0, sigma_end=5e-4),
        dict(stage=1, num_stages=10, sigma_start=1e-2, sigma_end=-1.0),
        dict(stage=1, num_stages=10, sigma_start=float("nan"), sigma_end=5e-4),
        dict(stage=1, num_stages=10, sigma_start=1e-2, sigma_end=0.0, kind="exponential"),
    ]:
        with pytest.raises(ValueError):
            sigma_schedule(**bad)
    assert sigma_schedule(9, 10, 1e-2, 0.0, "linear") == 0.0  # sigma_end = 0 is fine off log space


@pytest.mark.parametrize("total, K", [(100, 10), (7, 10), (1000, 3), (37, 4), (5, 2)])
def test_stage_for_step(total, K):
    for step in range(total + 3):
        exact = min(int(Fraction(min(step, total)) / Fraction(total, K)), K - 1)
        assert stage_for_step(step, total, K) == exact
    assert stage_for_step(0, total, K) == 0
    assert stage_for_step(total - 1, total, K) == K - 1 or total < K


def test_stage_for_step_intervals_are_equal():
    stages = [stage_for_step(s, 100, 10) for s in range(100)]
    assert [stages.count(k) for k in range(10)] == [10] * 10
    with pytest.raises(ValueError):
        stage_for_step(-1, 100, 10)
    with pytest.raises(ValueError):
        stage_for_step(0, 0, 10)


def test_aqn_config():
    cfg = AQNConfig(enabled=True)
    assert (cfg.sigma_start, cfg.sigma_end, cfg.num_stages, cfg.schedule) == (1e-2, 5e-4, 10, "exponential")
    assert cfg.sigma_at(0, 100) == (0, 0.0)
    assert cfg.sigma_at(10, 100) == (1, pytest.approx(1e-2))
    assert cfg.sigma_at(99, 100) == (9, pytest.approx(5e-4))
    assert AQNConfig(enabled=False).sigma_at(99, 100) == (None, 0.0)  # no noise, no stage
    with pytest.raises(ValueError, match="exponential"):
        AQNConfig(schedule="exp")
    with pytest.raises(ValueError):
        AQNConfig(num_stages=1)
    with pytest.raises(ValueError):
        AQNConfig(sigma_start=-1.0)
    with pytest.raises(ValueError):
        AQNConfig(enabled="yes")


# ----------------------------------------------------------------------------- injection

def test_finds_and_counts_decoder_norms(model):
    names = [n for n, _ in find_norms(model)]
    assert len(names) == 2 * LAYERS
    assert "model.layers.0.input_layernorm" in names and "model.layers.2.post_attention_layernorm" in names
    assert "model.norm" not in names  # the final norm feeds lm_head, not q/k/v or gate/up
    clean = norm_weights(model)
    with noisy_norms(model, 1e-2, seed=0) as n:
        assert n == 2 * LAYERS
        for name, p in norm_weights(model).items():
            changed = not torch.equal(p, clean[name])
            assert changed == any(name.startswith(f"{x}.") or f".{x}." in name for x in NORM_NAMES), name
    assert_bitwise_equal(norm_weights(model), clean)


def test_noise_is_channelwise_gaussian_with_sigma():
    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.input_layernorm = LlamaRMSNorm(8192)
            self.post_attention_layernorm = LlamaRMSNorm(8192)

    m = nn.Module()
    m.layers = nn.ModuleList([Layer()])
    with noisy_norms(m, 3e-2, seed=1) as n:
        assert n == 2
        z1 = m.layers[0].input_layernorm.weight.detach() - 1
        z2 = m.layers[0].post_attention_layernorm.weight.detach() - 1
    assert z1.std().item() == pytest.approx(3e-2, rel=0.05)
    assert abs(z1.mean().item()) < 3 * 3e-2 / math.sqrt(8192)
    assert not torch.allclose(z1, z2)  # one independent vector per module
    assert torch.equal(m.layers[0].input_layernorm.weight, torch.ones(8192))


def test_no_drift_after_1000_applications(model):
    clean = norm_weights(model)
    gen = torch.Generator().manual_seed(7)
    for _ in range(1000):
        with noisy_norms(model, 1e-2, generator=gen):
            pass
    assert_bitwise_equal(norm_weights(model), clean)


def test_no_drift_bf16(model):
    model.to(torch.bfloat16)
    clean = norm_weights(model)
    gen = torch.Generator().manual_seed(7)
    for _ in range(50):
        with noisy_norms(model, 2e-2, generator=gen) as n:
            assert n == 2 * LAYERS
            w = model.model.layers[0].input_layernorm.weight
            assert w.dtype == torch.bfloat16 and not torch.equal(w, clean["model.layers.0.input_layernorm.weight"])
    assert_bitwise_equal(norm_weights(model), clean)


def test_restore_on_exception(model):
    clean = norm_weights(model)
    with pytest.raises(RuntimeError, match="boom"):
        with noisy_norms(model, 5e-2, seed=3):
            assert not torch.equal(model.model.layers[1].input_layernorm.weight,
                                   clean["model.layers.1.input_layernorm.weight"])
            raise RuntimeError("boom")
    assert_bitwise_equal(norm_weights(model), clean)


def test_seeded_reproducibility(model):
    def noisy(**kw):
        with noisy_norms(model, 1e-2, **kw):
            return norm_weights(model)

    a, b, c = noisy(seed=11), noisy(seed=11), noisy(seed=12)
    assert_bitwise_equal(a, b)
    assert not torch.equal(a["model.layers.0.input_layernorm.weight"], c["model.layers.0.input_layernorm.weight"])
    # one long-lived generator: fresh noise each rollout, the same sequence from the same seed
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    seq1 = [noisy(generator=g1) for _ in range(3)]
    seq2 = [noisy(generator=g2) for _ in range(3)]
    key = "model.layers.2.post_attention_layernorm.weight"
    for x, y in zip(seq1, seq2):
        assert_bitwise_equal(x, y)
    assert not torch.equal(seq1[0][key], seq1[1][key])
    # global RNG when neither is given
    torch.manual_seed(99)
    d = noisy()
    torch.manual_seed(99)
    assert_bitwise_equal(d, noisy())


def test_sigma_zero_touches_nothing_and_errors(model):
    clean = norm_weights(model)
    with noisy_norms(model, 0.0, seed=0) as n:
        assert n == 0
        assert_bitwise_equal(norm_weights(model), clean)
    with noisy_norms(nn.Linear(4, 4), 0.0) as n:  # no norms but sigma 0: fine
        assert n == 0
    with pytest.raises(ValueError, match="input_layernorm"):
        with noisy_norms(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)), 1e-2, seed=0):
            pass
    for bad in (-1e-3, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="sigma"):
            with noisy_norms(model, bad):
                pass
    with pytest.raises(ValueError, match="not both"):
        with noisy_norms(model, 1e-2, generator=torch.Generator(), seed=1):
            pass
    assert_bitwise_equal(norm_weights(model), clean)


# ----------------------------------------------------------------------------- Eq. 12

def test_eq12_norm_noise_is_multiplicative_weight_noise_fp64():
    """Linear(RMSNorm_{w+z}(x)) == RMSNorm_w(x) @ (W * (1 + z/w))^T, exactly in fp64."""
    torch.manual_seed(0)
    hidden, out = 24, 40
    x = torch.randn(5, 7, hidden, dtype=torch.float64)
    w = torch.rand(hidden, dtype=torch.float64) + 0.5
    z = 1e-2 * torch.randn(hidden, dtype=torch.float64)
    W = torch.randn(out, hidden, dtype=torch.float64)

    def rmsnorm(v, weight, eps=1e-6):
        return weight * v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)

    lhs = rmsnorm(x, w + z) @ W.T
    rhs = rmsnorm(x, w) @ (W * (1 + z / w)[None, :]).T
    torch.testing.assert_close(lhs, rhs, rtol=1e-12, atol=1e-12)
    assert (lhs - rmsnorm(x, w) @ W.T).abs().max() > 1e-4  # the noise does change the output

    # the same with transformers' LlamaRMSNorm (it normalises in fp32, identically on both sides)
    norm_noisy, norm_clean = LlamaRMSNorm(hidden).double(), LlamaRMSNorm(hidden).double()
    with torch.no_grad():
        norm_noisy.weight.copy_(w + z)
        norm_clean.weight.copy_(w)
        torch.testing.assert_close(
            norm_noisy(x) @ W.T, norm_clean(x) @ (W * (1 + z / w)[None, :]).T, rtol=1e-12, atol=1e-12
        )


def test_eq12_through_a_llama_model(model):
    """noisy_norms on a whole (tiny) Llama == scaling the input columns of q/k/v and gate/up."""
    model.double()
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    clean = norm_weights(model)
    with torch.no_grad():
        base = model(ids).logits
        with noisy_norms(model, 5e-2, seed=21):
            noisy_logits = model(ids).logits
            z = {k: v - clean[k] for k, v in norm_weights(model).items()}
        scaled = copy.deepcopy(model)
        for i, layer in enumerate(scaled.model.layers):
            for norm, linears in (
                ("input_layernorm", (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj)),
                ("post_attention_layernorm", (layer.mlp.gate_proj, layer.mlp.up_proj)),
            ):
                key = f"model.layers.{i}.{norm}.weight"
                factor = 1 + z[key] / clean[key]
                for lin in linears:
                    lin.weight.mul_(factor[None, :])
        scaled_logits = scaled(ids).logits
    assert (noisy_logits - base).abs().max() > 1e-3
    torch.testing.assert_close(noisy_logits, scaled_logits, rtol=1e-5, atol=1e-6)
