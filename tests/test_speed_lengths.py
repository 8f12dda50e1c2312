"""Completion-length mixes in the speed experiments: the seeded clipped log-normal of
benchmarks/speed_common.py (parse, draw, summary), the mix rows of experiments/rollout_throughput.py
(compacting bf16 / NVFP4 and the static NVFP4 batch on the same lengths; useful tokens/s, steps per
batch size, the bs<B>_mix ratios) and of experiments/table3_speed_memory.py (the GRPO step on the mix),
on the CPU with a tiny model and the real compacting engine.

Run: OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_speed_lengths.py -q   (about 30 s)
"""

import json
import types

import numpy as np
import pytest

from benchmarks import speed_common as sc
from experiments import rollout_throughput as rt
from experiments import table3_speed_memory as t3


@pytest.fixture
def cfg(tiny_config):
    return tiny_config("qwen2", max_position_embeddings=1024)


def tiny(cfg, fmt="nvfp4", rank=4):
    return sc.build(None, fmt, rank, "cpu", config=cfg)


# ----------------------------------------------------------------------------------------------
# the length distributions


def test_parse_lengths():
    assert sc.parse_lengths("fixed") == {"kind": "fixed"}
    assert sc.parse_lengths(" mix ") == {"kind": "lognormal", "median": 0.25, "p95": 1.0}
    assert sc.parse_lengths("lognormal:median=512") == {"kind": "lognormal", "median": 512.0, "p95": 1.0}
    assert sc.parse_lengths("lognormal:median=0.1,p95=1500") == {"kind": "lognormal", "median": 0.1, "p95": 1500.0}


@pytest.mark.parametrize("spec, msg", [
    ("gamma", "expected 'fixed', 'mix'"), ("lognormal", "expected"), ("lognormal:", "expected"),
    ("lognormal:mean=3", "unknown or empty field"), ("lognormal:median=", "unknown or empty field"),
    ("lognormal:median=abc", "not a number"), ("lognormal:median=-5", "positive finite"),
    ("lognormal:median=nan", "positive finite"), ("lognormal:median=inf", "positive finite"),
    ("lognormal:median=5,median=6", "given twice"), ("lognormal:p95=0.5", "median= is required"),
])
def test_bad_length_specs_say_what_is_wrong(spec, msg):
    with pytest.raises(ValueError, match=msg):
        sc.parse_lengths(spec)


@pytest.mark.parametrize("spec", ["lognormal:median=0.9,p95=0.5", "lognormal:median=4096", "lognormal:median=0.01",
                                  "lognormal:median=100,p95=100"])
def test_lengths_that_cannot_be_drawn_at_the_cap(spec):
    """median and p95 are compared in tokens at the cap (fractions and tokens mix): 1 <= median < p95."""
    with pytest.raises(ValueError, match="need 1 <= median < p95"):
        sc.check_lengths(spec, 64)
    assert sc.check_lengths("lognormal:median=512", 2048) == "lognormal:median=512"  # p95 at the cap


def test_mix_is_the_documented_default():
    mu, sigma = sc.lognormal_params("mix", 2048)
    assert np.exp(mu) == pytest.approx(512) and sigma == pytest.approx(np.log(4) / 1.645, rel=1e-4)
    assert sc.lognormal_params("mix", 2048) == sc.lognormal_params("lognormal:median=512,p95=2048", 2048)


def test_draws_are_seeded_and_the_same_on_every_machine():
    a = sc.draw_lengths("mix", 16, 2048, seed=0)
    assert a == sc.draw_lengths("mix", 16, 2048, seed=0) != sc.draw_lengths("mix", 16, 2048, seed=1)
    # numpy's PCG64 stream, pinned: a change here changes every mix row's lengths
    assert a == [569, 458, 878, 559, 326, 694, 1537, 1137, 283, 176, 303, 530, 72, 426, 179, 276]
    assert sc.draw_lengths("fixed", 5, 2048) == [2048] * 5


def test_draws_are_clipped_integers_in_range():
    x = sc.draw_lengths("lognormal:median=2,p95=60", 2000, 16, seed=3)  # wide: both ends clip
    assert all(type(v) is int and 1 <= v <= 16 for v in x)
    assert x.count(1) > 100 and x.count(16) > 100


@pytest.mark.parametrize("spec, cap, median, p95", [("mix", 2048, 512, 2048), ("lognormal:median=100,p95=400", 10_000, 100, 400)])
def test_large_draws_match_the_spec(spec, cap, median, p95):
    x = np.asarray(sc.draw_lengths(spec, 100_000, cap, seed=7), dtype=float)
    assert np.median(x) == pytest.approx(median, rel=0.02)
    assert np.percentile(x, 95) == pytest.approx(p95, rel=0.03)
    if cap == p95:  # 5% reach the cap; the mean is about a third of it
        assert (x >= cap).mean() == pytest.approx(0.05, abs=0.003) and x.mean() / cap == pytest.approx(0.33, abs=0.01)


