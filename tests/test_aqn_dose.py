"""The AQN dose-response study (experiments/aqn_dose.py, results/aqn_dose/PLAN.md): its arms, the plan's
block, Holm's correction, the analysis of synthetic run folders, the cap check, and the runner through the
launcher with stand-in training commands (no training, no GPU); and, once the study is committed, that its
table.csv comes out of its run folders again.

    .venv/bin/python -m pytest tests/test_aqn_dose.py -q
"""

import csv
import json
import math
import random
from pathlib import Path

import pytest

from experiments import aqn_dose as D

PLAN = {"cap": 128, "seeds": list(range(300, 312)), "min_blocks": 10}


def test_the_arms_and_their_noise():
    assert list(D.ARMS) == ["nvfp4-0", "nvfp4-1e-3", "nvfp4-3e-3", "nvfp4-1e-2", "bf16-0", "bf16-1e-2"]
    assert D.ARMS["nvfp4-0"] == {"method": "nvfp4_lora"} and D.ARMS["bf16-0"] == {"method": "bf16_lora"}
    assert D.ARMS["nvfp4-3e-3"] == {"method": "nvfp4_lora_aqn", "sigma_start": 3e-3, "sigma_end": 1.5e-4}
    assert D.ARMS["bf16-1e-2"] == {"method": "bf16_lora_aqn", "sigma_start": 1e-2, "sigma_end": 5e-4}
    for ov in D.ARMS.values():  # every method exists, and sigma_end = sigma_start / 20
        from qerl.config import make_config

        cfg = make_config("small", **ov)
        assert cfg.aqn == ("sigma_start" in ov)
        if cfg.aqn:
            assert cfg.sigma_end == pytest.approx(cfg.sigma_start / 20)


def test_the_plans_block(tmp_path):
    plan = tmp_path / "PLAN.md"
    assert D.read_plan(plan) is None  # no plan yet
    plan.write_text("# plan\n\n```aqn_dose\nmax_completion_length: 192\nseeds: 300-347\nmin_blocks: 44\n```\n")
    assert D.read_plan(plan) == {"cap": 192, "seeds": list(range(300, 348)), "min_blocks": 44}
    plan.write_text("```aqn_dose\nmax_completion_length: 96\nseeds: 5 7 9\nmin_blocks: 3\n```\n")
    assert D.read_plan(plan)["seeds"] == [5, 7, 9]
    plan.write_text("# a plan without its block\n")
    with pytest.raises(ValueError, match="no ```aqn_dose block"):
        D.read_plan(plan)


def test_holm_and_the_slope():
    assert D.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert math.isnan(D.holm([0.5, math.nan, 0.01])[1])  # nan stays nan, and counts in no family
    assert D.holm([0.5, math.nan, 0.01])[::2] == pytest.approx([0.5, 0.02])
    assert D.slope([0.0, 1.0, 2.0, 3.0]) == pytest.approx(1.0) and D.slope([0.4] * 4) == pytest.approx(0.0)
    assert D.slope([0.5, 0.49, 0.45, 0.41]) == pytest.approx(-0.031)


def test_power_and_the_budget():
    d = D.detectable(128, 0.093, 0.05)
    assert d == pytest.approx(0.0232, abs=0.0005)  # ~ (1.98 + 0.84) * 0.093 / sqrt(128)
    from experiments.aqn_power import t_test_power

    assert t_test_power(128, d, sd=0.093) == pytest.approx(0.80, abs=0.005)
    b = D.budget_rows(104.0)  # the equivalence test's ~17.4 GPU-s a run at cap 64, six runs a block
    assert b["blocks"] == int(45 * 60 * 4 * 0.8 // 104) and b["runs"] == 6 * b["blocks"]
    assert b["d_level_0.01"] > b["d_level_0.05"] and b["d_slope_0.01"] < b["d_level_0.01"]


# ---------------------------------------------------------------------------------------- synthetic run folders
def _write_run(root, name, seed, pass1, method, cap=128, sha="abc123", clip=0.02, trunc=0.01, **cfg_extra):
    d = root / "runs" / name
    d.mkdir(parents=True)
    aqn = method.endswith("_aqn")
    cfg = {"method": method, "fmt": method.split("_")[0], "aqn": aqn, "seed": seed, "loss_type": "grpo",
           "max_completion_length": cap, "max_steps": 30, "num_stages": 5, "output_dir": str(d),
           "provenance": {"git_sha": sha}, **cfg_extra}
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "summary.json").write_text(json.dumps({"status": "ok", "eval/arith/accuracy": pass1, "eval/arith/samples": 16,
                                                "eval/arith/truncated": trunc}))
    (d / "run.json").write_text(json.dumps({"exit_code": 0, "wall_s": 100.0}))
    (d / "segments.json").write_text(json.dumps([{"wall_s": 60.0, "exit_code": -15}, {"wall_s": 50.0, "exit_code": 0}]))
    rows = [{"step": s, "reward": 0.5, "sampling/entropy": 1.0, "completions/clipped_ratio": clip * (2 if s <= 6 else 1),
             **({"aqn/stage": 0 if s < 7 else 1} if aqn else {})} for s in range(1, 31)]
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))


