"""Shared pytest fixtures: the embedded SmolLM2 model and tiny random Llama / Qwen2 models.

    smollm2          (session) (model, tokenizer) of the embedded default, bf16, CPU. The first
                     run converts the GGUF into $QERL_CACHE (~/.cache/qerl), ~20-40 s; later
                     runs load the cached safetensors in ~2 s.
    tiny_config      factory: tiny_config("llama" | "qwen2" | "qwen3", **overrides) -> config
                     (hidden 64, intermediate 128, 2 layers, 4 heads / 2 kv heads, vocab 256)
    tiny_llama       fresh random LlamaForCausalLM (bf16, seeded, untied lm_head)
    tiny_qwen2       fresh random Qwen2ForCausalLM (bf16, seeded, q/k/v biases, tied lm_head)
    tiny_tokenizer   a 256-token word-level fast tokenizer with a chat template
    tiny_llama_dir / tiny_qwen2_dir   those models saved with save_pretrained (+ tokenizer)

Run everything with: .venv/bin/python -m pytest tests -q
"""

import os

import pytest
import torch

# Triton reads TRITON_INTERPRET when a kernel module is imported: set it here, in the conftest that
# pytest loads first, so the kernel tests run in the interpreter on machines without CUDA.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# pytest-xdist workers (make test: -n 2) share the cores: each worker takes its share as torch threads,
# and the processes its tests start inherit it through OMP_NUM_THREADS. torch's default, a thread per core
# in every worker, oversubscribes the CPU (OpenMP threads spin while they wait: several times slower).
# An OMP_NUM_THREADS set by the caller wins.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    os.environ["OMP_NUM_THREADS"] = str(max(1, _cores // _WORKERS))
    torch.set_num_threads(max(1, _cores // _WORKERS))

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=128,
            rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def make_tiny_config(model_type: str = "llama", **overrides):
    """A tiny config of `model_type`; Qwen2 ties its embeddings as Qwen2.5-0.5B/3B do."""
    from transformers import AutoConfig

    values = dict(TINY, tie_word_embeddings=(model_type == "qwen2"))
    if model_type == "qwen3":
        values["head_dim"] = 16
    values.update(overrides)
    return AutoConfig.for_model(model_type, **values)


def make_tiny_model(model_type: str = "llama", seed: int = 0, dtype=torch.bfloat16, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    # dtype at construction (not .to(dtype) afterwards) keeps the rotary inv_freq in fp32, as
    # from_pretrained does, so a saved-and-reloaded tiny model computes the same logits.
    model = AutoModelForCausalLM.from_config(make_tiny_config(model_type, **overrides), dtype=dtype)
    if model_type == "qwen2":  # random non-zero biases, so that exporting them is tested
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.02)
    return model.eval()


def make_tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<|im_start|>", "<|im_end|>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    for i in range(256 - len(specials)):
        vocab[f"w{i}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<|im_start|>", eos_token="<|im_end|>",
        unk_token="<unk>",
        chat_template="{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}"
                      "<|im_end|>{% endfor %}{% if add_generation_prompt %}<|im_start|>"
                      "assistant{% endif %}")


@pytest.hookimpl(trylast=True)  # after -m has deselected
def pytest_collection_modifyitems(config, items):
    """Test files in the order pytest-xdist's workers take them (make test: --dist loadfile
    --no-loadscope-reorder): files holding a `slow` test first, then the files with more tests first (xdist's
    own order), so that no long file starts last while the other worker has nothing left. A file's tests
    keep their order."""
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::", 1)[0], []).append(item)

    def key(name):
        return (not any(item.get_closest_marker("slow") for item in files[name]), -len(files[name]))

    items[:] = [item for name in sorted(files, key=key) for item in files[name]]


@pytest.fixture(scope="session")
def smollm2():
    from qerl.models import DEFAULT_MODEL, load_model

    return load_model(DEFAULT_MODEL, dtype=torch.bfloat16)


@pytest.fixture
def tiny_config():
    return make_tiny_config


@pytest.fixture
def tiny_llama():
    return make_tiny_model("llama")


@pytest.fixture
def tiny_qwen2():
    return make_tiny_model("qwen2")


@pytest.fixture
def tiny_tokenizer():
    return make_tiny_tokenizer()


def _saved(tmp_path_factory, model_type):
    path = tmp_path_factory.mktemp(f"tiny_{model_type}")
    make_tiny_model(model_type).save_pretrained(path)
    make_tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture
def tiny_llama_dir(tmp_path_factory):
    return _saved(tmp_path_factory, "llama")


@pytest.fixture
def tiny_qwen2_dir(tmp_path_factory):
    return _saved(tmp_path_factory, "qwen2")


# ---------------------------------------------------------------------------------- greedy decodes
def assert_greedy_close(a, b, tol: float):
    """Two greedy decodes of the same prompts (RolloutOutput-like: completion_ids, completion_mask,
    logprobs of the chosen tokens) by two computation paths of one model agree up to rounding.

    Not "the same tokens": in bf16 two paths that differ only in rounding may break a near tie
    differently, and a row then continues differently. What is deterministic: on each row's common
    prefix the chosen tokens' log-probs differ by < tol, and where a row parts, both chosen tokens
    (each path's argmax) have log-probs within tol of each other: a near tie, not a different
    distribution. Returns the per-row common-prefix lengths.
    """
    prefixes = []
    for r, n, p, pa, pb, ia, ib in _greedy_rows(a, b):
        if p:
            d = float((pa[:p] - pb[:p]).abs().max())
            assert d < tol, f"row {r}: chosen-token log-probs differ by {d:.4f} on the common prefix ({p} tokens; tol {tol})"
        if p < n:
            gap = abs(float(pa[p] - pb[p]))
            assert gap < tol, (f"row {r} parts at token {p} (ids {int(ia[p])} vs {int(ib[p])}) with log-probs "
                               f"{float(pa[p]):.4f} vs {float(pb[p]):.4f}: not a near tie (tol {tol})")
        prefixes.append(p)
    return torch.tensor(prefixes)


def greedy_drift(a, b) -> float:
    """How far two greedy decodes of the same prompts drift apart: the smallest ``tol`` that
    assert_greedy_close(a, b, tol) accepts (the largest chosen-token log-prob difference on a row's
    common prefix, or between the two chosen tokens where a row parts). Tests measure it between two
    known-valid paths in the same run and bound a third path by it, instead of a fixed number for bf16
    rounding that any valid reordering of a reduction can cross."""
    worst = 0.0
    for _, n, p, pa, pb, _, _ in _greedy_rows(a, b):
        if p:
            worst = max(worst, float((pa[:p] - pb[:p]).abs().max()))
        if p < n:
            worst = max(worst, abs(float(pa[p] - pb[p])))
    return worst


def _greedy_rows(a, b):
    """Per row of two greedy decodes: (row, common length, common-prefix length, the two rows' chosen-token
    log-probs and ids on the CPU)."""
    la, lb = a.completion_mask.sum(1), b.completion_mask.sum(1)
    for r in range(a.completion_ids.shape[0]):
        n = int(min(la[r], lb[r]))
        ia, ib = a.completion_ids[r, :n].cpu(), b.completion_ids[r, :n].cpu()
        p = int((ia == ib).long().cumprod(0).sum())
        yield r, n, p, a.logprobs[r].float().cpu(), b.logprobs[r].float().cpu(), ia, ib


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_token_id=None):
    """HF generate's greedy decode of one prompt as (completion_ids, completion_mask, logprobs) [1, T],
    the log-probs of its chosen tokens from its own logits (for assert_greedy_close)."""
    from types import SimpleNamespace

    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids], device=device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, eos_token_id=eos_token_id)
    comp = out.sequences[:, len(prompt_ids):]
    logits = torch.stack(out.logits, 1).float()
    lp = torch.log_softmax(logits, -1).gather(-1, comp[..., None]).squeeze(-1)
    return SimpleNamespace(completion_ids=comp, completion_mask=torch.ones_like(comp), logprobs=lp)


@pytest.fixture
def greedy_close():
    return assert_greedy_close


@pytest.fixture
def text_rewards(monkeypatch):
    """Reward a hash of the completion text, so that a random tiny model (which never solves
    arithmetic) still gets advantages that are not all zero."""
    import zlib

    from qerl import rewards as qrewards

    def fake(completions, golds, **kw):
        r = [float(zlib.crc32(c.encode()) % 2) for c in completions]
        return qrewards.RewardResult(rewards=r, format=[0.0] * len(r), unparsed=0, sources=["none"] * len(r))

    monkeypatch.setattr(qrewards, "score_batch", fake)
