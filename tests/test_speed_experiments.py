"""The speed experiments on the CPU with tiny models: experiments/rollout_throughput.py (issue #5),
experiments/table3_speed_memory.py (issue #6) and their helpers (benchmarks/speed_common.py):
the measured rows, the GRPO step, the OOM handler, the JSON schema with exactly the summary keys,
and merging result files. The GPU runs themselves are in the scripts' docstrings.

Run: OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_speed_experiments.py -q   (about 15 s)
"""

import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent

from benchmarks import speed_common as sc  # noqa: E402
from experiments import rollout_throughput as rt  # noqa: E402
from experiments import table3_speed_memory as t3  # noqa: E402
from qerl.quantize import lora_parameters  # noqa: E402

P, C = 6, 5


@pytest.fixture
def cfg(tiny_config):
    return tiny_config("qwen2")


def tiny(cfg, fmt="nvfp4", rank=4):
    return sc.build(None, fmt, rank, "cpu", config=cfg)


# ----------------------------------------------------------------------------------------------
# helpers


def test_decode_bytes_per_step_formula(cfg):
    m = tiny(cfg)
    got = sc.decode_bytes_per_step(m, batch=2, context=10.5)
    layers = sum(t.numel() * t.element_size() for t in list(m.model.layers.parameters()) + list(m.model.layers.buffers()))
    H, V = cfg.hidden_size, cfg.vocab_size
    head_dim = H // cfg.num_attention_heads
    assert got["weight_bytes"] == layers + H * 2 + V * H * 2 + 2 * H * 2  # + norm + lm_head + 2 embedding rows
    assert got["kv_bytes"] == int(cfg.num_hidden_layers * 2 * 2 * cfg.num_key_value_heads * head_dim * 10.5 * 2)
    assert got["bytes_per_step"] == got["weight_bytes"] + got["kv_bytes"]


def test_set_lora_rank_swaps_adapters(cfg):
    m = tiny(cfg, rank=4)
    sc.set_lora_rank(m, 8)
    q = m.model.layers[1].mlp.down_proj
    assert q.r == 8 and q.lora_A.weight.shape == (8, q.in_features) and q.scaling == 2.0
    assert q.lora_A.weight.requires_grad and torch.count_nonzero(q.lora_B.weight) == 0
    with torch.no_grad():
        assert torch.isfinite(m(torch.randint(3, 200, (1, 4))).logits).all()


