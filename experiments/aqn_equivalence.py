"""Is AQN equivalent to no AQN at the small profile? The pre-registered test of results/aqn_equivalence/PLAN.md.

Arms ``noaqn`` (nvfp4_lora) and ``aqn`` (nvfp4_lora_aqn, sigma 1e-2 -> 5e-4), seeds 100-227, the
16-pair study's settings (experiments.aqn_paired: profile small, GRPO, 16 evaluation samples after
training). Expected runtime: a run takes ~20 s of a GPU's time when runs share it (on 4 H200s, 16 runs a
GPU, each took ~320 s: 64 runs every ~5.4 min; 12 at once on one H200, ~230 s each), so the 256 runs take
~22 minutes on 4 GPUs, ~11 on 8.

    python -m experiments.aqn_equivalence --gpus 0 1 2 3 --per-gpu 12 --dry-run   # the plan: each GPU's runs, commands
    python -m experiments.aqn_equivalence --gpus 0 1 2 3 4 5 6 7 --per-gpu 12
    python -m experiments.aqn_equivalence --gpus 0 1 2 3 --per-gpu 16 --time-budget 240 --stop-at 560 \
        --archive OUT/aqn_equivalence.tar.gz                             # one bounded call; the runs kept
    python -m experiments.aqn_equivalence --analyze-only             # table.csv, the figure, NOTES.md
    make aqn-equivalence                                             # every GPU of the machine, 12 runs each

Runs go to results/aqn_equivalence/small/runs/<arm>-s<seed>/ exactly as aqn_paired writes them (run.json,
only the small files kept); a finished run is never run again, so a stopped study resumes where it
stopped (call it again; ``--time-budget`` / ``--stop-at`` bound one call). The runs are launcher Tasks
(experiments.launch, the one launcher; ``pending``), started ``--per-gpu`` at once on each GPU of
``--gpus``; the pairs are dealt out whole over the GPUs (``assign_gpus``), so both arms of a seed run
on the same GPU.

The analysis (``analyze``), by the plan's rules: only pairs whose two runs finished, share the git sha
and differ in nothing but AQN; TOST with margin 0.02, the paired t-test, 90% and 95% t and bootstrap CIs,
the sign test, and one of four verdicts (``verdict``).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import shlex
import sys
from pathlib import Path

from experiments import aqn_paired
from experiments._common import Artefact, Outputs, declare
from experiments.aqn_power import SD, t_cdf, t_quantile, tost_power
from experiments.launch import Task, add_call_bounds, add_launch_args, concurrency, launch_kwargs, run_tasks
from qerl.logging import git_info

CONTROL, TREATED = aqn_paired.CONTROL, aqn_paired.TREATED
ARMS = (CONTROL, TREATED)
SEEDS = tuple(range(100, 228))  # 128 pairs, independent of the 16-pair study's seeds 0-15
MARGIN = 0.02
ALPHA = 0.05
MIN_PAIRS = 120
# GPU seconds a run of the small profile takes when several share a GPU (H200, 2026-11-27: 16 at once took
# ~320 s each, 12 at once ~230 s): the plan's time estimate
GPU_S_PER_RUN = 20
OUT = Path("results/aqn_equivalence/small")
# config.json keys the two arms of a pair may differ in: the AQN fields, and what names the run
AQN_KEYS = ("method", "aqn", "sigma_start", "sigma_end")
RUN_KEYS = ("output_dir", "wandb_name", "command", "provenance", "policy", "data_sources", "world_size")
VERDICTS = ("AQN helps", "AQN hurts", "equivalent within 0.02", "undecided")


# ----------------------------------------------------------------------------- statistics
def tost(d: list[float], margin: float = MARGIN) -> tuple[float, float, float]:
    """(p_low, p_high, p_TOST) of the two one-sided paired t-tests of -margin < mean(d) < margin."""
    n = len(d)
    if n < 2:
        return math.nan, math.nan, math.nan
    mean = sum(d) / n
    se = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1) / n)
    if se == 0:
        p_low, p_high = float(mean <= -margin), float(mean >= margin)
    else:
        p_low = 1 - t_cdf((mean + margin) / se, n - 1)  # H0: mean <= -margin
        p_high = t_cdf((mean - margin) / se, n - 1)  # H0: mean >= +margin
    return p_low, p_high, max(p_low, p_high)


def t_ci(d: list[float], level: float) -> tuple[float, float]:
    """The t confidence interval of mean(d) at ``level``."""
    n = len(d)
    if n < 2:
        return math.nan, math.nan
    mean = sum(d) / n
    half = t_quantile((1 + level) / 2, n - 1) * math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1) / n)
    return mean - half, mean + half


def endpoint(d: list[float], margin: float = MARGIN) -> dict:
    """Every statistic of the plan for one set of paired differences."""
    n = len(d)
    mean = sum(d) / n if n else math.nan
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1)) if n > 1 else math.nan
    t, p_t = aqn_paired.paired_t(d)
    p_low, p_high, p_tost = tost(d, margin)
    pos, neg, p_sign = aqn_paired.sign_test(d)
    (c90l, c90h), (c95l, c95h) = t_ci(d, 0.90), t_ci(d, 0.95)
    (b90l, b90h), (b95l, b95h) = aqn_paired.bootstrap_ci(d, level=0.90), aqn_paired.bootstrap_ci(d, level=0.95)
    return {"n": n, "mean_diff": mean, "sd": sd, "t": t, "p_t": p_t, "p_tost_low": p_low, "p_tost_high": p_high,
            "p_tost": p_tost, "ci90_low": c90l, "ci90_high": c90h, "ci95_low": c95l, "ci95_high": c95h,
            "boot90_low": b90l, "boot90_high": b90h, "boot95_low": b95l, "boot95_high": b95h,
            "n_pos": pos, "n_neg": neg, "p_sign": p_sign}


def verdict(e: dict, min_pairs: int = MIN_PAIRS, margin: float = MARGIN, alpha: float = ALPHA) -> str:
    """The plan's decision rule, in its order; one of VERDICTS."""
    if e["n"] < min_pairs:
        return "undecided"
    if e["p_tost"] < alpha and -margin < e["boot90_low"] and e["boot90_high"] < margin:
        return "equivalent within 0.02"
    if e["p_t"] < alpha and e["mean_diff"] > 0 and e["boot95_low"] > 0:
        return "AQN helps"
    if e["p_t"] < alpha and e["mean_diff"] < 0 and e["boot95_high"] < 0:
        return "AQN hurts"
    return "undecided"