def test_length_summary():
    s = sc.length_summary([1, 2, 3, 10, 10], 10)
    assert s == {"median": 3.0, "p95": 10.0, "mean": 5.2, "max": 10, "total": 26, "cap": 10, "at_cap_frac": 0.4}


# ----------------------------------------------------------------------------------------------
# the command lines


GPU_ROLLOUT = ["--models", "qwen2.5-7b", "--batch", "64", "--lengths", "mix", "--completion", "2048",
               "--methods", "bf16", "nvfp4", "nvfp4_static"]


def test_rollout_command_lines():
    a = rt.parse_args(GPU_ROLLOUT)
    assert a.lengths == "mix" and a.methods == ["bf16", "nvfp4", "nvfp4_static"] and a.batch == [64]
    assert rt.parse_args([]).lengths == "fixed"  # today's rows unless asked


@pytest.mark.parametrize("argv, msg", [
    (["--lengths", "gamma"], "expected 'fixed', 'mix'"),
    (["--lengths", "lognormal:median=4096", "--completion", "2048"], "need 1 <= median < p95"),
    (["--methods", "nvfp4", "nvfp4_static"], "needs a length mix"),
])
def test_rollout_bad_command_lines_exit_2(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        rt.parse_args(argv)
    assert e.value.code == 2 and msg in capsys.readouterr().err


def test_table3_command_lines(capsys):
    a = t3.parse_args(["--models", "qwen2.5-7b", "--batch", "64", "--lengths", "mix", "--completion", "2048"])
    assert a.lengths == "mix" and t3.row_specs(a) == [t3.RowSpec("qwen2.5-7b", 64, 2048, 1, True)]
    a = t3.parse_args(["--row", "qwen2.5-7b/bs64/c2048/mb8", "--lengths", "mix"])
    assert t3.row_specs(a) == [t3.RowSpec("qwen2.5-7b", 64, 2048, 8, True)]
    with pytest.raises(SystemExit) as e:  # the cap is each row's completion length
        t3.parse_args(["--row", "qwen2.5-7b/bs64/c256", "--lengths", "lognormal:median=300"])
    assert e.value.code == 2 and "at cap 256" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# summaries from given rows


STATS = sc.length_summary(sc.draw_lengths("mix", 64, 2048), 2048)


def _mix_rows(model="qwen2.5-7b", batch=64, tps=None, stats=STATS):
    tps = tps or {("bf16", True): 1000.0, ("nvfp4", True): 2000.0, ("nvfp4", False): 1250.0}
    return [dict(model=model, method=m, engine="fast", batch=batch, lora_rank=32, prompt_len=256, completion_len=2048,
                 lengths="mix", compact=c, length_stats=stats, useful_tokens_per_s=v) for (m, c), v in tps.items()]


def test_rollout_mix_summary_keys_and_ratios():
    fixed = [dict(model="qwen2.5-7b", method=m, batch=64, lora_rank=32, prompt_len=256, completion_len=1024,
                  tokens_per_s=v) for m, v in (("bf16", 600.0), ("nvfp4", 720.0))]
    rows = fixed + _mix_rows() + _mix_rows(batch=8, tps={("bf16", True): 10.0, ("nvfp4", True): 30.0,
                                                         ("nvfp4", False): 20.0})
    s, notes = rt.summarize(rows)
    assert list(s) == list(rt.SUMMARY_KEYS) and set(notes) == set(s)
    assert s["qwen2.5-7b/bs64_mix/nvfp4_over_bf16"] == pytest.approx(2.0)
    assert s["qwen2.5-7b/bs64_mix/nvfp4_over_static"] == pytest.approx(1.6)
    assert "useful tokens/s" in notes["qwen2.5-7b/bs64_mix/nvfp4_over_static"]
    assert s["qwen2.5-7b/bs64/nvfp4_over_bf16"] == pytest.approx(1.2)  # the fixed rows' key, untouched by the mix
    assert s["qwen2.5-14b/bs64_mix/nvfp4_over_bf16"] is None
    assert rt.TARGETS["qwen2.5-7b/bs64_mix/nvfp4_over_bf16"] == 1.6 and rt.TARGETS["qwen2.5-7b/bs64_mix/nvfp4_over_static"] == 1.4
    mix = rt.mix_ratios(rows)  # every batch size measured
    assert mix["qwen2.5-7b/bs8_mix/nvfp4_over_bf16"] == pytest.approx(3.0)
    assert mix["qwen2.5-7b/bs8_mix/nvfp4_over_static"] == pytest.approx(1.5)


def test_rollout_mix_ratio_needs_the_same_lengths():
    other = sc.length_summary(sc.draw_lengths("mix", 64, 2048, seed=1), 2048)
    rows = _mix_rows()
    rows[0]["length_stats"] = other  # bf16 on other lengths: no nvfp4_over_bf16; static still comparable
    s, _ = rt.summarize(rows)
    assert s["qwen2.5-7b/bs64_mix/nvfp4_over_bf16"] is None
    assert s["qwen2.5-7b/bs64_mix/nvfp4_over_static"] == pytest.approx(1.6)
    failed = [r for r in _mix_rows() if r["compact"]] + [dict(_mix_rows()[2], useful_tokens_per_s=None, error="OOM")]
    assert rt.summarize(failed)[0]["qwen2.5-7b/bs64_mix/nvfp4_over_static"] is None


def test_rollout_merge_keeps_mix_rows_apart(tmp_path):
    prov = {"gpu": "h100", "git_sha": "a" * 40, "date": "2026-11-27T00:00:00+00:00", "env": {}}
    fixed = [dict(model="qwen2.5-7b", method="nvfp4", engine="fast", batch=64, lora_rank=32, prompt_len=256,
                  completion_len=2048, tokens_per_s=5000.0)]
    sc.write_json(rt.assemble(fixed, prov, 3.0, {}), tmp_path / "a", "h100")
    sc.write_json(rt.assemble(_mix_rows(), prov, 3.0, {}), tmp_path / "b", "h100")
    merged = rt.merge([str(tmp_path / "a/h100.json"), str(tmp_path / "b/h100.json")], str(tmp_path / "out"))
    assert len(merged["rows"]) == 4
    assert merged["summary"]["qwen2.5-7b/bs64_mix/nvfp4_over_static"] == pytest.approx(1.6)
    assert json.loads((tmp_path / "out/h100.json").read_text())["mix_ratios"]["qwen2.5-7b/bs64_mix/nvfp4_over_bf16"] == 2.0


def test_table3_mix_summary():
    def row(method, step_s, lengths="mix", stats=STATS):
        return dict(model="qwen2.5-7b", method=method, batch=64, grad_ckpt=True, completion_len=2048, prompt_len=256,
                    micro_batch=8, step_s=step_s, lengths=lengths, length_stats=stats if lengths == "mix" else None)

    rows = [row("bf16", 30.0), row("nvfp4", 20.0), row("bf16", 50.0, "fixed"), row("nvfp4", 40.0, "fixed")]
    s, notes = t3.summarize(rows)
    assert list(s) == list(t3.SUMMARY_KEYS)
    assert s["qwen2.5-7b/bs64_mix/e2e_nvfp4_over_bf16"] == pytest.approx(1.5)
    assert s["qwen2.5-7b/bs64/e2e_nvfp4_over_bf16"] == pytest.approx(1.25)  # the fixed rows alone
    assert "(mix)" in notes["qwen2.5-7b/bs64_mix/e2e_nvfp4_over_bf16"]
    other = sc.length_summary(sc.draw_lengths("mix", 64, 2048, seed=1), 2048)
    rows[1]["length_stats"] = other  # NVFP4 on other lengths: not compared
    assert t3.summarize(rows)[0]["qwen2.5-7b/bs64_mix/e2e_nvfp4_over_bf16"] is None


# ----------------------------------------------------------------------------------------------
# the mix rows measured (CPU, tiny model, the real compacting engine)


def _graph_bookkeeping(monkeypatch):
    """Engines whose 'CUDA graphs' run on the CPU: _graph keeps FastEngine's key and capture count,
    and its replay runs the eager step the graph would hold. Returns the engines made."""
    made = []
    real = sc.make_fast_engine

    def make(*a, **k):
        e = real(*a, **k)
        e.cuda_graphs, e.captured, e.replayed = True, set(), []

        def graph(window, sampling, n=None, e=e):
            key = (e.buf.B, e.buf.L, e.buf.B if n is None else n, window, sampling)
            if key not in e.captured:
                e.captured.add(key)
                e.stats["captures"] += 1
            e.replayed.append(key)
            return types.SimpleNamespace(replay=lambda: e._decode_step(window, sampling, key[2]))

        e._graph = graph
        made.append(e)
        return e

    monkeypatch.setattr(sc, "make_fast_engine", make)
    return made


def test_warm_up_captures_the_buckets_only_when_sequences_can_leave():
    class FakeEngine:
        cuda_graphs, compact = True, True

        def __init__(self):
            self.graphs = []

        def generate(self, prompts, n, **kw):
            pass

        def _graph(self, window, sampling, n=None):
            self.graphs.append((window, n))

    e = FakeEngine()
    sc.warm_up_engine(e, 8, 256, 2048, vocab=1000, lengths=[2048] * 8)  # one length for all: no compaction
    assert e.graphs == [(512, None), (1024, None), (2048, None), (2304, None)]
    e = FakeEngine()
    sc.warm_up_engine(e, 8, 256, 2048, vocab=1000, lengths=[2048] + [7] * 7)
    assert e.graphs == [(w, n) for w in (512, 1024, 2048, 2304) for n in (8, 4, 2, 1)]
    e = FakeEngine()
    e.compact = False  # the static batch
    sc.warm_up_engine(e, 8, 256, 2048, vocab=1000, lengths=[2048] + [7] * 7)
    assert e.graphs == [(512, None), (1024, None), (2048, None), (2304, None)]


@pytest.mark.parametrize("compact", [True, False])
def test_mix_row_warm_up_captures_every_window_and_bucket(cfg, monkeypatch, compact):
    """The warm-up captures the graphs of every window at every batch bucket, so the timed call (which
    here replays several windows and, compacting, several buckets) captures none."""
    made = _graph_bookkeeping(monkeypatch)
    P, cap, B = 200, 400, 8
    lengths = sc.draw_lengths("lognormal:median=0.25", B, cap, seed=0)
    row = rt.time_mix_row(tiny(cfg), "tiny", "nvfp4", B, 4, P, lengths, "lognormal:median=0.25", cap,
                          cfg.vocab_size, compact)
    (e,) = made
    timed = e.replayed[-row["decode_steps"]:]
    assert len({k[3] for k in timed}) >= 2  # windows
    assert len({k[2] for k in timed}) >= 3 if compact else {k[2] for k in timed} == {B}  # buckets
    assert row["captures_during_timing"] == 0 and row["timed_calls"] == 1 and set(timed) <= e.captured
    assert row["useful_tokens"] == sum(lengths) and row["decode_steps"] == max(lengths) - 1
    assert sum(row["bucket_steps"].values()) == row["decode_steps"]
    assert row["row_steps"] == sum(int(k) * v for k, v in row["bucket_steps"].items())
    assert row["length_stats"] == sc.length_summary(lengths, cap) and row["completion_len"] == cap
    assert row["useful_tokens_per_s"] == pytest.approx(sum(lengths) / row["seconds"]) and "tokens_per_s" not in row


def test_mix_row_check_can_fail(cfg, monkeypatch):
    """Without the buckets in the warm-up, the compacting engine captures while timed (and says so)."""
    _graph_bookkeeping(monkeypatch)
    monkeypatch.setattr(sc, "buckets", lambda b: [b])
    lengths = sc.draw_lengths("mix", 8, 64, seed=0)
    row = rt.time_mix_row(tiny(cfg), "tiny", "nvfp4", 8, 4, 5, lengths, "mix", 64, cfg.vocab_size, True)
    assert row["timed_calls"] == 2  # the first timed call captured; the row is the second's


def test_rollout_mix_main_on_cpu(tmp_path, capsys):
    """The GPU invocation's shape on a tiny model: bf16 and NVFP4 compacting and NVFP4 static on the same lengths."""
    res = rt.main(["--models", "tiny-qwen2", "--device", "cpu", "--batch", "8", "--lengths", "mix", "--completion", "64",
                   "--prompt", "5", "--ranks", "4", "--methods", "bf16", "nvfp4", "nvfp4_static", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "cpu.json").read_text())["rows"]
    lengths = sc.draw_lengths("mix", 8, 64, seed=0)
    assert [(r["method"], r["compact"]) for r in rows] == [("nvfp4", True), ("nvfp4", False), ("bf16", True)]
    assert not [r for r in rows if r.get("error")]
    assert all(r["useful_tokens"] == sum(lengths) and r["lengths"] == "mix" for r in rows)
    assert {r["decode_steps"] for r in rows} == {max(lengths) - 1}
    static = rows[1]
    assert static["bucket_steps"] == {"8": max(lengths) - 1} and static["compactions"] == 0
    assert len(rows[0]["bucket_steps"]) > 1 and rows[0]["row_steps"] < static["row_steps"]
    assert set(res["mix_ratios"]) == {"tiny-qwen2/bs8_mix/nvfp4_over_bf16", "tiny-qwen2/bs8_mix/nvfp4_over_static"}
    assert all(v > 0 for v in res["mix_ratios"].values())
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == res["summary"]


def test_table3_mix_main_on_cpu(tmp_path):
    t3.main(["--row", "tiny-qwen2/bs8/c64/mb4", "--device", "cpu", "--methods", "nvfp4", "bf16", "--prompt", "5",
             "--lengths", "mix", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "cpu.json").read_text())["rows"]
    lengths = sc.draw_lengths("mix", 8, 64, seed=0)
    assert len(rows) == 2 and all(not r["oom"] and "error" not in r for r in rows)
    for r in rows:
        assert r["completion_tokens"] == sum(lengths) and r["length_stats"] == sc.length_summary(lengths, 64)
        assert r["rollout_tokens_per_s"] == pytest.approx(sum(lengths) / r["rollout_s"])
        assert sum(r["bucket_steps"].values()) == r["decode_steps"] == max(lengths) - 1 and len(r["bucket_steps"]) > 1
        assert r["captures_during_timing"] == 0


def test_figure_11_leaves_the_mix_rows_out(tmp_path):
    """Mix rows report useful tokens/s (no tokens_per_s): Figure 11 plots the fixed-length rows only."""
    import pandas as pd

    from qerl import plots

    fixed = dict(model="qwen2.5-7b", method="nvfp4", batch=8, lora_rank=32, completion_len=2048, tokens_per_s=1000.0)
    mix = pd.DataFrame(_mix_rows(batch=64))
    assert plots.plot_rollout_throughput(mix, out_dir=tmp_path) is None
    fig = plots.plot_rollout_throughput(pd.concat([pd.DataFrame([fixed]), mix]), out_dir=tmp_path)
    assert [ax.get_title() for ax in fig.axes] == ["batch 8"]


def test_rollout_rows_refill_and_waves_rows_and_ratio(tmp_path, capsys):
    """--rows: NVFP4 again with the batch on fewer rows, refilling and in waves; the rows carry max_batch /
    refill, stay out of issue 36's keys, and mix_ratios gains refill_over_waves."""
    with pytest.raises(SystemExit):
        rt.parse_args(["--rows", "4"])  # needs a mix
    a = rt.parse_args(["--lengths", "mix", "--rows", "16", "--batch", "64"])
    assert a.rows == 16 and a.refill == "both"
    rows = _mix_rows()
    ref = [dict(r, max_batch=16, refill=rf, useful_tokens_per_s=v) for r in rows if r["method"] == "nvfp4" and r["compact"]
           for rf, v in ((True, 1500.0), (False, 1200.0))]
    s, _ = rt.summarize(rows + ref)
    assert s["qwen2.5-7b/bs64_mix/nvfp4_over_static"] == pytest.approx(1.6)  # the 64-row rows only
    mix = rt.mix_ratios(rows + ref)
    assert mix["qwen2.5-7b/bs64_mix_rows16/refill_over_waves"] == pytest.approx(1.25)
    assert mix["qwen2.5-7b/bs64_mix/nvfp4_over_bf16"] == pytest.approx(2.0)


def test_rollout_mix_row_with_rows_on_the_cpu():
    """time_mix_row on a tiny model with 6 sequences on 2 rows: refill and waves decode the drawn lengths
    and report refills / waves."""
    import importlib.util
    from pathlib import Path

    import torch

    from qerl.quantize import QuantizeConfig, quantize_

    # tests/conftest.py's builder (a plain `import conftest` can pick up tests/kernels/conftest.py)
    spec = importlib.util.spec_from_file_location("_qerl_tests_conftest", Path(__file__).with_name("conftest.py"))
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    make_tiny_model = conftest.make_tiny_model

    model = make_tiny_model("qwen2", dtype=torch.float32)
    quantize_(model, QuantizeConfig(fmt="nvfp4", lora_rank=4))
    lengths = [3, 9, 1, 6, 4, 2]
    for refill in (True, False):
        row = rt.time_mix_row(model, "tiny", "nvfp4", 6, 4, 5, lengths, "mix", 9, model.config.vocab_size, True,
                              rows=2, refill=refill)
        assert row["useful_tokens"] == sum(lengths) and row["max_batch"] == 2 and row["refill"] is refill
        assert (row["refills"], row["waves"]) == ((4, 1) if refill else (0, 3))
    with pytest.raises(ValueError, match="rows must be"):
        rt.time_mix_row(model, "tiny", "nvfp4", 6, 4, 5, lengths, "mix", 9, model.config.vocab_size, True, rows=6)
