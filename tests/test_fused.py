"""The fused decode-step kernels (qerl.kernels.fused) against torch references, the grouped LoRA
linears against the modules' own forward, and the fused engine against the unfused one: same
tokens, log-probs within rounding, weights read live, and fewer ops per layer (counted).

On the CPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py sets it)."""

import collections
import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from qerl.kernels import fused
from qerl.quantize import QuantizeConfig, quantize_
from qerl.rollout import FastEngine
from qerl.rollout.fused_linear import grouped_linears

_spec = importlib.util.spec_from_file_location("_qerl_tests_conftest", Path(__file__).with_name("conftest.py"))
_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_conftest)
make_tiny_model = _conftest.make_tiny_model
assert_greedy_close = _conftest.assert_greedy_close

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14], [20]]
BF = torch.bfloat16
# the kernel tests run on the CPU (interpreter) and, marked gpu, compiled on CUDA
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                                reason="needs CUDA")])]


def _hf_rmsnorm(x, w, eps):  # Qwen2RMSNorm.forward (+ keep_norms_fp32's cast back to x.dtype)
    xf = x.float()
    return (w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)).to(x.dtype)


def _close_bf16(a, b, atol=1e-6):
    """Reductions in another order: x_hat may round one bf16 step apart, and the rounding after the
    weight product another step: within 2 steps (relative 2^-6); ``atol`` for sums that cancel."""
    torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -6, atol=atol)


# ---------------------------------------------------------------------------------- kernels
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("wdtype", [BF, torch.float32])
def test_add_rmsnorm(wdtype, device):
    torch.manual_seed(0)
    N = 3584 if device == "cuda" else 200  # Qwen2.5-7B's hidden size on the GPU
    res, delta = torch.randn(3, N, dtype=BF, device=device), torch.randn(3, N, dtype=BF, device=device)
    w = (1 + 0.1 * torch.randn(N, device=device)).to(wdtype)
    r, out = fused.add_rmsnorm(res, delta, w, 1e-6)
    assert torch.equal(r, res + delta)  # the residual add rounds as torch's does
    _close_bf16(out, _hf_rmsnorm(res + delta, w, 1e-6))
    _close_bf16(fused.rmsnorm(res, w, 1e-6), _hf_rmsnorm(res, w, 1e-6))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rmsnorm_lora_a(with_delta, device):
    """The norm kernel that also multiplies its output by the stacked LoRA A of q/k/v (gate/up)."""
    torch.manual_seed(0)
    M, N, R = (8, 3584, 32) if device == "cuda" else (3, 200, 8)
    res, delta = torch.randn(M, N, dtype=BF, device=device), torch.randn(M, N, dtype=BF, device=device)
    w = 1 + 0.1 * torch.randn(N, device=device)
    n = 3 if with_delta else 2  # q/k/v or gate/up
    As = [torch.randn(R, N, device=device) / N ** 0.5 for _ in range(n)]
    r, x, h = fused.add_rmsnorm_lora_a(res, delta if with_delta else None, w, 1e-6, As)
    r_ref, x_ref = fused.add_rmsnorm(res, delta, w, 1e-6) if with_delta else (res, fused.rmsnorm(res, w, 1e-6))
    assert torch.equal(r, r_ref) and torch.equal(x, x_ref)
    assert h.shape == (1, M, n * R)
    ref = torch.cat([(x.double() @ a.double().t()).float() for a in As], 1)
    torch.testing.assert_close(h[0], ref, rtol=1e-4, atol=1e-4)