def test_decode_windows_cover_the_timed_call():
    from qerl.rollout.fast import WINDOW

    w = sc.decode_windows(256, 2048)
    assert w == sorted(w) and w[-1] == WINDOW * -(-(256 + 2048) // WINDOW)  # the last window is the cache length
    assert all(x > 256 for x in w)


def test_warm_up_captures_each_window_without_long_prompts():
    class FakeEngine:
        cuda_graphs = True

        def __init__(self):
            self.calls, self.graphs = [], []

        def generate(self, prompts, n, **kw):
            self.calls.append((len(prompts), len(prompts[0]), n))

        def _graph(self, window, sampling):
            self.graphs.append((window, sampling))

    e = FakeEngine()
    sc.warm_up_engine(e, 8, 256, 2048, vocab=1000)
    assert e.calls == [(8, 256, 2)]  # one short call at the real prompt length
    assert [w for w, _ in e.graphs] == [512, 1024, 2048, 2304]
    assert e.graphs[0][1] == (1.0, 0, 1.0, False, True)


def test_random_prompts_avoid_special_tokens():
    p = sc.random_prompts(3, 50, vocab=152064, seed=1)
    assert len(p) == 3 and all(len(x) == 50 for x in p)
    assert max(max(x) for x in p) < sc.FIRST_SPECIAL_TOKEN
    assert p == sc.random_prompts(3, 50, vocab=152064, seed=1)


# ----------------------------------------------------------------------------------------------
# rollout_throughput.py


def test_fast_engine_row(cfg):
    row = rt.time_fast_engine(tiny(cfg), "tiny", "nvfp4", 2, 4, P, C, cfg.vocab_size, copy_tbps=2.0)
    assert row["tokens"] == 2 * C and row["completion_len"] == C and row["captures_during_timing"] == 0
    assert row["tokens_per_s"] == pytest.approx(2 * C / row["seconds"])
    assert row["roofline_fraction"] == pytest.approx(row["achieved_tbps"] / 2.0)
    assert row["bytes_per_step"] > 0 and row["ms_per_decode_step"] > 0


def test_hf_generate_row(cfg):
    row = rt.time_hf_generate(tiny(cfg, "bf16"), "tiny", 1, 4, P, 3, cfg.vocab_size)
    assert row["engine"] == "hf_generate" and row["tokens"] == 3 and row["completion_len"] == 3


def _tp_rows():
    rows = []
    tps = {"bf16": 100.0, "nf4": 50.0, "nvfp4": 300.0, "hf_generate_bf16": 10.0}
    for m in rt.SUMMARY_MODELS:
        for meth, v in tps.items():
            for b in (1, 8):
                rows.append(dict(model=m, method=meth, batch=b, lora_rank=32, prompt_len=256,
                                 completion_len=128 if meth == "hf_generate_bf16" else 2048, tokens_per_s=v * b,
                                 roofline_fraction=0.5 if meth == "nvfp4" else None))
    # a shorter-completion row of another configuration must not be picked for the summary
    rows.append(dict(model="qwen2.5-7b", method="nvfp4", batch=1, lora_rank=32, prompt_len=256, completion_len=256,
                     tokens_per_s=1e9, roofline_fraction=9.0))
    rows.append(dict(model="qwen2.5-7b", method="nvfp4", batch=1, lora_rank=16, prompt_len=256, completion_len=2048,
                     tokens_per_s=1e9))
    return rows


def test_rollout_summary_has_exactly_the_keys():
    summary, notes = rt.summarize(_tp_rows())
    assert list(summary) == list(rt.SUMMARY_KEYS) and len(summary) == 24 and set(notes) == set(summary)
    assert summary["qwen2.5-7b/bs64/nvfp4_over_bf16"] is None  # no batch-64 rows: no ratio
    assert summary["qwen2.5-7b/bs64_mix/nvfp4_over_static"] is None  # no length-mix rows (tests/test_speed_lengths.py)
    assert summary["qwen2.5-7b/bs1/nvfp4_over_bf16"] == pytest.approx(3.0)
    assert summary["qwen2.5-14b/bs8/nvfp4_over_bf16"] == pytest.approx(3.0)
    assert summary["qwen2.5-32b/bs1/nvfp4_over_nf4"] == pytest.approx(6.0)
    assert summary["qwen2.5-7b/bs1/nvfp4_over_hf_generate_bf16"] == pytest.approx(30.0)
    assert summary["qwen2.5-7b/bs1/roofline_fraction"] == 0.5
    assert "C=2048" in notes["qwen2.5-7b/bs1/nvfp4_over_bf16"]
    empty, _ = rt.summarize([])
    assert list(empty) == list(rt.SUMMARY_KEYS) and all(v is None for v in empty.values())


def test_rollout_json_and_merge(tmp_path):
    prov = {"gpu": "h200", "git_sha": "a" * 40, "date": "2026-01-01T00:00:00+00:00", "env": {}}
    rows = _tp_rows()
    half = len(rows) // 2
    for i, part in enumerate((rows[:half], rows[half:])):
        res = rt.assemble([dict(r) for r in part], prov, 4.0, {"part": i})
        sc.write_json(res, tmp_path / f"run{i}", "h200")
    merged = rt.merge([str(tmp_path / "run0/h200.json"), str(tmp_path / "run1/h200.json")], str(tmp_path / "out"))
    on_disk = json.loads((tmp_path / "out/h200.json").read_text())
    for key in ("gpu", "git_sha", "date", "rows", "summary"):
        assert key in on_disk
    assert list(on_disk["summary"]) == list(rt.SUMMARY_KEYS) and on_disk["gpu"] == "h200"
    assert len(on_disk["rows"]) == len(rows) and merged["summary"] == rt.summarize(rows)[0]
    assert "gpu_note" in on_disk and "reference only" in on_disk["paper_reference"]["source"]
    ref = [r for r in on_disk["rows"] if r["model"] == "qwen2.5-32b" and r["method"] == "nvfp4" and r["batch"] == 8]
    assert ref[0]["paper_vllm_tokens_per_s"] == 688.2
    assert all(r["git_sha"] == "a" * 40 for r in on_disk["rows"])  # each row keeps the commit that measured it


def test_guarded_turns_failures_into_rows():
    def boom():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    row = rt.guarded({"model": "m", "method": "bf16"}, boom)
    assert row["oom"] is True and "OutOfMemoryError" in row["error"]


# ----------------------------------------------------------------------------------------------
# table3_speed_memory.py


class _Args:
    prompt, completion, micro_batch, seed, lora_rank, learning_rate, device = P, C, 1, 0, 4, 1e-5, "cpu"
    old_logprobs, row, steps, lengths, padding_free, token_budget = "forward", None, 1, "fixed", "on", 0


def _t3_opt(m, args=_Args):
    from qerl.policy import make_optimizer

    return make_optimizer(t3.bench_config("nvfp4", args, 2, 1, C, "cpu"), lora_parameters(m), total_updates=1)


def _spec(batch=2, mb=1, gc=True):
    return t3.RowSpec("tiny-qwen2", batch, C, mb, gc, "full" if gc else "off")


@pytest.mark.parametrize("reuse", [False, True])
def test_table3_times_the_trainers_step(cfg, monkeypatch, reuse):
    """The benchmark's step runs qerl.step's phases with the trainer's optimizer: the warm-up runs
    them on a given rollout, the timed step runs every phase, the LoRA weights move, and the
    old-log-prob forward is skipped exactly when told to reuse."""
    from qerl import step as qstep

    m = tiny(cfg)
    opt, sched = _t3_opt(m)
    assert type(opt).__name__ == "AdamW"  # CPU: the trainer's torch AdamW
    trainable = lora_parameters(m)
    called, forwards = [], []
    for name in ("rollout", "logprobs", "update"):
        real = getattr(qstep, name)
        monkeypatch.setattr(qstep, name, lambda *a, _r=real, _n=name, **k: called.append(_n) or _r(*a, **k))
    real_lp = qstep.sequence_logprobs
    monkeypatch.setattr(qstep, "sequence_logprobs",
                        lambda *a, **k: forwards.append(torch.is_grad_enabled()) or real_lp(*a, **k))
    before = [p.detach().clone() for p in trainable]

    class A(_Args):
        old_logprobs = "reuse" if reuse else "forward"

    row = t3.measure(m, _spec(), "nvfp4", A, cfg.vocab_size, opt, sched, {})
    assert not row["oom"] and "error" not in row
    # the warm-up's phases on a given rollout, then the timed step's
    assert called == ["logprobs", "update", "rollout", "logprobs", "update"]
    # warm-up: one micro-batch of 1; the timed step: 2 micro-batches of 1, packed into one padding-free forward
    assert forwards.count(False) == (0 if reuse else 2) and forwards.count(True) == 2
    assert row["completion_tokens"] == 2 * C and torch.isfinite(torch.tensor(row["loss"]))
    changed = [not torch.equal(a, b) for a, b in zip(before, trainable)]
    assert any(changed)  # lora_B moves (A gets no gradient while B == 0, as in PEFT's first step)


@pytest.mark.parametrize("grad_ckpt", [True, False])
def test_measure_row(cfg, grad_ckpt):
    m = tiny(cfg)
    opt, sched = _t3_opt(m)
    row = t3.measure(m, _spec(gc=grad_ckpt), "nvfp4", _Args, cfg.vocab_size, opt, sched, {"model_size_gb": 0.1})
    assert not row["oom"] and "error" not in row and row["grad_ckpt"] is grad_ckpt
    assert row["step_s"] >= row["rollout_s"] + row["logprob_s"] + row["update_s"] - 1e-6
    assert row["train_s"] == pytest.approx(row["logprob_s"] + row["update_s"])
    assert 0 < row["rollout_share"] < 1 and row["completion_len"] == C and row["old_logprobs"] == "forward"


@pytest.mark.parametrize("phase, name", [("rollout", "rollout"), ("logprobs", "logprob"), ("update", "update")])
def test_oom_is_reported_with_its_phase_and_the_run_goes_on(cfg, monkeypatch, phase, name):
    from qerl import step as qstep

    m = tiny(cfg)
    opt, sched = _t3_opt(m)
    tr = lora_parameters(m)
    real = getattr(qstep, phase)
    calls = {"n": 0}

    def failing(*a, **k):
        calls["n"] += 1
        if calls["n"] > (0 if phase == "rollout" else 1):  # let the warm-up's call through
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return real(*a, **k)

    monkeypatch.setattr(qstep, phase, failing)
    row = t3.measure(m, _spec(), "nvfp4", _Args, cfg.vocab_size, opt, sched, {})
    assert row["oom"] is True and row["oom_phase"] == name and "step_s" not in row
    assert all(p.grad is None for p in tr)  # cleaned up
    monkeypatch.setattr(qstep, phase, real)
    again = t3.measure(m, _spec(), "nvfp4", _Args, cfg.vocab_size, opt, sched, {})
    assert not again["oom"] and again["step_s"] > 0


def test_row_specs():
    class A(_Args):
        models, batch, grad_ckpt, completion, micro_batch = ["qwen2.5-7b"], [2, 8], ["on", "off"], 2048, 1

    assert len(t3.row_specs(A)) == 4 and t3.row_specs(A)[1] == t3.RowSpec("qwen2.5-7b", 2, 2048, 1, False, "off")
    A.row = ["qwen2.5-7b/bs64/c512/mb8", "qwen2.5-14b/bs8/gcoff", "qwen2.5-7b/bs8/gcsel"]
    assert t3.row_specs(A) == [t3.RowSpec("qwen2.5-7b", 64, 512, 8, True), t3.RowSpec("qwen2.5-14b", 8, 2048, 1, False, "off"),
                               t3.RowSpec("qwen2.5-7b", 8, 2048, 1, True, "selective")]
    for bad, msg in (("qwen9/bs8", "unknown model"), ("qwen2.5-7b/c512", "batch"), ("qwen2.5-7b/bs8/x3", "bad part"),
                     ("qwen2.5-7b/bs0", "bad part")):
        A.row = [bad]
        with pytest.raises(ValueError, match=msg):
            t3.row_specs(A)


def _t3_rows():
    rows = []
    for model, steps in (("qwen2.5-7b", {"bf16": 30.0, "nf4": 40.0, "nvfp4": 20.0}),
                         ("qwen2.5-14b", {"bf16": 60.0, "nf4": 90.0, "nvfp4": 30.0})):
        for meth, s in steps.items():
            rows.append(dict(model=model, method=meth, batch=8, grad_ckpt=True, completion_len=2048, prompt_len=256,
                             micro_batch=1, step_s=s, peak_gib=10.0, logprob_s=0.1 * s, update_s=0.3 * s))
            rows.append(dict(model=model, method=meth, batch=8, grad_ckpt=False, completion_len=2048, prompt_len=256,
                             micro_batch=1, step_s=1.0, peak_gib=10.0))
    for meth, s in (("bf16", 40.0), ("nvfp4", 32.0)):  # the RL-batch row
        rows.append(dict(model="qwen2.5-7b", method=meth, batch=64, grad_ckpt=True, completion_len=512, prompt_len=256,
                         micro_batch=8, step_s=s, peak_gib=20.0, old_logprobs="forward"))
    for b, s in ((2, 11.0), (8, 13.0)):
        rows.append(dict(model="qwen2.5-32b", method="nvfp4", batch=b, grad_ckpt=True, completion_len=2048,
                         prompt_len=256, micro_batch=1, step_s=s, peak_gib=40.0 + b, memory_cap_gib=80.0))
        rows.append(dict(model="qwen2.5-32b", method="bf16", batch=b, grad_ckpt=True, completion_len=2048,
                         prompt_len=256, micro_batch=1, oom=True, oom_phase="build", memory_cap_gib=80.0))
    return rows


def test_table3_summary_has_exactly_the_keys_and_json(tmp_path):
    rows = _t3_rows()
    s, notes = t3.summarize(rows)
    assert list(s) == list(t3.SUMMARY_KEYS) and set(notes) == set(s)
    assert s["qwen2.5-14b/bs8/e2e_nvfp4_over_bf16"] == pytest.approx(2.0)
    assert s["qwen2.5-7b/bs8/e2e_nvfp4_over_bf16"] == pytest.approx(1.5)
    assert s["qwen2.5-14b/bs8/e2e_nvfp4_over_nf4"] == pytest.approx(3.0)
    assert s["qwen2.5-7b/bs8/train_nvfp4_over_bf16"] == pytest.approx(1.5)  # (0.4 * 30) / (0.4 * 20)
    assert s["qwen2.5-14b/bs8/train_nvfp4_over_bf16"] == pytest.approx(2.0)
    assert s["qwen2.5-7b/bs64/e2e_nvfp4_over_bf16"] == pytest.approx(1.25)
    assert "C=512 (fixed), micro-batch 8" in notes["qwen2.5-7b/bs64/e2e_nvfp4_over_bf16"]
    # rows of different set-ups (here: old log-probs reused by one method only) are not compared
    other = [dict(r, old_logprobs="reuse") if r.get("batch") == 64 and r["method"] == "nvfp4" else r for r in rows]
    assert t3.summarize(other)[0]["qwen2.5-7b/bs64/e2e_nvfp4_over_bf16"] is None
    assert s["qwen2.5-32b/bs2/peak_gib"] == 42.0 and s["qwen2.5-32b/bs8/s_per_step"] == 13.0
    assert s["qwen2.5-32b/memory_cap_gib"] == 80.0 and s["qwen2.5-32b/bf16_lora_oom"] is True
    assert "completion 2048" in notes["qwen2.5-32b/bs8/s_per_step"]
    prov = {"gpu": "h200", "git_sha": "b" * 40, "date": "2026-01-01T00:00:00+00:00", "env": {}}
    sc.write_json(t3.assemble(rows, prov, {}), tmp_path / "a", "h200")
    t3.merge([str(tmp_path / "a/h200.json")], str(tmp_path / "out"))
    on_disk = json.loads((tmp_path / "out/h200.json").read_text())
    assert {"gpu", "git_sha", "date", "rows", "summary"} <= set(on_disk)
    assert list(on_disk["summary"]) == list(t3.SUMMARY_KEYS) and on_disk["summary"] == s
    empty, _ = t3.summarize([])
    assert all(v is None for v in empty.values())
    no_oom, _ = t3.summarize([dict(model="qwen2.5-32b", method="bf16", batch=2, grad_ckpt=True, step_s=50.0,
                                   completion_len=2048, peak_gib=75.0, oom=False)])
    assert no_oom["qwen2.5-32b/bf16_lora_oom"] is False  # measured, not assumed


# ----------------------------------------------------------------------------------------------
# notebooks/table3.ipynb: runs headless on whatever results exist, and on none


def _run_notebook(name, tmp_path, monkeypatch, results):
    import nbformat

    from benchmarks import make_notebooks, run_notebooks

    monkeypatch.setenv("QERL_RESULTS", str(results))
    path = tmp_path / f"{name}.ipynb"
    nbformat.write(make_notebooks.build(name), path)
    nb = run_notebooks.run(path, timeout=120)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    return outputs


def _run_table3_notebook(tmp_path, monkeypatch, results):
    return _run_notebook("table3", tmp_path, monkeypatch, results)


def test_table3_notebook_without_results(tmp_path, monkeypatch):
    outputs = _run_table3_notebook(tmp_path, monkeypatch, tmp_path / "nothing")
    assert any("no results in" in o.get("text", "") for o in outputs)


def test_table3_notebook_plots_the_split(tmp_path, monkeypatch):
    rows = _t3_rows()
    for r in rows:
        if r.get("step_s"):
            r.update(rollout_s=0.6 * r["step_s"], logprob_s=0.1 * r["step_s"], update_s=0.3 * r["step_s"],
                     rollout_share=0.6)
    prov = {"gpu": "h200", "git_sha": "c" * 40, "date": "2026-01-01T00:00:00+00:00", "env": {}}
    sc.write_json(t3.assemble(rows, prov, {}), tmp_path / "res/table3", "h200")
    outputs = _run_table3_notebook(tmp_path, monkeypatch, tmp_path / "res")
    assert any("image/png" in o.get("data", {}) for o in outputs)
    assert any("bf16_lora_oom" in o.get("data", {}).get("text/plain", "") for o in outputs)


# ----------------------------------------------------------------------------------------------
# the scripts end to end on the CPU (toy architecture), as the GPU runs them


def test_rollout_throughput_main_smoke(tmp_path, capsys):
    res = rt.main(["--models", "tiny-qwen2", "--device", "cpu", "--methods", "nvfp4", "bf16", "hf_generate_bf16",
                   "--batch", "2", "--ranks", "4", "8", "--prompt", "5", "--completion", "4",
                   "--hf-completion", "3", "--out", str(tmp_path)])
    on_disk = json.loads((tmp_path / "cpu.json").read_text())
    rows = on_disk["rows"]
    assert on_disk["complete"] is True  # (written after every row with complete = False)
    assert len(rows) == 2 * 2 + 1 and not [r for r in rows if r.get("error")]
    assert {r["lora_rank"] for r in rows} == {4, 8} and list(res["summary"]) == list(rt.SUMMARY_KEYS)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == res["summary"]  # last line: JSON


def test_table3_main_smoke(tmp_path, capsys):
    res = t3.main(["--models", "tiny-qwen2", "--device", "cpu", "--methods", "nvfp4", "nf4", "--batch", "2",
                   "--grad-ckpt", "on", "off", "--prompt", "5", "--completion", "4", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "cpu.json").read_text())["rows"]
    assert len(rows) == 4 and all(r["step_s"] > 0 and not r["oom"] for r in rows)
    assert {"model_size_gb", "rollout_share", "optimizer", "lora_rank", "train_s"} <= set(rows[0])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == res["summary"]


def test_table3_steps_report_medians(tmp_path):
    t3.main(["--models", "tiny-qwen2", "--device", "cpu", "--methods", "nvfp4", "--batch", "2", "--prompt", "5",
             "--completion", "4", "--steps", "3", "--out", str(tmp_path)])
    (row,) = json.loads((tmp_path / "cpu.json").read_text())["rows"]
    assert row["timed_steps"] == 3 and len(row["steps"]) == 3
    for phase in ("rollout", "logprob", "update", "step"):
        vals = sorted(st[phase] for st in row["steps"])
        assert row[f"{phase}_s"] == vals[1]  # the median of three
    with pytest.raises(SystemExit):
        t3.parse_args(["--steps", "0"])


def test_table3_main_row_syntax_and_reuse(tmp_path):
    t3.main(["--row", "tiny-qwen2/bs4/c3/mb2", "--row", "tiny-qwen2/bs2/gcoff", "--device", "cpu", "--methods", "nvfp4",
             "--prompt", "5", "--completion", "4", "--old-logprobs", "reuse", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "cpu.json").read_text())["rows"]
    got = [(r["batch"], r["completion_len"], r["micro_batch"], r["grad_ckpt"], r["old_logprobs"]) for r in rows]
    assert got == [(4, 3, 2, True, "reuse"), (2, 4, 1, False, "reuse")]
    assert all(r["step_s"] > 0 and not r["oom"] and r["optimizer"] == "AdamW" for r in rows)


# notebooks/rollout.ipynb: the committed rollout results draw Figure 11; no results prints a note
def _run_rollout_notebook(tmp_path, monkeypatch, results):
    return _run_notebook("rollout", tmp_path, monkeypatch, results)


def test_rollout_notebook(tmp_path, monkeypatch):
    import shutil

    committed = Path(__file__).resolve().parents[1] / "results" / "rollout"
    if not list(committed.glob("*.json")):
        pytest.skip("no committed rollout results")
    (tmp_path / "res").mkdir()
    shutil.copytree(committed, tmp_path / "res" / "rollout")
    outputs = _run_rollout_notebook(tmp_path, monkeypatch, tmp_path / "res")
    assert any("image/png" in o.get("data", {}) for o in outputs)
    assert not (tmp_path / "res" / "figures").exists()  # a scratch folder unless asked
    monkeypatch.setenv("QERL_WRITE_FIGURES", "1")
    _run_rollout_notebook(tmp_path, monkeypatch, tmp_path / "res")
    assert (tmp_path / "res" / "figures" / "rollout_throughput.png").stat().st_size > 10_000
    empty = _run_rollout_notebook(tmp_path, monkeypatch, tmp_path / "nothing")
    assert any("no results in" in o.get("text", "") for o in empty)


def test_profile_decode_smoke_on_cpu(tmp_path):
    """benchmarks/profile_decode (a decode step's time by kernel category, issue 14) runs on a tiny model."""
    from benchmarks import profile_decode

    res = profile_decode.main(["--model", "tiny-qwen2", "--device", "cpu", "--methods", "nvfp4", "--batch", "2",
                               "--prompt", "5", "--tokens", "3", "--reps", "1", "--out", str(tmp_path)])
    (row,) = res["rows"]
    assert row["step_ms"] > 0 and row["kernels_per_step"] > 0 and row["categories"]
    assert json.loads((tmp_path / "profile_decode.json").read_text())["rows"][0]["batch"] == 2
    assert profile_decode.category("_fwd_gemv_kernel") == "4-bit linear"
    assert profile_decode.category("nvjet_sm90_tst_192x192") == "cuBLAS GEMM"
    assert profile_decode.category("void at::native::copy_kernel") == "other"


def test_table3_warm_up_trains_every_width_of_the_timed_step(cfg, monkeypatch):
    """With a length mix the warm-up trains on the timed step's own micro-batch widths (the 4-bit path's
    first forward / backward at a width costs more than later ones), so the timed step meets no new one."""
    from qerl import step as qstep

    monkeypatch.setattr(qstep, "WIDTH_ROUND", 2)  # several widths within the tiny cap
    widths, phase = {"warm": [], "timed": []}, ["warm"]
    real_width = qstep._width
    monkeypatch.setattr(qstep, "_width", lambda c, cm: widths[phase[0]].append(real_width(c, cm)) or widths[phase[0]][-1])
    real_rollout = qstep.rollout
    monkeypatch.setattr(qstep, "rollout", lambda *a, **k: phase.__setitem__(0, "timed") or real_rollout(*a, **k))

    class A(_Args):  # the padded path: micro-batch widths (padding-free forwards have no width)
        completion, lengths, padding_free = 8, "lognormal:median=2,p95=7", "off"

    m = tiny(cfg)
    opt, sched = _t3_opt(m, A)
    row = t3.measure(m, _spec(batch=4, mb=1), "nvfp4", A, cfg.vocab_size, opt, sched, {})
    assert not row["oom"] and "error" not in row
    drawn = sc.draw_lengths(A.lengths, 4, 8, seed=0)
    # each micro-batch (one sequence here) at its length rounded up, at most the rollout's width (its longest)
    assert sorted(set(widths["timed"])) == sorted({min(max(drawn), -(-n // 2) * 2) for n in drawn})
    assert len(set(widths["timed"])) >= 2 and set(widths["timed"]) <= set(widths["warm"])
