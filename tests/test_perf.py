"""qerl.perf: the model FLOPs behind Table 3's MFU and the trainer's perf/* metrics, counted by hand on a
tiny model, and the GPU peak table.

Run: python -m pytest tests/test_perf.py -q
"""

import importlib.util
from pathlib import Path

import pytest
import torch

from qerl import perf
from qerl.quantize import QuantizeConfig, quantize_

_spec = importlib.util.spec_from_file_location("_qerl_tests_conftest", Path(__file__).with_name("conftest.py"))
_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_conftest)


def test_peak_table_by_device_name():
    assert perf.peak_tflops("NVIDIA H200") == 989.0 and perf.peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert perf.peak_tflops("NVIDIA H100 PCIe") == 756.0 and perf.peak_tflops("NVIDIA GH200 480GB") == 989.0
    assert perf.peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0 and perf.peak_tflops("Some GPU") is None
    assert perf.mfu(989e12, 1.0, 989.0) == pytest.approx(1.0) and perf.mfu(1.0, 1.0, None) is None


def test_flops_of_a_tiny_model_counted_by_hand():
    model = _conftest.make_tiny_model("llama", dtype=torch.float32)  # hidden 64, inter 128, 2 layers, 4 / 2 heads
    quantize_(model, QuantizeConfig(fmt="nvfp4", lora_rank=4, lora_alpha=8))
    c = perf.FlopCounter(model)
    H, F, L, kv = 64, 128, 2, 32  # hidden, intermediate, layers, k / v width (2 kv heads of 16)
    assert c.frozen == L * (H * H + 2 * H * kv + H * H + 3 * H * F)
    assert c.trained == L * 4 * ((H + H) * 2 + (H + kv) * 2 + (H + F) * 2 + (F + H))  # r (in + out) each
    assert c.head == 256 * H and c.d_attn == H and c.layers == L
    lengths, n_logits = [3, 5], 4
    attn = 4 * H * (6 + 15) * L  # pairs: 3 * 4 / 2 + 5 * 6 / 2
    assert c.attention(lengths) == attn
    assert c.forward(lengths, n_logits) == 2 * (c.frozen + c.trained) * 8 + attn + 2 * c.head * n_logits
    assert c.backward(lengths, n_logits) == 2 * c.frozen * 8 + 4 * c.trained * 8 + 2.5 * attn + 2 * c.head * n_logits
    pm, cm = torch.tensor([[0, 1, 1], [1, 1, 1]]), torch.tensor([[1, 0], [1, 1]])
    fl = perf.training_flops(model, pm, cm, n_forwards=1, n_updates=1, recompute=True)
    rows = [3, 5]  # 2 + 1, 3 + 2 tokens; 3 completion tokens
    fwd, bwd = c.forward(rows, 3), c.backward(rows, 3)
    assert fl["real_tokens"] == 8 and fl["flops"] == 2 * fwd + bwd and fl["hardware_flops"] == 3 * fwd + bwd
