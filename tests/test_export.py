"""Tests for qerl.export and the `python -m qerl quantize` CLI on tiny random Llama/Qwen2 folders.

Checks tensor names, dtypes and shapes, the shared fused-group NVFP4 global scale, round trips
through our dequantization AND through compressed-tensors itself (its compressors, and
transformers loading the checkpoint), PEFT adapters reloaded by peft, and the error paths.

Run: .venv/bin/python -m pytest tests/test_export.py -q
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from qerl import formats
from qerl.cli import main
from qerl.export import (
    FUSED_GROUPS,
    LINEAR_NAMES,
    export_compressed_tensors,
    export_peft_adapter,
    load_quantized_state,
    quantization_config,
    quantize_checkpoint,
)

ROOT = Path(__file__).resolve().parents[1]


def _source_state(folder):
    with safe_open(str(Path(folder) / "model.safetensors"), framework="pt") as h:
        return {k: h.get_tensor(k) for k in h.keys()}


def _module_tensors(state, module):
    return {k[len(module) + 1:]: v for k, v in state.items() if k.startswith(module + ".weight_")}


def _quantized_modules(src_state):
    return sorted(k[: -len(".weight")] for k in src_state
                  if k.endswith(".weight") and k.split(".")[-2] in LINEAR_NAMES)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "nf4"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_cli_writes_named_packed_tensors_that_round_trip(arch, fmt, request, tmp_path, capsys):
    src = request.getfixturevalue(f"tiny_{arch}_dir")
    out = tmp_path / "out"
    assert main(["quantize", "--model", str(src), "--format", fmt, "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["num_quantized"] == 14 and summary["format"] == fmt

    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors",
              "generation_config.json"):
        assert (out / f).is_file(), f
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"] == quantization_config(fmt)
    assert cfg["model_type"] == arch and cfg["dtype"] == "bfloat16"

    src_state, state = _source_state(src), load_quantized_state(out)
    modules = _quantized_modules(src_state)
    assert len(modules) == 14
    expected = {f"{m}.{n}" for m in modules for n in formats.get(fmt).tensor_names}
    expected |= {k for k in src_state if k[: -len(".weight")] not in modules}
    if arch == "qwen2":  # tied embeddings: lm_head is stored once, as the embedding
        assert "lm_head.weight" not in src_state
    assert set(state) == expected

    for name, t in state.items():
        module = name.rsplit(".", 1)[0]
        if module not in modules:  # embeddings, norms, biases, lm_head: bf16 and unchanged
            assert t.dtype == torch.bfloat16 and torch.equal(t, src_state[name]), name
    for module in modules:
        w = src_state[module + ".weight"]
        out_f, in_f = w.shape
        tensors = _module_tensors(state, module)
        assert tensors["weight_packed"].dtype == torch.uint8
        assert tensors["weight_packed"].shape == (out_f, in_f // 2)
        if fmt == "nvfp4":
            assert tensors["weight_scale"].dtype == torch.float8_e4m3fn
            assert tensors["weight_scale"].shape == (out_f, in_f // 16)
            assert tensors["weight_global_scale"].dtype == torch.float32
            assert tensors["weight_global_scale"].shape == (1,)
        elif fmt == "mxfp4":
            assert tensors["weight_scale"].dtype == torch.uint8
            assert tensors["weight_scale"].shape == (out_f, in_f // 32)
        else:
            assert tensors["weight_absmax"].dtype == torch.float32
            assert tensors["weight_absmax"].shape == (out_f * in_f // 64,)
        w_hat = formats.dequantize(tensors, fmt, dtype=torch.float32)
        assert formats.sqnr_db(w.float(), w_hat) > 15  # 4-bit on Gaussian weights: ~18-21 dB


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_nvfp4_fused_groups_share_the_max_global_scale(arch, request, tmp_path):
    src = request.getfixturevalue(f"tiny_{arch}_dir")
    quantize_checkpoint(src, tmp_path / "out", "nvfp4", progress=False)
    src_state, state = _source_state(src), load_quantized_state(tmp_path / "out")
    for layer in range(2):
        for group in tuple(g for _, g in FUSED_GROUPS) + (("o_proj",), ("down_proj",)):
            parent = "self_attn" if group[0] in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            names = [f"model.layers.{layer}.{parent}.{p}" for p in group]
            amax = max(src_state[n + ".weight"].abs().max() for n in names)
            expected = formats.nvfp4_global_scale(amax)
            for n in names:
                gs = state[n + ".weight_global_scale"]
                assert torch.equal(gs, expected), n
                # 448 * 6 / amax of the whole group, computed in the weight dtype (bf16) as
                # compressed-tensors does: within one bf16 ulp of the exact quotient
                assert gs.item() == pytest.approx(448 * 6 / amax.item(), rel=2 ** -7), n
                # and the packed bytes are exactly what quantize() gives with that shared scale
                again = formats.quantize(src_state[n + ".weight"], "nvfp4",
                                         global_scale=state[n + ".weight_global_scale"])
                assert torch.equal(again["weight_packed"], state[n + ".weight_packed"])


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_compressed_tensors_decompresses_every_layer_to_our_values(fmt, tiny_qwen2_dir, tmp_path):
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme

    quantize_checkpoint(tiny_qwen2_dir, tmp_path / "out", fmt, progress=False)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    qc = QuantizationConfig.model_validate(cfg)  # the config parses as compressed-tensors'
    assert qc.format == f"{fmt}-pack-quantized"
    group = qc.config_groups["group_0"]
    scheme = QuantizationScheme(targets=["Linear"], weights=group.weights)
    compressor = NVFP4PackedCompressor if fmt == "nvfp4" else MXFP4PackedCompressor
    state = load_quantized_state(tmp_path / "out")
    modules = {k.rsplit(".", 1)[0] for k in state if k.endswith(".weight_packed")}
    assert len(modules) == 14
    for module in modules:
        tensors = _module_tensors(state, module)
        theirs = compressor.decompress(dict(tensors), scheme)["weight"]  # bf16, as vLLM uses
        ours = formats.dequantize(tensors, fmt, dtype=theirs.dtype)
        assert theirs.dtype == torch.bfloat16 and torch.equal(theirs, ours), module


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_transformers_loads_the_checkpoint_through_compressed_tensors(fmt, tiny_qwen2_dir, tmp_path):
    """What a consumer sees: transformers + compressed-tensors decompress our files exactly."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    out = tmp_path / "out"
    quantize_checkpoint(tiny_qwen2_dir, out, fmt, progress=False)
    state = load_quantized_state(out)
    dense = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, mod in dense.named_modules():
            if name + ".weight_packed" in state:
                mod.weight.copy_(formats.dequantize(_module_tensors(state, name), fmt))
    theirs = AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.bfloat16, quantization_config=CompressedTensorsConfig(run_compressed=False))
    sd = theirs.state_dict()
    for k, v in dense.state_dict().items():
        assert torch.equal(sd[k], v), k
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        assert torch.equal(theirs(ids).logits, dense(ids).logits)


