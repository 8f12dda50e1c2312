"""Does AQN help? The pre-registered paired experiment of results/aqn_paired/PLAN.md.

Arms (the plan's): ``noaqn`` (nvfp4_lora), ``aqn`` (nvfp4_lora_aqn, sigma 1e-2 -> 5e-4) and the
exploratory ``aqn3e-3`` (sigma_start 3e-3), each over seeds 0-15, GRPO, evaluated after training only
at 16 samples per problem. Runs go in pairs (noaqn-s0, aqn-s0, noaqn-s1, ...), then the exploratory
arm, ``--parallel`` processes sharing one GPU (or ``--gpus 0 1 ... --per-gpu N``: N on each GPU):

    python -m experiments.aqn_paired --parallel 12 --time-budget 330 --stop-at 540 --archive OUT/aqn.tar.gz
    python -m experiments.aqn_paired --analyze-only             # table.csv, the figure, NOTES.md again
    python -m experiments.aqn_paired --profile smoke --seeds 0 --out /tmp/aqn   # CPU check of the pipeline

Each run is ``python -m qerl train`` into <out>/runs/<arm>-s<seed>/, started by experiments.launch (the
experiments' one launcher); when it ends, only its small files
stay there (config.json, metrics.jsonl, summary.json, and run.json: the command as it ran, exit code,
wall time, git sha); checkpoints go, and so does the log of a run that succeeded. A finished run is
never run again (delete its folder to redo it); an unfinished one starts over. ``--time-budget S``:
no run starts after S seconds (those running finish); ``--stop-at S`` stops those still running
at S seconds (they stay unfinished). So one call of bounded length leaves every finished run and the
analysis of them; the next call continues.

Then the analysis, by the plan's rules (``analyze``): table.csv (every endpoint: n, mean paired
difference, bootstrap 95% CI, paired t-test, sign test, and the verdict of the primary endpoint),
per_seed.csv, paired_differences.png, and NOTES.md with the verdict in one sentence. ``--archive``
packs <out> into one .tar.gz (for carrying the results off the GPU machine).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import shlex
import shutil
import sys
import tarfile
from pathlib import Path

from experiments._common import GRPO, Artefact, Outputs, declare, flags
from experiments.launch import Task, add_call_bounds, add_launch_args, concurrency, launch_kwargs, run_tasks
from qerl.config import QERL_FORMAT, method_name
from qerl.logging import git_info
from qerl.noise import stage_for_step

# arm -> TrainConfig overrides (on the profile), in the plan's order; the last is exploratory
ARMS = {"noaqn": dict(method=method_name(QERL_FORMAT)),
        "aqn": dict(method=method_name(QERL_FORMAT, aqn=True), sigma_start=1e-2, sigma_end=5e-4),
        "aqn3e-3": dict(method=method_name(QERL_FORMAT, aqn=True), sigma_start=3e-3, sigma_end=5e-4)}
CONTROL, TREATED, EXPLORATORY = "noaqn", "aqn", ("aqn3e-3",)
SEEDS = tuple(range(16))
EVAL_SAMPLES = 16
NOISY_FROM = 7  # the first step of AQN stage 1 at the small profile (30 steps, K = 5): steps 7-30 are noisy
BOOTSTRAP = 10_000
ALPHA = 0.05
KEEP = ("config.json", "metrics.jsonl", "summary.json", "run.json")
DATASET = "arith"
# Wall seconds of one small run on an H100 with ~12 runs sharing it (an estimate: the 0.5 s step of a
# lone run, ~2x aggregate throughput from sharing, 133 x 16 evaluation samples in batches of 256, and
# ~20 s of loading on the CPU): for --dry-run and the time budget's message.
RUN_S = {"small": 110, "smoke": 120}


# ----------------------------------------------------------------------------- statistics
def bootstrap_ci(d: list[float], n_boot: int = BOOTSTRAP, seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap CI of the mean of ``d`` (resampling its entries with replacement; numpy's
    default generator seeded with ``seed``, so the same data give the same CI)."""
    if not d:
        return (math.nan, math.nan)
    import numpy as np

    x = np.asarray(d, dtype=np.float64)
    means = np.sort(x[np.random.default_rng(seed).integers(0, len(d), (n_boot, len(d)))].mean(1)).tolist()
    lo = means[int(math.floor((1 - level) / 2 * n_boot))]
    hi = means[min(n_boot - 1, int(math.ceil((1 + level) / 2 * n_boot)) - 1)]
    return lo, hi


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularized incomplete beta function (Lentz's method)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-15:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b)."""
    if x <= 0:
        return 0.0
    if x >= 1:
        return 1.0
    lbt = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1) / (a + b + 2):
        return math.exp(lbt) * _betacf(a, b, x) / a
    return 1.0 - math.exp(lbt) * _betacf(b, a, 1 - x) / b


