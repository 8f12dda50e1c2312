"""Shared machinery of the experiment scripts (one thin module per paper table / figure) and of the
driver `python -m experiments.reproduce`, which runs several at once.

A script lists its runs for a profile as `Run`s (a folder name + TrainConfig overrides) and calls
`main(Experiment(...))`. This module does the rest:

- flags: --profile smoke|small|paper, --dry-run (print the planned runs and commands, run nothing),
  --collect-only (rebuild the tables and the figure), --only PATTERN (a subset of the runs),
  --parallel N, --gpus 0 1 ... (each run sees one GPU, the least busy), --per-gpu N (N runs on each
  GPU of --gpus), --time-budget / --stop-at S (bound one call: no run starts after S seconds / the
  running ones stop then and stay unfinished), --seeds, --models,
  --data-dir, --max-steps, --wandb-mode; where runs go: --runs-dir, --root, --resume, --allow-drift,
  --publish, --results (the committed reference, default results/);
- launching: each distinct run is a task of experiments/launch.py, the one launcher of experiments/
  (processes, GPU slots, resume by run-folder completeness, log.txt and run.json);
- a run root: every invocation runs into a NEW folder <runs-dir>/<name>-<profile>-<UTC time>-<sha7>/
  (or --root DIR), so results/ stays the committed reference and nothing old is reused by accident.
  It holds plan.json (the git sha, the argv, every planned run), work/<experiment>/<run>/ (the full
  run folder: checkpoints, log.txt, planned.json) and results/<experiment>/<profile>/ (the same tree
  as results/). `--resume ROOT` continues a root: finished runs are kept, unfinished ones resume from
  their last checkpoint (`--resume-from auto`), and a run whose recorded git sha, dirty tree or
  config differs from the plan stops the invocation with the differences listed (--allow-drift
  reuses it anyway, and says so);
- runs that several experiments plan identically (same config: e.g. Table 1's nvfp4_lora-s0 and
  Fig. 5's) run once and are copied into each experiment's results in the root; in results/ (after
  --publish) each such file is stored once, under Table 1, and the others are relative links to it;
- results: config.json, metrics.jsonl, summary.json / eval.json and run.json (the command, the row
  label, the exit code) go to <root>/results/<experiment>/<profile>/runs/<run>/; then table.csv
  (long form: model, method, dataset, metric, value, seed, run, git_sha), summary.csv / summary.md
  (mean +- std over seeds per model, method, dataset and metric) and the figure
  (<root>/results/figures/<experiment>.png) are rebuilt;
- `--publish` copies a root's finished experiments into results/ (replacing
  results/<experiment>/<profile>/ and its figure; published.json says from where). It refuses a root
  with unfinished or failed runs.

In table.csv, `method` is the Table 1 method name, followed by the run's variant in parentheses
where a script varies a knob (e.g. "nvfp4_lora_aqn (lora_rank=16)"). Metrics: `accuracy` (after
training), `accuracy_before`, `format`, and for curve experiments `<key>_first5` / `<key>_last5`
(mean of the first / last 5 logged steps of reward and entropy, dataset = the training set), and
`logprob_gap_mean` for every training run (mean `sampling/logprob_gap` over its steps: near 0 unless
AQN perturbs the rollout or the rollout is broken).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import fnmatch
import hashlib
import importlib
import json
import os
import shlex
import shutil
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from experiments.launch import (
    Task,
    add_call_bounds,
    add_launch_args,
    concurrency,
    launch_kwargs,
    run_complete,
    run_tasks,
)
from qerl.cli_train import eval_flags
from qerl.config import PROFILES, TABLE4_BIGMATH, TrainConfig, eval_settings, make_config
from qerl.logging import git_info

ROOT = Path(__file__).resolve().parent.parent
COLUMNS = ["model", "method", "dataset", "metric", "value", "seed", "run", "git_sha"]
SUMMARY_COLUMNS = ["model", "method", "dataset", "metric", "n", "mean", "std", "values"]
RESULT_FILES = ("config.json", "metrics.jsonl", "summary.json", "eval.json")
FULL_FT_LR = 1e-5  # full fine-tuning moves every weight: a LoRA learning rate would wreck it
DEFAULT_SEEDS = {"smoke": [0], "small": [0, 1, 2], "paper": [0]}
CURVE_KEYS = ("reward", "entropy")
CURVE_WINDOW = 5
GAP_KEY = "sampling/logprob_gap"  # rollout vs training-forward log-prob gap (nats); table.csv: logprob_gap_mean

# The two policy losses the paper names, spelled out in full so that no config default decides which
# one a script runs (Table 4 for both: clip 0.2 / 0.28, no KL, no entropy loss).
GRPO = dict(loss_type="grpo", beta=0.0, epsilon=0.2, epsilon_high=0.28)  # TRL's sequence-level GRPO loss
DAPO = dict(loss_type="bnpo", beta=0.0, epsilon=0.2, epsilon_high=0.28)  # the paper's DAPO = TRL 0.18 "bnpo"
TABLE2_DATASETS = ("math500", "aime24", "aime25", "amc23")
# python -m experiments.reproduce --experiments <short name or module name>
ALIASES = {"table1": "table1_gsm8k", "table2": "table2_bigmath", "fig4": "fig4_reward_curves", "fig5": "fig5_entropy",
           "fig7": "fig7_training_reward", "fig8": "fig8_aqn_ablation", "fig9": "fig9_noise_schedulers",
           "fig10": "fig10_lora_rank", "fig16": "fig16_lr_ablation"}


@dataclass
class Run:
    """One row of an experiment: a `python -m qerl train` run (or `eval` of an untrained base)."""

    name: str  # folder name, unique within the experiment
    overrides: dict = field(default_factory=dict)  # TrainConfig fields on top of the profile
    kind: str = "train"  # train | eval
    label: str = ""  # the variant, shown in table.csv's method column as "<method> (<label>)"


@dataclass(frozen=True)
class Outputs:
    """What an artefact writes and where it is shown, declared by its script. ``declare`` writes it
    next to the results as results/<name>/artefact.json, which qerl.plots and the notebooks read."""

    figure: str | None = None  # the qerl.plots function that draws its figure (None: none, or drawn by the script)
    figure_kwargs: dict = field(default_factory=dict)  # its keywords (title, by, panels, keys, ...)
    figure_file: str | None = None  # its file name: <name>.png in results/figures/ (a figure the script draws
    # itself, with figure None: beside its results)
    columns: tuple[str, ...] = tuple(COLUMNS)  # its table's columns (table.csv, or a speed artefact's rows)
    notebook: str | None = None  # the notebook that shows it

    def declaration(self, name: str, script: str) -> dict:
        return {"artefact": name, "script": f"python -m {script}",
                "figure": {"draw": self.figure, "kwargs": self.figure_kwargs,
                           "file": self.figure_file or f"{name}.png"} if self.figure or self.figure_file else None,
                "columns": list(self.columns), "notebook": self.notebook}


@dataclass(frozen=True)
class Artefact:
    """An artefact that is no Experiment (a speed table, a study with its own analysis): its results
    folder name, its module and its Outputs. A script declares it as its module's ARTEFACT."""

    name: str
    script: str
    outputs: Outputs


