"""qerl.kernels.decode_attention (split over the keys) against its fp32 torch reference and torch's
SDPA: GQA groups of 1-8 query heads, head sizes that are and are not powers of two, left padding and
holes in the key mask, keys past the cursor, one split and many, bitwise repeats.

On the CPU the kernel runs under TRITON_INTERPRET=1 (tests/conftest.py sets it)."""

import pytest
import torch
import torch.nn.functional as F

from qerl.kernels import attention as attn_mod
from qerl.kernels import decode_attention, decode_attention_reference

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _case(B, n_kv, G, D, L, window, cur, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, n_kv * G, D, generator=g).to(dtype).to(device)
    k = torch.randn(B, n_kv, L, D, generator=g).to(dtype).to(device)
    v = torch.randn(B, n_kv, L, D, generator=g).to(dtype).to(device)
    valid = torch.zeros(B, L, dtype=torch.bool)
    for b in range(B):  # left padding of its own length, a few holes (a refilled row's old slots)
        start = int(torch.randint(0, max(1, cur // 2), (1,), generator=g))
        valid[b, start:cur + 1] = True
        holes = torch.randint(start, cur + 1, (3,), generator=g)
        valid[b, holes] = False
        valid[b, cur] = True
    valid[:, cur + 1:] = torch.rand(B, L - cur - 1, generator=g) < 0.5  # stale slots past the cursor: never read
    cpos = torch.tensor([cur], device=device)
    return q, k[:, :, :window], v[:, :, :window], valid.to(device), cpos


def _sdpa(q, k, v, valid, cpos, scale):
    B, n_kv, window, D = k.shape
    m = valid[:, :window].clone()
    m[:, int(cpos) + 1:] = False
    o = F.scaled_dot_product_attention(q.float().view(B, n_kv, -1, D), k.float(), v.float(),
                                       attn_mask=m[:, None, None, :], scale=scale)
    return o.reshape(B, -1)


@pytest.mark.parametrize("splits", [1, None])
@pytest.mark.parametrize("G,D", [(1, 16), (3, 64), (7, 48)])
def test_matches_the_reference_fp32(G, D, splits, monkeypatch):
    if splits == 1:
        monkeypatch.setattr(attn_mod, "MIN_CHUNK", 1 << 20)  # one program walks the whole window
    q, k, v, valid, cpos = _case(B=3, n_kv=2, G=G, D=D, L=320, window=256, cur=200, dtype=torch.float32,
                                 device="cpu")
    out = decode_attention(q, k, v, valid, cpos, D ** -0.5)
    ref = decode_attention_reference(q, k, v, valid, cpos, D ** -0.5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, _sdpa(q, k, v, valid, cpos, D ** -0.5), rtol=1e-5, atol=1e-5)


def test_splits_past_the_cursor_and_bitwise_repeats():
    # window 512, cursor 130: the later splits start past the cursor and only write empty partials
    q, k, v, valid, cpos = _case(B=2, n_kv=2, G=4, D=32, L=512, window=512, cur=130, dtype=torch.float32,
                                 device="cpu", seed=1)
    assert attn_mod.decode_attention_splits(2, 2, 512, 4) >= 2  # 256 keys a split: the second starts past 130
    out = decode_attention(q, k, v, valid, cpos, 0.2)
    torch.testing.assert_close(out, decode_attention_reference(q, k, v, valid, cpos, 0.2), rtol=1e-5, atol=1e-5)
    assert torch.equal(out, decode_attention(q, k, v, valid, cpos, 0.2))
    # what lies past the cursor does not matter
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 131:] = 1e4
    v2[:, :, 131:] = float("nan")
    assert torch.equal(out, decode_attention(q, k2, v2, valid, cpos, 0.2))


def test_bf16_within_rounding():
    q, k, v, valid, cpos = _case(B=2, n_kv=2, G=7, D=64, L=256, window=256, cur=255, dtype=torch.bfloat16,
                                 device="cpu", seed=2)
    out = decode_attention(q, k, v, valid, cpos, 0.125)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), decode_attention_reference(q, k, v, valid, cpos, 0.125).float(),
                               rtol=2 ** -6, atol=2e-3)


def test_a_row_without_valid_keys_gives_zeros():
    q, k, v, valid, cpos = _case(B=2, n_kv=1, G=2, D=16, L=256, window=256, cur=100, dtype=torch.float32,
                                 device="cpu", seed=3)
    valid[1] = False
    out = decode_attention(q, k, v, valid, cpos, 0.25)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    torch.testing.assert_close(out[0], decode_attention_reference(q, k, v, valid, cpos, 0.25)[0])