def paired_t(d: list[float]) -> tuple[float, float]:
    """(t, two-sided p) of the one-sample t-test of mean(d) = 0 (the paired t-test); nan below 2 pairs.
    All-equal nonzero differences give t = +-inf, p = 0."""
    n = len(d)
    if n < 2:
        return math.nan, math.nan
    mean = sum(d) / n
    var = sum((x - mean) ** 2 for x in d) / (n - 1)
    if var == 0:
        return (math.nan, 1.0) if mean == 0 else (math.copysign(math.inf, mean), 0.0)
    t = mean / math.sqrt(var / n)
    df = n - 1
    return t, betainc(df / 2, 0.5, df / (df + t * t))


def sign_test(d: list[float]) -> tuple[int, int, float]:
    """(positives, negatives, two-sided exact p) of the sign test; zeros are dropped."""
    pos, neg = sum(1 for x in d if x > 0), sum(1 for x in d if x < 0)
    n = pos + neg
    if n == 0:
        return 0, 0, 1.0
    k = min(pos, neg)
    p = 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return pos, neg, min(1.0, p)


def endpoint(d: list[float]) -> dict:
    """The plan's statistics of one set of paired differences."""
    lo, hi = bootstrap_ci(d)
    t, p_t = paired_t(d)
    pos, neg, p_s = sign_test(d)
    return {"n": len(d), "mean_diff": sum(d) / len(d) if d else math.nan, "ci_low": lo, "ci_high": hi,
            "t": t, "p_t": p_t, "n_pos": pos, "n_neg": neg, "p_sign": p_s}


def verdict(e: dict, alpha: float = ALPHA) -> str:
    """The plan's decision rule: helps | hurts | undecided."""
    tests = e["p_t"] < alpha and e["p_sign"] < alpha
    if e["ci_low"] > 0 and tests:
        return "helps"
    if e["ci_high"] < 0 and tests:
        return "hurts"
    return "undecided"


# ----------------------------------------------------------------------------- reading runs
def read_run(d: Path) -> dict | None:
    """The endpoints of one finished run folder, or None (unfinished / failed)."""
    try:
        summary = json.loads((d / "summary.json").read_text())
        cfg = json.loads((d / "config.json").read_text())
        rec = json.loads((d / "run.json").read_text()) if (d / "run.json").exists() else {}
        rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if x.strip()]
    except (OSError, ValueError):
        return None
    if summary.get("status") != "ok" or rec.get("exit_code", 0) != 0:
        return None
    steps = [r for r in rows if r.get("reward") is not None]
    out = {"pass1": summary.get(f"eval/{DATASET}/accuracy"),
           "eval_samples": summary.get(f"eval/{DATASET}/samples"),
           "loss_type": cfg.get("loss_type"), "git_sha": (cfg.get("provenance") or {}).get("git_sha"),
           "peak_gib": summary.get("memory/peak_gib"), "peak_with_eval_gib": summary.get("memory/peak_with_eval_gib"),
           "peak_reserved_gib": summary.get("memory/peak_reserved_gib"), "wall_s": rec.get("wall_s")}
    noisy = [r["reward"] for r in steps if r["step"] >= NOISY_FROM]
    out["reward_noisy"] = sum(noisy) / len(noisy) if noisy else None
    for key, name in (("sampling/entropy", "entropy"), ("sampling/logprob_gap", "gap")):
        by_stage: dict[int, list[float]] = {}
        for r in steps:
            # the noise-free arm logs no stage: its steps fall into the stages of the AQN arm's schedule
            stage = r.get("aqn/stage")
            if stage is None and cfg.get("max_steps") and cfg.get("num_stages"):
                stage = stage_for_step(r["step"] - 1, cfg["max_steps"], cfg["num_stages"])
            if r.get(key) is not None and stage is not None:
                by_stage.setdefault(int(stage), []).append(r[key])
        for st, vals in by_stage.items():
            out[f"{name}_stage{st}"] = sum(vals) / len(vals)
    return out