def test_sharded_source_and_sharded_output(tiny_llama, tiny_tokenizer, tmp_path):
    src = tmp_path / "src"
    tiny_llama.save_pretrained(src, max_shard_size="60KB")
    tiny_tokenizer.save_pretrained(src)
    assert (src / "model.safetensors.index.json").is_file()
    one = quantize_checkpoint(src, tmp_path / "one", "nvfp4", progress=False)
    many = quantize_checkpoint(src, tmp_path / "many", "nvfp4", progress=False,
                               max_shard_bytes=20_000)
    shards = sorted((tmp_path / "many").glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and one["bytes"] == many["bytes"]
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    a, b = load_quantized_state(tmp_path / "one"), load_quantized_state(tmp_path / "many")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_cli_entry_point_shows_progress(tiny_llama_dir, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "qerl", "quantize", "--model", str(tiny_llama_dir),
                           "--format", "nvfp4", "--out", str(tmp_path / "o")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "quantize nvfp4" in proc.stderr and "3/3" in proc.stderr  # tqdm: header + 2 layers
    assert json.loads(proc.stdout.strip().splitlines()[-1])["num_quantized"] == 14


def test_cli_errors(tmp_path, tiny_config, capsys):
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    assert main(["quantize", "--model", str(tmp_path / "nope"), "--format", "nvfp4",
                 "--out", str(tmp_path / "o1")]) == 2
    assert "no such model folder" in capsys.readouterr().err

    gpt2 = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(gpt2)
    assert main(["quantize", "--model", str(gpt2), "--format", "nvfp4", "--out", str(tmp_path / "o2")]) == 2
    err = capsys.readouterr().err
    assert "unsupported architecture model_type='gpt2'" in err and "llama, qwen2, qwen3" in err

    odd = tmp_path / "odd"  # hidden 72: 72 % 16 != 0, so no q/k/v/o/gate/up weight fits nvfp4
    AutoModelForCausalLM.from_config(tiny_config("llama", hidden_size=72, num_attention_heads=4,
                                                 num_key_value_heads=2)).save_pretrained(odd)
    with pytest.raises(ValueError, match="block size 16"):
        quantize_checkpoint(odd, tmp_path / "o3", "nvfp4", progress=False)
    assert not (tmp_path / "o3").exists()  # shapes are checked before anything is written

    with pytest.raises(SystemExit):  # argparse rejects a format outside the choices
        main(["quantize", "--model", str(odd), "--format", "int4", "--out", str(tmp_path / "o4")])


def test_refuses_to_overwrite_a_checkpoint(tiny_llama_dir, tmp_path):
    quantize_checkpoint(tiny_llama_dir, tmp_path / "o", "nf4", progress=False)
    with pytest.raises(FileExistsError):
        quantize_checkpoint(tiny_llama_dir, tmp_path / "o", "nf4", progress=False)
    with pytest.raises(ValueError, match="must differ"):
        quantize_checkpoint(tiny_llama_dir, tiny_llama_dir, "nf4", progress=False)


def _snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*"))}


@pytest.mark.parametrize("command", ["quantize", "export"])
def test_out_into_a_folder_that_holds_files_changes_nothing(capsys, tmp_path, monkeypatch, command):
    """`quantize --out` / `export --out` into a folder holding a training run: exit 2, one error line, before
    anything loads, and the folder is byte for byte as it was."""
    import qerl.export
    import qerl.trained

    run = tmp_path / "runs" / "mine"
    (run / "checkpoints" / "step-2").mkdir(parents=True)
    (run / "config.json").write_text('{"method": "nvfp4_lora"}')
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "checkpoints" / "step-2" / "trainable.safetensors").write_bytes(b"\0" * 64)
    before = _snapshot(run)

    def nothing_loads(*a, **k):
        raise AssertionError("loaded before the --out check")

    monkeypatch.setattr(qerl.export, "_source_folder", nothing_loads)
    monkeypatch.setattr(qerl.trained, "load_trained", nothing_loads)
    argv = (["quantize", "--model", "any", "--format", "nvfp4"] if command == "quantize"
            else ["export", "--adapter", str(run / "checkpoints" / "step-2")])
    rc = main([*argv, "--out", str(run)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("error:") == 1 and "Traceback" not in err, err
    assert f"--out {run} is not empty" in err and "config.json" in err
    assert _snapshot(run) == before


# ---------------------------------------------------------------------------------------------
# In-memory models (qerl.quantize.quantize_)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "nf4"])
def test_export_of_quantized_model_equals_the_streaming_cli(fmt, tiny_qwen2, tiny_tokenizer, tmp_path):
    from qerl.quantize import QuantizeConfig, quantize_

    src = tmp_path / "src"
    tiny_qwen2.save_pretrained(src)
    quantize_checkpoint(src, tmp_path / "cli", fmt, progress=False)
    quantize_(tiny_qwen2, QuantizeConfig(fmt=fmt, lora_rank=4))  # B = 0: nothing to merge
    info = export_compressed_tensors(tiny_qwen2, tmp_path / "mem", tokenizer=tiny_tokenizer)
    assert info["format"] == fmt and info["num_quantized"] == 14
    a, b = load_quantized_state(tmp_path / "cli"), load_quantized_state(tmp_path / "mem")
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    cfg = json.loads((tmp_path / "mem" / "config.json").read_text())
    assert cfg["quantization_config"] == quantization_config(fmt)
    assert (tmp_path / "mem" / "tokenizer.json").is_file()


def _with_random_lora(model, seed=1):
    from qerl.qlinear import QuantLinear

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, QuantLinear) and m.r:
                m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=g) * 0.05)
    return model