def _hf_rope_ref(x, cos, sin):  # HF apply_rotary_pos_emb on [B, H, D] with cos/sin [B, D]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None] + torch.cat((-x2, x1), dim=-1) * sin[:, None]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_cache_write(qk_norm, device):
    torch.manual_seed(0)
    B, NH, NKV, D, L = (2, 28, 4, 128, 8) if device == "cuda" else (2, 4, 2, 16, 8)
    q, k, v = (torch.randn(B, n * D, dtype=BF, device=device) for n in (NH, NKV, NKV))
    ang = torch.rand(B, D // 2, device=device) * 6
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(BF), torch.cat([ang.sin()] * 2, -1).to(BF)
    kc, vc = (torch.randn(B, NKV, L, D, dtype=BF, device=device) for _ in range(2))
    kc0, vc0 = kc.clone(), vc.clone()
    qn, kn = ((1 + 0.1 * torch.randn(D, device=device)).to(BF) for _ in range(2)) if qk_norm else (None, None)
    qo = fused.rope_cache_write(q, k, v, cos, sin, kc, vc, torch.tensor([5], device=device), qn, kn, 1e-6)
    qh, kh = q.view(B, NH, D), k.view(B, NKV, D)
    if qk_norm:
        qh, kh = _hf_rmsnorm(qh, qn, 1e-6), _hf_rmsnorm(kh, kn, 1e-6)
    if qk_norm:  # the per-head norm reduces in another order
        _close_bf16(qo[:, :, 0], _hf_rope_ref(qh, cos, sin))
        _close_bf16(kc[:, :, 5], _hf_rope_ref(kh, cos, sin))
    else:  # elementwise: bitwise HF's rounding
        assert torch.equal(qo[:, :, 0], _hf_rope_ref(qh, cos, sin))
        assert torch.equal(kc[:, :, 5], _hf_rope_ref(kh, cos, sin))
    assert torch.equal(vc[:, :, 5], v.view(B, NKV, D))
    others = [i for i in range(L) if i != 5]
    assert torch.equal(kc[:, :, others], kc0[:, :, others]) and torch.equal(vc[:, :, others], vc0[:, :, others])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qk_norm,bias,B", [(False, True, 1), (True, False, 3), (False, False, 6)])
def test_lora_rope_cache_write_equals_its_two_launches(qk_norm, bias, B, device):
    """The q/k/v epilogue and the rotary in one launch (few rows, ROPE_LORA_OUT_MAX_M): the same rotated q,
    cache rows and values as lora_out then rope_cache_write (6 rows: a full and a ragged 4-row tile); q / k / v
    themselves stay the base outputs; h as the norm kernel gives it (final sums) or as lora_a's partials."""
    torch.manual_seed(0)
    NH, NKV, D, L, R = (28, 4, 128, 8, 32) if device == "cuda" else (4, 2, 16, 8, 16)
    K = 3584 if device == "cuda" else 64
    x = torch.randn(B, K, dtype=BF, device=device)
    q, k, v = (torch.randn(B, n * D, dtype=BF, device=device) for n in (NH, NKV, NKV))
    As = [torch.randn(R, K, device=device) / K ** 0.5 for _ in range(3)]
    Bs = [torch.randn(n * D, R, device=device) * 0.1 for n in (NH, NKV, NKV)]
    bs = [torch.randn(n * D, dtype=BF, device=device) for n in (NH, NKV, NKV)] if bias else []
    ang = torch.rand(B, D // 2, device=device) * 6
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(BF), torch.cat([ang.sin()] * 2, -1).to(BF)
    kc, vc = (torch.randn(B, NKV, L, D, dtype=BF, device=device) for _ in range(2))
    kc2, vc2 = kc.clone(), vc.clone()
    qn, kn = ((1 + 0.1 * torch.randn(D, device=device)).to(BF) for _ in range(2)) if qk_norm else (None, None)
    cpos = torch.tensor([5], device=device)
    h = fused.lora_a(x, As)
    base = [t.clone() for t in (q, k, v)]
    qo = fused.lora_rope_cache_write(q, k, v, h, Bs, bs, 2.0, cos, sin, kc, vc, cpos, qn, kn, 1e-6)
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), base))
    fused.lora_out([q, k, v], h, Bs, bs, 2.0)
    want = fused.rope_cache_write(q, k, v, cos, sin, kc2, vc2, cpos, qn, kn, 1e-6)
    assert torch.equal(vc, vc2)  # values: lora_out's arithmetic and rounding, bitwise
    if qk_norm:  # the head norm's sums in another layout
        _close_bf16(qo, want)
        _close_bf16(kc, kc2)
    else:
        assert torch.equal(qo, want) and torch.equal(kc, kc2)


@pytest.mark.parametrize("device", DEVICES)
def test_silu_mul(device):
    torch.manual_seed(0)
    g, u = torch.randn(3, 1500, dtype=BF, device=device), torch.randn(3, 1500, dtype=BF, device=device)
    _close_bf16(fused.silu_mul(g, u), F.silu(g) * u)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n,bias,K,M,R", [(1, False, 64, 6, 8), (2, False, 2100, 6, 8), (3, True, 2100, 6, 8),
                                           (3, True, 300, 20, 16), (1, False, 9000, 20, 16), (2, False, 300, 70, 8)])