def read_runs(out: Path) -> dict[tuple[str, int], dict]:
    runs = {}
    for d in sorted((out / "runs").glob("*-s*")):
        arm, _, seed = d.name.rpartition("-s")
        if arm in ARMS and seed.isdigit():
            r = read_run(d)
            if r is not None:
                runs[(arm, int(seed))] = r
    return runs


def paired(runs: dict, arm: str, key: str, control: str = CONTROL) -> tuple[list[int], list[float]]:
    """(seeds, differences arm - control of ``key``) over the seeds where both runs have it."""
    seeds = sorted(s for (a, s) in runs if a == arm and (control, s) in runs
                   and runs[(arm, s)].get(key) is not None and runs[(control, s)].get(key) is not None)
    return seeds, [runs[(arm, s)][key] - runs[(control, s)][key] for s in seeds]


# ----------------------------------------------------------------------------- analysis
TABLE_COLUMNS = ["endpoint", "role", "comparison", "n", "mean_diff", "ci_low", "ci_high", "t", "p_t", "n_pos",
                 "n_neg", "p_sign", "verdict"]
# What this study writes into <out>/ (its artefact.json): table.csv's columns, the figure it draws
# itself beside them, and the notebook that shows it
ARTEFACT = Artefact("aqn_paired", "experiments.aqn_paired", Outputs(
    figure_file="paired_differences.png", columns=tuple(TABLE_COLUMNS), notebook="notebooks/rewards.ipynb"))


