"""Experiment scripts (experiments/*.py): planning, commands, skipping, table.csv, figures.

No training: planned commands are parsed by qerl's own CLI into TrainConfigs, the run loop is
driven with a stand-in command that writes a run folder, and table.csv is built from synthetic
runs (and, where committed, from results/table1/small, which it must reproduce exactly).

Run with: OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_experiments.py -q   (~15 s, CPU)
"""

import argparse
import importlib
import json
import shutil
import sys
from pathlib import Path

import pytest

from qerl.cli_train import add_eval_args, add_train_args, config_from_args
from qerl.config import PROFILES, TABLE4_BIGMATH, make_config

ROOT = Path(__file__).resolve().parent.parent
from experiments import _common as C  # noqa: E402
from experiments import launch as L  # noqa: E402

SCRIPTS = ["table1_gsm8k", "table2_bigmath", "fig4_reward_curves", "fig5_entropy", "fig7_training_reward",
           "fig8_aqn_ablation", "fig9_noise_schedulers", "fig10_lora_rank", "fig16_lr_ablation"]
# (script, profile) -> number of planned runs with the default seeds and models
EXPECTED_RUNS = {
    ("table1_gsm8k", "smoke"): 4 + 6, ("table1_gsm8k", "small"): 4 + 6 * 3, ("table1_gsm8k", "paper"): 2 * 10,
    ("table2_bigmath", "smoke"): 6, ("table2_bigmath", "small"): 6, ("table2_bigmath", "paper"): 2 * 6,
    ("fig4_reward_curves", "smoke"): 10, ("fig4_reward_curves", "small"): 30, ("fig4_reward_curves", "paper"): 10,
    ("fig5_entropy", "smoke"): 4, ("fig5_entropy", "small"): 12, ("fig5_entropy", "paper"): 4,
    ("fig7_training_reward", "smoke"): 3, ("fig7_training_reward", "small"): 9, ("fig7_training_reward", "paper"): 6,
    ("fig8_aqn_ablation", "smoke"): 2, ("fig8_aqn_ablation", "small"): 6, ("fig8_aqn_ablation", "paper"): 4,
    ("fig9_noise_schedulers", "smoke"): 4, ("fig9_noise_schedulers", "small"): 12, ("fig9_noise_schedulers", "paper"): 4,
    ("fig10_lora_rank", "smoke"): 4, ("fig10_lora_rank", "small"): 12, ("fig10_lora_rank", "paper"): 4,
    ("fig16_lr_ablation", "smoke"): 4, ("fig16_lr_ablation", "small"): 12, ("fig16_lr_ablation", "paper"): 4,
}


GIT = {"git_sha": "a" * 40, "git_dirty": False}


def _plan(script, profile, tmp_path, *extra):
    exp = importlib.import_module(f"experiments.{script}").EXPERIMENT
    args = C.parse_args(exp, ["--profile", profile, "--results", str(tmp_path / "results"),
                              "--runs-dir", str(tmp_path / "runs"), "--data-dir", "DATA", *extra])
    return exp, args, C.planned(exp, args, tmp_path / "root")


def _train_cfg(cmd):
    """The TrainConfig `python -m qerl train ...` would build from a planned command."""
    assert cmd[1:4] == ["-m", "qerl", "train"], cmd
    p = argparse.ArgumentParser()
    add_train_args(p)
    return config_from_args(p.parse_args(cmd[4:]))


def _eval_args(cmd):
    assert cmd[1:4] == ["-m", "qerl", "eval"], cmd
    p = argparse.ArgumentParser()
    add_eval_args(p)
    return p.parse_args(cmd[4:])


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_imports_and_has_a_docstring(script):
    mod = importlib.import_module(f"experiments.{script}")
    doc = mod.__doc__
    assert doc.startswith("Paper ") and f"python -m experiments.{script} " in doc
    assert "--profile small" in doc and "--profile paper" in doc and "H200" in doc
    assert isinstance(mod.EXPERIMENT, C.Experiment) and mod.EXPERIMENT.name == mod.NAME