# ----------------------------------------------------------------------------- pairs
def _config(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def check_pair(out: Path, seed: int) -> str | None:
    """None when the pair of ``seed`` may be used; else why not (same git sha, same settings but AQN)."""
    a, b = _config(out / "runs" / f"{CONTROL}-s{seed}"), _config(out / "runs" / f"{TREATED}-s{seed}")
    sha = [(c.get("provenance") or {}).get("git_sha") for c in (a, b)]
    if sha[0] != sha[1] or sha[0] is None:
        return f"git sha differs ({sha[0]} / {sha[1]})"
    diff = sorted(k for k in set(a) | set(b) if k not in AQN_KEYS + RUN_KEYS and a.get(k) != b.get(k))
    return f"settings differ beyond AQN: {', '.join(diff)}" if diff else None


def pairs(out: Path, runs: dict) -> tuple[list[int], dict[int, str]]:
    """(seeds of the usable pairs, {seed: why a finished pair is left out})."""
    done = sorted(s for (arm, s) in runs if arm == CONTROL and (TREATED, s) in runs)
    left_out = {s: why for s in done if (why := check_pair(out, s)) is not None}
    return [s for s in done if s not in left_out], left_out


# ----------------------------------------------------------------------------- analysis
TABLE_COLUMNS = ["endpoint", "role", "comparison", "n", "mean_diff", "sd", "t", "p_t", "p_tost_low", "p_tost_high",
                 "p_tost", "ci90_low", "ci90_high", "ci95_low", "ci95_high", "boot90_low", "boot90_high",
                 "boot95_low", "boot95_high", "n_pos", "n_neg", "p_sign", "verdict"]
# What this study writes into <out>/ (its artefact.json): table.csv's columns, the figure it draws itself
# beside them, and the notebook that shows it
ARTEFACT = Artefact("aqn_equivalence", "experiments.aqn_equivalence", Outputs(
    figure_file="paired_differences.png", columns=tuple(TABLE_COLUMNS), notebook="notebooks/rewards.ipynb"))


def analyze(out: Path = OUT, min_pairs: int = MIN_PAIRS) -> dict:
    """table.csv, per_seed.csv, paired_differences.png and NOTES.md of the runs under ``out``."""
    runs = {k: v for k, v in aqn_paired.read_runs(out).items() if k[0] in ARMS}
    seeds, left_out = pairs(out, runs)
    use = {k: v for k, v in runs.items() if k[1] in seeds}
    stages = sorted({int(k[len("gap_stage"):]) for r in use.values() for k in r if k.startswith("gap_stage")})
    endpoints = [("pass@1 (final)", "pass1", "primary"), ("reward, steps 7-30", "reward_noisy", "secondary")]
    endpoints += [(f"sampling entropy, stage {s}", f"entropy_stage{s}", "secondary") for s in stages if s]
    endpoints += [(f"log-prob gap, stage {s}", f"gap_stage{s}", "secondary") for s in stages if s]
    table, primary = [], None
    for name, key, role in endpoints:
        _, d = aqn_paired.paired(use, TREATED, key)
        if not d:
            continue
        e = endpoint(d)
        row = {"endpoint": name, "role": role, "comparison": f"{TREATED} - {CONTROL}", **e, "verdict": ""}
        if key == "pass1":
            row["verdict"] = verdict(e, min_pairs)
            primary = {**row, "d": d}
        table.append(row)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "table.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=TABLE_COLUMNS)
        w.writeheader()
        w.writerows([{k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items() if k != "d"}
                     for r in table])
    keys = sorted({k for r in runs.values() for k in r})
    with (out / "per_seed.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["arm", "seed", "used", *keys])
        w.writeheader()
        for (arm, seed), r in sorted(runs.items(), key=lambda x: (x[0][1], ARMS.index(x[0][0]))):
            w.writerow({"arm": arm, "seed": seed, "used": seed in seeds, **r})
    figure(out, primary)
    notes(out, runs, seeds, left_out, table, primary, min_pairs)
    return {"runs": runs, "seeds": seeds, "left_out": left_out, "table": table, "primary": primary}


def verdict_sentence(primary: dict | None, min_pairs: int = MIN_PAIRS) -> str:
    if primary is None:
        return "No verdict: no complete pair of noaqn and aqn runs yet."
    e = primary
    stats = (f"mean paired difference in final pass@1 {e['mean_diff']:+.4f} over {e['n']} pairs (90% CI "
             f"{e['ci90_low']:+.4f} to {e['ci90_high']:+.4f}, TOST p = {e['p_tost']:.3g} for the margin +-{MARGIN}; "
             f"95% CI {e['ci95_low']:+.4f} to {e['ci95_high']:+.4f}, paired t-test p = {e['p_t']:.3g})")
    v = e["verdict"]
    if v == "undecided" and e["n"] < min_pairs:
        return f"Undecided: only {e['n']} complete pairs, fewer than the plan's {min_pairs}; {stats}."
    what = {"AQN helps": "AQN helps NVFP4 LoRA", "AQN hurts": "AQN hurts NVFP4 LoRA",
            "equivalent within 0.02": "AQN and no AQN are equivalent within 0.02 for NVFP4 LoRA",
            "undecided": "Undecided: this test can neither show AQN equivalent to no AQN within 0.02 nor a "
                         "difference, for NVFP4 LoRA"}[v]
    return f"{what} at the small profile (135M, GRPO): {stats}."


def notes(out: Path, runs: dict, seeds: list[int], left_out: dict, table: list[dict], primary: dict | None,
          min_pairs: int) -> None:
    def f(v, fmt="+.4f"):
        return "" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)

    shas = sorted({r.get("git_sha") or "?" for (a, s), r in runs.items() if s in seeds})
    lines = ["# AQN equivalence test: results", "",
             "The plan is `../PLAN.md` (committed before the runs). The verdict, by its decision rule:", "",
             f"**{verdict_sentence(primary, min_pairs)}**", "",
             "## Runs", "",
             f"- finished: {sum(1 for a, _ in runs if a == CONTROL)} `{CONTROL}`, "
             f"{sum(1 for a, _ in runs if a == TREATED)} `{TREATED}`; complete pairs used: {len(seeds)}",
             f"- git sha of the runs used: {', '.join(shas) if shas else '-'}"]
    devices = devices_of(out, seeds)
    if devices:
        lines.append("- devices of those runs: " + ", ".join(f"{d} ({n} runs)" for d, n in sorted(devices.items())))
    lines += [f"- left out, seed {s}: {why}" for s, why in sorted(left_out.items())]
    if primary is not None and primary["n"] >= 2 and primary["sd"] > 0:
        lines += ["", f"Exploratory (not in the plan): the paired differences' SD is {primary['sd']:.4f}; the plan "
                  f"sized the test with {SD}. At the observed SD, {primary['n']} pairs give TOST a power of "
                  f"{tost_power(primary['n'], sd=primary['sd'], margin=MARGIN):.2f} at a true difference of 0 "
                  f"(plan: {tost_power(primary['n'], sd=SD, margin=MARGIN):.2f})."]
    lines += ["", "## Endpoints", "",
              "Paired differences aqn - noaqn; t CIs and TOST (margin +-0.02, alpha 0.05 each side); bootstrap: "
              "percentile, 10,000 resamples. Only the primary row decides; the secondary rows are uncorrected "
              "for multiplicity, and the log-prob gap rises with AQN by construction (noise in the rollout "
              "only).", "",
              "| endpoint | role | n | mean diff | 90% CI (t) | 95% CI (t) | 95% CI (bootstrap) | p (t) | p (TOST) "
              "| sign (+/-) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        lines.append(f"| {r['endpoint']} | {r['role']} | {r['n']} | {f(r['mean_diff'])} | [{f(r['ci90_low'])}, "
                     f"{f(r['ci90_high'])}] | [{f(r['ci95_low'])}, {f(r['ci95_high'])}] | [{f(r['boot95_low'])}, "
                     f"{f(r['boot95_high'])}] | {f(r['p_t'], '.3g')} | {f(r['p_tost'], '.3g')} | "
                     f"{r['n_pos']}/{r['n_neg']} |")
    lines += ["", "Per-run values: `per_seed.csv`; the figure: `paired_differences.png`.", "", scope(out, seeds)]
    (out / "NOTES.md").write_text("\n".join(lines) + "\n")


def scope(out: Path, seeds: list[int]) -> str:
    """The Scope line: the setting read from a used AQN run's config.json (schedule, cap, steps, task)."""
    cfg = {}
    for s in seeds:
        try:
            cfg = json.loads((out / "runs" / f"{TREATED}-s{s}" / "config.json").read_text())
            break
        except (OSError, ValueError):
            continue
    parts = []
    if cfg.get("sigma_start") is not None and cfg.get("sigma_end") is not None:
        parts.append(f"sigma {cfg['sigma_start']:g} -> {cfg['sigma_end']:g}, {cfg.get('noise_schedule') or '?'}, "
                     f"K = {cfg.get('num_stages')} stages")
    if cfg.get("max_completion_length") is not None:
        parts.append(f"completions capped at {cfg['max_completion_length']} tokens")
    if cfg.get("max_steps") is not None:
        parts.append(f"{cfg['max_steps']} steps")
    if cfg.get("dataset"):
        levels = ", ".join(str(v) for v in cfg.get("arith_levels") or [])
        parts.append(f"{cfg['dataset']} level {levels}" if cfg["dataset"] == "arith" and levels else cfg["dataset"])
    setting = f" ({'; '.join(parts)})" if parts else ""
    return ("Scope: a 135M model on arithmetic" + setting + ", on a base quantized twice (Q4_1 GGUF, then NVFP4), "
            "with the project's restored noise (aqn_mode restored); not the paper's 3B-14B models, not the "
            "upstream code's accumulating noise.")


def devices_of(out: Path, seeds: list[int]) -> dict[str, int]:
    """How many of the used runs ran on each device (config.json's ``provenance.device``)."""
    counts: dict[str, int] = {}
    for arm in ARMS:
        for s in seeds:
            try:
                cfg = json.loads((out / "runs" / f"{arm}-s{s}" / "config.json").read_text())
                dev = (cfg.get("provenance") or {}).get("device")
            except (OSError, ValueError):
                dev = None
            counts[dev or "?"] = counts.get(dev or "?", 0) + 1
    return counts


def figure(out: Path, primary: dict | None) -> Path | None:
    """paired_differences.png: each pair's difference (sorted), the mean, its 90% / 95% t CIs, the margin."""
    if primary is None:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = sorted(primary["d"])
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.scatter(range(len(d)), d, s=8, color="0.4", label="pair (aqn - noaqn), sorted")
    ax.axhspan(-MARGIN, MARGIN, color="tab:green", alpha=0.12, label=f"equivalence margin +-{MARGIN}")
    ax.axhline(0, color="0.6", lw=0.8)
    x = len(d) + max(2, len(d) // 20)
    ax.errorbar([x], [primary["mean_diff"]], yerr=[[primary["mean_diff"] - primary["ci95_low"]],
                                                   [primary["ci95_high"] - primary["mean_diff"]]],
                fmt="o", color="tab:blue", capsize=3, label="mean, 95% CI (t)")
    ax.errorbar([x], [primary["mean_diff"]], yerr=[[primary["mean_diff"] - primary["ci90_low"]],
                                                   [primary["ci90_high"] - primary["mean_diff"]]],
                fmt="none", color="tab:red", lw=3, label="90% CI (t, = TOST)")
    ax.set_xlabel("pair")
    ax.set_ylabel("final pass@1 difference")
    ax.set_title(f"AQN equivalence, small profile: {primary['n']} pairs, verdict: {primary['verdict']}")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    path = out / "paired_differences.png"
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- running
def plan_runs(seeds=SEEDS) -> list[tuple[str, int]]:
    """Pair by pair: noaqn-s100, aqn-s100, noaqn-s101, ... (aqn_paired's order for its primary arms)."""
    return aqn_paired.plan_runs(ARMS, seeds)


def assign_gpus(seeds, gpus) -> dict[str, list[int]]:
    """{GPU: the seeds whose runs it takes}: the pairs dealt out whole, in the plan's order, one GPU after
    the other. Both arms of a seed run on one GPU, so each GPU holds as many runs of one arm as of the
    other: no arm is tied to a GPU."""
    out: dict[str, list[int]] = {str(g): [] for g in gpus}
    for k, seed in enumerate(dict.fromkeys(seeds)):
        out[str(gpus[k % len(gpus)])].append(seed)
    return out


def seed_of(task: Task) -> int:
    """The seed of a run from its name, <arm>-s<seed>."""
    return int(task.name.rpartition("-s")[2])


def study_args(args: argparse.Namespace) -> argparse.Namespace:
    """aqn_paired's arguments for this study's runs: the small profile, the two primary arms, --seeds."""
    return argparse.Namespace(profile="small", seeds=list(args.seeds), arms=list(ARMS), data_dir=None,
                              max_steps=args.max_steps, train_flags=args.train_flags)


def pending(args: argparse.Namespace, out: Path) -> list[Task]:
    """The planned runs not finished yet (a finished run is never run again), as launcher Tasks in the
    plan's order (aqn_paired.pending: its commands, its small-files-only clean-up). With --gpus, each
    is pinned to its pair's GPU (``assign_gpus`` of the pairs still to run), so a resumed study deals
    what is left over all GPUs again."""
    todo = aqn_paired.pending(study_args(args), out)
    if args.gpus:
        gpu_of = {s: g for g, seeds in assign_gpus([seed_of(t) for t in todo], args.gpus).items() for s in seeds}
        for t in todo:
            t.gpu = gpu_of[seed_of(t)]
    return todo


def print_plan(args: argparse.Namespace, todo: list[Task], out: Path, commands: bool = False) -> None:
    """The plan: pairs, runs finished and to run, how many at once, the estimated time and the runs each
    GPU takes (``commands``: every command too)."""
    seeds = list(dict.fromkeys(args.seeds))
    total = len(plan_runs(seeds))
    at_once = concurrency(**launch_kwargs(args))
    per = GPU_S_PER_RUN
    where = (f"{len(args.gpus)} GPU{'s' * (len(args.gpus) > 1)} x {args.per_gpu} runs" if args.gpus and args.per_gpu
             else f"{at_once} runs" + (f" over GPUs {' '.join(args.gpus)}" if args.gpus else
                                      " (no --gpus: CUDA_VISIBLE_DEVICES left alone)"))
    print(f"aqn_equivalence: {len(seeds)} pairs (seeds {min(seeds)}-{max(seeds)}) = {total} runs; "
          f"{total - len(todo)} finished, {len(todo)} to run, {where} at once "
          f"(~{per} s of a GPU's time each: ~{len(todo) * per / max(len(args.gpus or [0]), 1) / 60:.0f} min); "
          f"{out / 'runs'}",
          flush=True)
    if args.gpus:
        for g, mine in assign_gpus([seed_of(t) for t in todo], args.gpus).items():
            n = sum(1 for t in todo if t.gpu == g)
            print(f"  GPU {g}: {len(mine)} pairs, {n} runs, seeds {' '.join(map(str, mine)) or '-'}")
    if commands:
        for t in todo:
            print(f"  {t.name}" + (f" [GPU {t.gpu}]" if t.gpu is not None else "") + f": {shlex.join(t.command)}")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.strip().split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS), help="the pairs' seeds (default: the "
                    "plan's 100-227; its replacement seeds 228, 229, ... are added here)")
    add_launch_args(ap, parallel=12)
    add_call_bounds(ap, "left unfinished; the next call redoes them")
    ap.add_argument("--max-steps", type=int, default=0, help="override max_steps (pipeline checks only)")
    ap.add_argument("--train-flags", default="", help="extra `qerl train` flags that do not change the computation")
    ap.add_argument("--archive", default=None, metavar="PATH.tar.gz", help="pack <out> (runs and analysis) into "
                    "this tarball at the end, also when the runs or the analysis fail (to carry a study between "
                    "machines; unpack it where the next call runs to resume)")
    ap.add_argument("--analyze-only", action="store_true", help="run nothing; rebuild the analysis")
    ap.add_argument("--dry-run", action="store_true", help="print the plan, each GPU's runs and the commands; "
                    "run and write nothing")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    try:
        kw = launch_kwargs(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    codes: dict[str, int] = {}
    if not args.analyze_only:
        todo = pending(args, out)
        print_plan(args, todo, out, commands=args.dry_run)
        if args.dry_run:
            return 0
    try:
        if not args.analyze_only and todo:
            aqn_paired.prepare_model("small")
            codes = run_tasks(todo, **kw, time_budget=args.time_budget, stop_at=args.stop_at, git=git_info())
        res = analyze(out)
        declare(ARTEFACT, out)
        print(verdict_sentence(res["primary"]))
        print(f"wrote {out / 'table.csv'}, per_seed.csv, paired_differences.png, NOTES.md")
    finally:
        if args.archive and out.exists():
            print(f"archive: {aqn_paired.archive(out, Path(args.archive))}")
    return 1 if any(c != 0 for c in codes.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