def _study(root, seeds, level_step=-0.03, bf16_effect=0.0, sd=0.02, **kw):
    rng = random.Random(0)
    for s in seeds:
        base = rng.uniform(0.3, 0.6)
        for i, sig in enumerate(D.LEVELS):
            arm = D.arm_name("nvfp4", sig)
            _write_run(root, f"{arm}-s{s}", s, base + i * level_step + rng.gauss(0, sd), D.ARMS[arm]["method"], **kw)
        b = base + 0.2
        _write_run(root, f"bf16-0-s{s}", s, b + rng.gauss(0, sd), "bf16_lora", **kw)
        _write_run(root, f"bf16-1e-2-s{s}", s, b + bf16_effect + rng.gauss(0, sd), "bf16_lora_aqn", **kw)


def test_analysis_of_synthetic_blocks(tmp_path):
    _study(tmp_path, PLAN["seeds"])
    res = D.analyze(tmp_path, PLAN)
    assert res["seeds"] == PLAN["seeds"] and not res["left_out"]
    rows = {r["endpoint"]: r for r in csv.DictReader((tmp_path / "table.csv").open())}
    trend = rows["trend over sigma, NVFP4 (slope per level)"]
    assert float(trend["estimate"]) == pytest.approx(-0.03, abs=0.01) and trend["decision"] == "lower"
    assert rows["sigma 1e-2 vs 0, NVFP4"]["decision"] == "lower"
    assert rows["sigma 1e-2 vs 0, bf16"]["decision"] == "no difference shown"
    primary = [r for r in rows.values() if r["role"] == "primary"]
    assert len(primary) == 5 and all(float(r["p_holm"]) >= float(r["p_t"]) for r in primary)
    assert all(r["decision"] == "" and r["p_holm"] == "" for r in rows.values() if r["role"] == "secondary")
    inter = rows["noise effect at 1e-2, bf16 minus NVFP4"]
    assert float(inter["estimate"]) == pytest.approx(0.09, abs=0.035)  # bf16: no effect; NVFP4: -0.09 (SE 0.012)
    per_seed = list(csv.DictReader((tmp_path / "per_seed.csv").open()))
    assert len(per_seed) == 6 * 12 and {"cap_hit", "cap_hit_eval", "cap_hit_stage0", "wall_s"} <= set(per_seed[0])
    r = res["runs"][("nvfp4-1e-2", 300)]
    assert r["cap_hit"] == pytest.approx((6 * 0.04 + 24 * 0.02) / 30) and r["cap_hit_stage0"] == pytest.approx(0.04)
    assert r["wall_s"] == 110.0 and r["calls"] == 2  # two calls: the segments' wall times add up
    notes = (tmp_path / "NOTES.md").read_text()
    assert D.verdict(res) in notes and "final pass@1 falls" in notes and len(notes.splitlines()) < 120
    assert (tmp_path / "dose_response.png").stat().st_size > 0
    if hasattr(D, "ARTEFACT"):  # declared once notebooks/rewards.ipynb shows the study
        assert json.loads((tmp_path / "artefact.json").read_text())["artefact"] == "aqn_dose"


