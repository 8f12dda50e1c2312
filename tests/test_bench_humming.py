"""benchmarks/bench_kernels.py's optional humming-kernels column on the CPU: skipped cleanly where
humming is not importable, its summary keys (humming time / qerl time), the NVRTC library-path
helper, and (only where humming is installed) that humming reads qerl's NVFP4 tensors as they are."""

import os
import sys

import pytest
import torch

from benchmarks import bench_kernels as bk
from benchmarks import humming as humming_setup
from qerl import formats
from qerl.arch import LINEAR_NAMES, linear_shapes


def layer_rows(ms, times):
    """Rows for the seven qwen2.5-7b linears at each M: {method: ms per linear}."""
    rows = []
    for m in ms:
        for p in LINEAR_NAMES:
            n, k = linear_shapes("qwen2.5-7b")[p]
            for meth, t in times.items():
                rows.append(dict(model="qwen2.5-7b", proj=p, N=n, K=k, M=m, op="linear", method=meth, ms=t))
    return rows


def test_humming_absent_is_skipped_with_a_note(monkeypatch):
    monkeypatch.setitem(sys.modules, "humming", None)  # import humming -> ImportError
    hum, why = bk.load_humming()
    assert hum is None
    assert why.startswith("humming-kernels not importable: ModuleNotFoundError")
    s = bk.summarize(layer_rows([1, 16], {"nvfp4": 0.01, "bf16": 0.02}), copy_tbps=3.0)
    assert s["qwen2.5-7b/layer/M16/nvfp4_over_bf16"] == pytest.approx(2.0)
    assert not [key for key in s if "humming" in key]


def test_humming_summary_keys_are_humming_over_qerl():
    rows = layer_rows([1, 16], {"nvfp4": 0.01, "bf16": 0.02, "humming": 0.012, "humming_batch_invariant": 0.03})
    rows = [r for r in rows if not (r["M"] == 16 and r["method"] == "humming_batch_invariant" and r["proj"] == "down_proj")]
    s = bk.summarize(rows, copy_tbps=3.0)
    assert s["qwen2.5-7b/layer/M1/nvfp4_over_humming"] == pytest.approx(1.2)
    assert s["qwen2.5-7b/layer/M16/nvfp4_over_humming"] == pytest.approx(1.2)
    assert s["qwen2.5-7b/layer/M1/nvfp4_over_humming_batch_invariant"] == pytest.approx(3.0)
    # a layer sum needs all seven linears: a missing one leaves the key out, never a partial sum
    assert "qwen2.5-7b/layer/M16/nvfp4_over_humming_batch_invariant" not in s


def test_min_over_every_m_to_64_names_the_worst_m():
    rows = layer_rows(range(1, 65), {"nvfp4": 0.01, "bf16": 0.02})
    rows = [dict(r, ms=0.012) if r["M"] == 37 and r["method"] == "bf16" else r for r in rows]
    s = bk.summarize(rows, copy_tbps=3.0)
    assert s["qwen2.5-7b/layer/min_M1-64/nvfp4_over_bf16"] == pytest.approx(1.2)
    assert s["qwen2.5-7b/layer/min_M1-64/at_M"] == 37
    # a gap in 1..64 leaves the key out (a minimum over the powers of two alone would hide M = 33)
    s = bk.summarize([r for r in rows if r["M"] != 33], copy_tbps=3.0)
    assert "qwen2.5-7b/layer/min_M1-64/nvfp4_over_bf16" not in s


def test_nvrtc_builtins_folder_goes_first_on_ld_library_path(tmp_path, monkeypatch):
    lib = tmp_path / "nvidia" / "cu13" / "lib"
    lib.mkdir(parents=True)
    (lib / "libnvrtc-builtins.so.13.0").write_bytes(b"")
    (tmp_path / "nvidia" / "cu13" / "include").mkdir()
    assert humming_setup.nvrtc_builtins_dirs([str(tmp_path), str(tmp_path / "nowhere")]) == [str(lib)]
    monkeypatch.setenv("LD_LIBRARY_PATH", "/a:/b")
    assert humming_setup.prepend_ld_library_path([str(lib)]) == [str(lib)]
    assert humming_setup.prepend_ld_library_path([str(lib)]) == []
    assert os.environ["LD_LIBRARY_PATH"] == os.pathsep.join([str(lib), "/a", "/b"])


def test_humming_reads_qerl_nvfp4_tensors_as_they_are():
    """Names, shapes and dtypes match, and the global scale is read as a divisor (humming keeps
    1 / weight_global_scale as its weight_scale_2 multiplier)."""
    pytest.importorskip("humming")
    from humming.schema import BaseWeightSchema

    schema = BaseWeightSchema.from_config(bk.Humming.weight_config())
    n, k = 48, 64
    attrs = schema.get_tensors_attrs(shape_n=n, shape_k=k, param_dtype=torch.bfloat16)
    assert {name: (tuple(a["shape"]), a["dtype"]) for name, a in attrs.items()} == formats.packed_shapes("nvfp4", n, k)
    t = formats.quantize(torch.randn(n, k) * 0.02, "nvfp4")
    _, out = schema.convert_humming(dict(t), [n], [k], torch.bfloat16, device=-1)  # -1: no CUDA device
    assert torch.equal(out["weight_scale"].view(torch.uint8), t["weight_scale"].view(torch.uint8))
    assert float(out["weight_scale_2"].reshape(-1)[0] * t["weight_global_scale"][0]) == pytest.approx(1.0, rel=1e-6)
