"""Padding-free training forwards (qerl.packing, qerl.step): packed rows against the padded forward.

- the packed layout (ids, positions restarting per row, cu_seqlens, where each log-prob is read);
- packed and padded forwards give the same log-probs and entropies (tiny Llama / Qwen2, fp32);
- one update on the embedded SmolLM2 (NVFP4 + LoRA, fp32 compute): the LoRA gradients of the packed
  forwards, at any token budget, equal the padded forwards' at micro-batches of 1 and of 8 rows, for
  every loss type (tolerance: 1e-5 relative to the gradient's norm; fp32 sums in another order);
- the token-budget plan (every row once, within the budget, longest first).
The two-rank run with padding-free forwards: tests/test_distributed.py.

Run: OMP_NUM_THREADS=2 python -m pytest tests/test_packing.py -q      (~1 min on 2 cores)
"""

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from qerl import step as qstep
from qerl.logprobs import sequence_logprobs
from qerl.packing import PACK_ALIGN, pack_rows, plan_forwards, row_tokens, varlen_attention
from qerl.rollout import RolloutOutput
from qerl.rollout.common import left_pad

_spec = importlib.util.spec_from_file_location("_qerl_tests_conftest", Path(__file__).with_name("conftest.py"))
_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_conftest)
make_tiny_model = _conftest.make_tiny_model


def test_packed_layout_restarts_positions_and_reads_each_completion_token_once():
    p_ids, p_mask = left_pad([[5, 6, 7], [8]], 0, "cpu")
    c_ids = torch.tensor([[20, 21, 0], [30, 31, 32]])
    c_mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    pk = pack_rows(p_ids, p_mask, c_ids, c_mask, align=1)
    assert pk.input_ids.tolist() == [[5, 6, 7, 20, 21, 8, 30, 31, 32]]
    assert pk.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3]]
    assert pk.cu_seqlens.tolist() == [0, 5, 9] and pk.max_len == 5
    assert pk.target_ids.tolist() == [20, 21, 30, 31, 32]
    assert pk.logit_pos.tolist() == [2, 3, 5, 6, 7]  # the position before each completion token
    assert list(zip(pk.rows.tolist(), pk.cols.tolist())) == [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)]
    aligned = pack_rows(p_ids, p_mask, c_ids, c_mask)  # filled to a multiple of PACK_ALIGN by one filler segment
    assert aligned.n_tokens == PACK_ALIGN and aligned.cu_seqlens.tolist() == [0, 5, 9, PACK_ALIGN]
    assert row_tokens(p_mask, c_mask).tolist() == [5, 4]
    with pytest.raises(ValueError, match="no prompt token"):
        pack_rows(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, dtype=torch.long), c_ids[:1], c_mask[:1])


def test_varlen_attention_is_causal_within_rows_only():
    """Against SDPA with an explicit block-diagonal causal mask, GQA (4 query heads on 2 KV heads)."""
    torch.manual_seed(0)
    cu = torch.tensor([0, 3, 10, 11], dtype=torch.int32)
    q, k, v = torch.randn(11, 4, 8), torch.randn(11, 2, 8), torch.randn(11, 2, 8)
    out = varlen_attention(q, k, v, cu, 7, scale=0.3)
    seg = torch.repeat_interleave(torch.arange(3), torch.diff(cu))
    mask = (seg[:, None] == seg[None, :]) & torch.ones(11, 11, dtype=torch.bool).tril()
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1), v.repeat_interleave(2, 1).transpose(0, 1),
        attn_mask=mask, scale=0.3).transpose(0, 1)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_packed_logprobs_equal_padded(model_type):
    """Left-padded prompts, right-padded completions, a row without completion: the packed forward's
    log-probs and entropies equal the padded forward's at every completion token (fp32 rounding)."""
    model = make_tiny_model(model_type, dtype=torch.float32)
    torch.manual_seed(1)
    p_ids, p_mask = left_pad([[5, 6, 7, 8, 9], [10, 11], [12, 13, 14], [3]], 0, "cpu")
    lengths = torch.tensor([9, 2, 0, 5])
    c_mask = (torch.arange(9)[None] < lengths[:, None]).long()
    c_ids = torch.randint(3, 200, (4, 9)) * c_mask
    with torch.no_grad():
        a, ea = sequence_logprobs(model, p_ids, p_mask, c_ids, c_mask, 0.7, with_entropy=True)
        b, eb = sequence_logprobs(model, p_ids, p_mask, c_ids, c_mask, 0.7, with_entropy=True, packed=False)
    m = c_mask.bool()
    torch.testing.assert_close(a[m], b[m], atol=2e-6, rtol=1e-6)
    torch.testing.assert_close(ea[m], eb[m], atol=2e-6, rtol=1e-6)
    assert (a[~m] == 0).all() and (a[m] != 0).all()


