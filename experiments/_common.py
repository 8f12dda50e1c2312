"""Shared machinery of the experiment scripts (one thin script per paper table / figure).

A script lists its runs for a profile as `Run`s (a folder name + TrainConfig overrides) and calls
`main(Experiment(...))`. This module does the rest:

- flags: --profile smoke|small|paper, --dry-run (print the planned runs and commands, run nothing),
  --collect-only (rebuild table.csv and the figure from results/), --only PATTERN (a subset of
  the runs), --parallel N, --gpus 0 1 ... (each run sees one GPU, the least busy), --seeds,
  --models, --data-dir, --max-steps, --wandb-mode, --runs-dir, --results;
- launching: each run is a `python -m qerl train` (or `eval`, for untrained rows) subprocess in
  runs/<experiment>/<profile>/<run>/ (checkpoints, W&B offline files, log.txt), W&B group
  `<experiment>-<profile>`, `--resume-from auto` so a run cut short resumes from its last checkpoint;
- skipping: a run whose results/<experiment>/<profile>/runs/<run>/summary.json says status "ok"
  (or whose eval.json exists) is done and is not launched again, so a rerun resumes; a done run
  whose recorded config differs from the planned one (another --max-steps, a changed profile) is
  reported, not rerun: delete its results folder to rerun it;
- results: config.json, metrics.jsonl, summary.json / eval.json and run.json (the command and the
  row label) are copied into results/<experiment>/<profile>/runs/<run>/, then
  results/<experiment>/<profile>/table.csv is rebuilt in long form (model, method, dataset, metric,
  value, seed, run, git_sha) and the script's figure is drawn into results/figures/.

In table.csv, `method` is the Table 1 method name, followed by the run's variant in parentheses
where a script varies a knob (e.g. "nvfp4_lora_aqn (lora_rank=16)"). Metrics: `accuracy` (after
training), `accuracy_before`, `format`, and for curve experiments `<key>_first5` / `<key>_last5`
(mean of the first / last 5 logged steps of reward and entropy, dataset = the training set).
"""

from __future__ import annotations

import argparse
import csv
import fnmatch
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent

from qerl.cli_train import eval_flags  # noqa: E402
from qerl.config import PROFILES, TABLE4_BIGMATH, TrainConfig, eval_settings, make_config  # noqa: E402
from qerl.logging import git_info  # noqa: E402

COLUMNS = ["model", "method", "dataset", "metric", "value", "seed", "run", "git_sha"]
RESULT_FILES = ("config.json", "metrics.jsonl", "summary.json", "eval.json")
FULL_FT_LR = 1e-5  # full fine-tuning moves every weight: a LoRA learning rate would wreck it
DEFAULT_SEEDS = {"smoke": [0], "small": [0, 1], "paper": [0]}
CURVE_KEYS = ("reward", "entropy")
CURVE_WINDOW = 5
POLL_S = 2.0  # seconds between polls of the running processes

# The two policy losses the paper names (Table 4 for both: clip 0.2 / 0.28, no KL, no entropy loss).
GRPO = dict(loss_type="grpo", beta=0.0)  # TRL's sequence-level GRPO loss
DAPO = dict(loss_type="bnpo", beta=0.0, epsilon_high=0.28)  # the paper's DAPO = TRL 0.18 "bnpo"
TABLE2_DATASETS = ("math500", "aime24", "aime25", "amc23")


@dataclass
class Run:
    """One row of an experiment: a `python -m qerl train` run (or `eval` of an untrained base)."""

    name: str  # folder name under runs/, unique within the experiment
    overrides: dict = field(default_factory=dict)  # TrainConfig fields on top of the profile
    kind: str = "train"  # train | eval
    label: str = ""  # the variant, shown in table.csv's method column as "<method> (<label>)"


@dataclass
class Experiment:
    name: str  # results/<name>/<profile>/, W&B group <name>-<profile>
    doc: str  # the script's docstring (its first paragraph is the --help description)
    plan: Callable[[argparse.Namespace], list[Run]]
    figure: Callable[[Path, argparse.Namespace], object] | None = None  # default: plots.experiment_figure
    paper_models: tuple[str, ...] = ("Qwen/Qwen2.5-7B-Instruct",)  # default --models at profile paper
    seeds: dict = field(default_factory=lambda: dict(DEFAULT_SEEDS))  # default --seeds per profile
    curves: bool = True  # add reward / entropy first5 / last5 rows to table.csv
    add_args: Callable[[argparse.ArgumentParser], None] | None = None