def test_live_lora_is_refused_or_merged(tiny_llama, tmp_path):
    from qerl.qlinear import QuantLinear
    from qerl.quantize import QuantizeConfig, quantize_

    quantize_(tiny_llama, QuantizeConfig(fmt="nvfp4", lora_rank=4, lora_alpha=8))
    _with_random_lora(tiny_llama)
    with pytest.raises(ValueError, match="export_peft_adapter"):
        export_compressed_tensors(tiny_llama, tmp_path / "a")
    export_compressed_tensors(tiny_llama, tmp_path / "b", merge_lora=True)
    state = load_quantized_state(tmp_path / "b")
    assert not any(".lora_" in k for k in state)
    q = tiny_llama.model.layers[0].self_attn.q_proj
    assert isinstance(q, QuantLinear)
    with torch.no_grad():
        merged = q.dequantized_weight(torch.float32) + q.scaling * (q.lora_B.weight @ q.lora_A.weight)
    got = formats.dequantize(_module_tensors(state, "model.layers.0.self_attn.q_proj"), "nvfp4",
                             dtype=torch.float32)
    assert formats.sqnr_db(merged, got) > 15
    gs = {state[f"model.layers.0.self_attn.{p}_proj.weight_global_scale"].item() for p in "qkv"}
    assert len(gs) == 1  # requantized with one shared scale again


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_peft_adapter_reproduces_our_logits(arch, request, tmp_path):
    from peft import PeftModel

    from qerl.quantize import QuantizeConfig, quantize_

    model = request.getfixturevalue(f"tiny_{arch}")
    base_dir = tmp_path / "base"
    model.save_pretrained(base_dir)
    quantize_(model, QuantizeConfig(fmt="bf16", lora_rank=4, lora_alpha=8))
    _with_random_lora(model)
    info = export_peft_adapter(model, tmp_path / "adapter", str(base_dir))
    assert info["num_modules"] == 14 and info["target_modules"] == sorted(LINEAR_NAMES)
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (cfg["r"], cfg["lora_alpha"], cfg["peft_type"]) == (4, 8, "LORA")

    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.bfloat16)
    peft_model = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    ids = torch.randint(0, 256, (2, 11))
    with torch.no_grad():
        ours = model(ids).logits
        theirs = peft_model(ids).logits
        with peft_model.disable_adapter():
            plain = peft_model(ids).logits
    effect = (ours.float() - plain.float()).abs().max()
    gap = (ours.float() - theirs.float()).abs().max()
    assert effect > 0.05  # the adapter matters...
    if arch == "llama":
        assert torch.equal(ours, theirs)  # ...and PEFT applies it exactly as we do
    else:
        # Qwen2's q/k/v biases: QuantLinear's bf16 path adds the bias after F.linear (one more
        # bf16 rounding than nn.Linear), so agreement is to bf16 rounding, not bit-exact.
        assert gap < 0.1 * effect, (gap, effect)


def test_peft_adapter_with_a_subset_of_targets(tiny_llama, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from qerl.quantize import QuantizeConfig, quantize_

    tiny_llama.save_pretrained(tmp_path / "base")
    quantize_(tiny_llama, QuantizeConfig(fmt="bf16", lora_rank=2, lora_alpha=2,
                                         targets=("q_proj", "v_proj")))
    _with_random_lora(tiny_llama)
    info = export_peft_adapter(tiny_llama, tmp_path / "adapter", str(tmp_path / "base"))
    assert info["target_modules"] == ["q_proj", "v_proj"]
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.bfloat16)
    peft_model = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    ids = torch.randint(0, 256, (1, 5))
    with torch.no_grad():
        assert torch.equal(tiny_llama(ids).logits, peft_model(ids).logits)
