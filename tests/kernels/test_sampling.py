"""The fused Gumbel-max draw (qerl.kernels.sampling) against the torch code it replaces.

    python -m pytest tests/kernels/test_sampling.py          (CPU: the kernel under TRITON_INTERPRET=1)
    python -m pytest -m gpu tests/kernels/test_sampling.py   (GPU: token for token with torch's CUDA ops)
"""

import pytest
import torch

from qerl.kernels import sampling
from qerl.rollout.common import sequence_keys

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, GPU])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("B,V", [(1, 100), (5, 3000), (3, 4097), (7, 2048)])
def test_gumbel_argmax_matches_torch(device, B, V):
    """Random logits (a masked half in row 0, as top-k / top-p leave them) and zero logits (the token is
    then decided by the noise alone, so any wrong hash bit shows); t past 2^32 (only its low bits count)."""
    g = torch.Generator().manual_seed(B * V)
    keys = sequence_keys(1234, torch.arange(B)).to(device)
    for x in (torch.randn(B, V, generator=g) * 3, torch.zeros(B, V)):
        x[0, : V // 2] = float("-inf")
        x = x.to(device)
        for t in (0, 1, 77, 2**33 + 5):
            tt = torch.tensor(t, device=device)
            got = sampling.gumbel_argmax(x, keys, tt)
            assert got.dtype == torch.long and got.shape == (B,)
            assert torch.equal(got, sampling.gumbel_argmax_reference(x, keys, tt)), (B, V, t)
            assert int(got[0]) >= V // 2  # never a masked entry


@pytest.mark.parametrize("device", DEVICES)
def test_gumbel_argmax_takes_a_step_per_row(device):
    """Rows decoding sequences that started at different steps (the engine's refilled slots) pass one t
    per row: row b draws what it would draw alone at t[b]."""
    B, V = 6, 1000
    keys = sequence_keys(99, torch.arange(B)).to(device)
    x = torch.zeros(B, V, device=device)  # the noise alone decides
    t = torch.tensor([0, 3, 3, 17, 2**33 + 1, 5], device=device)
    got = sampling.gumbel_argmax(x, keys, t)
    assert torch.equal(got, sampling.gumbel_argmax_reference(x, keys, t))
    for b in range(B):
        one = sampling.gumbel_argmax(x[b:b + 1], keys[b:b + 1], t[b])
        assert int(got[b]) == int(one[0]), b
    assert not torch.equal(got, sampling.gumbel_argmax(x, keys, t[:1]))  # not every row's t the first's
    with pytest.raises(ValueError, match="one element or"):
        sampling.gumbel_argmax(x, keys, t[:4])


@pytest.mark.gpu
@GPU
def test_gumbel_argmax_full_vocab_batch_64():
    """The rollout's shape (Qwen2.5's vocabulary, a 64-sequence batch): torch's tokens, and through
    sample_tokens on the GPU (the fused path) the same tokens as with the torch ops."""
    from qerl.rollout import common

    B, V = 64, 152064
    keys = sequence_keys(7, torch.arange(B)).cuda()
    x = torch.randn(B, V, device="cuda") * 4
    for t in range(3):
        tt = torch.tensor(t, device="cuda")
        assert torch.equal(sampling.gumbel_argmax(x, keys, tt), sampling.gumbel_argmax_reference(x, keys, tt))
    fused = common.sample_tokens(x, 1.0, 0, 1.0, False, keys, torch.tensor(5, device="cuda"))
    ref = common.sample_tokens(x, 1.0, 0, 1.0, False, keys, torch.tensor(5, device="cuda"), fused=False)
    for a, b in zip(fused, ref):
        assert torch.equal(a, b)


def test_gumbel_argmax_rejects_bad_input():
    keys = sequence_keys(0, torch.arange(2))
    with pytest.raises(ValueError, match="fp32"):
        sampling.gumbel_argmax(torch.zeros(2, 8, dtype=torch.float64), keys, torch.tensor(0))
    with pytest.raises(ValueError, match="keys"):
        sampling.gumbel_argmax(torch.zeros(2, 8), keys[:1], torch.tensor(0))