# ----------------------------------------------------------------------------- planning helpers
def default_model(profile: str) -> str:
    return PROFILES[profile].get("model", TrainConfig.model)


def model_tag(model: str, profile: str) -> str:
    """'' for the profile's own model, else '<short name>-' (keeps run names stable and unique)."""
    return "" if model == default_model(profile) else Path(model).name.lower() + "-"


def train_run(args, method: str, seed: int, *, model: str | None = None, name: str | None = None,
              label: str = "", **overrides) -> Run:
    """A training Run named `<model tag><name or method>-s<seed>`; bf16_full gets FULL_FT_LR unless set."""
    model = model or default_model(args.profile)
    ov = {"method": method, "seed": seed, **overrides}
    if model != default_model(args.profile):
        ov["model"] = model
    if method == "bf16_full" and "learning_rate" not in overrides:
        ov["learning_rate"] = FULL_FT_LR
    return Run(f"{model_tag(model, args.profile)}{name or method}-s{seed}", ov, label=label)


def eval_run(args, fmt: str, *, model: str | None = None, **overrides) -> Run:
    """An untrained base row `base-<fmt>` (evaluation only) with the profile's eval settings."""
    model = model or default_model(args.profile)
    ov = {**overrides, **({"model": model} if model != default_model(args.profile) else {})}
    return Run(f"{model_tag(model, args.profile)}base-{fmt}", ov, kind="eval")


def bigmath_task(profile: str) -> dict:
    """Table 4's BigMath column with DAPO (qerl.config.TABLE4_BIGMATH) at profile paper; at smoke /
    small the profile's own (arith) task with DAPO's loss: BigMath is beyond the 135M model."""
    return dict(TABLE4_BIGMATH) if profile == "paper" else dict(DAPO)


# ----------------------------------------------------------------------------- commands
def _flags(overrides: dict) -> list[str]:
    out = []
    for k, v in overrides.items():
        if v is None:
            continue
        out.append("--" + k.replace("_", "-"))
        if isinstance(v, (list, tuple)):
            out += [str(x) for x in v]
        elif isinstance(v, bool):
            out.append(str(v).lower())
        else:
            out.append(str(v))
    return out


def common_overrides(args) -> dict:
    """TrainConfig overrides every run of this invocation gets from the shared flags."""
    return {k: v for k, v in dict(data_dir=args.data_dir, max_steps=args.max_steps or None,
                                  wandb_mode=args.wandb_mode).items() if v is not None}


def command(exp: Experiment, run: Run, args, run_dir: Path) -> list[str]:
    py = [sys.executable, "-m", "qerl"]
    if run.kind == "train":
        ov = {**run.overrides, **common_overrides(args)}
        return py + ["train", "--profile", args.profile, "--output-dir", str(run_dir), "--wandb-group",
                     f"{exp.name}-{args.profile}", "--resume-from", "auto", *_flags(ov)]
    cfg = make_config(args.profile, **{**run.overrides, **common_overrides(args)})
    fmt = run.name.rsplit("base-", 1)[1]
    return py + ["eval", "--profile", args.profile, "--model", cfg.model, "--method", fmt,
                 *eval_flags(eval_settings(cfg)), "--out", str(run_dir / "eval.json"), "--seed", str(args.seeds[0])]


# Fields that say where or how a run is logged, not what it computes.
NOT_COMPARED = {"output_dir", "data_dir", "resume_from", "save_every", "wandb_mode", "wandb_project", "wandb_group",
                "profile"}


def config_drift(run: Run, res_dir: Path, args) -> dict:
    """{field: (recorded, planned)} where a finished run's config.json differs from what is planned now
    (e.g. it ran with --max-steps 2, or the profile changed since). Such a run still counts as done."""
    path = res_dir / "config.json"
    if run.kind != "train" or not path.exists():
        return {}
    have = json.loads(path.read_text())
    want = make_config(args.profile, **{**run.overrides, **common_overrides(args)}).to_dict()

    def norm(v):
        return tuple(v) if isinstance(v, (list, tuple)) else v

    return {k: (have[k], v) for k, v in want.items() if k in have and k not in NOT_COMPARED and norm(have[k]) != norm(v)}


def is_done(run: Run, res_dir: Path) -> bool:
    f = res_dir / ("summary.json" if run.kind == "train" else "eval.json")
    if not f.exists():
        return False
    return run.kind == "eval" or json.loads(f.read_text()).get("status") == "ok"