def test_plan_forwards_takes_every_row_once_within_the_budget():
    tokens = [50, 7, 0, 300, 20, 20, 90, 1, 64]
    plan = plan_forwards(tokens, 100)
    flat = sorted(i for f in plan for i in f)
    assert flat == [i for i, t in enumerate(tokens) if t > 0]  # the empty row is left out
    assert all(sum(tokens[i] for i in f) <= 100 or len(f) == 1 for f in plan)
    assert plan[0] == [3]  # a row over the budget runs alone, longest first
    assert plan == plan_forwards(tokens, 100)
    assert len(plan_forwards(tokens, 10 ** 6)) == 1
    with pytest.raises(ValueError, match="token_budget"):
        plan_forwards(tokens, 0)


# ----------------------------------------------------------------------------- gradients, embedded model


@pytest.fixture(scope="module")
def policy():
    """SmolLM2-135M with NVFP4 bases and LoRA r 8 (B random, so both A and B have gradients), fp32 compute."""
    from qerl.models import DEFAULT_MODEL, load_model
    from qerl.quantize import QuantizeConfig, lora_parameters, quantize_

    model, _ = load_model(DEFAULT_MODEL, dtype=torch.float32)
    model.model.layers = model.model.layers[:3]  # 3 of 30 layers: the same code, a tenth of the time
    model.config.num_hidden_layers = 3
    quantize_(model, QuantizeConfig(fmt="nvfp4", lora_rank=8, lora_alpha=16))
    params = lora_parameters(model)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in params:
            p.normal_(0, 0.02)
    return model, params


