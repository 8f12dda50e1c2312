"""Figures and notebooks regenerate from a results/ tree alone (no GPU, no model): here a synthetic
one in the committed layout (Table 1 runs with metrics over seeds, base rows, the kernel benchmark).

Run with: .venv/bin/python -m pytest tests/test_notebooks.py -q   (about 15 s on 2 CPU cores)
"""

import json
import shutil
from pathlib import Path

import pytest

from experiments import _common as C
from qerl import plots

ROOT = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FIGURES = ["table1", "rewards", "entropy", "aqn", "step_time", "kernels"]
METHODS = {"bf16_lora": (0, 1, 2), "nf4_lora": (0, 1), "nvfp4_lora": (0, 1, 2), "nvfp4_lora_aqn": (0, 1, 2)}


def _train_run(d: Path, method: str, seed: int, steps: int = 8):
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"model": "m", "method": method, "seed": seed, "dataset": "arith",
                                               "provenance": {"git_sha": "a" * 40}}))
    acc = 0.2 + 0.05 * seed + (0.1 if "aqn" in method else 0.0)
    (d / "summary.json").write_text(json.dumps({"status": "ok", "eval_before/arith/accuracy": 0.1 + 0.01 * seed,
                                                "eval/arith/accuracy": acc, "steps": steps}))
    lines = [{"step": 0, "eval_before/arith/accuracy": 0.1}] + [
        {"step": i, "reward": 0.1 * i / steps + 0.02 * seed, "entropy": 2.0 - 0.1 * i, "sampling/entropy": 2.1 - 0.1 * i,
         "time/rollout_s": 5.0, "time/train_s": 1.0, "step_time": 6.0,
         "aqn/sigma": 0.01 / i if "aqn" in method else 0.0} for i in range(1, steps + 1)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


@pytest.fixture
def results(tmp_path):
    """A results/ tree: table1/small (base rows + trained rows over seeds) and the kernel benchmark."""
    res = tmp_path / "results"
    t1 = res / "table1" / "small"
    for fmt in ("bf16", "nf4", "mxfp4", "nvfp4"):
        (t1 / "runs" / f"base-{fmt}").mkdir(parents=True)
        (t1 / "runs" / f"base-{fmt}" / "eval.json").write_text(json.dumps(
            {"results": {"arith": {"accuracy": 0.15}}, "args": {"model": "m"}, "provenance": {"git_sha": "a" * 40}}))
    for method, seeds in METHODS.items():
        for s in seeds:
            _train_run(t1 / "runs" / f"{method}-s{s}", method, s)
    C.collect(t1)
    if (ROOT / "results/kernels/h100.json").exists():
        (res / "kernels").mkdir()
        shutil.copy(ROOT / "results/kernels/h100.json", res / "kernels/h100.json")
    return res


def test_make_figures_writes_every_png(results, tmp_path):
    from experiments import make_figures

    out = make_figures.main(["--results", str(results), "--out", str(tmp_path / "figs")])
    for name in FIGURES:
        if name == "kernels" and not (results / "kernels").exists():
            continue
        png = tmp_path / "figs" / f"{name}.png"
        assert png.read_bytes()[:8] == PNG_MAGIC, name
        assert png.stat().st_size > 10_000, name  # a drawn figure, not an empty canvas
    tab = out["table1"]
    # Table 1 values are the seed means and standard deviations of table.csv.
    assert tab.loc["nf4_lora", "after_mean"] == pytest.approx(0.225)
    assert tab.loc["nf4_lora", "after_std"] == pytest.approx(0.05 / 2 ** 0.5)
    assert tab.loc["nvfp4_lora_aqn", "seeds"] == 3 and tab.loc["nf4_lora", "seeds"] == 2
    assert list(tab.index[:4]) == ["bf16", "nf4", "mxfp4", "nvfp4"]


def test_curves_draw_mean_and_a_std_band(results):
    fig = plots.plot_rewards(results=results, out_dir=results / "figs", smooth=1)
    ax = fig.axes[0]
    line = next(ln for ln in ax.get_lines() if ln.get_label() == "nvfp4_lora (n=3)")
    assert line.get_ydata()[0] == pytest.approx(0.1 / 8 + 0.02)  # mean of seeds 0, 1, 2 at step 1
    band = ax.collections[[ln.get_label() for ln in ax.get_lines()].index("nvfp4_lora (n=3)")]
    lo, hi = band.get_paths()[0].vertices[:, 1].min(), band.get_paths()[0].vertices[:, 1].max()
    assert lo < line.get_ydata().min() and hi > line.get_ydata().max()  # +- std (0.02) around the mean


def test_curves_with_a_panel_per_method_and_a_line_per_config_field(tmp_path):
    """Fig. 16's layout: one panel per method (named by panel_names), one line per learning rate in each."""
    runs = tmp_path / "results" / "lr" / "small" / "runs"
    for method in ("nvfp4_lora_aqn", "bf16_lora"):
        for lr in (5e-05, 3e-04):
            for s in (0, 1):
                d = runs / f"{method}-lr{lr:.0e}-s{s}"
                _train_run(d, method, s)
                cfg = json.loads((d / "config.json").read_text())
                (d / "config.json").write_text(json.dumps({**cfg, "learning_rate": lr}))
    fig = plots.plot_curves(results=tmp_path / "results", experiment="lr/small", by="learning_rate", panels="method",
                            panel_names={"nvfp4_lora_aqn": "QeRL", "bf16_lora": "bf16 LoRA"}, out_dir=tmp_path)
    assert [ax.get_title() for ax in fig.axes] == ["bf16 LoRA", "QeRL"]
    for ax in fig.axes:
        assert sorted(ln.get_label() for ln in ax.get_lines()) == ["learning_rate=0.0003 (n=2)",
                                                                   "learning_rate=5e-05 (n=2)"]


def test_kernel_table_matches_benchmark_summary(tmp_path):
    if not (ROOT / "results/kernels/h100.json").exists():
        pytest.skip("no kernel results")
    k = plots.kernel_table(results=ROOT / "results", out_dir=tmp_path)  # (None: it would redraw the repo's figure)
    summary = json.loads((ROOT / "results/kernels/h100.json").read_text())["summary"]
    for m in (1, 8, 2048):
        got = k.loc[("qwen2.5-7b", "linear", m), "bf16/nvfp4"]
        assert got == pytest.approx(summary[f"qwen2.5-7b/layer/M{m}/nvfp4_over_bf16"], rel=1e-6)


def test_missing_results_are_skipped_not_raised(tmp_path, capsys):
    out = plots.make_all(results=tmp_path / "nothing", out_dir=tmp_path / "figs")
    assert all(v is None for v in out.values())
    assert "skipped" in capsys.readouterr().out


def test_partial_results_draw_what_exists(results, tmp_path):
    """Only table.csv present: Table 1 is drawn, the curve plots are skipped."""
    (tmp_path / "part/table1/small").mkdir(parents=True)
    shutil.copy(results / "table1/small/table.csv", tmp_path / "part/table1/small/table.csv")
    out = plots.make_all(results=tmp_path / "part", out_dir=tmp_path / "figs")
    assert out["table1"] is not None and out["rewards"] is None
    assert (tmp_path / "figs/table1.png").exists() and not (tmp_path / "figs/rewards.png").exists()


def test_notebook_executes(results, tmp_path, monkeypatch):
    import nbformat

    from benchmarks import make_notebooks, run_notebooks

    monkeypatch.setenv("QERL_RESULTS", str(results))
    path = tmp_path / "entropy.ipynb"
    nbformat.write(make_notebooks.build("entropy"), path)
    nb = run_notebooks.run(path, timeout=120)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert not (results / "figures").exists()  # figures go to a scratch folder unless QERL_WRITE_FIGURES=1
    assert any("image/png" in o.get("data", {}) for o in outputs)
    assert any("entropy_early" in o.get("data", {}).get("text/plain", "") for o in outputs)


def test_unknown_notebook_name_raises():
    from benchmarks import make_notebooks

    with pytest.raises(ValueError, match="allowed"):
        make_notebooks.build("nope")


def test_decode_profile_plot_stacks_the_categories(tmp_path):
    """One bar per (method, batch), its segments the categories' ms (profile_decode's JSON)."""
    rows = [dict(method=m, batch=b, step_ms=3.0 * b, kernel_ms=2.5 * b,
                 categories={"4-bit linear" if m == "nvfp4" else "cuBLAS GEMM": {"ms": 2.0 * b, "kernels": 112},
                             "qerl fused": {"ms": 0.5 * b, "kernels": 200}})
            for m in ("nvfp4", "bf16") for b in (1, 8)]
    d = dict(provenance=dict(gpu="h100", git_sha="abc1234", date="2026-11-25"), settings=dict(model="m"), rows=rows)
    fig = plots.plot_decode_profile(results=tmp_path, out_dir=tmp_path, profile=d)
    assert (tmp_path / "decode_profile.png").exists()
    widths = {}
    for patch in fig.axes[0].patches:
        y = round(patch.get_y() + patch.get_height() / 2)
        widths[y] = widths.get(y, 0.0) + patch.get_width()
    assert sorted(round(w, 6) for w in widths.values()) == [2.5, 2.5, 20.0, 20.0]
    d2 = json.loads(json.dumps(d))
    (tmp_path / "decode_profile").mkdir()
    (tmp_path / "decode_profile" / "a.json").write_text(json.dumps(d2))
    assert plots.load_decode_profile(tmp_path)["rows"] == rows
    ab = dict(d, rows=[dict(r, lora_a_beside=on) for r in rows[:2] for on in (True, False)])
    fig = plots.plot_decode_profile(results=tmp_path, out_dir=tmp_path, profile=ab)
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert len(set(labels)) == 4 and any("lora_a_beside=True" in t for t in labels), labels


@pytest.mark.parametrize("path", sorted((ROOT / "notebooks").glob("*.ipynb")), ids=lambda p: p.stem)
def test_committed_notebook_was_executed_and_holds_no_error(path):
    """A committed notebook is benchmarks/make_notebooks.py's cells executed against the committed
    results/ (python -m benchmarks.run_notebooks): every code cell ran, and no output is an error."""
    import nbformat

    from benchmarks import make_notebooks

    nb = nbformat.read(path, as_version=4)
    assert [c.source for c in nb.cells] == [c.source for c in make_notebooks.build(path.stem).cells], \
        f"{path.name} differs from make_notebooks.py: rebuild and re-execute it"
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.execution_count for c in code), f"{path.name} has cells that did not run"
    for c in code:
        for o in c.outputs:
            assert o.output_type != "error", f"{path.name}: {o.get('ename')}: {o.get('evalue')}"
            text = o.get("text", "") + o.get("data", {}).get("text/plain", "")
            assert "Traceback" not in text and "Error:" not in text, f"{path.name}: {text[:200]}"