# ----------------------------------------------------------------------------- table.csv
def _window_means(metrics_path: Path, keys=CURVE_KEYS, n=CURVE_WINDOW) -> dict:
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("reward") is not None]  # the step-0 line holds only the eval
    out = {}
    for key in keys:
        vals = [r[key] for r in rows if r.get(key) is not None]
        if vals:
            out[f"{key}_first{n}"] = sum(vals[:n]) / len(vals[:n])
            out[f"{key}_last{n}"] = sum(vals[-n:]) / len(vals[-n:])
    return out


def collect(res_root: Path, curves: bool = False) -> list[dict]:
    """Rebuild res_root/table.csv from res_root/runs/*/ (long form, one row per cell)."""
    rows, sha = [], git_info()["git_sha"]
    for d in sorted((res_root / "runs").glob("*")):
        meta = json.loads((d / "run.json").read_text()) if (d / "run.json").exists() else {}
        label = meta.get("label") or ""
        if (d / "eval.json").exists():  # an untrained row
            ev = json.loads((d / "eval.json").read_text())
            method = d.name.rsplit("base-", 1)[-1] + (f" ({label})" if label else "")
            for ds, r in ev["results"].items():
                rows.append(dict(model=(ev.get("args") or {}).get("model", ""), method=method, dataset=ds,
                                 metric="accuracy", value=r["accuracy"], seed="", run=d.name,
                                 git_sha=(ev.get("provenance") or {}).get("git_sha") or sha))
        elif (d / "summary.json").exists() and (d / "config.json").exists():
            s = json.loads((d / "summary.json").read_text())
            cfg = json.loads((d / "config.json").read_text())
            base = dict(model=cfg["model"], method=cfg["method"] + (f" ({label})" if label else ""),
                        seed=cfg["seed"], run=d.name, git_sha=(cfg.get("provenance") or {}).get("git_sha") or sha)
            for k, v in s.items():
                if k.startswith(("eval/", "eval_before/")) and v is not None:
                    _, ds, metric = k.split("/")
                    metric = metric if k.startswith("eval/") else f"{metric}_before"
                    rows.append(dict(base, dataset=ds, metric=metric, value=v))
            if curves and (d / "metrics.jsonl").exists():
                for metric, v in _window_means(d / "metrics.jsonl").items():
                    rows.append(dict(base, dataset=cfg["dataset"], metric=metric, value=v))
    res_root.mkdir(parents=True, exist_ok=True)
    with (res_root / "table.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    return rows


# ----------------------------------------------------------------------------- CLI and the run loop
def parse_args(exp: Experiment, argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=exp.doc.strip().split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="small", choices=("smoke", "small", "paper"))  # `official` is for train
    ap.add_argument("--dry-run", action="store_true", help="print the planned runs and commands; run nothing")
    ap.add_argument("--collect-only", action="store_true", help="rebuild table.csv and the figure; run nothing")
    ap.add_argument("--seeds", nargs="+", type=int, default=None, help="default: per profile (see the docstring)")
    ap.add_argument("--models", "--model", nargs="+", default=None,
                    help="hub ids / local dirs; default: the profile's model (paper: the paper's models)")
    ap.add_argument("--only", nargs="+", default=None, metavar="PATTERN",
                    help="plan only the runs whose names match one of these glob patterns (e.g. 'cosine-*')")
    ap.add_argument("--parallel", type=int, default=1, help="runs at once (processes)")
    ap.add_argument("--gpus", nargs="*", default=None, help="GPU ids; each run gets the least busy one")
    ap.add_argument("--data-dir", default=os.environ.get("QERL_DATA_DIR"), help="local JSONL data (shared/data)")
    ap.add_argument("--max-steps", type=int, default=0, help="override every run's max_steps (0 = keep)")
    ap.add_argument("--wandb-mode", default=None, choices=("offline", "online", "disabled"))
    ap.add_argument("--runs-dir", default="runs", help="full run folders go to <runs-dir>/<experiment>/<profile>/")
    ap.add_argument("--results", default="results", help="results root: <results>/<experiment>/<profile>/")
    if exp.add_args:
        exp.add_args(ap)
    args = ap.parse_args(argv)
    if args.seeds is None:
        args.seeds = list(exp.seeds[args.profile])
    if args.models is None:
        args.models = list(exp.paper_models) if args.profile == "paper" else [default_model(args.profile)]
    return args


def planned(exp: Experiment, args) -> list[tuple[Run, list[str], bool]]:
    """(run, command, done) for every planned run; names must be unique."""
    runs = exp.plan(args)
    if args.only:
        runs = [r for r in runs if any(fnmatch.fnmatch(r.name, pat) for pat in args.only)]
    names = [r.name for r in runs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"{exp.name}: duplicate run names {dup}")
    res_root = Path(args.results) / exp.name / args.profile
    run_root = Path(args.runs_dir) / exp.name / args.profile
    return [(r, command(exp, r, args, run_root / r.name), is_done(r, res_root / "runs" / r.name)) for r in runs]


def launch(exp: Experiment, args, todo: list[tuple[Run, list[str]]]) -> dict[str, int]:
    """Run the commands, `args.parallel` at a time; copy each run's files into results. -> exit codes."""
    res_root = Path(args.results) / exp.name / args.profile
    run_root = Path(args.runs_dir) / exp.name / args.profile
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "WANDB_SILENT": "true"}
    gpus = list(args.gpus or [])
    todo, running, codes, t0 = list(todo), [], {}, time.time()
    while todo or running:
        while todo and len(running) < max(args.parallel, 1):
            run, cmd = todo.pop(0)
            run_dir = run_root / run.name
            run_dir.mkdir(parents=True, exist_ok=True)
            penv = dict(env)
            gpu = None
            if gpus:
                gpu = min(gpus, key=lambda g: sum(1 for r in running if r[4] == g))
                penv["CUDA_VISIBLE_DEVICES"] = str(gpu)
            log = open(run_dir / "log.txt", "w")
            p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=penv)
            running.append((p, run, cmd, log, gpu))
        time.sleep(POLL_S)
        for item in list(running):
            p, run, cmd, log, _ = item
            if p.poll() is None:
                continue
            running.remove(item)
            log.close()
            run_dir, dest = run_root / run.name, res_root / "runs" / run.name
            dest.mkdir(parents=True, exist_ok=True)
            for f in RESULT_FILES:
                if (run_dir / f).exists():
                    shutil.copy(run_dir / f, dest / f)
            (dest / "run.json").write_text(json.dumps(
                {"experiment": exp.name, "profile": args.profile, "run": run.name, "kind": run.kind,
                 "label": run.label, "overrides": run.overrides, "command": shlex.join(cmd),
                 "exit_code": p.returncode}, indent=2, default=str))
            codes[run.name] = p.returncode
            status = "ok" if p.returncode == 0 else f"FAILED (exit {p.returncode}; see {run_dir / 'log.txt'})"
            print(f"[{time.time() - t0:6.0f}s] {run.name}: {status}", flush=True)
            if p.returncode != 0:
                print("".join((run_dir / "log.txt").read_text().splitlines(True)[-15:]), flush=True)
    return codes