def test_lora_a_and_out(n, bias, K, M, R, device):
    """Stacked A (K split into partial sums, lora_a_chunk), then bias + scaled B in place.
    6 rows: two 4-row lora_out programs, one ragged, 9 partial sums in one masked load; 20 rows at rank 16:
    the tl.dot kernels (lora_a from 16 rows, tiled, its K chunks summed in the launch: at K = 9000 four;
    lora_out's row tile); 70 rows at rank 8: two ragged row tiles, r padded to the dot's 16."""
    torch.manual_seed(0)
    Ns = [96, 32, 48][:n]
    if device == "cuda":  # Qwen2.5-7B: q/k/v, gate/up, down at r = 32, batch 8
        M, R, K, Ns = (64 if M == 20 else 8), 32, {1: 18944, 2: 3584, 3: 3584}[n], {1: [3584], 2: [18944] * 2, 3: [3584, 512, 512]}[n]
    x = torch.randn(M, K, dtype=BF, device=device)
    As = [torch.randn(R, K, device=device) / K ** 0.5 for _ in range(n)]
    Bs = [torch.randn(N, R, device=device) for N in Ns]
    bs = [torch.randn(N, dtype=BF, device=device) for N in Ns] if bias else []
    ys = [torch.randn(M, N, dtype=BF, device=device) for N in Ns]
    h = fused.lora_a(x, As)
    S = 1 if M >= fused.LORA_A_DOT_MIN_M else -(-K // fused.lora_a_chunk(M, K))
    assert h.shape == (S, M, n * R)
    if M >= fused.LORA_A_DOT_MIN_M:  # the K chunks summed in a fixed order: bitwise repeatable
        assert torch.equal(fused.lora_a(x, As), h)
    ref_h = torch.cat([(x.double() @ a.double().t()).float() for a in As], 1)
    torch.testing.assert_close(h.sum(0), ref_h, rtol=1e-4, atol=1e-4)
    want = [(y.float() + (bs[i].float() if bias else 0) + 2.0 * (ref_h[:, i * R:(i + 1) * R] @ Bs[i].t())).to(BF)
            for i, y in enumerate(ys)]
    fused.lora_out(ys, h, Bs, bs, 2.0)
    for y, w in zip(ys, want):  # terms of size ~1-10: a sum that cancels to ~0 keeps their fp32 error
        _close_bf16(y, w, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_lora_a_tiled_sums_many_chunks(device):
    """The tiled lora_a at an explicit config: 10 K chunks summed by the last to arrive, two adapters
    (their own workspace slices and counters), two row tiles, rank 8 padded to 16: the reference sums,
    and bitwise the same on a repeat (which needs the tile counters reset by the launch before)."""
    from qerl import kernels

    torch.manual_seed(0)
    M, K, R = 70, 300, 8
    x = torch.randn(M, K, dtype=BF, device=device)
    As = [torch.randn(R, K, device=device) / K ** 0.5 for _ in range(2)]
    conf = dict(BLOCK_M=64, BLOCK_K=32, K_CHUNK=32)
    h = kernels.lora_a_tuned(x, As, conf)
    ref = torch.cat([(x.double() @ a.double().t()).float() for a in As], 1)
    torch.testing.assert_close(h[0], ref, rtol=1e-4, atol=1e-4)
    assert torch.equal(kernels.lora_a_tuned(x, As, conf), h)
    assert torch.equal(kernels.lora_a_tuned(x, As, dict(conf, K_CHUNK=320)), kernels.lora_a_tuned(x, As, dict(conf, K_CHUNK=320)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("R", [8, 64, 128, 256])
def test_lora_a_tiled_any_rank_gpu(R):
    """Ranks other than the benchmarked 32: the rule shortens the K step as r grows, so that the tile
    fits shared memory (r = 256 at the 32-rank step would not); lora_a's sums match fp64 and lora_out
    adds them through B, at the decode step's 64 rows and at 256."""
    torch.manual_seed(0)
    K, Ns = 3584, [3584, 512, 512]
    for M in (64, 256):
        x = torch.randn(M, K, dtype=BF, device="cuda")
        As = [torch.randn(R, K, device="cuda") / K ** 0.5 for _ in Ns]
        Bs = [torch.randn(N, R, device="cuda") / R ** 0.5 for N in Ns]
        ys = [torch.randn(M, N, dtype=BF, device="cuda") for N in Ns]
        h = fused.lora_a(x, As)
        ref = torch.cat([(x.double() @ a.double().t()).float() for a in As], 1)
        torch.testing.assert_close(h.sum(0), ref, rtol=1e-4, atol=1e-4)
        want = [(y.float() + 2.0 * (ref[:, i * R:(i + 1) * R] @ Bs[i].t())).to(BF) for i, y in enumerate(ys)]
        fused.lora_out(ys, h, Bs, [], 2.0)
        for y, w in zip(ys, want):
            _close_bf16(y, w, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias", [False, True])
def test_lora_silu_mul(bias, device):
    """gate/up epilogues and SiLU(gate) * up in one launch = lora_out on each, then silu_mul."""
    torch.manual_seed(0)
    M, R, K, N = (40, 32, 3584, 18944) if device == "cuda" else (6, 8, 64, 96)
    x = torch.randn(M, K, dtype=BF, device=device)
    As = [torch.randn(R, K, device=device) / K ** 0.5 for _ in range(2)]
    Bs = [torch.randn(N, R, device=device) for _ in range(2)]
    bs = [torch.randn(N, dtype=BF, device=device) for _ in range(2)] if bias else []
    g, u = torch.randn(M, N, dtype=BF, device=device), torch.randn(M, N, dtype=BF, device=device)
    h = fused.lora_a(x, As)
    out = fused.lora_silu_mul(g, u, h, Bs, bs, 2.0)
    ys = [g.clone(), u.clone()]
    fused.lora_out(ys, h, Bs, bs, 2.0)
    _close_bf16(out, fused.silu_mul(*ys))  # the same arithmetic, one launch fewer
    _close_bf16(out, F.silu(ys[0]) * ys[1])


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_grouped_linears_equal_the_modules(fmt):
    """q/k/v of a tiny Qwen2 (biases) with LoRA: one stacked A and one B launch give each module's output."""
    model = make_tiny_model("qwen2", dtype=BF)
    quantize_(model, QuantizeConfig(fmt=fmt, lora_rank=8))
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        for m in (attn.q_proj, attn.k_proj, attn.v_proj):
            m.lora_B.weight.normal_(0, 0.5)
        x = torch.randn(3, 64, dtype=BF)
        mods = [attn.q_proj, attn.k_proj, attn.v_proj, model.lm_head]  # lm_head: a plain nn.Linear
        for got, m in zip(grouped_linears(x, mods), mods):
            _close_bf16(got, m(x))


# ---------------------------------------------------------------------------------- engine
def _lora_model(model_type, fmt="nvfp4", dtype=torch.float32, **kw):
    model = make_tiny_model(model_type, dtype=dtype, **kw)
    quantize_(model, QuantizeConfig(fmt=fmt, lora_rank=4, **({"backend": "triton"} if fmt == "nvfp4" else {})))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return model


@pytest.mark.parametrize("model_type,norm_lora_max_m,producer_lora_max_m,rope_max_m",
                         [("llama", 16, 0, 0), ("qwen2", 16, 0, 0), ("qwen3", 16, 0, 0), ("qwen2", 0, 0, 0),
                          ("qwen2", 16, 16, 16), ("qwen3", 16, 16, 16), ("qwen2", 0, 0, 16)])
def test_fused_engine_equals_unfused(model_type, norm_lora_max_m, producer_lora_max_m, rope_max_m, monkeypatch):
    """fp32 tiny models with NVFP4 + LoRA: the same sampled tokens, log-probs within fp32 rounding.
    norm_lora_max_m 0: the large-batch step (plain norm, then a tiled lora_a launch per group);
    producer_lora_max_m 16: o_proj's and down_proj's LoRA A products in the launches that produce their inputs;
    rope_max_m 16: q/k/v's bias and LoRA in the rotary launch (h from the norm kernel, or with norm_lora_max_m 0
    from a lora_a launch)."""
    import qerl.rollout.fast as fast

    monkeypatch.setattr(fast, "NORM_LORA_A_MAX_M", norm_lora_max_m)
    monkeypatch.setattr(fast, "PRODUCER_LORA_A_MAX_M", producer_lora_max_m)
    monkeypatch.setattr(fast, "ROPE_LORA_OUT_MAX_M", rope_max_m)
    model = _lora_model(model_type)
    kw = dict(temperature=1.0, top_k=40, seed=3)
    a = FastEngine(model, eos_token_ids=[2], pad_id=0, fused=False).generate(PROMPTS, 10, **kw)
    f = FastEngine(model, eos_token_ids=[2], pad_id=0, fused=True)
    assert f.fused
    b = f.generate(PROMPTS, 10, **kw)
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert torch.equal(a.completion_mask, b.completion_mask)
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-4, rtol=0)
    torch.testing.assert_close(a.entropy, b.entropy, atol=1e-4, rtol=0)


def test_fused_compaction_equals_the_static_batch():
    """The fused decode step on shrinking buckets (rows packed, LoRA-A in the norm kernel and tiled): the
    static batch's tokens and log-probs (fp32 NVFP4 + LoRA, per-sequence caps)."""
    model = _lora_model("qwen2")
    prompts = [PROMPTS[i % len(PROMPTS)] + [40 + i] for i in range(6)]
    caps, kw = [2, 9, 4, 7, 1, 5], dict(temperature=1.0, seed=7, ignore_eos=True)
    a = FastEngine(model, eos_token_ids=[2], pad_id=0, fused=True, sync_every=2, compact=False).generate(prompts, caps, **kw)
    f = FastEngine(model, eos_token_ids=[2], pad_id=0, fused=True, sync_every=2)
    b = f.generate(prompts, caps, **kw)
    assert f.last_stats["compactions"] >= 2 and min(f.last_stats["bucket_steps"]) <= 2
    assert torch.equal(a.completion_ids, b.completion_ids) and b.completion_mask.sum(1).tolist() == caps
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-4, rtol=0)


def test_fused_refill_equals_one_batch():
    """The fused decode step with freed rows taking waiting prompts (each row at its own token index, one
    cache cursor): one batch's tokens and log-probs (fp32 NVFP4 + LoRA, per-sequence caps)."""
    model = _lora_model("qwen2")
    prompts = [PROMPTS[i % len(PROMPTS)] + [40 + i] * (1 + i % 2) for i in range(5)]
    caps, kw = [2, 5, 1, 3, 4], dict(temperature=1.0, seed=7, ignore_eos=True)
    a = FastEngine(model, eos_token_ids=[2], pad_id=0, fused=True, sync_every=2).generate(prompts, caps, **kw)
    f = FastEngine(model, eos_token_ids=[2], pad_id=0, fused=True, sync_every=2, max_batch=2)
    b = f.generate(prompts, caps, **kw)
    assert f.last_stats["refills"] == 3 and b.completion_mask.sum(1).tolist() == caps
    w = min(a.completion_ids.shape[1], b.completion_ids.shape[1])
    assert torch.equal(a.completion_ids[:, :w], b.completion_ids[:, :w])
    torch.testing.assert_close(a.logprobs[:, :w], b.logprobs[:, :w], atol=1e-4, rtol=0)


def test_fused_engine_bf16_agrees():
    """bf16 (the rollout dtype): reductions in another order may flip a near tie, rarely."""
    model = _lora_model("qwen2", fmt="bf16", dtype=BF)
    a = FastEngine(model, eos_token_ids=[2], pad_id=0, fused=False).generate(PROMPTS, 12, greedy=True)
    b = FastEngine(model, eos_token_ids=[2], pad_id=0, fused=True).generate(PROMPTS, 12, greedy=True)
    assert (a.completion_ids == b.completion_ids).float().mean() > 0.9
    first = a.completion_ids[:, :3] == b.completion_ids[:, :3]
    assert first.all()  # before any divergence the logits agree to bf16 rounding
    assert (a.logprobs[:, :3] - b.logprobs[:, :3]).abs().max() < 0.05


def test_decode_step_runs_without_autograd():
    """Graph warm-up/capture call the step outside generate (benchmarks/speed_common.warm_up_engine):
    with grad enabled, the in-place LoRA epilogue on the 4-bit op's output must still run."""
    model = _lora_model("qwen2", dtype=BF)
    fe = FastEngine(model, eos_token_ids=[2], pad_id=0, fused=True)
    fe.generate([[5, 6, 7]], 2, temperature=1.0)
    assert torch.is_grad_enabled()
    fe._decode_step(256, (1.0, 0, 1.0, False, False))
    assert int(fe.buf.col[0]) == 3  # the step ran and advanced the row's token index


def test_fused_engine_reads_the_model_tensors_live():
    """No copy: a LoRA update and AQN noise (norm weights changed in place) are seen by the next call."""
    from qerl.noise import noisy_norms

    model = _lora_model("llama")
    ptrs = {t.data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    fe = FastEngine(model, eos_token_ids=[2], pad_id=0, fused=True)
    before = fe.generate(PROMPTS, 6, greedy=True, ignore_eos=True)
    assert {t.data_ptr() for t in list(model.parameters()) + list(model.buffers())} == ptrs
    with noisy_norms(model, 0.5, seed=0):
        noisy = fe.generate(PROMPTS, 6, greedy=True, ignore_eos=True)
    assert not torch.allclose(noisy.logprobs, before.logprobs)
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.lora_B.weight.normal_(0, 1.0)
    after = fe.generate(PROMPTS, 6, greedy=True, ignore_eos=True)
    assert not torch.allclose(after.logprobs, before.logprobs)
    ref = FastEngine(model, eos_token_ids=[2], pad_id=0, fused=False).generate(PROMPTS, 6, greedy=True,
                                                                               ignore_eos=True)
    torch.testing.assert_close(after.logprobs, ref.logprobs, atol=1e-4, rtol=0)


class _OpCounter(TorchDispatchMode):
    """Counts the ops a step dispatches, leaving out views and allocations (no kernel on a GPU).
    A custom op (a Triton launch, the 4-bit GEMV) counts once."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.overloadpacket.__name__ not in ("empty", "empty_like", "empty_strided"):
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _ops_per_layer(model_type, fused_on, lora_rank):
    """Ops of one decode step, per decoder layer: the difference between 3- and 2-layer models."""
    counts = []
    for n_layers in (2, 3):
        model = make_tiny_model(model_type, dtype=BF, num_hidden_layers=n_layers)
        quantize_(model, QuantizeConfig(fmt="nvfp4", lora_rank=lora_rank, backend="triton"))
        fe = FastEngine(model, eos_token_ids=[2], pad_id=0, fused=fused_on)
        fe.generate([[5, 6, 7]], 2, temperature=1.0)  # allocates the buffers
        counter = _OpCounter()
        with counter, torch.no_grad():
            fe._decode_step(256, (1.0, 0, 1.0, False, False))
        counts.append(counter.ops)
    per_layer = counts[1].copy()
    per_layer.subtract(counts[0])
    return sum(per_layer.values()), per_layer


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_fused_decode_step_launches_fewer_ops(model_type):
    """Counted with a TorchDispatchMode (each Triton kernel is a custom op): with LoRA, the unfused
    step dispatches 88 (Qwen2) / 101 (Qwen3) ops per layer, the fused one 17: 7 GEMVs, 2 add+norm
    (with the q/k/v and gate/up LoRA-A), 2 LoRA-A (o, down), 3 bias/LoRA-B (q/k/v, o, down), 1
    gate/up LoRA-B + SiLU*up, 1 rotary+cache write, 1 SDPA."""
    n_fused, ops = _ops_per_layer(model_type, True, 8)
    n_unfused, _ = _ops_per_layer(model_type, False, 8)
    assert n_fused <= 17, ops
    assert n_unfused >= 5 * n_fused, (n_unfused, n_fused)
    assert ops["qerl.fp4_e4m3_linear.default"] == 7 and ops["qerl.add_rmsnorm_lora_a.default"] == 2


def test_lora_a_in_the_producing_launches_saves_two_launches(monkeypatch):
    """With PRODUCER_LORA_A_MAX_M rows, o_proj's LoRA A product rides in the attention launch and down_proj's
    in the SiLU * up launch: two ops a layer fewer (their lora_a)."""
    import qerl.rollout.fast as fast

    n_off, off = _ops_per_layer("qwen2", True, 8)
    monkeypatch.setattr(fast, "PRODUCER_LORA_A_MAX_M", 16)
    n_on, on = _ops_per_layer("qwen2", True, 8)
    assert n_on == n_off - 2, (off, on)
    assert on["qerl.lora_a.default"] == off["qerl.lora_a.default"] - 2
    assert on["qerl.decode_attention_lora_a.default"] == 1 and on["qerl.decode_attention.default"] == 0
    assert on["qerl.lora_silu_mul_lora_a.default"] == 1 and on["qerl.lora_silu_mul.default"] == 0


def test_q_k_v_epilogue_in_the_rotary_launch_saves_a_launch(monkeypatch):
    """With ROPE_LORA_OUT_MAX_M rows, q/k/v's lora_out rides in the rotary + cache launch: one op a layer fewer."""
    import qerl.rollout.fast as fast

    n_off, off = _ops_per_layer("qwen2", True, 8)
    monkeypatch.setattr(fast, "ROPE_LORA_OUT_MAX_M", 16)
    n_on, on = _ops_per_layer("qwen2", True, 8)
    assert n_on == n_off - 1, (off, on)
    assert on["qerl.lora_out.default"] == off["qerl.lora_out.default"] - 1
    assert on["qerl.lora_rope_cache_write.default"] == 1 and on["qerl.rope_cache_write.default"] == 0


def test_fused_needs_a_kernel_backend(monkeypatch):
    model = make_tiny_model("llama", dtype=torch.float32)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="fused=True cannot run"):
        FastEngine(model, eos_token_ids=[2], fused=True)
    assert not FastEngine(model, eos_token_ids=[2]).fused  # CPU default: the HF-order eager path


# ---------------------------------------------------------------------------------- GPU
def _gpu_model(dtype, lora):
    torch.manual_seed(0)
    model = make_tiny_model("qwen2", dtype=dtype, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                            num_attention_heads=8, num_key_value_heads=2, vocab_size=2048,
                            max_position_embeddings=1024, tie_word_embeddings=False).cuda()
    if lora:
        quantize_(model, QuantizeConfig(fmt="nvfp4", lora_rank=16))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.02)
    return model


GPU_PROMPTS = [[3 + (7 * i + 11 * j) % 2000 for j in range(n)] for i, n in enumerate((7, 30, 120, 200))]


def _gpu_engine(model, **kw):
    return FastEngine(model, eos_token_ids=[2], pad_id=0, max_seq_len=512, **kw)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_cuda_graphs_fp32_equal_unfused():
    """fp32, random Qwen2-architecture model (no download: runs on the device image), 250 greedy
    tokens over the 256 and 512 windows: the fused graphs give the unfused graphs' log-probs within
    1e-3 (fp32: reduction order moves logits by ~1e-6), rows parting only at a near tie."""
    model = _gpu_model(torch.float32, lora=False)
    a = _gpu_engine(model, fused=False).generate(GPU_PROMPTS, 250, greedy=True, ignore_eos=True)
    fe = _gpu_engine(model, fused=True)
    assert fe.fused and fe.cuda_graphs
    b = fe.generate(GPU_PROMPTS, 250, greedy=True, ignore_eos=True)
    assert_greedy_close(a, b, 1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, BF])
def test_compaction_cuda_graphs_equal_the_static_batch(dtype):
    """Finished rows leave the batch under CUDA graphs (a graph per bucket and window): 40 sequences with
    their own caps over the 256 and 512 windows give the static batch's greedy tokens (fp32: log-probs
    within 1e-3, rows parting only at a near tie; bf16 NVFP4 + LoRA: within bf16 rounding, 0.05), the
    decode steps run at buckets 40, 32, ..., 1, and a repeat is bitwise the same."""
    model = _gpu_model(dtype, lora=dtype == BF)
    prompts = [GPU_PROMPTS[i % 4][: 5 + 3 * i] for i in range(40)]
    caps = [1 + (37 * i) % 170 for i in range(36)] + [180, 220, 260, 300]  # a long tail: the last buckets run
    caps = [caps[(7 * i) % 40] for i in range(40)]
    kw = dict(greedy=True, ignore_eos=True)
    a = _gpu_engine(model, compact=False).generate(prompts, caps, **kw)
    fe = _gpu_engine(model)
    assert fe.compact and fe.cuda_graphs
    b = fe.generate(prompts, caps, **kw)
    assert b.completion_mask.sum(1).tolist() == caps
    assert_greedy_close(a, b, 1e-3 if dtype == torch.float32 else 0.05)
    st = fe.last_stats
    assert set(st["bucket_steps"]) == {40, 32, 16, 8, 4, 2, 1} and st["decode_steps"] == max(caps) - 1
    c = fe.generate(prompts, caps, **kw)
    assert torch.equal(b.completion_ids, c.completion_ids) and torch.equal(b.logprobs, c.logprobs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, BF])