def test_blocks_left_out_and_too_few_blocks(tmp_path):
    _study(tmp_path, range(300, 304))
    _study(tmp_path, [304])
    cfg = tmp_path / "runs" / "nvfp4-3e-3-s304" / "config.json"
    cfg.write_text(cfg.read_text().replace("abc123", "other"))  # one run of the block at another commit
    _study(tmp_path, [305], cap=64)
    _study(tmp_path, [306], learning_rate=1.0)
    (tmp_path / "runs" / "bf16-0-s306" / "summary.json").unlink()  # unfinished: the block is incomplete
    _study(tmp_path, [307], clip=0.2)  # over the cap limit: reported, still used
    res = D.analyze(tmp_path, PLAN)
    assert res["seeds"] == [300, 301, 302, 303, 307]
    assert "git sha" in res["left_out"][304] and "completion cap 64" in res["left_out"][305]
    assert 306 not in res["left_out"]  # not complete, so not a block at all
    notes = (tmp_path / "NOTES.md").read_text()
    assert "Undecided: 5 complete blocks, fewer than the plan's 10." in notes
    assert "- left out, seed 304: git sha differs" in notes and "over the limit: " in notes


def test_one_block_is_no_test(tmp_path):
    _study(tmp_path, [300])
    res = D.analyze(tmp_path, {**PLAN, "min_blocks": 1})
    assert res["seeds"] == [300] and res["table"] == []
    assert "Undecided: 1 complete blocks, too few for a paired test." in (tmp_path / "NOTES.md").read_text()


def test_the_cap_check_reports_the_rates_and_the_budget(tmp_path):
    for cap, clip in ((64, 0.4), (128, 0.02)):
        for s in (900, 901):
            for arm, ov in D.ARMS.items():
                _write_run(tmp_path, f"{arm}-cap{cap}-s{s}", s, 0.4, ov["method"], cap=cap, clip=clip)
    rows = D.cap_check(tmp_path, per_gpu=10)
    assert len(rows) == 12 and {r["cap"] for r in rows} == {64, 128}
    r = next(r for r in rows if r["cap"] == 128 and r["arm"] == "bf16-1e-2")
    assert r["runs"] == 2 and r["cap_hit"] == pytest.approx(0.024) and r["cap_hit_last_stage"] == pytest.approx(0.02)
    # timed against the equivalence test's cap-64 noaqn runs: the same wall as nvfp4-0 at cap 64 here
    assert r["gpu_s"] == pytest.approx(D.ANCHOR_GPU_S)
    md = (tmp_path / "cap_check.md").read_text()
    assert "| 64 | no |" in md and "| 128 | yes | 99 |" in md  # six arms x 16.6 GPU-s a block


# ---------------------------------------------------------------------------------------- running
FAKE_TRAIN = r"""
import json, os, sys
from pathlib import Path
a = sys.argv[1:]
out = Path(a[a.index("--output-dir") + 1]); out.mkdir(parents=True, exist_ok=True)
seed = int(a[a.index("--seed") + 1]); method = a[a.index("--method") + 1]
cap = int(a[a.index("--max-completion-length") + 1])
assert a[a.index("--resume-from") + 1] == "auto" and "--overwrite" not in a
if os.environ.get("FAKE_STOP") and not (out / "checkpoints").exists():  # stopped mid-run: a checkpoint stays
    (out / "checkpoints" / "step-10").mkdir(parents=True)
    sys.exit(143)
(out / "config.json").write_text(json.dumps({"method": method, "fmt": method.split("_")[0],
    "aqn": method.endswith("_aqn"), "seed": seed, "max_completion_length": cap, "max_steps": 30, "num_stages": 5,
    "output_dir": str(out), "provenance": {"git_sha": "b" * 40}, "gpu": os.environ.get("CUDA_VISIBLE_DEVICES"),
    "resumed": (out / "checkpoints").exists()}))
(out / "metrics.jsonl").write_text("".join(json.dumps({"step": t, "reward": 0.5, "completions/clipped_ratio": 0.01})
                                           + "\n" for t in range(1, 31)))
(out / "checkpoints" / "step-30").mkdir(parents=True, exist_ok=True)
(out / "summary.json").write_text(json.dumps({"status": "ok", "eval/arith/accuracy": 0.4, "eval/arith/samples": 16,
                                              "eval/arith/truncated": 0.0}))
"""