@pytest.mark.parametrize("profile", ["smoke", "small", "paper"])
@pytest.mark.parametrize("script", SCRIPTS)
def test_every_planned_command_parses_into_a_valid_config(script, profile, tmp_path):
    exp, args, plan = _plan(script, profile, tmp_path)
    assert len(plan) == EXPECTED_RUNS[(script, profile)]
    for run, cmd, done in plan:
        assert not done
        if run.kind == "eval":
            ev = _eval_args(cmd)
            assert ev.out == str(tmp_path / "root" / "work" / exp.name / run.name / "eval.json")
            assert ev.data_dir == "DATA"
            continue
        cfg = _train_cfg(cmd)
        # the data folder only where the run reads one (arith is generated)
        assert cfg.data_dir == ("DATA" if C.reads_data_dir(cfg) else None), run.name
        assert cfg.profile == profile and cfg.resume_from == "auto"
        assert cfg.wandb_group == f"{exp.name}-{profile}"
        assert cfg.output_dir == str(tmp_path / "root" / "work" / exp.name / run.name)
        assert run.name.endswith(f"-s{cfg.seed}")
        for k, v in run.overrides.items():  # every override reaches the config
            assert getattr(cfg, k) == (tuple(v) if isinstance(v, list) else v), (run.name, k)


def test_knobs_of_each_figure(tmp_path):
    def cfgs(script, profile="small"):
        return {r.name: _train_cfg(cmd) for r, cmd, _ in _plan(script, profile, tmp_path)[2] if r.kind == "train"}

    fig9 = cfgs("fig9_noise_schedulers")
    assert {c.noise_schedule for c in fig9.values()} == {"exponential", "linear", "cosine", "logarithmic"}
    assert {c.method for c in fig9.values()} == {"nvfp4_lora_aqn"}
    fig10 = cfgs("fig10_lora_rank")
    assert {(c.lora_rank, c.lora_alpha) for c in fig10.values()} == {(16, 32), (32, 64), (64, 128), (128, 256)}
    fig16 = cfgs("fig16_lr_ablation", "paper")
    assert {(c.method, c.learning_rate) for c in fig16.values()} == {
        (m, lr) for m in ("nvfp4_lora_aqn", "bf16_lora") for lr in (5e-6, 3e-5)}
    fig4 = cfgs("fig4_reward_curves")
    assert {c.loss_type for c in fig4.values()} == {"grpo", "bnpo"}
    assert len({c.method for c in fig4.values()}) == 5 and fig4["grpo-bf16_full-s0"].learning_rate == C.FULL_FT_LR
    assert all(c.beta == 0 and c.epsilon_high == 0.28 for c in fig4.values())
    fig7 = cfgs("fig7_training_reward", "paper")
    assert {c.model for c in fig7.values()} == {"Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-14B-Instruct"}
    assert all(c.dataset == "bigmath" and c.loss_type == "bnpo" and c.num_generations == 16 and c.max_steps == 250
               for c in fig7.values())
    fig8 = cfgs("fig8_aqn_ablation", "paper")
    assert fig8["qwen2.5-3b-instruct-nvfp4_lora_aqn-s0"].dataset == "gsm8k"
    assert fig8["qwen2.5-3b-instruct-nvfp4_lora_aqn-s0"].max_steps == 80
    assert fig8["nvfp4_lora_aqn-s0"].dataset == "bigmath"
    t2 = _plan("table2_bigmath", "small", tmp_path)[2]
    assert [r.name for r, _, _ in t2[:2]] == ["base-bf16", "base-nvfp4"]
    assert _eval_args(t2[0][1]).datasets == ["arith", "math500", "aime24", "aime25", "amc23"]
    t2p = {r.name: _train_cfg(cmd) for r, cmd, _ in _plan("table2_bigmath", "paper", tmp_path)[2] if r.kind == "train"}
    assert t2p["bf16_lora-s0"].learning_rate == 5e-6 and t2p["nvfp4_lora_aqn-s0"].learning_rate == 1e-5
    assert t2p["nvfp4_lora-s0"].eval_datasets == ("math500", "aime24", "aime25", "amc23")


# The paper's algorithm per artefact: GRPO for Table 1 and the GSM8K figures (Fig. 5, 9, 10, 16 and
# Fig. 8's 3B panel), DAPO (TRL 0.18 "bnpo") for Table 2, Fig. 7 and Fig. 8's 7B BigMath panel; Fig. 4
# shows both. Pinned by the scripts, so a change of TrainConfig's default loss cannot move them.
GRPO_LOSS = {"loss_type": "grpo", "beta": 0.0, "epsilon": 0.2, "epsilon_high": 0.28}
DAPO_LOSS = {"loss_type": "bnpo", "beta": 0.0, "epsilon": 0.2, "epsilon_high": 0.28}
ALGORITHM = {"table1_gsm8k": "grpo", "table2_bigmath": "dapo", "fig4_reward_curves": "label",
             "fig5_entropy": "grpo", "fig7_training_reward": "dapo", "fig9_noise_schedulers": "grpo",
             "fig10_lora_rank": "grpo", "fig16_lr_ablation": "grpo",
             "fig8_aqn_ablation": lambda cfg: "dapo" if cfg.dataset == "bigmath" else "grpo"}


