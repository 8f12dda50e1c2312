"""qerl.logprobs: the training forward's log-probs and entropies, chunked over token rows, against
the unchunked computation (values and gradients) and the HF model's own full logits.

Run: OMP_NUM_THREADS=1 python -m pytest tests/test_logprobs.py -q
"""

import importlib.util
from pathlib import Path

import pytest
import torch

from qerl.forward import lm_logits, positions_from_mask
from qerl.logprobs import LOGPROB_CHUNK_ROWS, sequence_logprobs, token_logprobs
from qerl.rollout.common import left_pad

_spec = importlib.util.spec_from_file_location("_qerl_tests_conftest", Path(__file__).with_name("conftest.py"))
_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_conftest)
make_tiny_model = _conftest.make_tiny_model


def _unchunked(h, w, ids, T):
    logp_all = torch.log_softmax((h.float() @ w.float().t()) / T, dim=-1)
    return logp_all.gather(-1, ids[..., None]).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)


@pytest.mark.parametrize("T", [0.7, 1.0])
@pytest.mark.parametrize("chunk", [1, 3, 7, 64])
def test_chunked_logprobs_equal_unchunked_values_and_grads(chunk, T):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, 7, 16, generator=g, dtype=torch.float64).float().requires_grad_(True)
    w = torch.randn(50, 16, generator=g).requires_grad_(True)
    ids = torch.randint(0, 50, (3, 7), generator=g)
    up = torch.randn(3, 7, generator=g)
    ref_lp, ref_ent = _unchunked(h, w, ids, T)
    (ref_lp * up).sum().backward()
    ref_gh, ref_gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    lp, ent = token_logprobs(h, w, ids, T, with_entropy=True, chunk_rows=chunk)
    assert lp.shape == ids.shape and ent.shape == ids.shape and not ent.requires_grad
    (lp * up).sum().backward()
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h.grad, ref_gh, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w.grad, ref_gw, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        lp2, none = token_logprobs(h, w, ids, T, chunk_rows=chunk)
    assert none is None and torch.equal(lp2, lp.detach())


def test_chunk_size_does_not_change_a_row():
    """A row's log-prob is computed from that row alone: any chunking gives its value (up to the
    matmul's blocking, fp32 rounding)."""
    g = torch.Generator().manual_seed(1)
    h = torch.randn(5, 9, 16, generator=g)
    w = torch.randn(70, 16, generator=g)
    ids = torch.randint(0, 70, (5, 9), generator=g)
    ref_lp, ref_ent = token_logprobs(h, w, ids, 0.9, with_entropy=True, chunk_rows=1)
    for chunk in (2, 8, 45, 1000):
        lp, ent = token_logprobs(h, w, ids, 0.9, with_entropy=True, chunk_rows=chunk)
        torch.testing.assert_close(lp, ref_lp, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(ent, ref_ent, atol=1e-6, rtol=1e-6)


def test_chunked_logprobs_keep_no_full_logits():
    """Under autograd no tensor of [rows, vocabulary] is saved for the backward: at most one chunk's
    logits exist at a time (the checkpointed chunk keeps only its inputs)."""
    h = torch.randn(64, 8, requires_grad=True)
    w = torch.randn(1000, 8)
    ids = torch.randint(0, 1000, (64,))
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, _ = token_logprobs(h, w, ids, 1.0, with_entropy=True, chunk_rows=16)
    assert max(saved) <= max(16 * 1000, w.numel())  # never 64 x 1000 at once
    lp.sum().backward()
    assert h.grad is not None and torch.isfinite(h.grad).all()
    with pytest.raises(ValueError, match="chunk_rows"):
        token_logprobs(h, w, ids, chunk_rows=0)


def test_sequence_logprobs_match_the_models_full_logits():
    """Left-padded prompts, padded completions: the chunked training forward gives the log-softmax of
    the HF model's own [B, T, V] logits at the completion positions (fp32 rounding), and the entropy."""
    model = make_tiny_model("llama", dtype=torch.float32)
    prompts, pad = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]], 0
    p_ids, p_mask = left_pad(prompts, pad, "cpu")
    c_ids = torch.tensor([[20, 21, 22, 23], [30, 31, 0, 0], [40, 41, 42, 0]])
    c_mask = (c_ids != 0).long()
    T = 0.8
    with torch.no_grad():
        lp, ent = sequence_logprobs(model, p_ids, p_mask, c_ids, c_mask, T, with_entropy=True, chunk_rows=5)
        ids, mask = torch.cat([p_ids, c_ids], 1), torch.cat([p_mask, c_mask], 1)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask)).logits.float()
        logp_all = torch.log_softmax(logits[:, p_ids.size(1) - 1:-1] / T, -1)
    ref = logp_all.gather(-1, c_ids[..., None]).squeeze(-1)
    m = c_mask.bool()
    torch.testing.assert_close(lp[m], ref[m], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ent[m], -(logp_all.exp() * logp_all).sum(-1)[m], atol=2e-5, rtol=1e-5)
    lp1, none = sequence_logprobs(model, p_ids, p_mask, c_ids, c_mask, T, chunk_rows=5)  # with grad: the same
    assert none is None and lp1.requires_grad and torch.equal(lp1.detach(), lp)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_chunked_logprobs_peak_memory_on_gpu():
    """8 x 2048 rows of a 7B-sized head (152k vocabulary): one fp32 copy of the unchunked logits alone
    is 9.3 GiB; the chunked forward + backward stays within a few chunks (0.58 GiB each) of its inputs,
    and gives the unchunked values (bf16 operands, fp32 logits as on the GPU path)."""
    torch.manual_seed(0)
    H, V = 3584, 152064
    w = torch.randn(V, H, device="cuda", dtype=torch.bfloat16) * 0.02
    h = torch.randn(8, 2048, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ids = torch.randint(0, V, (8, 2048), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    lp, ent = token_logprobs(h, w, ids, 1.0, with_entropy=True)
    lp.sum().backward()
    torch.cuda.synchronize()
    extra = (torch.cuda.max_memory_allocated() - base) / 2**30
    chunk = LOGPROB_CHUNK_ROWS * V * 4 / 2**30
    assert extra < 8 * chunk + 3 * h.numel() * 2 / 2**30, f"{extra:.2f} GiB above the inputs"
    with torch.no_grad():
        ref = torch.log_softmax(lm_logits(h[:1], w), -1).gather(-1, ids[:1, :, None]).squeeze(-1)
    torch.testing.assert_close(lp[:1].detach(), ref, atol=1e-3, rtol=1e-3)
    assert torch.isfinite(h.grad).all() and torch.isfinite(ent).all()