@pytest.fixture
def fake(tmp_path, monkeypatch):
    from experiments import aqn_paired as A
    from experiments import launch as L

    script = tmp_path / "fake_train.py"
    script.write_text(FAKE_TRAIN)
    real = D.command
    monkeypatch.setattr(D, "command", lambda args, arm, seed, d, cap: [D.sys.executable, str(script),
                                                                       *real(args, arm, seed, d, cap)[4:]])
    monkeypatch.setattr(A, "prepare_model", lambda profile: None)
    monkeypatch.setattr(L, "POLL_S", 0.05)
    plan = tmp_path / "PLAN.md"
    plan.write_text("```aqn_dose\nmax_completion_length: 96\nseeds: 300-303\nmin_blocks: 4\n```\n")
    return plan


def test_the_study_needs_its_plan_and_runs_block_by_block_and_resumes(tmp_path, fake, monkeypatch, capsys):
    out = tmp_path / "small"
    argv = ["--plan", str(fake), "--out", str(out), "--gpus", "0", "1", "--per-gpu", "3"]
    assert D.main(["--plan", str(tmp_path / "none.md"), "--out", str(out)]) == 2
    assert "no plan at" in capsys.readouterr().err and not out.exists()
    assert D.main([*argv, "--dry-run"]) == 0
    dry = capsys.readouterr().out
    assert "24 runs, 0 finished, 24 to run, 6 at once" in dry and "nvfp4-0-s300 [GPU 0]" in dry
    assert "bf16-1e-2-s301 [GPU 1]" in dry and "--max-completion-length 96" in dry and not out.exists()
    monkeypatch.setenv("FAKE_STOP", "1")  # the first call: every run stopped with a checkpoint
    assert D.main(argv) == 1
    assert (out / "runs" / "nvfp4-0-s300" / "checkpoints" / "step-10").is_dir()  # kept for the next call
    monkeypatch.delenv("FAKE_STOP")
    assert D.main([*argv, "--archive", str(tmp_path / "dose.tar.gz")]) == 0
    d = out / "runs" / "bf16-1e-2-s302"
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["resumed"] and cfg["max_completion_length"] == 96 and not (d / "checkpoints").exists()
    assert [s["exit_code"] for s in json.loads((d / "segments.json").read_text())] == [143, 0]
    gpus = {s: {json.loads((out / "runs" / f"{a}-s{s}" / "config.json").read_text())["gpu"] for a in D.ARMS}
            for s in range(300, 304)}
    assert all(len(g) == 1 for g in gpus.values())  # a block on one GPU
    assert (out / "table.csv").is_file() and (out / "NOTES.md").is_file()
    import tarfile

    names = tarfile.open(tmp_path / "dose.tar.gz").getnames()
    assert "small/runs/nvfp4-3e-3-s303/segments.json" in names and not any("checkpoints" in n for n in names)
    monkeypatch.setattr(D, "command", lambda *a: pytest.fail("a finished run was started again"))
    assert D.main(argv) == 0


def test_the_cap_check_runs_every_arm_at_each_cap(tmp_path, fake, capsys):
    out = tmp_path / "check"
    assert D.main(["--check", "--caps", "64", "96", "--check-seeds", "900", "--out", str(out), "--gpus", "0", "1",
                   "--per-gpu", "4"]) == 0
    assert len(list((out / "runs").iterdir())) == 12 and (out / "runs" / "bf16-0-cap64-s900").is_dir()
    rows = list(csv.DictReader((out / "cap_check.csv").open()))
    assert {(r["arm"], r["cap"]) for r in rows} == {(a, c) for a in D.ARMS for c in ("64", "96")}
    assert "| 96 | yes |" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------- the committed study
def test_the_committed_study_reproduces(tmp_path):
    """results/aqn_dose/small: the analysis of the committed run folders gives the committed table.csv, by the
    committed plan, from one git sha."""
    import shutil

    root = Path(__file__).resolve().parents[1]
    src = root / D.OUT
    if not (src / "table.csv").is_file():
        pytest.skip("no committed results/aqn_dose/small/table.csv yet")
    plan = D.read_plan(root / D.PLAN)
    shutil.copytree(src / "runs", tmp_path / "runs")
    res = D.analyze(tmp_path, plan)
    assert len(res["seeds"]) >= plan["min_blocks"] and not res["left_out"]
    assert len({r["git_sha"] for (a, s), r in res["runs"].items() if s in res["seeds"]}) == 1
    assert (tmp_path / "table.csv").read_text() == (src / "table.csv").read_text()
    assert D.verdict(res) in (src / "NOTES.md").read_text()