@pytest.mark.parametrize("profile", ["smoke", "small", "paper"])
@pytest.mark.parametrize("script", SCRIPTS)
def test_each_script_pins_the_papers_algorithm(script, profile, tmp_path, monkeypatch):
    import qerl.config

    # a different default loss must not change what any script runs
    monkeypatch.setitem(qerl.config.PROFILES, profile, {**qerl.config.PROFILES[profile], "loss_type": "dr_grpo",
                                                        "epsilon_high": 0.5, "beta": 0.1})
    trained = [(r, _train_cfg(cmd)) for r, cmd, _ in _plan(script, profile, tmp_path)[2] if r.kind == "train"]
    assert trained
    for run, cfg in trained:
        rule = ALGORITHM[script]
        algo = run.label if rule == "label" else rule(cfg) if callable(rule) else rule
        want = {"grpo": GRPO_LOSS, "dapo": DAPO_LOSS}[algo]
        assert {k: getattr(cfg, k) for k in want} == want, (script, run.name)
    if script == "fig8_aqn_ablation" and profile == "paper":
        assert {cfg.loss_type for _, cfg in trained} == {"grpo", "bnpo"}


def test_paper_profile_holds_table4():
    g = make_config("paper", method="nvfp4_lora_aqn")
    assert (g.prompts_per_step * g.num_generations, g.num_generations) == (128, 8)  # batch 128, 8 samples
    assert g.num_iterations == 4 and g.mini_batch_size == 0  # 4 policy updates per rollout
    assert (g.max_completion_length, g.temperature, g.epsilon, g.epsilon_high, g.beta) == (4096, 1.0, 0.2, 0.28, 0)
    assert (g.optim, g.learning_rate, g.lora_rank, g.sigma_start, g.sigma_end) == ("adamw_8bit", 1e-5, 32, 1e-2, 5e-4)
    assert g.loss_type == "grpo" and g.dataset == "gsm8k" and (g.eval_temperature, g.eval_top_p) == (0.6, 0.95)
    assert make_config("paper", method="bf16_lora").learning_rate == 5e-6  # Table 4: bf16 LoRA
    assert make_config("paper", method="bf16_lora", learning_rate=3e-5).learning_rate == 3e-5  # flags win
    assert make_config("small", method="bf16_lora").learning_rate == PROFILES["small"]["learning_rate"]
    b = make_config("paper", **TABLE4_BIGMATH)
    assert (b.prompts_per_step * b.num_generations, b.num_generations, b.num_iterations) == (128, 16, 1)
    assert (b.max_completion_length, b.loss_type, b.epsilon_high) == (8192, "bnpo", 0.28)