def test_bad_shapes_are_clear_errors():
    q, k, v, valid, cpos = _case(B=2, n_kv=2, G=2, D=16, L=256, window=256, cur=10, dtype=torch.float32,
                                 device="cpu")
    with pytest.raises(ValueError, match="multiple of the KV heads"):
        decode_attention(q[:, :3], k, v, valid, cpos, 0.25)
    with pytest.raises(ValueError, match="bool"):
        decode_attention(q, k, v, valid.float(), cpos, 0.25)
    with pytest.raises(ValueError, match="v"):
        decode_attention(q, k, v[:, :, :128], valid, cpos, 0.25)


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("B,n_kv,G,D,window,cur", [(1, 4, 7, 128, 2048, 1900), (16, 4, 7, 128, 2048, 1100),
                                                   (64, 4, 7, 128, 1024, 1023), (5, 8, 5, 128, 512, 300),
                                                   (3, 2, 8, 64, 256, 17)])
def test_matches_the_reference_gpu(B, n_kv, G, D, window, cur, dtype):
    q, k, v, valid, cpos = _case(B=B, n_kv=n_kv, G=G, D=D, L=window + 64, window=window, cur=cur, dtype=dtype,
                                 device="cuda", seed=B)
    scale = D ** -0.5
    out = decode_attention(q, k, v, valid, cpos, scale)
    ref = decode_attention_reference(q, k, v, valid, cpos, scale)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:  # against torch's own bf16 attention: within a few bf16 steps of the fp32 result as it is
        sdpa = F.scaled_dot_product_attention(q.view(B, n_kv, G, D), k, v, scale=scale,
                                              attn_mask=(valid[:, :window] & (torch.arange(window, device="cuda")
                                                                              <= cur))[:, None, None, :])
        err, err_sdpa = (out.float() - ref.float()).abs().max(), (sdpa.reshape(B, -1).float() - ref.float()).abs().max()
        assert err <= 2 * err_sdpa + 1e-3, (err, err_sdpa)
    assert torch.equal(out, decode_attention(q, k, v, valid, cpos, scale))
    # under a CUDA graph, with the cursor moved after the capture
    g = torch.cuda.CUDAGraph()
    static = torch.empty_like(out)
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        static.copy_(decode_attention(q, k, v, valid, cpos, scale))
    cpos.fill_(cur // 2)
    g.replay()
    torch.testing.assert_close(static, decode_attention(q, k, v, valid, cpos, scale), rtol=0, atol=0)


def _lora_a_case(G, D, R, B, window, cur, device, n_kv=2):
    from qerl.kernels import decode_attention_lora_a

    q, k, v, valid, cpos = _case(B=B, n_kv=n_kv, G=G, D=D, L=window + 64, window=window, cur=cur,
                                 dtype=torch.bfloat16, device=device, seed=2)
    A = (torch.randn(R, n_kv * G * D, generator=torch.Generator().manual_seed(3)) * 0.05).to(device)
    o, h = decode_attention_lora_a(q, k, v, valid, cpos, D ** -0.5, A)
    assert torch.equal(o, decode_attention(q, k, v, valid, cpos, D ** -0.5))
    assert h.shape == (n_kv, B, R) and h.dtype == torch.float32
    torch.testing.assert_close(h.sum(0), o.float() @ A.T, rtol=1e-5, atol=1e-5)
    for kh in range(n_kv):  # each KV head's share is its own query heads' columns
        cols = slice(kh * G * D, (kh + 1) * G * D)
        torch.testing.assert_close(h[kh], o.float()[:, cols] @ A[:, cols].T, rtol=1e-5, atol=1e-5)
    o2, h2 = decode_attention_lora_a(q, k, v, valid, cpos, D ** -0.5, A)
    assert torch.equal(o2, o) and torch.equal(h2, h)


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("B,window,cur", [(1, 2048, 1900), (16, 512, 300), (3, 256, 200)])
def test_the_lora_a_product_rides_in_the_same_launch_gpu(B, window, cur):
    """As below on the GPU, the 7B shapes (4 KV heads of 7 query heads, head size 128, rank 32)."""
    _lora_a_case(7, 128, 32, B, window, cur, "cuda", n_kv=4)


@pytest.mark.parametrize("splits", [1, None])
@pytest.mark.parametrize("G,D,R", [(1, 16, 8), (7, 48, 32), (4, 32, 5)])
def test_the_lora_a_product_rides_in_the_same_launch(G, D, R, splits, monkeypatch):
    """decode_attention_lora_a: the same o as decode_attention (bit for bit), and per KV head a partial sum
    whose sum over the heads is o A^T (o as stored, bf16) in fp32; one split and many; repeatable."""
    if splits == 1:
        monkeypatch.setattr(attn_mod, "MIN_CHUNK", 1 << 20)
    _lora_a_case(G, D, R, 3, 256, 200, "cpu")


def test_the_lora_a_variant_refuses_an_a_of_the_wrong_width():
    from qerl.kernels import decode_attention_lora_a

    q, k, v, valid, cpos = _case(B=1, n_kv=2, G=2, D=16, L=128, window=128, cur=50, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match=r"A must be \[r, H \* D\]"):
        decode_attention_lora_a(q, k, v, valid, cpos, 0.25, torch.randn(4, 63))