def test_refill_cuda_graphs_equal_one_batch(dtype):
    """Freed rows take waiting prompts under CUDA graphs (each row's own token index in the graph, the
    fused per-row Gumbel draw), with a cache of prompt + cap + sync_every slots, so the cursor moves back:
    40 sequences on 8 rows give one batch's greedy tokens (the closeness rule of the compaction test),
    and seeded sampled runs repeat bitwise."""
    model = _gpu_model(dtype, lora=dtype == BF)
    prompts = [GPU_PROMPTS[i % 4][: 5 + 3 * i] for i in range(40)]
    caps = [1 + (37 * i) % 170 for i in range(40)]
    kw = dict(greedy=True, ignore_eos=True)
    a = _gpu_engine(model).generate(prompts, caps, **kw)
    fe = _gpu_engine(model, max_batch=8)
    b = fe.generate(prompts, caps, **kw)
    assert b.completion_mask.sum(1).tolist() == caps
    st = fe.last_stats
    assert st["refills"] == 32 and st["rebases"] >= 1 and max(st["bucket_steps"]) == 8, st
    w = min(a.completion_ids.shape[1], b.completion_ids.shape[1])
    from types import SimpleNamespace

    cut = [SimpleNamespace(**{f: getattr(x, f)[:, :w] for f in ("completion_ids", "completion_mask", "logprobs")})
           for x in (a, b)]
    assert_greedy_close(*cut, 1e-3 if dtype == torch.float32 else 0.05)
    s1 = fe.generate(prompts, caps, temperature=1.0, seed=3, ignore_eos=True)
    s2 = _gpu_engine(model, max_batch=8).generate(prompts, caps, temperature=1.0, seed=3, ignore_eos=True)
    assert torch.equal(s1.completion_ids, s2.completion_ids) and torch.equal(s1.logprobs, s2.logprobs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_cuda_graphs_bf16_lora_live():
    """bf16 NVFP4 + LoRA (non-zero B): the fused graphs give the unfused graphs' and fused eager's
    log-probs within bf16 rounding (a bf16 near tie may fall either way, anywhere in a row: compared
    by log-probs, not by where the rows part), and see AQN noise and a LoRA update with no re-capture."""
    from qerl.noise import keep_norms_fp32, noisy_norms

    model = _gpu_model(BF, lora=True)
    keep_norms_fp32(model)
    kw = dict(greedy=True, ignore_eos=True)
    unfused, fused_g, fused_e = (_gpu_engine(model, fused=False), _gpu_engine(model, fused=True),
                                 _gpu_engine(model, fused=True, cuda_graphs=False))
    a, b, c = (e.generate(GPU_PROMPTS, 250, **kw) for e in (unfused, fused_g, fused_e))
    for other in (a, c):  # log-probs within bf16 rounding; rows may part only at a near tie
        assert_greedy_close(other, b, 0.05)
    caps = fused_g.stats["captures"]
    with noisy_norms(model, 0.05, seed=0):
        d = fused_g.generate(GPU_PROMPTS, 250, **kw)
    assert not torch.equal(d.logprobs, b.logprobs)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.lora_B.weight.normal_(0, 0.5)
    e = fused_g.generate(GPU_PROMPTS, 250, **kw)
    assert fused_g.stats["captures"] == caps  # same graphs, new noise and new LoRA weights
    assert not torch.equal(e.logprobs, b.logprobs)
    assert_greedy_close(unfused.generate(GPU_PROMPTS, 250, **kw), e, 0.05)  # the update as the unfused path sees it


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pdl_gives_the_same_bits():
    """Programmatic dependent launch (on by default on sm_90) changes when a kernel's programs start, not
    what they compute: bf16 NVFP4 + LoRA, 40 sampled sequences of their own lengths under CUDA graphs (buckets
    40 to 1: the mma and warp-specialised kernels, the tiled and broadcast lora_a, split attention, the
    sampler) give the same tokens and log-probs bit for bit with PDL on and off (a fresh model each: the
    kernel launches are kept per weight)."""
    from qerl import kernels

    if torch.cuda.get_device_capability(0)[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90")
    prompts = [GPU_PROMPTS[i % 4][: 5 + 3 * i] for i in range(40)]
    caps = [1 + (37 * i) % 170 for i in range(40)]
    kw = dict(temperature=1.0, seed=5, ignore_eos=True)
    runs = []
    before = kernels.set_pdl(True)
    try:
        for on in (True, False):
            kernels.set_pdl(on)
            assert kernels.pdl(torch.device("cuda", 0)) == on
            runs.append(_gpu_engine(_gpu_model(BF, lora=True)).generate(prompts, caps, **kw))
    finally:
        kernels.set_pdl(before)
    a, b = runs
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.logprobs, b.logprobs)


def test_split_attention_equals_sdpa():
    """The fused step's attention split over the keys (the default) against torch SDPA over the whole window:
    the same tokens and log-probs within fp32 rounding (fp32 NVFP4 + LoRA, sampled; the kernel's splits, the
    cursor and windows past 256 slots: tests/kernels/test_decode_attention.py)."""
    model = _lora_model("qwen2")
    prompts = [PROMPTS[i % len(PROMPTS)] + [40 + i] for i in range(3)]
    kw = dict(temperature=1.0, seed=3, ignore_eos=True)
    runs = [FastEngine(model, eos_token_ids=[2], pad_id=0, fused=True, sync_every=4, attention=a).generate(
        prompts, 8, **kw) for a in ("sdpa", "qerl")]
    assert torch.equal(runs[0].completion_ids, runs[1].completion_ids)
    torch.testing.assert_close(runs[0].logprobs, runs[1].logprobs, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="attention must be one of"):
        FastEngine(model, eos_token_ids=[2], pad_id=0, attention="flash")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_lora_a_beside_the_matmuls_gives_the_same_bits(monkeypatch):
    """lora_a on a side stream beside the base matmuls (fused_linear.LORA_A_BESIDE) changes when it runs,
    not what it computes: bf16 NVFP4 + LoRA, 40 sampled sequences of their own lengths (buckets 40 to 1:
    the tiled and the in-norm lora_a) under CUDA graphs and eagerly give the in-line run's tokens and
    log-probs bit for bit."""
    from qerl.rollout import fused_linear

    prompts = [GPU_PROMPTS[i % 4][: 5 + 3 * i] for i in range(40)]
    caps = [1 + (37 * i) % 170 for i in range(40)]
    kw = dict(temperature=1.0, seed=5, ignore_eos=True)
    model = _gpu_model(BF, lora=True)
    runs = {}
    for beside in (False, True):
        monkeypatch.setattr(fused_linear, "LORA_A_BESIDE", beside)
        for graphs in (True, False):
            runs[beside, graphs] = _gpu_engine(model, cuda_graphs=graphs).generate(prompts, caps, **kw)
    for graphs in (True, False):
        a, b = runs[False, graphs], runs[True, graphs]
        assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.logprobs, b.logprobs), graphs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_few_row_opt_ins_gpu(monkeypatch):
    """o_proj's and down_proj's LoRA A products in the launches that produce their inputs (PRODUCER_LORA_A_MAX_M),
    and q/k/v's epilogue in the rotary launch (ROPE_LORA_OUT_MAX_M), under CUDA graphs: an fp32 NVFP4 + LoRA
    model's greedy tokens and log-probs as with the separate launches (within fp32 rounding of the partial sums'
    order), and bitwise repeatable."""
    import qerl.rollout.fast as fast

    model = _gpu_model(torch.float32, lora=True)
    a = _gpu_engine(model).generate(GPU_PROMPTS, 120, greedy=True, ignore_eos=True)
    monkeypatch.setattr(fast, "PRODUCER_LORA_A_MAX_M", 16)
    monkeypatch.setattr(fast, "ROPE_LORA_OUT_MAX_M", 16)
    b = _gpu_engine(model).generate(GPU_PROMPTS, 120, greedy=True, ignore_eos=True)
    assert_greedy_close(a, b, 1e-3)
    c = _gpu_engine(model).generate(GPU_PROMPTS, 120, greedy=True, ignore_eos=True)
    assert torch.equal(b.completion_ids, c.completion_ids) and torch.equal(b.logprobs, c.logprobs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("M", [1, 3])
def test_lora_silu_mul_with_the_next_lora_a(bias, M, device):
    """lora_silu_mul_lora_a: lora_silu_mul's output bit for bit, and partial sums over column blocks whose
    sum is that output times down_proj's LoRA A (fp32, as stored); a ragged last block."""
    from qerl.kernels import lora_silu_mul, lora_silu_mul_lora_a

    g = torch.Generator().manual_seed(4)
    N, R, K, Rd = 300, 8, 64, 5
    gate, up = (torch.randn(M, N, generator=g).to(BF).to(device) for _ in range(2))
    x = torch.randn(M, K, generator=g).to(device)
    As = [torch.randn(R, K, generator=g).to(device) * 0.1 for _ in range(2)]
    h = (x @ torch.cat(As).T)[None].contiguous()
    Bs = [torch.randn(N, R, generator=g).to(device) * 0.1 for _ in range(2)]
    biases = [torch.randn(N, generator=g).to(BF).to(device) for _ in range(2)] if bias else []
    Ad = torch.randn(Rd, N, generator=g).to(device) * 0.1
    want = lora_silu_mul(gate, up, h, Bs, biases, 2.0)
    out, hn = lora_silu_mul_lora_a(gate, up, h, Bs, biases, 2.0, Ad)
    assert torch.equal(out, want)
    assert hn.shape[1:] == (M, Rd) and hn.shape[0] >= 2
    torch.testing.assert_close(hn.sum(0), out.float() @ Ad.T, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="next_A must be"):
        lora_silu_mul_lora_a(gate, up, h, Bs, biases, 2.0, Ad[:, :-1])