def declare(artefact: Artefact, folder: Path) -> Path:
    """Write <folder>/artefact.json (folder: the artefact's results, results/<name>/ by default): its
    declared outputs (see Outputs)."""
    path = Path(folder) / "artefact.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(artefact.outputs.declaration(artefact.name, artefact.script), indent=1) + "\n")
    return path


def redeclare(results: Path) -> list[Path]:
    """Rewrite every artefact.json under `results` from its script's current declaration (the
    artefact named in it); -> the files rewritten. A declaration whose artefact is gone is left."""
    arts = {a.name: a for a in all_artefacts()}
    out = []
    for f in sorted(Path(results).rglob("artefact.json")):
        art = arts.get(json.loads(f.read_text()).get("artefact"))
        if art is not None:
            out.append(declare(art, f.parent))
    return out


def declared(module) -> Artefact | None:
    """The Artefact a script module declares (its EXPERIMENT's, or its ARTEFACT), None for other modules."""
    exp = getattr(module, "EXPERIMENT", None)
    if isinstance(exp, Experiment):
        return exp.artefact
    art = getattr(module, "ARTEFACT", None)
    return art if isinstance(art, Artefact) else None


def all_artefacts() -> list[Artefact]:
    """Every artefact declared by a module of experiments/ (each module is imported; none runs)."""
    import pkgutil

    import experiments

    out = []
    for info in pkgutil.iter_modules(experiments.__path__):
        art = declared(importlib.import_module(f"experiments.{info.name}"))
        if art is not None:
            out.append(art)
    return out