def analyze(out: Path) -> dict:
    """table.csv, per_seed.csv, paired_differences.png and NOTES.md of the runs under ``out``."""
    runs = read_runs(out)
    stages = sorted({int(k[len("gap_stage"):]) for r in runs.values() for k in r if k.startswith("gap_stage")})
    endpoints = [("pass@1 (final)", "pass1", "primary"), ("reward, steps 7-30", "reward_noisy", "secondary")]
    endpoints += [(f"sampling entropy, stage {s}", f"entropy_stage{s}", "secondary") for s in stages]
    endpoints += [(f"log-prob gap, stage {s}", f"gap_stage{s}", "secondary") for s in stages]
    table, primary = [], None
    for arm in (TREATED, *EXPLORATORY):
        for name, key, role in endpoints:
            seeds, d = paired(runs, arm, key)
            if not d:
                continue
            e = endpoint(d)
            row = {"endpoint": name, "role": role if arm == TREATED else "exploratory",
                   "comparison": f"{arm} - {CONTROL}", **e, "verdict": ""}
            if arm == TREATED and key == "pass1":
                row["verdict"] = verdict(e)
                primary = {**row, "seeds": seeds, "d": d}
            table.append(row)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "table.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=TABLE_COLUMNS)
        w.writeheader()
        w.writerows([{k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()} for r in table])
    keys = sorted({k for r in runs.values() for k in r})
    with (out / "per_seed.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["arm", "seed", *keys])
        w.writeheader()
        for (arm, seed), r in sorted(runs.items(), key=lambda x: (list(ARMS).index(x[0][0]), x[0][1])):
            w.writerow({"arm": arm, "seed": seed, **r})
    figure(out, runs, primary)
    notes(out, runs, table, primary)
    return {"runs": runs, "table": table, "primary": primary}


def verdict_sentence(primary: dict | None) -> str:
    if primary is None:
        return "No verdict: no complete pair of noaqn and aqn runs yet."
    n, m, lo, hi = primary["n"], primary["mean_diff"], primary["ci_low"], primary["ci_high"]
    stats = (f"mean paired difference in final pass@1 {m:+.3f} (bootstrap 95% CI {lo:+.3f} to {hi:+.3f}), "
             f"paired t-test p = {primary['p_t']:.3g}, sign test {primary['n_pos']} up / {primary['n_neg']} down, "
             f"p = {primary['p_sign']:.3g}")
    what = {"helps": "AQN helps", "hurts": "AQN hurts",
            "undecided": "Undecided: this experiment cannot tell whether AQN helps or hurts"}[primary["verdict"]]
    return f"{what} NVFP4 LoRA at the small profile (135M, GRPO, {n} paired seeds): {stats}."


def notes(out: Path, runs: dict, table: list[dict], primary: dict | None) -> None:
    def f(v, fmt="+.3f"):
        return "" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)

    lines = ["# AQN paired experiment: results", "",
             "The plan is `PLAN.md` (committed before the runs). The verdict, by its decision rule:", "",
             f"**{verdict_sentence(primary)}**", ""]
    counts = {a: sorted(s for (b, s) in runs if b == a) for a in ARMS}
    lines += ["## Runs", ""]
    for a, seeds in counts.items():
        tag = " (exploratory)" if a in EXPLORATORY else ""
        lines.append(f"- `{a}`{tag}: {len(seeds)} finished runs, seeds {' '.join(map(str, seeds)) or '-'}")
    missing = [f"{a}-s{s}" for a in (CONTROL, TREATED) for s in SEEDS if (a, s) not in runs]
    if missing:
        lines.append(f"- primary runs missing: {' '.join(missing)} (the plan: rerun them, never drop them)")
    checks = [(k, r) for k, r in runs.items()]
    bad = [f"{a}-s{s}" for (a, s), r in checks if r.get("loss_type") != "grpo" or (r.get("eval_samples") or 0) < EVAL_SAMPLES]
    lines.append(f"- loss_type grpo and >= {EVAL_SAMPLES} evaluation samples: "
                 + ("every run" if not bad else f"NOT in {' '.join(bad)}"))
    shas = sorted({r.get("git_sha") or "unknown" for _, r in checks})
    lines.append(f"- git sha of the runs: {', '.join(s[:10] for s in shas) or '-'}")
    peaks = [r["peak_gib"] for _, r in checks if r.get("peak_gib")]
    peaks_e = [r["peak_with_eval_gib"] for _, r in checks if r.get("peak_with_eval_gib")]
    if peaks:
        with_eval = (f"; with the final evaluation {min(peaks_e):.2f}-{max(peaks_e):.2f} GiB "
                     "(`memory/peak_with_eval_gib`)" if peaks_e else "")
        lines.append(f"- peak memory of the training steps per run (summary `memory/peak_gib`: GPU memory allocated; "
                     f"the process's RSS on a CPU): {min(peaks):.2f}-{max(peaks):.2f} GiB{with_eval}")
    walls = [r["wall_s"] for _, r in checks if r.get("wall_s")]
    if walls:
        lines.append(f"- wall time per run (sharing the GPU): {min(walls):.0f}-{max(walls):.0f} s")
    lines += ["", "## Endpoints", "",
              "Paired differences (arm - noaqn) over seeds; CI: percentile bootstrap 95% (10,000 resamples); "
              "t: two-sided paired t-test; sign: two-sided exact sign test. Only the primary row decides.", "",
              "| endpoint | role | comparison | n | mean diff | 95% CI | p (t) | sign (+/-) | p (sign) |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        lines.append(f"| {r['endpoint']} | {r['role']} | {r['comparison']} | {r['n']} | {f(r['mean_diff'], '+.4f')} | "
                     f"[{f(r['ci_low'], '+.4f')}, {f(r['ci_high'], '+.4f')}] | {f(r['p_t'], '.3g')} | "
                     f"{r['n_pos']}/{r['n_neg']} | {f(r['p_sign'], '.3g')} |")
    lines += ["", "Per-run values: `per_seed.csv`; the figure: `paired_differences.png`.", "",
              "Scope: a 135M model on arithmetic, 30 steps, on a base quantized twice (Q4_1 GGUF, then NVFP4). "
              "The verdict is about this scale and this base, not the paper's 3B-14B models.", ""]
    (out / "NOTES.md").write_text("\n".join(lines))


