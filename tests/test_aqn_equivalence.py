"""The AQN equivalence test (results/aqn_equivalence/PLAN.md): its power calculation, and its analysis on
synthetic run folders (no training, no GPU).

    .venv/bin/python -m pytest tests/test_aqn_equivalence.py -q
"""

import math
from pathlib import Path

import pytest

from experiments import aqn_power


def test_t_distribution_matches_tables():
    # textbook quantiles: t(0.975, 15) = 2.131, t(0.95, 127) = 1.657, t(0.95, 1) = 6.314
    assert aqn_power.t_quantile(0.975, 15) == pytest.approx(2.1314, abs=1e-4)
    assert aqn_power.t_quantile(0.95, 127) == pytest.approx(1.6570, abs=1e-4)
    assert aqn_power.t_quantile(0.95, 1) == pytest.approx(6.3138, abs=1e-4)
    assert aqn_power.t_cdf(0.0, 7) == 0.5 and aqn_power.t_cdf(-2.1314, 15) == pytest.approx(0.025, abs=1e-5)


def test_tost_power_agrees_with_simulation_and_the_plan():
    """The plan's numbers: 128 pairs give ~81% power at true difference 0 (SD 0.076, margin 0.02, alpha 0.05)."""
    exact = aqn_power.tost_power(128)
    assert exact == pytest.approx(0.812, abs=0.005)
    assert aqn_power.simulated_tost_power(128, studies=8000) == pytest.approx(exact, abs=0.02)
    assert aqn_power.tost_power(125) < 0.8 <= aqn_power.tost_power(126)  # pairs_needed() = 126
    assert aqn_power.tost_power(128, delta=0.005) < exact  # a true difference costs power
    assert aqn_power.tost_power(128, sd=0.2) < 0.01  # too noisy: the margin is never reached
    assert math.isclose(aqn_power.t_test_power(16, 0.057), 0.80, abs_tol=0.01)


# ---------------------------------------------------------------------------------------- the analysis
def _write_run(root, arm, seed, pass1, sha="abc123", **cfg_extra):
    import json

    d = root / "runs" / f"{arm}-s{seed}"
    d.mkdir(parents=True)
    aqn = arm == "aqn"
    cfg = {"method": "nvfp4_lora_aqn" if aqn else "nvfp4_lora", "aqn": aqn, "seed": seed, "loss_type": "grpo",
           "output_dir": str(d), "provenance": {"git_sha": sha}, **cfg_extra}
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "summary.json").write_text(json.dumps({"status": "ok", "eval/arith/accuracy": pass1,
                                                "eval/arith/samples": 16}))
    (d / "run.json").write_text(json.dumps({"exit_code": 0, "wall_s": 100.0}))
    rows = [{"step": s, "reward": 0.5, "aqn/stage": 0 if s < 7 else 1, "sampling/entropy": 1.0,
             "sampling/logprob_gap": 0.1 + (0.2 * aqn if s >= 7 else 0.0)} for s in range(1, 13)]
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))


def _study(root, diffs, **kw):
    import random

    rng = random.Random(0)
    for i, dlt in enumerate(diffs):
        base = rng.uniform(0.3, 0.6)
        _write_run(root, "noaqn", 100 + i, base)
        _write_run(root, "aqn", 100 + i, base + dlt, **kw)


@pytest.mark.parametrize("mean, sd, n, want", [
    (0.0, 0.03, 124, "equivalent within 0.02"),
    (0.06, 0.03, 124, "AQN helps"),
    (-0.06, 0.03, 124, "AQN hurts"),
    (0.0, 0.3, 124, "undecided"),  # too noisy for either
    (0.0, 0.03, 60, "undecided"),  # fewer pairs than the plan's 120
])
def test_analysis_of_synthetic_runs(tmp_path, mean, sd, n, want):
    import csv
    import random

    from experiments import aqn_equivalence as eq

    rng = random.Random(1)
    _study(tmp_path, [rng.gauss(mean, sd) for _ in range(n)])
    res = eq.analyze(tmp_path)
    p = res["primary"]
    assert p["n"] == n and p["verdict"] == want
    rows = list(csv.DictReader((tmp_path / "table.csv").open()))
    assert rows[0]["endpoint"] == "pass@1 (final)" and rows[0]["verdict"] == want
    assert {"p_tost", "p_tost_low", "p_tost_high", "p_t", "ci90_low", "ci90_high", "ci95_low", "ci95_high",
            "boot90_low", "boot95_high"} <= set(rows[0])
    assert float(rows[0]["ci90_low"]) > float(rows[0]["ci95_low"])  # the 90% CI lies inside the 95% one
    assert (p["p_tost"] < 0.05) == (-0.02 < p["ci90_low"] and p["ci90_high"] < 0.02)  # TOST = the 90% CI rule
    notes = (tmp_path / "NOTES.md").read_text()
    assert eq.verdict_sentence(p) in notes and (tmp_path / "paired_differences.png").stat().st_size > 0
    gap = next(r for r in rows if r["endpoint"] == "log-prob gap, stage 1")
    assert float(gap["mean_diff"]) == pytest.approx(0.2) and gap["verdict"] == ""  # secondary: decides nothing