def main(exp: Experiment, argv=None) -> int:
    args = parse_args(exp, argv)
    res_root = Path(args.results) / exp.name / args.profile
    plan = planned(exp, args)
    todo = [(r, cmd) for r, cmd, done in plan if not done]
    print(f"{exp.name}[{args.profile}]: {len(plan)} runs, {len(plan) - len(todo)} done, "
          f"{'would run' if args.dry_run else 'running'} {0 if args.collect_only else len(todo)} "
          f"({args.parallel} at a time); results in {res_root}", flush=True)
    res_runs = res_root / "runs"
    for r, _, done in plan:
        drift = config_drift(r, res_runs / r.name, args) if done else {}
        if drift:
            print(f"  note: {r.name} is done but ran with " + ", ".join(f"{k}={a!r} (planned {b!r})" for k, (a, b) in
                  drift.items()) + f"; delete {res_runs / r.name} to rerun it", flush=True)
    if args.dry_run:
        for r, cmd, done in plan:
            print(f"  [{'done' if done else 'todo'}] {r.name}{f'  ({r.label})' if r.label else ''}")
            if not done:
                print(f"      {shlex.join(cmd)}")
        return 0
    codes = launch(exp, args, todo) if todo and not args.collect_only else {}
    rows = collect(res_root, curves=exp.curves)
    print(f"wrote {res_root / 'table.csv'} ({len(rows)} rows)")
    if exp.figure is not None:
        exp.figure(Path(args.results), args)
    else:
        from qerl import plots  # matplotlib: only when drawing

        if exp.name in plots.EXPERIMENT_FIGURES:
            plots.experiment_figure(exp.name, args.profile, results=Path(args.results))
    failed = [n for n, c in codes.items() if c != 0]
    if failed:
        print(f"{len(failed)} runs failed: {' '.join(failed)}")
    return 1 if failed else 0