def figure(out: Path, runs: dict, primary: dict | None) -> Path | None:
    """paired_differences.png: final pass@1 of each arm minus noaqn, per seed, with the mean and its CI."""
    arms = [a for a in (TREATED, *EXPLORATORY) if paired(runs, a, "pass1")[1]]
    if not arms:
        return None
    try:
        import matplotlib
    except ImportError:  # a GPU machine without it: the figure is drawn later with --analyze-only
        print("note: matplotlib is not installed: no paired_differences.png (rerun with --analyze-only where it is)")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.8))
    for i, arm in enumerate(arms):
        seeds, d = paired(runs, arm, "pass1")
        e = endpoint(d)
        off = 0.18 * (i - (len(arms) - 1) / 2)
        label = f"{arm} - {CONTROL}" + (" (exploratory)" if arm in EXPLORATORY else "")
        color = "C3" if arm == TREATED else "C7"
        ax.scatter([s + off for s in seeds], d, color=color, s=22, zorder=3,
                   label=f"{label}: mean {e['mean_diff']:+.3f}, 95% CI [{e['ci_low']:+.3f}, {e['ci_high']:+.3f}]")
        x0, x1 = -0.6, max(SEEDS) + 0.6
        ax.hlines(e["mean_diff"], x0, x1, color=color, lw=1.5, ls="-" if arm == TREATED else "--")
        ax.fill_between([x0, x1], e["ci_low"], e["ci_high"], color=color, alpha=0.15 if arm == TREATED else 0.08, lw=0)
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xticks(list(SEEDS))
    ax.set_xlabel("seed")
    ax.set_ylabel("final pass@1 difference")
    title = "AQN vs no AQN, paired by seed (NVFP4 LoRA, 135M, GRPO)"
    if primary is not None:
        title += f": {primary['verdict']}"
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7.5, loc="best")
    fig.tight_layout()
    path = out / "paired_differences.png"
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- running
def plan_runs(arms, seeds) -> list[tuple[str, int]]:
    """The plan's order: the primary pairs seed by seed, then the exploratory arms seed by seed."""
    primary = [(a, s) for s in seeds for a in (CONTROL, TREATED) if a in arms]
    return primary + [(a, s) for a in arms if a not in (CONTROL, TREATED) for s in seeds]


def command(args, arm: str, seed: int, run_dir: Path) -> list[str]:
    ov = {**ARMS[arm], "seed": seed, **GRPO, "eval_samples": EVAL_SAMPLES, "eval_before": False,
          "wandb_mode": "disabled", "save_every": 0}
    if args.data_dir:
        ov["data_dir"] = str(Path(args.data_dir).resolve())
    if args.max_steps:
        ov["max_steps"] = args.max_steps
    return [sys.executable, "-m", "qerl", "train", "--profile", args.profile, "--output-dir", str(run_dir),
            "--overwrite", *flags(ov), *shlex.split(args.train_flags)]