def _fake_train_run(d: Path, method="nvfp4_lora", seed=0, status="ok", rewards=(0.1, 0.2, 0.3), **cfg):
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({"model": "m", "method": method, "seed": seed, "dataset": "arith",
                                               "provenance": {"git_sha": "abc"}, **cfg}))
    (d / "summary.json").write_text(json.dumps({"status": status, "eval_before/arith/accuracy": 0.1,
                                                "eval/arith/accuracy": 0.5, "eval/arith/format": 0.0, "steps": 3}))
    lines = [{"step": 0, "eval/arith/accuracy": 0.1}] + [
        {"step": i + 1, "reward": r, "entropy": 2.0 - 0.1 * i, "aqn/sigma": 0.01, "sampling/logprob_gap": 0.01 * (i + 1)}
        for i, r in enumerate(rewards)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_collect_builds_long_form_table(tmp_path):
    root = tmp_path / "exp" / "small"
    _fake_train_run(root / "runs" / "r16-s0", lora_rank=16)
    (root / "runs" / "r16-s0" / "run.json").write_text(json.dumps({"label": "lora_rank=16"}))
    (root / "runs" / "base-nvfp4").mkdir(parents=True)
    (root / "runs" / "base-nvfp4" / "eval.json").write_text(json.dumps(
        {"results": {"math500": {"accuracy": 0.25}}, "args": {"model": "m"}, "provenance": {"git_sha": "def"}}))
    rows = C.collect(root, curves=True)
    import pandas as pd

    df = pd.read_csv(root / "table.csv")
    assert list(df.columns) == C.COLUMNS and len(df) == len(rows)
    base = df[df.run == "base-nvfp4"].iloc[0]
    assert (base.method, base.dataset, base.value, base.git_sha) == ("nvfp4", "math500", 0.25, "def")
    r = df[df.run == "r16-s0"].set_index("metric")
    assert r.loc["accuracy", "method"] == "nvfp4_lora (lora_rank=16)"
    assert r.loc["accuracy", "value"] == 0.5 and r.loc["accuracy_before", "value"] == 0.1
    assert r.loc["reward_last5", "value"] == pytest.approx(0.2) and r.loc["reward_first5", "dataset"] == "arith"
    assert r.loc["entropy_first5", "value"] == pytest.approx(1.9)
    assert r.loc["logprob_gap_mean", "value"] == pytest.approx(0.02)


def test_collect_reproduces_committed_table1(tmp_path):
    src = ROOT / "results/table1/small"
    if not (src / "table.csv").exists():
        pytest.skip("committed results/table1/small not present")
    shutil.copytree(src / "runs", tmp_path / "runs")
    C.collect(tmp_path, curves=False)
    assert (tmp_path / "table.csv").read_text() == (src / "table.csv").read_text()


FAKE_TRAIN = r"""
import json, sys
from pathlib import Path
args = sys.argv[1:]
out = Path(args[args.index("--output-dir") + 1]); out.mkdir(parents=True, exist_ok=True)
seed = int(args[args.index("--seed") + 1]); sched = args[args.index("--noise-schedule") + 1]
steps = int(args[args.index("--max-steps") + 1]) if "--max-steps" in args else 30
(out / "config.json").write_text(json.dumps({"model": "MODEL", "method": "nvfp4_lora_aqn", "seed": seed,
    "dataset": "arith", "noise_schedule": sched, "max_steps": steps, "provenance": {"git_sha": "a" * 40}}))
(out / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "reward": 0.1 * i + 0.01 * seed, "entropy": 1.0,
    "aqn/sigma": 0.01 / (i + 1)}) + "\n" for i in range(1, 4)))
(out / "summary.json").write_text(json.dumps({"status": "ok", "eval/arith/accuracy": 0.5 + 0.1 * seed}))
sys.exit(3 if sched == "cosine" and seed == 1 and not (out / "fixed").exists() else 0)
"""


@pytest.fixture
def fake_runs(tmp_path, monkeypatch):
    """Experiments launch a stand-in for `python -m qerl train` at a fixed, clean git sha."""
    script = tmp_path / "fake_train.py"
    script.write_text(FAKE_TRAIN.replace("MODEL", C.default_model("small")))
    real = C.command
    monkeypatch.setattr(C, "command", lambda e, r, a, d: [sys.executable, str(script), *real(e, r, a, d)[4:]]
                        if r.kind == "train" else real(e, r, a, d))
    monkeypatch.setattr(L, "POLL_S", 0.05)
    monkeypatch.setattr(C, "git_info", lambda: dict(GIT))
    return tmp_path


def test_run_loop_runs_fresh_collects_summarizes_and_draws(fake_runs, capsys):
    """The real loop: a new root per invocation, parallel launch, copy, table, summary over seeds, figure."""
    tmp_path = fake_runs
    exp = importlib.import_module("experiments.fig9_noise_schedulers").EXPERIMENT
    root = tmp_path / "root"
    base = ["--profile", "small", "--parallel", "4", "--seeds", "0", "1", "--results", str(tmp_path / "results")]
    assert C.main(exp, base + ["--root", str(root)]) == 1  # one run exited 3
    res = root / "results" / exp.name / "small"
    meta = json.loads((res / "runs/cosine-s1/run.json").read_text())
    assert meta["exit_code"] == 3 and meta["label"] == "noise_schedule=cosine" and "--noise-schedule cosine" in meta["command"]
    planned = json.loads((root / "work" / exp.name / "linear-s0" / "planned.json").read_text())
    assert planned["git_sha"] == GIT["git_sha"] and planned["spec"]["noise_schedule"] == "linear"
    import pandas as pd

    df = pd.read_csv(res / "table.csv")
    assert set(df.run) == {f"{s}-s{i}" for s in ("exponential", "linear", "cosine", "logarithmic") for i in (0, 1)}
    summ = pd.read_csv(res / "summary.csv").set_index(["method", "metric"])
    acc = summ.loc[("nvfp4_lora_aqn (noise_schedule=linear)", "accuracy")]
    assert acc["n"] == 2 and acc["mean"] == pytest.approx(0.55) and acc["std"] == pytest.approx(0.1 / 2 ** 0.5)
    assert "0.550 +- 0.071 (2)" in (res / "summary.md").read_text()
    assert (root / "results/figures/fig9_noise_schedulers.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "results").exists()  # the reference folder is untouched
    # another invocation without --resume starts a new root: it reuses nothing
    assert C.main(exp, base + ["--runs-dir", str(tmp_path / "runs"), "--dry-run"]) == 0
    assert "8 planned runs, 8 distinct, 0 done, would run 8" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--resume"):  # an existing root is never reused implicitly
        C.main(exp, base + ["--root", str(root)])
    # --publish refuses a root with a failed run; resuming reruns only that run, then publishes
    with pytest.raises(SystemExit, match="--only"):
        C.main(exp, base + ["--resume", str(root), "--only", "linear-*", "--publish"])
    launched = []
    real_launch = C.launch
    import experiments._common as mod

    mod.launch = lambda jobs, *a: launched.extend(j.run.name for j in jobs) or real_launch(jobs, *a)
    try:
        assert C.main(exp, base + ["--resume", str(root), "--publish"]) == 1  # cosine-s1 fails again
        assert "not published: 1 runs are not finished" in capsys.readouterr().out
        assert not (tmp_path / "results").exists()
        (root / "work" / exp.name / "cosine-s1" / "fixed").touch()
        assert C.main(exp, base + ["--resume", str(root), "--publish"]) == 0
    finally:
        mod.launch = real_launch
    assert launched == ["cosine-s1", "cosine-s1"]
    pub = tmp_path / "results" / exp.name / "small"
    assert not (pub / "runs/linear-s0/metrics.jsonl").read_text() == ""
    assert json.loads((pub / "published.json").read_text())["root"] == str(root)
    assert (tmp_path / "results/figures/fig9_noise_schedulers.png").exists()
    assert len(pd.read_csv(pub / "table.csv").query("metric == 'accuracy'")) == 8


def test_time_budget_and_stop_at_bound_one_call(fake_runs, monkeypatch):
    """--time-budget / --stop-at reach the launcher, so one call of bounded length leaves its finished runs and
    a later --resume continues the rest."""
    exp = importlib.import_module("experiments.fig9_noise_schedulers").EXPERIMENT
    seen = {}
    real = C.run_tasks
    monkeypatch.setattr(C, "run_tasks", lambda tasks, **kw: seen.update(kw) or real(tasks, **kw))
    base = ["--profile", "small", "--seeds", "0", "--only", "linear-*", "--results", str(fake_runs / "results"),
            "--root", str(fake_runs / "root")]
    assert C.main(exp, [*base, "--time-budget", "200", "--stop-at", "560"]) == 0
    assert seen["time_budget"] == 200 and seen["stop_at"] == 560


def test_resume_stops_on_drift_unless_allowed(fake_runs, monkeypatch, capsys):
    tmp_path = fake_runs
    exp = importlib.import_module("experiments.fig9_noise_schedulers").EXPERIMENT
    root = tmp_path / "root"
    base = ["--profile", "small", "--seeds", "0", "--only", "linear-*", "exponential-*", "--results",
            str(tmp_path / "results")]
    assert C.main(exp, base + ["--root", str(root)]) == 0
    monkeypatch.setattr(C, "launch", lambda *a: pytest.fail("nothing should be launched"))
    assert C.main(exp, base + ["--resume", str(root)]) == 0  # same code, same plan: all done
    # another commit
    monkeypatch.setattr(C, "git_info", lambda: {"git_sha": "b" * 40, "git_dirty": False})
    with pytest.raises(SystemExit, match="differ from the plan"):
        C.main(exp, base + ["--resume", str(root)])
    assert f"git sha {'a' * 40} (now {'b' * 40})" in capsys.readouterr().out
    assert C.main(exp, base + ["--resume", str(root), "--dry-run"]) == 2
    assert C.main(exp, base + ["--resume", str(root), "--allow-drift"]) == 0
    assert json.loads((root / "plan.json").read_text())["resumes"][-1]["drift_allowed"]
    # a dirty tree cannot be compared; a changed plan (--max-steps) is drift too
    monkeypatch.setattr(C, "git_info", lambda: {**GIT, "git_dirty": True})
    with pytest.raises(SystemExit, match="differ from the plan"):
        C.main(exp, base + ["--resume", str(root)])
    assert "uncommitted changes" in capsys.readouterr().out
    monkeypatch.setattr(C, "git_info", lambda: dict(GIT))
    with pytest.raises(SystemExit, match="differ from the plan"):
        C.main(exp, base + ["--resume", str(root), "--max-steps", "2"])
    assert "max_steps=30 (planned 2)" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="planned at profile small"):
        C.main(exp, [*base, "--resume", str(root), "--profile", "smoke"])
    with pytest.raises(SystemExit, match="not a run root"):
        C.main(exp, base + ["--resume", str(tmp_path / "nothing")])


def test_reproduce_plans_the_union_and_runs_shared_runs_once(tmp_path, capsys):
    from experiments import reproduce

    argv = ["--profile", "small", "--experiments", "table1", "fig4", "fig5", "fig8", "--parallel", "4", "--dry-run",
            "--runs-dir", str(tmp_path / "runs"), "--data-dir", "DATA"]
    assert reproduce.main(argv) == 0
    out = capsys.readouterr().out
    # table1 22 + fig4 30 + fig5 12 + fig8 6 planned; distinct: 4 base rows + 6 methods x 3 seeds (GRPO)
    # + 5 DAPO methods x 3 seeds
    assert "70 planned runs, 37 distinct, 0 done, would run 37" in out
    assert ("table1/nvfp4_lora-s0 also serves fig4_reward_curves/grpo-nvfp4_lora-s0, fig5_entropy/nvfp4_lora-s0, "
            "fig8_aqn_ablation/nvfp4_lora-s0") in out
    assert "min at --parallel 4" in out and not (tmp_path / "runs").exists()
    with pytest.raises(ValueError, match="allowed"):
        reproduce.main(["--experiments", "fig99", "--dry-run"])


@pytest.mark.parametrize("name", ["table2_bigmath", "fig4_reward_curves", "fig5_entropy", "fig7_training_reward",
                                  "fig8_aqn_ablation", "fig9_noise_schedulers", "fig10_lora_rank", "fig16_lr_ablation"])
def test_experiment_figures_draw_from_synthetic_runs(name, tmp_path):
    from qerl import plots

    root = tmp_path / name / "small"
    for i, (method, knobs) in enumerate([("nvfp4_lora_aqn", dict(loss_type="grpo", lora_rank=16, learning_rate=5e-5,
                                                                 noise_schedule="linear", model="a")),
                                         ("bf16_lora", dict(loss_type="bnpo", lora_rank=32, learning_rate=3e-4,
                                                            noise_schedule="cosine", model="b"))]):
        _fake_train_run(root / "runs" / f"run{i}-s0", method=method, rewards=(0.1 * i, 0.2, 0.3 + 0.1 * i),
                        **knobs)
    C.collect(root, curves=True)
    C.declare(C.load_experiment(name).artefact, tmp_path / name)  # what collect_experiment writes
    out = plots.experiment_figure(name, "small", results=tmp_path, out_dir=tmp_path / "figs")
    assert out is not None
    assert (tmp_path / "figs" / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plots.experiment_figure(name, "small", results=tmp_path / "none", out_dir=tmp_path / "figs") is None
    assert plots.experiment_figure("fig99", "small", results=tmp_path) is None  # no declaration: a note
    decl = tmp_path / name / "artefact.json"
    decl.write_text(decl.read_text().replace(f'"{json.loads(decl.read_text())["figure"]["draw"]}"', '"nonesuch"'))
    with pytest.raises(ValueError, match="allowed"):
        plots.experiment_figure(name, "small", results=tmp_path)


def test_only_selects_runs_by_pattern(tmp_path):
    _, _, plan = _plan("fig10_lora_rank", "small", tmp_path, "--only", "r16-*", "r128-s1")
    assert [r.name for r, _, _ in plan] == ["r16-s0", "r16-s1", "r16-s2", "r128-s1"]


def test_run_json_keeps_the_command_that_ran_and_data_dir_only_where_read(fake_runs, monkeypatch):
    """run.json says what was launched, even when the root is collected by another invocation with other
    flags; an arith run (generated data) gets no --data-dir it would never read."""
    tmp_path = fake_runs
    exp = importlib.import_module("experiments.fig9_noise_schedulers").EXPERIMENT
    args = C.parse_args(exp, ["--profile", "small", "--data-dir", str(tmp_path / "data")])
    run = C.plan_runs(exp, args)[0]
    assert "--data-dir" not in C.command(exp, run, args, tmp_path / "w")  # arith: nothing is read
    gsm = C.Run("g-s0", {"method": "nvfp4_lora", "seed": 0, "dataset": "gsm8k", "eval_datasets": ("gsm8k",)})
    cmd = C.command(exp, gsm, args, tmp_path / "w")
    assert cmd[cmd.index("--data-dir") + 1] == str(tmp_path / "data")
    root = tmp_path / "root"
    base = ["--profile", "small", "--seeds", "0", "--only", "linear-*", "--results", str(tmp_path / "results")]
    assert C.main(exp, base + ["--root", str(root)]) == 0
    ran = json.loads((root / "work" / exp.name / "linear-s0" / "run.json").read_text())["command"]
    monkeypatch.setattr(C.sys, "executable", "/elsewhere/python")  # collected later, on another machine
    assert C.main(exp, base + ["--resume", str(root), "--data-dir", str(tmp_path / "other")]) == 0
    meta = json.loads((root / "results" / exp.name / "small" / "runs/linear-s0/run.json").read_text())
    assert meta["command"] == ran and "/elsewhere" not in meta["command"]

def test_committed_results_hold_each_file_once():
    """No two byte-identical files under results/; a run several experiments share is a link to
    its one copy (link_duplicates), and every link resolves to a file inside results/."""
    import hashlib

    res = (ROOT / "results").resolve()
    seen = {}
    for f in sorted(res.rglob("*")):
        if f.is_symlink():
            assert f.resolve().is_file() and f.resolve().is_relative_to(res), f
        elif f.is_file():
            digest = hashlib.sha256(f.read_bytes()).hexdigest()
            assert digest not in seen, f"{f} is a copy of {seen[digest]}"
            seen[digest] = f


def test_link_duplicates_keeps_table1_as_owner_and_publish_keeps_linked_data(tmp_path):
    ref = tmp_path / "results"
    for exp in ("fig5_entropy", "table1"):
        _fake_train_run(ref / exp / "small" / "runs" / "nvfp4_lora-s0")
    # another run: its own config and metrics, the same summary.json
    _fake_train_run(ref / "fig8_aqn_ablation" / "small" / "runs" / "nvfp4_lora-s0", seed=1, rewards=(0.5,))
    assert C.link_duplicates(ref) == 4
    t1, f5 = ref / "table1/small/runs/nvfp4_lora-s0", ref / "fig5_entropy/small/runs/nvfp4_lora-s0"
    assert not (t1 / "metrics.jsonl").is_symlink() and (f5 / "metrics.jsonl").is_symlink()
    assert (f5 / "metrics.jsonl").resolve() == (t1 / "metrics.jsonl").resolve()
    f8 = ref / "fig8_aqn_ablation/small/runs/nvfp4_lora-s0"
    assert not (f8 / "config.json").is_symlink() and not (f8 / "metrics.jsonl").is_symlink()
    assert (f8 / "summary.json").is_symlink()
    assert C.link_duplicates(ref) == 4  # idempotent
    before = (f5 / "summary.json").read_text()
    # publishing a new Table 1 first turns the links into it back into files
    C.unlink_into(ref, ref / "table1" / "small")
    shutil.rmtree(ref / "table1")
    assert not (f5 / "summary.json").is_symlink() and (f5 / "summary.json").read_text() == before

def test_job_progress_reads_the_running_run_folder(tmp_path):
    """`make reproduce` shows each running job's step and reward, read from its run folder."""
    from experiments.launch import run_progress as job_progress

    assert job_progress(tmp_path) == "starting"
    (tmp_path / "config.json").write_text(json.dumps({"max_steps": 30}))
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "eval/arith/accuracy": 0.1}) + "\n")
    assert job_progress(tmp_path) == "evaluating"
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 3, "reward": 0.25}) + "\n")
    assert job_progress(tmp_path) == "step 3/30 reward 0.250"
