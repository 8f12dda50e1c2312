"""Figures and notebooks regenerate from the committed results/ alone (no GPU, no model).

Run with: .venv/bin/python -m pytest tests/test_notebooks.py -q   (about 10 s on 2 CPU cores)
"""

import json
import shutil
from pathlib import Path

import pytest

from qerl import plots

ROOT = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FIGURES = ["table1", "rewards", "entropy", "aqn", "step_time", "kernels"]

needs_results = pytest.mark.skipif(not (ROOT / "results/table1/small/table.csv").exists(),
                                   reason="committed results/table1/small not present")


@needs_results
def test_make_figures_writes_every_png(tmp_path):
    from experiments import make_figures

    out = make_figures.main(["--out", str(tmp_path)])
    for name in FIGURES:
        png = tmp_path / f"{name}.png"
        assert png.read_bytes()[:8] == PNG_MAGIC, name
        assert png.stat().st_size > 10_000, name  # a drawn figure, not an empty canvas
    tab = out["table1"]
    # Table 1 values are the seed means of table.csv.
    raw = plots.load_table()
    want = raw[(raw.method == "nf4_lora") & (raw.metric == "accuracy")]["value"].mean()
    assert tab.loc["nf4_lora", "after_mean"] == pytest.approx(want)
    assert tab.loc["nf4_lora", "seeds"] == 2
    assert list(tab.index[:4]) == ["bf16", "nf4", "mxfp4", "nvfp4"]


@needs_results
def test_kernel_table_matches_benchmark_summary():
    if not (ROOT / "results/kernels/h100.json").exists():
        pytest.skip("no kernel results")
    k = plots.kernel_table(out_dir=None)
    summary = json.loads((ROOT / "results/kernels/h100.json").read_text())["summary"]
    for m in (1, 8, 2048):
        got = k.loc[("qwen2.5-7b", "linear", m), "bf16/nvfp4"]
        assert got == pytest.approx(summary[f"qwen2.5-7b/layer/M{m}/nvfp4_over_bf16"], rel=1e-6)


def test_missing_results_are_skipped_not_raised(tmp_path, capsys):
    out = plots.make_all(results=tmp_path / "nothing", out_dir=tmp_path / "figs")
    assert all(v is None for v in out.values())
    assert "skipped" in capsys.readouterr().out


@needs_results
def test_partial_results_draw_what_exists(tmp_path):
    """Only table.csv present: Table 1 is drawn, the curve plots are skipped."""
    (tmp_path / "table1/small").mkdir(parents=True)
    shutil.copy(ROOT / "results/table1/small/table.csv", tmp_path / "table1/small/table.csv")
    out = plots.make_all(results=tmp_path, out_dir=tmp_path / "figs")
    assert out["table1"] is not None and out["rewards"] is None
    assert (tmp_path / "figs/table1.png").exists() and not (tmp_path / "figs/rewards.png").exists()


@needs_results
def test_notebook_executes(tmp_path):
    import nbformat

    from benchmarks import make_notebooks, run_notebooks

    path = tmp_path / "entropy.ipynb"
    nbformat.write(make_notebooks.build("entropy"), path)
    nb = run_notebooks.run(path, timeout=120)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs)
    assert any("entropy_early" in o.get("data", {}).get("text/plain", "") for o in outputs)


def test_unknown_notebook_name_raises():
    from benchmarks import make_notebooks

    with pytest.raises(ValueError, match="allowed"):
        make_notebooks.build("nope")