def _rollout(B=8, P=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(18, 97, (B,), generator=g)
    C = int(lengths.max())
    cmask = (torch.arange(C)[None] < lengths[:, None]).long()
    p_len = torch.randint(4, P + 1, (B,), generator=g)
    pmask = (torch.arange(P)[None] >= (P - p_len)[:, None]).long()  # left padding
    pids = torch.randint(20, 40000, (B, P), generator=g) * pmask
    cids = torch.randint(20, 40000, (B, C), generator=g) * cmask
    z = torch.zeros(B, C)
    return RolloutOutput(pids, pmask, cids, cmask, z, z.clone(), lengths == C), torch.randn(B, generator=g)


def _grads(model, params, ro, adv, loss_type, padding_free, micro, budget=0, old=None):
    cfg = SimpleNamespace(micro_batch_size=micro, padding_free=padding_free, forward_token_budget=budget,
                          token_budget=budget or micro * (ro.prompt_ids.size(1) + ro.completion_ids.size(1)),
                          num_iterations=1, mini_batch_size=0, seed=0, loss_type=loss_type, epsilon=0.2,
                          epsilon_high=0.28, beta=0.0, max_completion_length=ro.completion_ids.size(1),
                          temperature=0.9, max_grad_norm=1e9)
    batch = qstep.Batch.given(ro, adv, [adv.numel()], 0)
    reuse = old is None
    old_lp = torch.zeros_like(ro.logprobs) if reuse else old.clone()
    opt = torch.optim.SGD(params, lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    m = qstep.update(cfg, model, ro, batch, old_lp, None, opt, sched, params, 0, reuse)
    return torch.cat([p.grad.flatten() for p in params]), m


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_padding_free_update_gives_the_padded_gradient(policy, loss_type):
    """The same rows trained padded (micro-batches of 8 rows and of 1) and packed (token budgets that
    cut micro-batches across forwards, and one forward for all): the same LoRA gradient and loss."""
    model, params = policy
    ro, adv = _rollout()
    ref, m_ref = _grads(model, params, ro, adv, loss_type, False, 8)
    for padding_free, micro, budget in ((False, 1, 0), (True, 8, 150), (True, 8, 300), (True, 8, 10 ** 6)):
        g, m = _grads(model, params, ro, adv, loss_type, padding_free, micro, budget)
        rel = float((g - ref).norm() / ref.norm())
        if micro == 8:  # micro-batches of 1 row normalise grpo / bnpo / dr_grpo per row, by design
            assert rel < 1e-5, (padding_free, budget, rel)
            assert m["loss"] == pytest.approx(m_ref["loss"], rel=1e-5, abs=1e-7)
            assert m["entropy"] == pytest.approx(m_ref["entropy"], rel=1e-5)
        elif loss_type == "dapo":  # dapo's global normaliser: the cut of micro-batches does not matter
            assert rel < 1e-5, rel
    assert ref.norm() > 0


def test_padding_free_update_with_old_logprobs_and_clipping(policy):
    """Old log-probs off the current policy (ratios clipped on both sides): packed equals padded."""
    model, params = policy
    ro, adv = _rollout(seed=3)
    with torch.no_grad():
        lp, _ = sequence_logprobs(model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask, 0.9)
    old = lp + 0.3 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(0))
    ref, m_ref = _grads(model, params, ro, adv, "bnpo", False, 4, old=old)
    got, m = _grads(model, params, ro, adv, "bnpo", True, 4, budget=300, old=old)
    assert m_ref["clip_ratio/region_mean"] > 0.05  # the clipping is exercised
    assert float((got - ref).norm() / ref.norm()) < 1e-5
    assert m["clip_ratio/region_mean"] == pytest.approx(m_ref["clip_ratio/region_mean"], rel=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_packed_varlen_on_gpu_equals_padded_sdpa(model_type):
    """CUDA, bf16: the packed forward (torch's FlashAttention varlen, GQA) against the padded SDPA forward,
    log-probs and the gradient of their sum w.r.t. the embeddings (bf16 tolerances)."""
    model = make_tiny_model(model_type, dtype=torch.bfloat16).cuda()
    torch.manual_seed(2)
    p_ids, p_mask = left_pad([[5, 6, 7, 8, 9] * 9, [10, 11], [12, 13, 14] * 30], 0, "cuda")
    lengths = torch.tensor([140, 3, 77], device="cuda")
    c_mask = (torch.arange(140, device="cuda")[None] < lengths[:, None]).long()
    c_ids = torch.randint(3, 200, (3, 140), device="cuda") * c_mask
    emb = model.get_input_embeddings().weight
    emb.requires_grad_(True)
    out = []
    for packed in (True, False):
        emb.grad = None
        lp, _ = sequence_logprobs(model, p_ids, p_mask, c_ids, c_mask, 1.0, packed=packed)
        (lp * c_mask).sum().backward()
        out.append((lp.detach(), emb.grad.float().clone()))
    m = c_mask.bool()
    torch.testing.assert_close(out[0][0][m], out[1][0][m], atol=0.05, rtol=0.02)
    rel = float((out[0][1] - out[1][1]).norm() / out[1][1].norm())
    assert rel < 0.03, rel


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", ["nvfp4", "bf16"])
def test_recompute_modes_give_the_same_lora_gradients_on_gpu(fmt):
    """CUDA, bf16, the fused LoRA path: off, selective and full recomputation of a packed forward give the
    same LoRA gradients (full: bitwise; selective keeps outputs it would otherwise recompute: bitwise too)."""
    from qerl import recompute
    from qerl.quantize import QuantizeConfig, lora_parameters, quantize_

    grads = {}
    p_ids, p_mask = left_pad([[5, 6, 7, 8, 9] * 9, [10, 11], [12, 13, 14] * 30], 0, "cuda")
    lengths = torch.tensor([140, 3, 77], device="cuda")
    c_mask = (torch.arange(140, device="cuda")[None] < lengths[:, None]).long()
    c_ids = torch.randint(3, 200, (3, 140), device="cuda", generator=torch.Generator("cuda").manual_seed(0)) * c_mask
    for mode in recompute.MODES:
        model = make_tiny_model("qwen2", dtype=torch.bfloat16, hidden_size=256, intermediate_size=512).cuda()
        quantize_(model, QuantizeConfig(fmt=fmt, lora_rank=16, lora_alpha=32))
        params = lora_parameters(model)
        torch.manual_seed(0)
        with torch.no_grad():
            for p in params:
                p.normal_(0, 0.02)
        recompute.enable(model, mode)
        model.train()
        lp, _ = sequence_logprobs(model, p_ids, p_mask, c_ids, c_mask, 1.0)
        (lp * c_mask).sum().backward()
        grads[mode] = torch.cat([p.grad.flatten() for p in params])
    assert grads["off"].norm() > 0
    for mode in ("selective", "full"):
        assert float((grads[mode] - grads["off"]).norm() / grads["off"].norm()) < 1e-6, mode