@dataclass
class Experiment:
    name: str  # results/<name>/<profile>/, W&B group <name>-<profile>
    doc: str  # the script's docstring (its first paragraph is the --help description)
    plan: Callable[[argparse.Namespace], list[Run]]
    outputs: Outputs = Outputs()  # its table, figure and notebook (results/<name>/artefact.json)
    paper_models: tuple[str, ...] = ("Qwen/Qwen2.5-7B-Instruct",)  # default --models at profile paper
    seeds: dict = field(default_factory=lambda: dict(DEFAULT_SEEDS))  # default --seeds per profile
    curves: bool = True  # add reward / entropy first5 / last5 rows to table.csv
    add_args: Callable[[argparse.ArgumentParser], None] | None = None

    @property
    def artefact(self) -> Artefact:
        return Artefact(self.name, f"experiments.{ALIASES.get(self.name, self.name)}", self.outputs)


def load_experiment(name: str) -> Experiment:
    """The Experiment of experiments/<name>.py; `name` may be a short alias (table1, fig4, ...)."""
    module = ALIASES.get(name, name)
    if module not in ALIASES.values():
        raise ValueError(f"unknown experiment {name!r}; allowed: {sorted(ALIASES)} or {sorted(ALIASES.values())}")
    return importlib.import_module(f"experiments.{module}").EXPERIMENT


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
def flags(overrides: dict) -> list[str]:
    """`qerl train` flags of TrainConfig overrides: --field-name value (lists as several values, bools as true/false)."""
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
                                  wandb_mode=args.wandb_mode, save_every=getattr(args, "save_every", 0) or None).items()
            if v is not None}


def reads_data_dir(cfg: TrainConfig) -> bool:
    """Whether a run of ``cfg`` reads the data folder at all (arith is generated, never read)."""
    return any(name != "arith" for name in (cfg.dataset, *cfg.eval_datasets))


def command(exp: Experiment, run: Run, args, run_dir: Path) -> list[str]:
    py = [sys.executable, "-m", "qerl"]
    if run.kind == "train":
        ov = {**run.overrides, **common_overrides(args)}
        if not reads_data_dir(make_config(args.profile, **ov)):  # the command says only what the run reads
            ov.pop("data_dir", None)
        return py + ["train", "--profile", args.profile, "--output-dir", str(run_dir), "--wandb-group",
                     f"{exp.name}-{args.profile}", "--resume-from", "auto", *flags(ov)]
    cfg = make_config(args.profile, **{**run.overrides, **common_overrides(args)})
    fmt = run.name.rsplit("base-", 1)[1]
    return py + ["eval", "--profile", args.profile, "--model", cfg.model, "--method", fmt,
                 *eval_flags(eval_settings(cfg)), "--out", str(run_dir / "eval.json"), "--seed", str(args.seeds[0])]


# Fields that say where or how a run is logged, not what it computes.
NOT_COMPARED = {"output_dir", "data_dir", "resume_from", "save_every", "wandb_mode", "wandb_project", "wandb_group",
                "wandb_entity", "wandb_tags", "wandb_name", "profile"}


def _jsonable(x):
    return json.loads(json.dumps(x, default=str))


def run_spec(run: Run, args) -> dict:
    """What a run computes, as JSON: the full TrainConfig (less NOT_COMPARED) of a training run, the
    eval flags (less output and data paths) of an untrained row. Runs with equal specs are the same
    run (the driver runs them once), and a resumed run must match its recorded spec."""
    if run.kind == "train":
        cfg = make_config(args.profile, **{**run.overrides, **common_overrides(args)}).to_dict()
        return _jsonable({"kind": "train", **{k: v for k, v in cfg.items() if k not in NOT_COMPARED}})
    flags, skip = command(None, run, args, Path("."))[3:], False
    kept = []
    for a in flags:
        if skip:
            skip = False
        elif a in ("--out", "--data-dir"):
            skip = True
        else:
            kept.append(a)
    return {"kind": "eval", "args": kept}