def test_pairs_with_another_commit_or_other_settings_are_left_out(tmp_path):
    from experiments import aqn_equivalence as eq

    _study(tmp_path, [0.0] * 4)
    _write_run(tmp_path, "noaqn", 200, 0.5)
    _write_run(tmp_path, "aqn", 200, 0.5, sha="other")
    _write_run(tmp_path, "noaqn", 201, 0.5)
    _write_run(tmp_path, "aqn", 201, 0.5, learning_rate=1.0)
    _write_run(tmp_path, "noaqn", 202, 0.5)  # its aqn run is missing: no pair
    res = eq.analyze(tmp_path, min_pairs=2)
    assert res["seeds"] == [100, 101, 102, 103]
    assert set(res["left_out"]) == {200, 201} and "learning_rate" in res["left_out"][201]
    assert "left out, seed 200: git sha differs" in (tmp_path / "NOTES.md").read_text()


def test_tost():
    from experiments import aqn_equivalence as eq

    lo, hi, p = eq.tost([0.001, -0.002, 0.0015, -0.0005] * 10)
    assert p == max(lo, hi) < 1e-6
    assert eq.tost([0.05, 0.06, 0.04, 0.05])[2] > 0.5  # clearly outside the margin


# ---------------------------------------------------------------------------------------- planning and running
def _args(*argv):
    from experiments import aqn_equivalence as eq

    return eq.parse_args(list(argv))


def test_plan_deals_pairs_whole_over_the_gpus(tmp_path):
    from experiments import aqn_equivalence as eq

    todo = eq.plan_runs()
    assert len(todo) == 256 and todo[:3] == [("noaqn", 100), ("aqn", 100), ("noaqn", 101)]
    assert {s for _, s in todo} == set(range(100, 228))  # the plan's seeds
    by_gpu = eq.assign_gpus([s for _, s in todo], ["0", "1", "2", "3"])
    assert [len(v) for v in by_gpu.values()] == [32] * 4 and sorted(sum(by_gpu.values(), [])) == list(range(100, 228))
    tasks = eq.pending(_args("--out", str(tmp_path), "--gpus", "0", "1", "2", "3", "--per-gpu", "12"), tmp_path)
    assert len(tasks) == 256 and {t.name for t in tasks} == {f"{a}-s{s}" for a, s in todo}
    gpu = {t.name: t.gpu for t in tasks}
    for g in ("0", "1", "2", "3"):  # both arms of a seed on one GPU: as many runs of each arm on every GPU
        arms = [t.name.rpartition("-s")[0] for t in tasks if t.gpu == g]
        assert arms.count("aqn") == arms.count("noaqn") == 32
    assert all(gpu[f"aqn-s{s}"] == gpu[f"noaqn-s{s}"] for s in range(100, 228))
    assert "--seed 100" in " ".join(tasks[0].command) and "--method nvfp4_lora " in " ".join(tasks[0].command) + " "
    assert not (tmp_path / "runs").exists()  # planning writes nothing
    # without --gpus nothing is pinned (the launcher leaves CUDA_VISIBLE_DEVICES alone)
    assert all(t.gpu is None for t in eq.pending(_args("--out", str(tmp_path)), tmp_path))


def test_a_resumed_study_plans_only_the_unfinished_runs(tmp_path):
    from experiments import aqn_equivalence as eq

    _study(tmp_path, [0.0] * 10)  # seeds 100-109 finished in both arms
    _write_run(tmp_path, "noaqn", 110, 0.5)  # seed 110: only its noaqn run finished
    _write_run(tmp_path, "aqn", 111, 0.5)
    (tmp_path / "runs" / "aqn-s111" / "summary.json").unlink()  # cut off: not finished, runs again
    tasks = eq.pending(_args("--out", str(tmp_path), "--gpus", "0", "1", "--per-gpu", "3"), tmp_path)
    names = [t.name for t in tasks]
    assert len(names) == 256 - 21 and names[:3] == ["aqn-s110", "noaqn-s111", "aqn-s111"]
    assert not {f"{a}-s{s}" for a in ("noaqn", "aqn") for s in range(100, 110)} & set(names)
    assert {t.gpu for t in tasks} == {"0", "1"} and tasks[1].gpu == tasks[2].gpu


