"""The paired AQN experiment's statistics, decision rule and analysis, on synthetic run folders."""

from __future__ import annotations

import csv
import json
import math
import tarfile

import pytest

from experiments import aqn_paired as A
from experiments import launch as L


def test_sign_test_exact():
    # 13 of 16 in one direction: 2 * sum_{i<=3} C(16, i) / 2^16 = 2 * 697 / 65536
    assert A.sign_test([1.0] * 13 + [-1.0] * 3) == (13, 3, pytest.approx(2 * 697 / 65536))
    assert A.sign_test([1.0] * 12 + [-1.0] * 4)[2] > 0.05  # 12 of 16 is not enough
    assert A.sign_test([0.0, 1.0, -1.0]) == (1, 1, 1.0)  # the zero is dropped


def test_betainc_and_t_test():
    assert A.betainc(3.0, 3.0, 0.5) == pytest.approx(0.5)
    assert A.betainc(1.0, 1.0, 0.3) == pytest.approx(0.3)  # uniform
    assert A.betainc(2.0, 1.0, 0.6) == pytest.approx(0.36)  # x^2
    # the two-sided 5% and 1% critical values of t with 15 degrees of freedom: 2.1314 and 2.9467; 16
    # differences of sample sd 1 and mean t / 4 have exactly that t
    z = math.sqrt(15 / 16)
    for t_crit, p in ((2.1314, 0.05), (2.9467, 0.01)):
        t, pv = A.paired_t([t_crit / 4 + z * (1 if i % 2 else -1) for i in range(16)])
        assert t == pytest.approx(t_crit, rel=1e-9)
        assert pv == pytest.approx(p, abs=2e-4)
    assert A.paired_t([0.25, 0.25, 0.25]) == (math.inf, 0.0)


def test_bootstrap_ci_covers_mean_and_is_deterministic():
    d = [0.01 * i - 0.05 for i in range(16)]
    lo, hi = A.bootstrap_ci(d)
    assert lo < sum(d) / 16 < hi
    assert (lo, hi) == A.bootstrap_ci(d)
    assert A.bootstrap_ci([0.2] * 5) == (pytest.approx(0.2), pytest.approx(0.2))


def test_decision_rule():
    e = dict(ci_low=0.01, ci_high=0.05, p_t=0.01, p_sign=0.02)
    assert A.verdict(e) == "helps"
    assert A.verdict({**e, "p_sign": 0.08}) == "undecided"  # both tests must pass
    assert A.verdict(dict(ci_low=-0.08, ci_high=-0.02, p_t=0.001, p_sign=0.004)) == "hurts"
    assert A.verdict(dict(ci_low=-0.08, ci_high=0.01, p_t=0.04, p_sign=0.04)) == "undecided"


def _write_run(root, arm, seed, pass1, rewards, gaps, loss_type="grpo"):
    d = root / "runs" / f"{arm}-s{seed}"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"loss_type": loss_type, "provenance": {"git_sha": "a" * 40}}))
    (d / "summary.json").write_text(json.dumps({"status": "ok", "eval/arith/accuracy": pass1, "eval/arith/samples": 16,
                                                "memory/peak_gib": 2.5, "memory/peak_with_eval_gib": 3.1}))
    (d / "run.json").write_text(json.dumps({"command": "python -m qerl train", "exit_code": 0, "wall_s": 90.0}))
    rows = [{"step": t, "reward": rewards[t - 1], "aqn/stage": (t - 1) // 6, "sampling/entropy": 1.0,
             "sampling/logprob_gap": gaps[t - 1]} for t in range(1, 31)]
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def test_analysis_on_synthetic_runs(tmp_path):
    out = tmp_path / "small"
    for s in range(16):
        base = 0.3 + 0.01 * s
        _write_run(out, "noaqn", s, base, [0.5] * 30, [0.02] * 30)
        # AQN lower in 14 of 16 seeds; its rewards over steps 7-30 lower by 0.1, its gap higher in stages 1-4
        _write_run(out, "aqn", s, base - 0.05 if s < 14 else base + 0.01, [0.5] * 6 + [0.4] * 24,
                   [0.02] * 6 + [0.2] * 24)
    for s in range(4):  # the exploratory arm: fewer seeds
        _write_run(out, "aqn3e-3", s, 0.3 + 0.01 * s, [0.5] * 30, [0.05] * 30)
    (out / "runs" / "aqn-s99").mkdir()  # an unfinished run folder is ignored
    res = A.analyze(out)
    p = res["primary"]
    assert p["n"] == 16 and p["verdict"] == "hurts"
    assert p["mean_diff"] == pytest.approx((14 * -0.05 + 2 * 0.01) / 16)
    assert (p["n_pos"], p["n_neg"]) == (2, 14)
    rows = list(csv.DictReader((out / "table.csv").open()))
    prim = [r for r in rows if r["role"] == "primary"]
    assert len(prim) == 1 and prim[0]["verdict"] == "hurts" and prim[0]["comparison"] == "aqn - noaqn"
    reward = next(r for r in rows if r["endpoint"] == "reward, steps 7-30" and r["comparison"] == "aqn - noaqn")
    assert float(reward["mean_diff"]) == pytest.approx(-0.1)
    gap1 = next(r for r in rows if r["endpoint"] == "log-prob gap, stage 1" and r["comparison"] == "aqn - noaqn")
    gap0 = next(r for r in rows if r["endpoint"] == "log-prob gap, stage 0" and r["comparison"] == "aqn - noaqn")
    assert float(gap1["mean_diff"]) == pytest.approx(0.18) and float(gap0["mean_diff"]) == pytest.approx(0.0)
    expl = [r for r in rows if r["comparison"] == "aqn3e-3 - noaqn"]
    assert expl and all(r["role"] == "exploratory" and r["verdict"] == "" for r in expl)
    assert next(r for r in expl if r["endpoint"] == "pass@1 (final)")["n"] == "4"
    notes = (out / "NOTES.md").read_text()
    assert "**AQN hurts NVFP4 LoRA" in notes and "16 paired seeds" in notes
    assert "`aqn3e-3` (exploratory): 4 finished runs" in notes and "2.50-2.50 GiB; with the final evaluation 3.10-3.10" in notes
    assert (out / "paired_differences.png").stat().st_size > 1000
    tgz = A.archive(out, tmp_path / "x" / "aqn.tar.gz")
    names = tarfile.open(tgz).getnames()
    assert "small/NOTES.md" in names and "small/runs/aqn-s0/metrics.jsonl" in names