def is_done(run_dir: Path) -> bool:
    return read_run(run_dir) is not None


def _keep_small_files(task: Task, code: int) -> None:
    """When a run ends, only its small files stay (the log too if the run failed)."""
    for p in task.folder.iterdir():
        if p.name in KEEP or (p.name == "log.txt" and code != 0):
            continue
        shutil.rmtree(p) if p.is_dir() else p.unlink()


def pending(args, out: Path) -> list[Task]:
    """The planned runs not finished yet, as launcher Tasks (experiments.launch), in the plan's order."""
    dirs = {(a, s): out / "runs" / f"{a}-s{s}" for a, s in plan_runs(args.arms, args.seeds)}
    return [Task(d.name, command(args, a, s, d), d, done=is_done, on_exit=_keep_small_files)
            for (a, s), d in dirs.items() if not is_done(d)]


def run_all(args, out: Path) -> dict[str, int]:
    todo = pending(args, out)
    per = RUN_S.get(args.profile, 120)
    at_once = concurrency(**launch_kwargs(args))
    print(f"aqn_paired[{args.profile}]: {len(todo)} runs to do, {at_once} at a time "
          f"(~{per} s each while sharing: ~{len(todo) * per / at_once / 60:.0f} min); {out}", flush=True)
    if args.dry_run:
        for t in todo:
            print("  " + shlex.join(t.command))
        return {}
    if todo:
        prepare_model(args.profile)
    return run_tasks(todo, **launch_kwargs(args), time_budget=args.time_budget, stop_at=args.stop_at, git=git_info())


def prepare_model(profile: str) -> None:
    """Convert the profile's GGUF model into its cache before the runs start, so that the parallel
    runs load it instead of each converting it (what a failure means, each run then says itself)."""
    from qerl.config import make_config
    from qerl.models import resolve_model_path

    try:
        resolve_model_path(make_config(profile).model)
    except Exception as exc:  # noqa: BLE001 - the runs report it with their own error
        print(f"note: could not prepare the model ({type(exc).__name__}: {exc}); the runs will say why", flush=True)


def archive(out: Path, dest: Path) -> Path:
    """One .tar.gz of ``out`` (runs and analysis), paths relative to out's parent."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(dest, "w:gz") as tar:
        tar.add(out, arcname=out.name)
    return dest


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.strip().split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="small", choices=("small", "smoke"), help="small: the plan's; smoke: a CPU check")
    ap.add_argument("--out", default=None, help="default: results/aqn_paired/<profile>")
    ap.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=tuple(ARMS))
    add_launch_args(ap, parallel=12)
    add_call_bounds(ap, "left unfinished; the next call redoes them), so the analysis and archive still happen (0: never")
    ap.add_argument("--data-dir", default=None, help="only for datasets other than the built-in arith")
    ap.add_argument("--max-steps", type=int, default=0, help="override max_steps (pipeline checks only)")
    ap.add_argument("--train-flags", default="", help="extra `qerl train` flags for every run, for settings that "
                    "do not change the computation (e.g. '--eval-batch-size 64'); each run.json records them")
    ap.add_argument("--analyze-only", action="store_true", help="run nothing; rebuild the analysis")
    ap.add_argument("--archive", default=None, metavar="PATH.tar.gz", help="pack <out> into this tarball at the end")
    ap.add_argument("--dry-run", action="store_true", help="print the commands; run nothing")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out or f"results/aqn_paired/{args.profile}")
    try:
        launch_kwargs(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    codes = {} if args.analyze_only else run_all(args, out)
    if args.dry_run:
        return 0
    res = analyze(out)
    declare(ARTEFACT, out)
    print(verdict_sentence(res["primary"]))
    print(f"wrote {out / 'table.csv'}, per_seed.csv, paired_differences.png, NOTES.md")
    if args.archive:
        print(f"archive: {archive(out, Path(args.archive))}")
    return 1 if any(c != 0 for c in codes.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