def test_dry_run_prints_the_plan_and_each_gpus_runs_and_writes_nothing(tmp_path, capsys):
    from experiments import aqn_equivalence as eq

    assert eq.main(["--out", str(tmp_path / "eq"), "--gpus", "0", "1", "2", "3", "--per-gpu", "12", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "128 pairs (seeds 100-227) = 256 runs; 0 finished, 256 to run, 4 GPUs x 12 runs at once" in out
    for g in range(4):
        assert f"GPU {g}: 32 pairs, 64 runs, seeds {100 + g} {104 + g} " in out
    assert "noaqn-s100 [GPU 0]: " in out and "aqn-s100 [GPU 0]: " in out and "aqn-s101 [GPU 1]: " in out
    assert not (tmp_path / "eq").exists()
    assert eq.main(["--out", str(tmp_path / "eq"), "--per-gpu", "4", "--dry-run"]) == 2  # --per-gpu needs --gpus


FAKE_TRAIN = r"""
import json, os, sys
from pathlib import Path
a = sys.argv[1:]
out = Path(a[a.index("--output-dir") + 1]); out.mkdir(parents=True, exist_ok=True)
seed = int(a[a.index("--seed") + 1]); aqn = a[a.index("--method") + 1].endswith("_aqn")
(out / "config.json").write_text(json.dumps({"method": a[a.index("--method") + 1], "aqn": aqn, "seed": seed,
    "loss_type": "grpo", "output_dir": str(out), "provenance": {"git_sha": "b" * 40},
    "gpu": os.environ.get("CUDA_VISIBLE_DEVICES")}))
(out / "metrics.jsonl").write_text("".join(json.dumps({"step": t, "reward": 0.5}) + "\n" for t in range(1, 31)))
(out / "checkpoints").mkdir()
(out / "summary.json").write_text(json.dumps({"status": "ok", "eval/arith/accuracy": 0.4 + 0.01 * aqn,
                                              "eval/arith/samples": 16}))
"""


def test_the_study_runs_through_the_launcher_and_resumes(tmp_path, monkeypatch):
    """Stand-in training commands (no training): the runs spread over two GPUs, two at once on each, both
    arms of a seed on one GPU; the analysis and artefact.json follow; a second call starts nothing."""
    import json

    from experiments import aqn_equivalence as eq
    from experiments import aqn_paired as A
    from experiments import launch as L

    script = tmp_path / "fake_train.py"
    script.write_text(FAKE_TRAIN)
    real = A.command
    monkeypatch.setattr(A, "command", lambda args, arm, seed, d: [A.sys.executable, str(script),
                                                                  *real(args, arm, seed, d)[4:]])
    monkeypatch.setattr(A, "prepare_model", lambda profile: None)
    monkeypatch.setattr(L, "POLL_S", 0.05)
    out = tmp_path / "small"
    argv = ["--out", str(out), "--seeds", "100", "101", "102", "103", "--gpus", "0", "1", "--per-gpu", "2"]
    assert eq.main(argv) == 0
    rec = {d.name: json.loads((d / "run.json").read_text()) for d in (out / "runs").iterdir()}
    assert len(rec) == 8 and {r["gpu"] for r in rec.values()} == {"0", "1"}
    assert all(rec[f"aqn-s{s}"]["gpu"] == rec[f"noaqn-s{s}"]["gpu"] for s in range(100, 104))
    cfg = json.loads((out / "runs" / "aqn-s101" / "config.json").read_text())
    assert cfg["gpu"] == rec["aqn-s101"]["gpu"]  # the process saw its one GPU
    assert not (out / "runs" / "aqn-s101" / "checkpoints").exists()  # only the small files stay
    assert json.loads((out / "artefact.json").read_text())["artefact"] == "aqn_equivalence"
    assert "undecided" in (out / "table.csv").read_text()  # 4 pairs: fewer than the plan's 120
    monkeypatch.setattr(A, "command", lambda *a: pytest.fail("a finished run was started again"))
    assert eq.main(argv) == 0
    # --archive packs the runs and the analysis, also when the analysis fails (to carry a study on)
    import tarfile

    tgz = tmp_path / "study.tar.gz"
    monkeypatch.setattr(eq, "analyze", lambda out: (_ for _ in ()).throw(RuntimeError("analysis broke")))
    with pytest.raises(RuntimeError, match="analysis broke"):
        eq.main([*argv, "--archive", str(tgz)])
    names = tarfile.open(tgz).getnames()
    assert "small/runs/aqn-s103/run.json" in names and "small/table.csv" in names


def test_the_committed_study_reproduces_and_the_readme_states_its_verdict(tmp_path):
    """results/aqn_equivalence/small: the analysis of the committed runs gives the committed table.csv, the
    plan's rules hold on them (>= 120 pairs, one git sha, configs differing only in AQN), and the README's
    AQN row names the verdict."""
    import csv
    import shutil

    from experiments import aqn_equivalence as eq

    root = Path(__file__).resolve().parents[1]
    src = root / eq.OUT
    if not (src / "table.csv").is_file():
        pytest.skip("no committed results/aqn_equivalence/small/table.csv")
    shutil.copytree(src / "runs", tmp_path / "runs")
    res = eq.analyze(tmp_path)
    p = res["primary"]
    assert p["n"] >= eq.MIN_PAIRS and not res["left_out"]
    assert len({r["git_sha"] for r in res["runs"].values()}) == 1
    assert (tmp_path / "table.csv").read_text() == (src / "table.csv").read_text()
    committed = list(csv.DictReader((src / "table.csv").open()))[0]
    assert committed["verdict"] == p["verdict"]
    assert eq.verdict_sentence(p) in (src / "NOTES.md").read_text()
    readme = (root / "README.md").read_text()
    row = next(line for line in readme.splitlines() if "aqn_equivalence/small/NOTES.md" in line)
    assert f"**{p['verdict']}" in row and f"{p['mean_diff']:+.3f}" in row