def test_analysis_undecided_and_missing_pairs(tmp_path):
    out = tmp_path / "small"
    for s in range(6):
        _write_run(out, "noaqn", s, 0.3, [0.5] * 30, [0.02] * 30)
        if s < 5:
            _write_run(out, "aqn", s, 0.3 + (0.01 if s % 2 else -0.01), [0.5] * 30, [0.02] * 30)
    res = A.analyze(out)
    assert res["primary"]["n"] == 5 and res["primary"]["verdict"] == "undecided"
    notes = (out / "NOTES.md").read_text()
    assert "Undecided" in notes and "aqn-s5" in notes and "primary runs missing" in notes


def test_plan_order_and_command(tmp_path):
    order = A.plan_runs(list(A.ARMS), [0, 1])
    assert order == [("noaqn", 0), ("aqn", 0), ("noaqn", 1), ("aqn", 1), ("aqn3e-3", 0), ("aqn3e-3", 1)]
    args = A.parse_args(["--profile", "small"])
    cmd = A.command(args, "aqn3e-3", 3, tmp_path / "r")
    joined = " ".join(cmd)
    for piece in ("--profile small", "--method nvfp4_lora_aqn", "--sigma-start 0.003", "--seed 3", "--loss-type grpo",
                  "--eval-samples 16", "--eval-before false", "--wandb-mode disabled"):
        assert piece in joined
    import argparse

    from qerl.cli_train import add_train_args  # the flags parse into the plan's config

    ap = argparse.ArgumentParser()
    add_train_args(ap)
    ns = ap.parse_args(cmd[cmd.index("train") + 1:])
    assert ns.eval_before is False and ns.eval_samples == 16 and ns.loss_type == "grpo"


FAKE_TRAIN = r"""
import json, sys
from pathlib import Path
a = sys.argv[1:]
out = Path(a[a.index("--output-dir") + 1]); out.mkdir(parents=True, exist_ok=True)
seed = int(a[a.index("--seed") + 1]); aqn = a[a.index("--method") + 1].endswith("_aqn")
(out / "config.json").write_text(json.dumps({"loss_type": a[a.index("--loss-type") + 1],
                                             "provenance": {"git_sha": "b" * 40}}))
(out / "metrics.jsonl").write_text("".join(json.dumps({"step": t, "reward": 0.5, "aqn/stage": (t - 1) // 6,
    "sampling/entropy": 1.0, "sampling/logprob_gap": 0.1 if aqn else 0.02}) + "\n" for t in range(1, 31)))
(out / "checkpoints" / "step-30").mkdir(parents=True); (out / "reward.png").write_bytes(b"x")
(out / "summary.json").write_text(json.dumps({"status": "ok", "eval/arith/accuracy": 0.3 - 0.02 * aqn + 0.001 * seed,
                                              "eval/arith/samples": int(a[a.index("--eval-samples") + 1])}))
sys.exit(0)
"""


def test_run_loop_keeps_small_files_records_the_command_and_skips_finished_runs(tmp_path, monkeypatch):
    script = tmp_path / "fake_train.py"
    script.write_text(FAKE_TRAIN)
    real = A.command
    monkeypatch.setattr(A, "command", lambda args, arm, seed, d: [A.sys.executable, str(script),
                                                                  *real(args, arm, seed, d)[4:]])
    monkeypatch.setattr(A, "prepare_model", lambda profile: None)
    monkeypatch.setattr(L, "POLL_S", 0.2)
    out = tmp_path / "small"
    argv = ["--out", str(out), "--seeds", "0", "1", "2", "--arms", "noaqn", "aqn", "--parallel", "3",
            "--archive", str(tmp_path / "aqn.tar.gz")]
    assert A.main(argv) == 0
    d = out / "runs" / "aqn-s1"
    assert sorted(p.name for p in d.iterdir()) == ["config.json", "metrics.jsonl", "run.json", "summary.json"]
    rec = json.loads((d / "run.json").read_text())
    assert rec["exit_code"] == 0 and "--method nvfp4_lora_aqn" in rec["command"] and "--seed 1" in rec["command"]
    assert "--eval-before false" in rec["command"] and rec["wall_s"] >= 0
    rows = list(csv.DictReader((out / "table.csv").open()))
    prim = next(r for r in rows if r["role"] == "primary")
    assert prim["n"] == "3" and float(prim["mean_diff"]) == pytest.approx(-0.02)
    assert (tmp_path / "aqn.tar.gz").exists()
    mtime = (d / "summary.json").stat().st_mtime_ns
    monkeypatch.setattr(A, "command", lambda *a: pytest.fail("a finished run was started again"))
    assert A.main(argv) == 0  # everything finished: nothing runs, the analysis is rebuilt
    assert (d / "summary.json").stat().st_mtime_ns == mtime
