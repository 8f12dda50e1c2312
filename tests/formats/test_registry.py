"""The format registry: a format defined in this file alone runs through all of qerl.

"toy4" (symmetric 4-bit integers, one fp32 step per block of 8, two codes per byte, low nibble
first) is registered here and nowhere in qerl; quantize_, QuantLinear's reference forward and
backward, the kernel dispatch, export_compressed_tensors, the streaming `quantize` CLI and the
checkpoint round trip must all work with it, because each asks the registry.
"""

import copy
import json

import pytest
import torch
from safetensors.torch import load_file

from qerl import formats, kernels
from qerl.export import export_compressed_tensors, load_quantized_state, quantization_config
from qerl.formats.registry import FormatSpec
from qerl.quantize import QuantizeConfig, lora_parameters, quantize_

BLOCK = 8


def _shapes(out_f, in_f):
    return {"weight_packed": ((out_f, in_f // 2), torch.uint8),
            "weight_step": ((out_f, in_f // BLOCK), torch.float32)}


def _quantize(w, global_scale=None):
    assert global_scale is None
    out_f, in_f = w.shape
    blocks = w.float().reshape(out_f, in_f // BLOCK, BLOCK)
    step = blocks.abs().amax(-1).clamp(min=1e-12) / 7
    codes = (torch.round(blocks / step.unsqueeze(-1)).clamp(-7, 7) + 8).to(torch.uint8).reshape(out_f, in_f)
    return {"weight_packed": codes[:, 0::2] | (codes[:, 1::2] << 4), "weight_step": step}


def _dequantize(t, dtype=torch.bfloat16):
    packed, step = t["weight_packed"], t["weight_step"]
    codes = torch.stack((packed & 0xF, packed >> 4), -1).flatten(-2).float() - 8
    out_f, in_f = codes.shape
    return (codes.reshape(out_f, -1, BLOCK) * step.unsqueeze(-1)).reshape(out_f, in_f).to(dtype)


TOY = FormatSpec(
    name="toy4", block_size=BLOCK, bits_per_weight=4 + 32 / BLOCK, code="int4", scale_kind="step",
    tensor_names=("weight_packed", "weight_step"), packed_shapes=_shapes,
    quantize=_quantize, dequantize=_dequantize,
    export_config=lambda targets, ignore: {"quant_method": "toy", "format": "toy4",
                                           "targets": list(targets), "ignore": list(ignore)},
)


@pytest.fixture
def toy():
    formats.register(TOY)
    try:
        yield "toy4"
    finally:
        formats.unregister("toy4")


def test_builtin_formats_are_registered_with_consistent_specs():
    assert formats.names()[:3] == ("nvfp4", "mxfp4", "nf4")
    for fmt in formats.names():
        spec = formats.get(fmt)
        w = torch.randn(4 * spec.block_size, 2 * spec.block_size)
        tensors = formats.quantize(w, fmt)
        shapes = formats.packed_shapes(fmt, *w.shape)
        assert tuple(tensors) == spec.tensor_names == tuple(shapes)
        for name, t in tensors.items():
            assert (tuple(t.shape), t.dtype) == shapes[name], (fmt, name)
    assert formats.with_kernel("triton") == ("nvfp4", "mxfp4")
    assert formats.with_kernel("bitsandbytes") == ("nf4",)


def test_registry_errors(toy):
    with pytest.raises(ValueError, match="already registered"):
        formats.register(TOY)
    with pytest.raises(ValueError, match="unknown format 'int3'.*toy4"):
        formats.get("int3")
    with pytest.raises(ValueError, match="tensor_names"):
        FormatSpec(name="bad", block_size=8, bits_per_weight=5.0, tensor_names=("weight_step",),
                   packed_shapes=_shapes, quantize=_quantize, dequantize=_dequantize,
                   export_config=TOY.export_config)
    with pytest.raises(ValueError, match="unknown kernels"):
        FormatSpec(**{**TOY.__dict__, "name": "bad", "kernels": ("cutlass",), "check_shape": None})


def test_toy_format_quantizes_and_runs_forward_backward(toy, tiny_llama):
    w = torch.randn(32, 64)
    t = formats.quantize(w, toy)
    assert formats.sqnr_db(w, formats.dequantize(t, toy, torch.float32)) > 15
    with pytest.raises(ValueError, match="toy4 needs in_features % 8"):
        formats.check_shape((32, 60), toy)

    model = tiny_llama.float()
    dense = copy.deepcopy(model)
    report = quantize_(model, QuantizeConfig(toy, lora_rank=4, lora_alpha=8, backend="reference"))
    assert report["num_quantized"] == 14
    q = model.model.layers[0].self_attn.q_proj
    assert set(dict(q.named_buffers())) == {"weight_packed", "weight_step"}
    # The dense model with the dequantized weights computes the same logits (LoRA B starts at 0).
    with torch.no_grad():
        dense_modules = dict(dense.named_modules())
        for name, m in model.named_modules():
            if getattr(m, "fmt", None) == toy:
                dense_modules[name].weight.copy_(m.dequantized_weight(torch.float32))
    ids = torch.randint(3, 256, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, dense(ids).logits, rtol=1e-4, atol=1e-4)
    params = lora_parameters(model)
    model(ids).logits.float().pow(2).mean().backward()
    assert all(p.grad is not None for p in params)
    assert any(float(p.grad.abs().max()) > 0 for p in params)
    # The gradient of the input goes through the reference grad_input with the toy weight.
    x = torch.randn(3, q.in_features, requires_grad=True)
    with q.disable_adapters():
        q(x).sum().backward()
    w = q.dequantized_weight(torch.float32)
    torch.testing.assert_close(x.grad, torch.ones(3, q.out_features) @ w, rtol=1e-5, atol=1e-5)
    # The dispatcher knows toy4 has no fast kernel and says so.
    with pytest.raises(RuntimeError, match="toy4"):
        kernels.linear(x.detach(), toy, q.packed_tensors(), q.out_features, q.in_features, backend="triton")


def test_toy_format_checkpoint_round_trip(toy, tiny_llama, tiny_llama_dir, tmp_path):
    from qerl.cli import main

    model = tiny_llama
    fresh = copy.deepcopy(model)
    with torch.no_grad():
        for p in fresh.parameters():
            p.normal_()
    quantize_(model, QuantizeConfig(toy, lora_rank=4, backend="reference"))
    summary = export_compressed_tensors(model, tmp_path / "exported")
    assert summary["format"] == toy and summary["num_quantized"] == 14
    cfg = json.loads((tmp_path / "exported" / "config.json").read_text())
    assert cfg["quantization_config"] == quantization_config(toy)
    state = load_quantized_state(tmp_path / "exported")
    assert {k.rsplit(".", 1)[1] for k in state if ".layers." in k and "proj" in k} == {"weight_packed", "weight_step"}

    # Load the checkpoint into a fresh quantized skeleton: same buffers, same logits.
    quantize_(fresh, QuantizeConfig(toy, lora_rank=4, backend="reference"))
    missing, unexpected = fresh.load_state_dict(state, strict=False)
    assert not unexpected and all(".lora_" in k for k in missing)
    ids = torch.randint(3, 256, (1, 10))
    with torch.no_grad():
        torch.testing.assert_close(fresh(ids).logits, model(ids).logits, rtol=0, atol=0)

    # The streaming CLI writes the same format from an HF folder.
    assert main(["quantize", "--model", str(tiny_llama_dir), "--format", toy, "--out", str(tmp_path / "cli"),
                 "--no-progress"]) == 0
    streamed = load_quantized_state(tmp_path / "cli")
    source = load_file(str(tiny_llama_dir / "model.safetensors"))
    key = "model.layers.1.mlp.down_proj"
    expected = formats.quantize(source[key + ".weight"], toy)
    for name in TOY.tensor_names:
        torch.testing.assert_close(streamed[f"{key}.{name}"], expected[name], rtol=0, atol=0)