def spec_drift(recorded: dict, planned: dict) -> dict:
    """{field: (recorded, planned)} where two specs differ."""
    keys = sorted(set(recorded) | set(planned))
    return {k: (recorded.get(k), planned.get(k)) for k in keys if recorded.get(k) != planned.get(k)}


def config_drift(run: Run, run_dir: Path, args) -> dict:
    """{field: (recorded, planned)} where the config.json a training run wrote differs from what is planned now."""
    path = run_dir / "config.json"
    if run.kind != "train" or not path.exists():
        return {}
    have = _jsonable(json.loads(path.read_text()))
    want = run_spec(run, args)
    return {k: (have[k], v) for k, v in want.items() if k in have and have[k] != v}


def is_done(run: Run, run_dir: Path) -> bool:
    """Finished: its summary says ok (eval: eval.json exists) and its process, if recorded, exited 0."""
    return run_complete(run_dir, run.kind)


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


def _mean_of(metrics_path: Path, key: str) -> float | None:
    if not metrics_path.exists():
        return None
    vals = [r[key] for r in map(json.loads, filter(str.strip, metrics_path.read_text().splitlines()))
            if r.get(key) is not None]
    return sum(vals) / len(vals) if vals else None


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
            gap = _mean_of(d / "metrics.jsonl", GAP_KEY)
            if gap is not None:  # a broken rollout shows here first (results/INVALIDATED.md)
                rows.append(dict(base, dataset=cfg["dataset"], metric="logprob_gap_mean", value=gap))
    res_root.mkdir(parents=True, exist_ok=True)
    with (res_root / "table.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    return rows




def summarize(res_root: Path, rows: list[dict] | None = None) -> list[dict]:
    """Write res_root/summary.csv and summary.md: mean and sample std over seeds (runs) of every
    (model, method, dataset, metric) cell of table.csv; std is empty with one run."""
    if rows is None:
        with (res_root / "table.csv").open() as f:
            rows = list(csv.DictReader(f))
    groups: dict[tuple, list[float]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["method"], r["dataset"], r["metric"]), []).append(float(r["value"]))
    out = []
    for (model, method, dataset, metric), vals in groups.items():
        out.append(dict(model=model, method=method, dataset=dataset, metric=metric, n=len(vals),
                        mean=statistics.fmean(vals), std=statistics.stdev(vals) if len(vals) > 1 else "",
                        values=" ".join(f"{v:.4g}" for v in vals)))
    with (res_root / "summary.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=SUMMARY_COLUMNS)
        w.writeheader()
        w.writerows(out)
    lines = ["| model | method | dataset | metric | mean +- std (n) |", "|---|---|---|---|---|"]
    for r in out:
        spread = f" +- {r['std']:.3f}" if r["std"] != "" else ""
        lines.append(f"| {Path(r['model']).name} | {r['method']} | {r['dataset']} | {r['metric']} | "
                     f"{r['mean']:.3f}{spread} ({r['n']}) |")
    (res_root / "summary.md").write_text("\n".join(lines) + "\n")
    return out


# ----------------------------------------------------------------------------- CLI
# Rough wall seconds of one run while 3-7 runs share one GPU. small: the H200 runs of 2026-11-22 took
# ~200 s of steps + ~60 s of loading and 1-sample evaluation; evaluating 8 samples per problem before
# and after training adds an estimated ~80 s per evaluation (not yet measured). smoke: the CPU runs.
RUN_S = {"smoke": {"train": 180, "eval": 60}, "small": {"train": 420, "eval": 120}}


def add_common_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--profile", default="small", choices=("smoke", "small", "paper"))  # `official` is for train
    ap.add_argument("--dry-run", action="store_true", help="print the planned runs and commands; run nothing")
    ap.add_argument("--collect-only", action="store_true",
                    help="rebuild the tables and figures of --resume ROOT (without it: of --results); run nothing")
    ap.add_argument("--seeds", nargs="+", type=int, default=None, help="default: per profile (see the docstring)")
    ap.add_argument("--models", "--model", nargs="+", default=None,
                    help="hub ids / local dirs; default: the profile's model (paper: the paper's models)")
    ap.add_argument("--only", nargs="+", default=None, metavar="PATTERN",
                    help="plan only the runs whose names match one of these glob patterns (e.g. 'cosine-*')")
    add_launch_args(ap)
    add_call_bounds(ap, "0: never; they stay unfinished and --resume ROOT continues them from their last checkpoint",
                    not_started="a later --resume ROOT starts the rest")
    ap.add_argument("--data-dir", default=os.environ.get("QERL_DATA_DIR"), help="local JSONL data (shared/data)")
    ap.add_argument("--max-steps", type=int, default=0, help="override every run's max_steps (0 = keep)")
    ap.add_argument("--save-every", type=int, default=0, help="a checkpoint every N steps in every run (0 = the "
                    "profile's), so that a run stopped by --stop-at continues from it; not part of a run's plan")
    ap.add_argument("--wandb-mode", default=None, choices=("offline", "online", "disabled"))
    ap.add_argument("--runs-dir", default="runs", help="where new run roots are made")
    ap.add_argument("--root", default=None, help="the new run root (default: <runs-dir>/<name>-<profile>-<UTC "
                    "time>-<sha7>); must be new or empty")
    ap.add_argument("--resume", default=None, metavar="ROOT", help="continue the run root ROOT: keep its finished "
                    "runs, resume the others; stops if a run's git sha or config differs from the plan")
    ap.add_argument("--allow-drift", action="store_true",
                    help="with --resume: reuse runs whose recorded git sha / config differ from the plan")
    ap.add_argument("--publish", action="store_true", help="when every planned run of the root is finished, copy "
                    "its results over results/<experiment>/<profile>/ (the committed reference)")
    ap.add_argument("--results", default="results", help="the reference results folder (read by the notebooks)")


def experiment_args(exp: Experiment, shared: argparse.Namespace) -> argparse.Namespace:
    """The shared flags plus `exp`'s own flags (their defaults when absent) and its default seeds / models."""
    args = argparse.Namespace(**vars(shared))
    if exp.add_args:
        ap = argparse.ArgumentParser(allow_abbrev=False, add_help=False)
        exp.add_args(ap)
        for k, v in vars(ap.parse_args([])).items():
            if not hasattr(args, k):
                setattr(args, k, v)
    if args.seeds is None:
        args.seeds = list(exp.seeds[args.profile])
    if args.models is None:
        args.models = list(exp.paper_models) if args.profile == "paper" else [default_model(args.profile)]
    return args


def parse_args(exp: Experiment, argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=exp.doc.strip().split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap)
    if exp.add_args:
        exp.add_args(ap)
    return experiment_args(exp, ap.parse_args(argv))


# ----------------------------------------------------------------------------- planning a root
@dataclass
class Job:
    """One distinct run of a plan: where it runs and every (experiment, args, run) it stands for."""

    spec: dict
    work: Path
    command: list[str]
    uses: list[tuple[Experiment, argparse.Namespace, Run]] = field(default_factory=list)

    @property
    def run(self) -> Run:
        return self.uses[0][2]

    @property
    def name(self) -> str:
        return f"{self.uses[0][0].name}/{self.run.name}"


def plan_runs(exp: Experiment, args) -> list[Run]:
    runs = exp.plan(args)
    if args.only:
        runs = [r for r in runs if any(fnmatch.fnmatch(r.name, pat) for pat in args.only)]
    names = [r.name for r in runs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"{exp.name}: duplicate run names {dup}")
    return runs


def plan_jobs(targets: list[tuple[Experiment, argparse.Namespace]], root: Path) -> list[Job]:
    """The distinct runs of every target, in plan order; a run planned identically by several
    experiments (equal run_spec) is one Job in <root>/work/<first experiment>/<run>/."""
    jobs: dict[str, Job] = {}
    for exp, args in targets:
        for run in plan_runs(exp, args):
            spec = run_spec(run, args)
            key = json.dumps(spec, sort_keys=True)
            if key not in jobs:
                work = root / "work" / exp.name / run.name
                jobs[key] = Job(spec, work, command(exp, run, args, work))
            jobs[key].uses.append((exp, args, run))
    return list(jobs.values())


def planned(exp: Experiment, args, root: Path) -> list[tuple[Run, list[str], bool]]:
    """(run, command, done in root) for every planned run of one experiment."""
    return [(j.run, j.command, is_done(j.run, j.work)) for j in plan_jobs([(exp, args)], root)]


def job_drift(job: Job, git: dict) -> list[str]:
    """Why an existing run folder may not be what the plan asks for now (empty: it is)."""
    if not job.work.exists() or not any(job.work.iterdir()):
        return []
    rec_path = job.work / "planned.json"
    if not rec_path.exists():
        return [f"{rec_path} is missing: what ran there is unknown"]
    rec = json.loads(rec_path.read_text())
    out = []
    diff = spec_drift(rec.get("spec", {}), job.spec)
    if diff:
        out.append("config " + ", ".join(f"{k}={a!r} (planned {b!r})" for k, (a, b) in diff.items()))
    if rec.get("git_sha") != git["git_sha"]:
        out.append(f"git sha {rec.get('git_sha')} (now {git['git_sha']})")
    elif not git["git_sha"]:
        out.append("no git sha, then or now (a tree without .git: set QERL_GIT_SHA)")
    if rec.get("git_dirty") or git["git_dirty"]:
        out.append(f"uncommitted changes (then {rec.get('git_dirty')}, now {git['git_dirty']}): the code cannot be "
                   "compared")
    exp, args, run = job.uses[0]
    diff = config_drift(run, job.work, args)
    if diff:
        out.append("its config.json has " + ", ".join(f"{k}={a!r} (planned {b!r})" for k, (a, b) in diff.items()))
    return out


def new_root(shared, label: str, git: dict) -> Path:
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    return Path(shared.runs_dir) / f"{label}-{shared.profile}-{stamp}-{(git['git_sha'] or 'nogit')[:7]}"


# ----------------------------------------------------------------------------- running
def launch(jobs: list[Job], shared, git: dict) -> dict[str, int]:
    """Run the jobs through the launcher (experiments.launch), each in its work folder, as the shared
    flags --parallel / --gpus / --per-gpu say, within --time-budget / --stop-at. -> {job name: exit code}"""
    tasks = [Task(j.name, j.command, j.work, done=lambda d, kind=j.run.kind: run_complete(d, kind),
                  planned={"spec": j.spec, **git}) for j in jobs]
    return run_tasks(tasks, **launch_kwargs(shared), time_budget=getattr(shared, "time_budget", 0),
                     stop_at=getattr(shared, "stop_at", 0), git=git)


def assemble(exp: Experiment, args, jobs: list[Job], results: Path) -> Path:
    """Copy the result files of `exp`'s runs from their work folders into results/<exp>/<profile>/runs/."""
    res_root = results / exp.name / args.profile
    for job in jobs:
        for e, _, run in job.uses:
            if e is not exp or not job.work.exists():
                continue
            dest = res_root / "runs" / run.name
            dest.mkdir(parents=True, exist_ok=True)
            for f in RESULT_FILES:
                if (job.work / f).exists():
                    shutil.copy(job.work / f, dest / f)
            rec = json.loads((job.work / "run.json").read_text()) if (job.work / "run.json").exists() else {}
            if "command" not in rec and (job.work / "planned.json").exists():
                rec["command"] = json.loads((job.work / "planned.json").read_text()).get("command")
            # the command that ran (recorded when it was launched), not this invocation's plan of it: a
            # root collected elsewhere (another machine, another --data-dir) would otherwise rewrite it
            (dest / "run.json").write_text(json.dumps(
                {"experiment": exp.name, "profile": args.profile, "run": run.name, "kind": run.kind,
                 "label": run.label, "overrides": run.overrides, "command": rec.get("command") or shlex.join(job.command),
                 "exit_code": rec.get("exit_code"), "work": str(job.work)}, indent=2, default=str))
    return res_root


def collect_experiment(exp: Experiment, args, results: Path) -> None:
    """table.csv, summary.csv / summary.md and the figure of `exp` under `results`."""
    res_root = results / exp.name / args.profile
    if not (res_root / "runs").exists():
        print(f"{exp.name}: no runs under {res_root}")
        return
    rows = collect(res_root, curves=exp.curves)
    summarize(res_root, rows)
    print(f"wrote {res_root / 'table.csv'} ({len(rows)} rows), summary.csv, summary.md")
    declare(exp.artefact, results / exp.name)
    if exp.outputs.figure:
        from qerl import plots  # matplotlib: only when drawing

        plots.experiment_figure(exp.name, args.profile, results=results)


def _result_files(reference: Path):
    """Every run result file (config.json, metrics.jsonl, ...) under reference/<exp>/<profile>/runs/."""
    for name in RESULT_FILES:
        yield from sorted(reference.glob(f"*/*/runs/*/{name}"))


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def unlink_into(reference: Path, dest: Path) -> None:
    """Turn every link under `reference` that points into `dest` back into a file, so that replacing
    `dest` cannot change what another experiment's published runs hold."""
    dest = dest.resolve()
    for f in _result_files(reference):
        if f.is_symlink() and f.resolve().is_relative_to(dest):
            data = f.read_bytes()
            f.unlink()
            f.write_bytes(data)


def link_duplicates(reference: Path) -> int:
    """Store each run result file under `reference` once: of byte-identical files under
    <exp>/<profile>/runs/, the one of the first experiment in ALIASES' order (Table 1 first) stays a
    file and the others become relative links to it (Table 1's nvfp4_lora-s0 is also Fig. 4's, 5's and
    8's). -> the number of files that are links now."""
    order = [load_experiment(a).name for a in ALIASES]
    groups: dict[str, list[Path]] = {}
    for f in _result_files(reference):
        groups.setdefault(_digest(f), []).append(f)
    n = 0
    for files in groups.values():
        owners = [f for f in files if not f.is_symlink()]
        if not owners:
            continue
        rank = lambda f: (order.index(f.parts[-5]) if f.parts[-5] in order else len(order), str(f))  # noqa: E731
        owner = min(owners, key=rank)
        for f in files:
            if f == owner:
                continue
            target = os.path.relpath(owner, f.parent)
            if not (f.is_symlink() and os.readlink(f) == target):
                f.unlink()
                f.symlink_to(target)
            n += 1
    return n


def publish(exp: Experiment, args, root: Path, reference: Path) -> None:
    """Replace reference/<exp>/<profile>/ and the experiment's figures with the root's; a run file
    that several published experiments hold is stored once (link_duplicates)."""
    src, dest = root / "results" / exp.name / args.profile, reference / exp.name / args.profile
    if dest.exists():
        unlink_into(reference, dest)
        shutil.rmtree(dest)
    shutil.copytree(src, dest)
    linked = link_duplicates(reference)
    declare(exp.artefact, reference / exp.name)
    plan = json.loads((root / "plan.json").read_text())
    (dest / "published.json").write_text(json.dumps(
        {"experiment": exp.name, "root": str(root), "git_sha": plan.get("git_sha"), "git_dirty": plan.get("git_dirty"),
         "argv": plan.get("argv"), "resumes": plan.get("resumes", []),
         "published": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}, indent=2))
    for png in sorted((root / "results" / "figures").glob(f"{exp.name}*.png")):
        (reference / "figures").mkdir(parents=True, exist_ok=True)
        shutil.copy(png, reference / "figures" / png.name)
    print(f"published {src} -> {dest}" + (f" ({linked} run files under {reference} are links to a copy)"
                                          if linked else ""))


def estimate(jobs: list[Job], profile: str, parallel: int) -> str:
    per = RUN_S.get(profile)
    if per is None:
        return "no time estimate for this profile"
    serial = sum(per[j.run.kind] for j in jobs)
    return (f"~{serial / 60:.0f} min of runs (~{per['train']} s per training run, {per['eval']} s per evaluation, "
            f"with 3-7 runs sharing a GPU): ~{serial / 60 / max(parallel, 1):.0f} min at --parallel {parallel}")


def execute(targets: list[tuple[Experiment, argparse.Namespace]], shared, label: str) -> int:
    """Plan, check, run, collect and (with --publish) publish `targets` in one run root."""
    git = git_info()
    if shared.collect_only and shared.publish:
        raise SystemExit("--publish with --collect-only: use --resume ROOT --publish (it runs nothing when the root "
                         "is finished)")
    if shared.collect_only:
        base = Path(shared.resume) / "results" if shared.resume else Path(shared.results)
        for exp, args in targets:
            collect_experiment(exp, args, base)
        return 0
    if shared.resume and shared.root:
        raise SystemExit("--resume ROOT and --root DIR exclude each other")
    if shared.publish and shared.only:
        raise SystemExit("--publish replaces whole experiments in results/: it cannot be combined with --only")
    if shared.allow_drift and not shared.resume:
        raise SystemExit("--allow-drift needs --resume ROOT (a new root has nothing to reuse)")
    root = Path(shared.resume or shared.root or new_root(shared, label, git))
    if shared.resume and not (root / "plan.json").exists():
        raise SystemExit(f"{root} is not a run root (no plan.json)")
    if shared.resume and json.loads((root / "plan.json").read_text()).get("profile") != shared.profile:
        raise SystemExit(f"{root} was planned at profile {json.loads((root / 'plan.json').read_text()).get('profile')}"
                         f", not {shared.profile}")
    if not shared.resume and root.exists() and any(root.iterdir()):
        raise SystemExit(f"{root} exists and is not empty: continue it with --resume {root}, or pick another --root")
    try:
        at_once = concurrency(**launch_kwargs(shared))
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    jobs = plan_jobs(targets, root)
    n_runs = sum(len(j.uses) for j in jobs)
    done = {j.name for j in jobs if is_done(j.run, j.work)}
    todo = [j for j in jobs if j.name not in done]
    print(f"{label}[{shared.profile}]: {n_runs} planned runs, {len(jobs)} distinct, {len(done)} done, "
          f"{'would run' if shared.dry_run else 'running'} {len(todo)} ({at_once} at a time); root {root}",
          flush=True)
    for j in jobs:
        if len(j.uses) > 1:
            print(f"  {j.name} also serves " + ", ".join(f"{e.name}/{r.name}" for e, _, r in j.uses[1:]))
    drift = {j.name: why for j in jobs if (why := job_drift(j, git))}
    for name, why in drift.items():
        print(f"  DRIFT {name}: " + "; ".join(why))
    if shared.dry_run:
        print("  " + estimate(todo, shared.profile, at_once))
        for j in jobs:
            state = "done" if j.name in done else ("partial" if j.work.exists() else "todo")
            print(f"  [{state}] {j.name}{f'  ({j.run.label})' if j.run.label else ''}")
            if state != "done":
                print(f"      {shlex.join(j.command)}")
        return 2 if drift and not shared.allow_drift else 0
    if drift and not shared.allow_drift:
        raise SystemExit(f"{len(drift)} runs in {root} differ from the plan (above): start a new root (drop "
                         "--resume), or reuse them knowingly with --allow-drift")
    if not git["git_sha"] or git["git_dirty"]:
        print(f"  WARNING: git sha {git['git_sha']}, dirty {git['git_dirty']}: these runs cannot be tied to a commit "
              "(on a tree without .git set QERL_GIT_SHA)", flush=True)
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    entries = [{"work": str(j.work), "spec": j.spec, "command": shlex.join(j.command),
                "uses": [f"{e.name}/{r.name}" for e, _, r in j.uses]} for j in jobs]
    if shared.resume:
        plan = json.loads((root / "plan.json").read_text())
        plan.setdefault("resumes", []).append({"date": now, **git, "argv": sys.argv, "drift_allowed": drift})
        known = {r["work"] for r in plan["runs"]}
        plan["runs"] += [e for e in entries if e["work"] not in known]  # runs this invocation adds
        plan["experiments"] = list(dict.fromkeys(plan["experiments"] + [e.name for e, _ in targets]))
    else:
        plan = {"created": now, **git, "profile": shared.profile, "argv": sys.argv,
                "experiments": [e.name for e, _ in targets], "runs": entries}
    root.mkdir(parents=True, exist_ok=True)
    (root / "plan.json").write_text(json.dumps(plan, indent=2))
    codes = launch(todo, shared, git) if todo else {}
    for exp, args in targets:
        assemble(exp, args, jobs, root / "results")
        collect_experiment(exp, args, root / "results")
    failed = [n for n, c in codes.items() if c != 0]
    if failed:
        print(f"{len(failed)} runs failed: {' '.join(failed)}")
    unfinished = [j.name for j in jobs if not is_done(j.run, j.work)]
    if shared.publish:
        if unfinished:
            print(f"not published: {len(unfinished)} runs are not finished ({' '.join(unfinished)}); "
                  f"continue with --resume {root}")
            return 1
        for exp, args in targets:
            publish(exp, args, root, Path(shared.results))
    print(f"run root: {root}" + (f"  (resume: --resume {root}; publish: --resume {root} --publish)"
                                 if unfinished or not shared.publish else ""))
    return 1 if failed or unfinished else 0


def main(exp: Experiment, argv=None) -> int:
    args = parse_args(exp, argv)
    return execute([(exp, args)], args, exp.name)
