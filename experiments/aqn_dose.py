"""AQN dose-response on the NVFP4 and the bf16 base: the pre-registered study of results/aqn_dose/PLAN.md.

Six arms, paired by seed (a seed's six runs are one block): the NVFP4 base with sigma_start 0 (no AQN),
1e-3, 3e-3 and 1e-2, and the bf16 base with sigma_start 0 and 1e-2; sigma_end = sigma_start / 20.
Everything else is the equivalence test's setting (experiments.aqn_equivalence: profile small, GRPO,
16 evaluation samples after training only, the exponential schedule over K = 5 stages), except the
completion cap, which the plan fixes after the cap check:

    python -m experiments.aqn_dose --check --caps 64 128 256 --gpus 0 1 2 3 --per-gpu 9   # before the plan
    python -m experiments.aqn_dose --gpus 0 1 2 3 --per-gpu 12 --time-budget 420 --stop-at 540 \
        --archive OUT/aqn_dose.tar.gz           # the study: the plan's cap and seeds; call again to resume
    python -m experiments.aqn_dose --analyze-only   # table.csv, per_seed.csv, dose_response.png, NOTES.md
    python -m experiments.aqn_dose --dry-run --gpus 0 1 2 3 --per-gpu 12   # the plan: runs, GPUs, commands

``--check`` runs every arm over ``--check-seeds`` at each cap of ``--caps`` into <check-out>/runs/ and
writes cap_check.csv / cap_check.md: per arm and cap the fraction of completions that hit the cap (in
the training rollouts, in the worst AQN stage, in the final evaluation), the seconds each run took, and
the blocks that the budget buys at each cap with the effects they can detect. The study (default
mode) reads its cap, seeds and minimum of blocks from the plan's ```aqn_dose block and refuses to
start without the plan. Runs checkpoint every SAVE_EVERY steps and continue with --resume-from auto, so
a run stopped at --stop-at goes on from its last checkpoint in the next call; when a run finishes, only
its small files stay (config.json, metrics.jsonl, summary.json, run.json, segments.json: the wall time of
each call it ran in).

The analysis, by the plan's rules: complete blocks only (six finished runs, one git sha, the plan's cap,
settings differing only in the arm's fields); five primary hypotheses under Holm's correction (the
NVFP4 trend over the four levels, each NVFP4 level against no noise, bf16 1e-2 against no noise), and
secondary endpoints that decide nothing.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import shlex
import shutil
import statistics
import sys
from pathlib import Path

from experiments import aqn_paired as A
from experiments._common import GRPO, Artefact, Outputs, declare, flags
from experiments.aqn_equivalence import RUN_KEYS, assign_gpus, seed_of, t_ci
from experiments.aqn_power import t_test_power
from experiments.launch import Task, add_call_bounds, add_launch_args, concurrency, launch_kwargs, run_tasks
from qerl.logging import git_info
from qerl.noise import stage_for_step

LEVELS = (0.0, 1e-3, 3e-3, 1e-2)  # sigma_start of the NVFP4 arms; the bf16 base gets the first and the last
END_RATIO = 20  # sigma_end = sigma_start / END_RATIO


def arm_name(base: str, sigma: float) -> str:
    return f"{base}-{'0' if sigma == 0 else f'{sigma:.0e}'.replace('e-0', 'e-')}"


def _arm(base: str, sigma: float) -> dict:
    if sigma == 0:
        return {"method": f"{base}_lora"}
    return {"method": f"{base}_lora_aqn", "sigma_start": sigma, "sigma_end": round(sigma / END_RATIO, 12)}


ARMS = {arm_name(b, s): _arm(b, s) for b, levels in (("nvfp4", LEVELS), ("bf16", (0.0, 1e-2))) for s in levels}
NVFP4_ARMS = [arm_name("nvfp4", s) for s in LEVELS]
BF16_CONTROL, BF16_NOISE = arm_name("bf16", 0.0), arm_name("bf16", 1e-2)
CONTROL = NVFP4_ARMS[0]
ARM_KEYS = ("method", "fmt", "aqn", "sigma_start", "sigma_end")  # config.json keys an arm sets
SAVE_EVERY = 10
KEEP = (*A.KEEP, "segments.json")
CAP_LIMIT = 0.05  # the cap-hit rate every arm must stay under (training rollouts and final evaluation)
CHECK_SEEDS = (900, 901)
BUDGET_MIN, GPUS_BUDGET, OVERHEAD = 45, 4, 0.2  # the issue's budget: 45 min of a 4-GPU machine, ~20% lost to starts
SD_PAIR = 0.093  # SD of the paired differences in final pass@1 of the equivalence test (128 pairs, cap 64)
# GPU-seconds a noaqn run of the equivalence test took (cap 64, 16 runs a GPU of 4 H200s: median wall 264.9 s / 16):
# the cap check scales it by each run's wall time over the cap-64 nvfp4-0 runs' of the same check
ANCHOR_CAP, ANCHOR_GPU_S = 64, 264.9 / 16
ALPHA = 0.05
PLAN = Path("results/aqn_dose/PLAN.md")
OUT = Path("results/aqn_dose/small")
CHECK_OUT = Path("results/aqn_dose/cap_check")
# The study's outputs. Declared as the module's ARTEFACT (then analyze writes artefact.json, and every declared
# artefact's notebook must show it: tests/test_layout.py) once notebooks/rewards.ipynb has its cell.
STUDY = Artefact("aqn_dose", "experiments.aqn_dose", Outputs(
    figure_file="dose_response.png", notebook="notebooks/rewards.ipynb",
    columns=("endpoint", "role", "comparison", "n", "estimate", "sd", "t", "p_t", "p_holm", "ci95_low", "ci95_high",
             "boot95_low", "boot95_high", "n_pos", "n_neg", "p_sign", "decision")))
ARTEFACT = STUDY


# ----------------------------------------------------------------------------- the plan's settings
def read_plan(path: Path = PLAN) -> dict | None:
    """The plan's ```aqn_dose block: {"cap": int, "seeds": [int], "min_blocks": int}; None without a plan.
    Lines `key: value`; seeds as `a-b` (inclusive) or a list of numbers."""
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    m = re.search(r"```aqn_dose\n(.*?)```", text, re.S)
    if not m:
        raise ValueError(f"{path}: no ```aqn_dose block (max_completion_length, seeds, min_blocks)")
    kv = dict(line.split(":", 1) for line in m.group(1).splitlines() if ":" in line)
    kv = {k.strip(): v.strip() for k, v in kv.items()}
    seeds = [int(x) for x in re.findall(r"\d+", kv["seeds"])]
    if re.fullmatch(r"\d+\s*-\s*\d+", kv["seeds"]):
        seeds = list(range(seeds[0], seeds[1] + 1))
    return {"cap": int(kv["max_completion_length"]), "seeds": seeds, "min_blocks": int(kv["min_blocks"])}


# ----------------------------------------------------------------------------- running
def command(args, arm: str, seed: int, run_dir: Path, cap: int) -> list[str]:
    """``qerl train`` of one run: the equivalence test's overrides (aqn_paired.command) with the arm, the
    cap, and checkpoints every SAVE_EVERY steps that --resume-from auto continues from."""
    ov = {**ARMS[arm], "seed": seed, **GRPO, "max_completion_length": cap, "eval_samples": A.EVAL_SAMPLES,
          "eval_before": False, "wandb_mode": "disabled", "save_every": SAVE_EVERY, "save_total_limit": 1}
    if args.max_steps:
        ov["max_steps"] = args.max_steps
    return [sys.executable, "-m", "qerl", "train", "--profile", args.profile, "--output-dir", str(run_dir),
            "--resume-from", "auto", *flags(ov), *shlex.split(args.train_flags)]


def _on_exit(task: Task, code: int) -> None:
    """Record the call's segment of the run (segments.json); a finished run keeps only its small files, an
    unfinished one keeps its checkpoints for the next call."""
    seg_path = task.folder / "segments.json"
    segs = json.loads(seg_path.read_text()) if seg_path.exists() else []
    rec = json.loads((task.folder / "run.json").read_text()) if (task.folder / "run.json").exists() else {}
    segs.append({k: rec.get(k) for k in ("started", "wall_s", "exit_code", "gpu")})
    seg_path.write_text(json.dumps(segs, indent=1))
    if code == 0 and A.is_done(task.folder):
        for p in task.folder.iterdir():
            if p.name not in KEEP:
                shutil.rmtree(p) if p.is_dir() else p.unlink()


def tasks(args, runs: list[tuple[str, int, int]], root: Path, pin: bool) -> list[Task]:
    """Launcher Tasks of (arm, seed, cap) runs not finished yet, in order; ``pin``: a seed's runs on one GPU."""
    name = (lambda a, s, c: f"{a}-s{s}") if pin else (lambda a, s, c: f"{a}-cap{c}-s{s}")
    dirs = {(a, s, c): root / "runs" / name(a, s, c) for a, s, c in runs}
    todo = [Task(d.name, command(args, a, s, d, c), d, done=A.is_done, on_exit=_on_exit)
            for (a, s, c), d in dirs.items() if not A.is_done(d)]
    if pin and args.gpus:
        gpu_of = {s: g for g, seeds in assign_gpus([seed_of(t) for t in todo], args.gpus).items() for s in seeds}
        for t in todo:
            t.gpu = gpu_of[seed_of(t)]
    return todo


def study_runs(seeds) -> list[tuple[str, int]]:
    """Block by block: every arm of a seed, then the next seed."""
    return [(a, s) for s in dict.fromkeys(seeds) for a in ARMS]


# ----------------------------------------------------------------------------- reading runs
def read_run(d: Path) -> dict | None:
    """aqn_paired.read_run's endpoints, plus the cap-hit rates: ``cap_hit`` (training completions that hit the
    cap, all steps), ``cap_hit_stage<k>`` (per AQN stage), ``cap_hit_eval`` (final evaluation), and the run's
    total wall seconds over its calls."""
    r = A.read_run(d)
    if r is None:
        return None
    cfg = json.loads((d / "config.json").read_text())
    summary = json.loads((d / "summary.json").read_text())
    rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if x.strip()]
    clip = [(row["step"], row["completions/clipped_ratio"]) for row in rows
            if row.get("reward") is not None and row.get("completions/clipped_ratio") is not None]
    r["cap"] = cfg.get("max_completion_length")
    r["cap_hit"] = sum(c for _, c in clip) / len(clip) if clip else None
    if clip and cfg.get("max_steps") and cfg.get("num_stages"):
        by: dict[int, list[float]] = {}
        for step, c in clip:
            by.setdefault(stage_for_step(step - 1, cfg["max_steps"], cfg["num_stages"]), []).append(c)
        r.update({f"cap_hit_stage{k}": sum(v) / len(v) for k, v in by.items()})
    r["cap_hit_eval"] = summary.get(f"eval/{A.DATASET}/truncated")
    segs = json.loads((d / "segments.json").read_text()) if (d / "segments.json").exists() else []
    r["wall_s"] = sum(s.get("wall_s") or 0 for s in segs) or r.get("wall_s")
    r["calls"] = len(segs) or None
    return r


def read_runs(out: Path) -> dict[tuple[str, int], dict]:
    runs = {}
    for d in sorted((Path(out) / "runs").glob("*-s*")):
        arm, _, seed = d.name.rpartition("-s")
        if arm in ARMS and seed.isdigit() and (r := read_run(d)) is not None:
            runs[(arm, int(seed))] = r
    return runs


def _config(out: Path, arm: str, seed: int) -> dict:
    try:
        return json.loads((out / "runs" / f"{arm}-s{seed}" / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def check_block(out: Path, seed: int, cap: int) -> str | None:
    """None when the block of ``seed`` may be used; else why not."""
    cfgs = {a: _config(out, a, seed) for a in ARMS}
    shas = {(c.get("provenance") or {}).get("git_sha") for c in cfgs.values()}
    if len(shas) != 1 or None in shas:
        return f"git sha differs ({' / '.join(sorted(map(str, shas)))})"
    caps = {c.get("max_completion_length") for c in cfgs.values()}
    if caps != {cap}:
        return f"completion cap {' / '.join(sorted(map(str, caps)))}, the plan's is {cap}"
    ref = cfgs[CONTROL]
    diff = sorted({k for c in cfgs.values() for k in set(c) | set(ref)
                   if k not in ARM_KEYS + RUN_KEYS and c.get(k) != ref.get(k)})
    return f"settings differ beyond the arm: {', '.join(diff)}" if diff else None


def blocks(out: Path, runs: dict, cap: int) -> tuple[list[int], dict[int, str]]:
    """(seeds of the usable blocks, {seed: why a block with every run finished is left out})."""
    done = sorted({s for _, s in runs if all((a, s) in runs for a in ARMS)})
    left_out = {s: why for s in done if (why := check_block(out, s, cap)) is not None}
    return [s for s in done if s not in left_out], left_out


# ----------------------------------------------------------------------------- statistics
def holm(pvals: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the order given (nan stays nan)."""
    idx = sorted((i for i, p in enumerate(pvals) if not math.isnan(p)), key=lambda i: pvals[i])
    m, out, run = len(idx), [math.nan] * len(pvals), 0.0
    for rank, i in enumerate(idx):
        run = max(run, min(1.0, (m - rank) * pvals[i]))
        out[i] = run
    return out


def slope(values: list[float]) -> float:
    """The least-squares slope of values over their index 0..k-1 (per level step)."""
    k = len(values)
    xs = [i - (k - 1) / 2 for i in range(k)]
    return sum(x * v for x, v in zip(xs, values)) / sum(x * x for x in xs)


def stats(d: list[float]) -> dict:
    n = len(d)
    mean = sum(d) / n if n else math.nan
    t, p = A.paired_t(d)
    lo, hi = t_ci(d, 0.95)
    blo, bhi = A.bootstrap_ci(d)
    pos, neg, p_sign = A.sign_test(d)
    return {"n": n, "estimate": mean, "sd": statistics.stdev(d) if n > 1 else math.nan, "t": t, "p_t": p,
            "ci95_low": lo, "ci95_high": hi, "boot95_low": blo, "boot95_high": bhi, "n_pos": pos, "n_neg": neg,
            "p_sign": p_sign}


def endpoints(runs: dict, seeds: list[int]) -> list[dict]:
    """The plan's rows: five primary hypotheses (Holm, family-wise alpha 0.05), then the secondary ones."""
    def y(arm, s, key="pass1"):
        return runs[(arm, s)][key]

    rows = [("trend over sigma, NVFP4 (slope per level)", "primary", " < ".join(NVFP4_ARMS),
             [slope([y(a, s) for a in NVFP4_ARMS]) for s in seeds])]
    rows += [(f"sigma {a.split('-', 1)[1]} vs 0, NVFP4", "primary", f"{a} - {CONTROL}",
              [y(a, s) - y(CONTROL, s) for s in seeds]) for a in NVFP4_ARMS[1:]]
    rows.append(("sigma 1e-2 vs 0, bf16", "primary", f"{BF16_NOISE} - {BF16_CONTROL}",
                 [y(BF16_NOISE, s) - y(BF16_CONTROL, s) for s in seeds]))
    noise_1e2 = NVFP4_ARMS[-1]
    rows.append(("noise effect at 1e-2, bf16 minus NVFP4", "secondary",
                 f"({BF16_NOISE} - {BF16_CONTROL}) - ({noise_1e2} - {CONTROL})",
                 [(y(BF16_NOISE, s) - y(BF16_CONTROL, s)) - (y(noise_1e2, s) - y(CONTROL, s)) for s in seeds]))
    rows.append(("NVFP4 vs bf16 base, no noise", "secondary", f"{CONTROL} - {BF16_CONTROL}",
                 [y(CONTROL, s) - y(BF16_CONTROL, s) for s in seeds]))
    for a in (*NVFP4_ARMS[1:], BF16_NOISE):
        ctrl = BF16_CONTROL if a.startswith("bf16") else CONTROL
        if all(runs[(x, s)].get("reward_noisy") is not None for x in (a, ctrl) for s in seeds):
            rows.append((f"reward steps 7-30, {a} vs {ctrl}", "secondary", f"{a} - {ctrl}",
                         [y(a, s, "reward_noisy") - y(ctrl, s, "reward_noisy") for s in seeds]))
    table = [{"endpoint": e, "role": role, "comparison": c, **stats(d), "d": d} for e, role, c, d in rows if d]
    primary = [r for r in table if r["role"] == "primary"]
    for r, p in zip(primary, holm([r["p_t"] for r in primary])):
        r["p_holm"] = p
    for r in table:
        r.setdefault("p_holm", None)  # secondary: no correction
        r["decision"] = (("higher" if r["estimate"] > 0 else "lower") if r["p_holm"] < ALPHA else
                         "no difference shown") if r["role"] == "primary" else ""
    return table


# ----------------------------------------------------------------------------- analysis
def analyze(out: Path = OUT, plan: dict | None = None) -> dict:
    """table.csv, per_seed.csv, dose_response.png and NOTES.md of the runs under ``out`` (the plan's rules)."""
    plan = plan or read_plan()
    if plan is None:
        raise SystemExit(f"no plan at {PLAN}: the analysis follows its rules")
    out = Path(out)
    runs = read_runs(out)
    seeds, left_out = blocks(out, runs, plan["cap"])
    table = endpoints(runs, seeds) if len(seeds) >= 2 else []
    cols = list(STUDY.outputs.columns)
    with (out / "table.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        w.writerows([{k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()} for r in table])
    keys = sorted({k for r in runs.values() for k in r})
    with (out / "per_seed.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["arm", "seed", "used", *keys])
        w.writeheader()
        for (arm, seed), r in sorted(runs.items(), key=lambda x: (x[0][1], list(ARMS).index(x[0][0]))):
            w.writerow({"arm": arm, "seed": seed, "used": seed in seeds, **r})
    res = {"runs": runs, "seeds": seeds, "left_out": left_out, "table": table, "plan": plan}
    figure(out, res)
    notes(out, res)
    if isinstance(globals().get("ARTEFACT"), Artefact):
        declare(ARTEFACT, out)  # noqa: F821 - declared once the notebook shows the study
    return res


def verdict(res: dict) -> str:
    """The verdict in the plan's words, from the primary rows."""
    n, need = len(res["seeds"]), res["plan"]["min_blocks"]
    if n < need:
        return f"Undecided: {n} complete blocks, fewer than the plan's {need}."
    rows = {r["comparison"]: r for r in res["table"] if r["role"] == "primary"}
    if " < ".join(NVFP4_ARMS) not in rows:
        return f"Undecided: {n} complete blocks, too few for a paired test."
    trend = rows[" < ".join(NVFP4_ARMS)]
    shown = [r for c, r in rows.items() if r["decision"] != "no difference shown" and " < " not in c]

    def fmt(r):
        return f"{r['estimate']:+.3f} (95% CI {r['ci95_low']:+.3f} to {r['ci95_high']:+.3f}, Holm p = {r['p_holm']:.3g})"

    words = {"lower": "falls", "higher": "rises", "no difference shown": "shows no trend"}
    s = (f"On the NVFP4 base final pass@1 {words[trend['decision']]} over sigma_start 0, 1e-3, 3e-3, 1e-2: "
         f"slope {fmt(trend)} per level.")
    for r in rows.values():
        if " < " in r["comparison"]:
            continue
        what = f"{r['decision']}: "
        s += f" {r['endpoint']}: {what}{fmt(r)}."
    return s + ("" if shown else " No level differs from no noise after Holm's correction.")


def notes(out: Path, res: dict) -> None:
    def f(v, spec="+.4f"):
        return "" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)

    runs, seeds, plan = res["runs"], res["seeds"], res["plan"]
    shas = sorted({r.get("git_sha") or "?" for (a, s), r in runs.items() if s in seeds})
    lines = ["# AQN dose-response: results", "",
             "The plan is `../PLAN.md` (committed before the runs). The verdict, by its decision rule:", "",
             f"**{verdict(res)}**", "", "## Runs", "",
             f"- finished: {len(runs)} runs; complete blocks used: {len(seeds)} (plan: seeds "
             f"{min(plan['seeds'])}-{max(plan['seeds'])}, at least {plan['min_blocks']} blocks), completion cap "
             f"{plan['cap']} tokens",
             f"- git sha of the runs used: {', '.join(shas) if shas else '-'}"]
    lines += [f"- left out, seed {s}: {why}" for s, why in sorted(res["left_out"].items())]
    lines += ["", "## Arms (complete blocks)", "",
              "| arm | final pass@1 mean (SD) | cap hit, training | worst stage | cap hit, evaluation | wall s (median) |",
              "|---|---|---|---|---|---|"]
    for a in ARMS:
        rs = [runs[(a, s)] for s in seeds]
        if not rs:
            continue
        p = [r["pass1"] for r in rs]
        hit = [r["cap_hit"] for r in rs if r.get("cap_hit") is not None]
        worst = max((v for r in rs for k, v in r.items() if k.startswith("cap_hit_stage")), default=None)
        ev = [r["cap_hit_eval"] for r in rs if r.get("cap_hit_eval") is not None]
        walls = [r["wall_s"] for r in rs if r.get("wall_s")]
        lines.append(f"| {a} | {statistics.fmean(p):.4f} ({f(statistics.stdev(p) if len(p) > 1 else None, '.4f')}) | "
                     f"{f(statistics.fmean(hit) if hit else None, '.3f')} | {f(worst, '.3f')} | "
                     f"{f(statistics.fmean(ev) if ev else None, '.3f')} | "
                     f"{f(statistics.median(walls) if walls else None, '.0f')} |")
    over = [a for a in ARMS if seeds and max(statistics.fmean(runs[(a, s)].get(k) or 0 for s in seeds)
                                             for k in ("cap_hit", "cap_hit_eval")) >= CAP_LIMIT]
    lines += ["", f"Cap hit: the fraction of completions that reached the {plan['cap']}-token cap (the plan requires "
              f"under {CAP_LIMIT:.0%} in every arm; worst stage: the highest mean of one AQN stage in one run)."]
    lines += [f"- over the limit: {' '.join(over)}"] if over else []
    lines += ["", "## Endpoints", "",
              "Paired differences within a block; the trend is each seed's least-squares slope of final pass@1 over the "
              "NVFP4 levels (0, 1e-3, 3e-3, 1e-2 as steps 0-3). Primary rows: paired t-tests, Holm's correction over "
              "the five (family-wise alpha 0.05). Secondary rows decide nothing and are uncorrected. Bootstrap: "
              "percentile, 10,000 resamples of the blocks.", "",
              "| endpoint | role | n | estimate | 95% CI (t) | 95% CI (bootstrap) | p (t) | p (Holm) | sign (+/-) | "
              "decision |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["table"]:
        lines.append(f"| {r['endpoint']} | {r['role']} | {r['n']} | {f(r['estimate'])} | [{f(r['ci95_low'])}, "
                     f"{f(r['ci95_high'])}] | [{f(r['boot95_low'])}, {f(r['boot95_high'])}] | {f(r['p_t'], '.3g')} | "
                     f"{f(r['p_holm'], '.3g')} | {r['n_pos']}/{r['n_neg']} | {r['decision']} |")
    lines += ["", "Per-run values: `per_seed.csv`; the figure: `dose_response.png`.", "",
              "Scope: a 135M model on arithmetic (arith level 0, 30 steps, K = 5 stages, exponential schedule, "
              f"{plan['cap']}-token cap); the NVFP4 base is the Q4_1 GGUF quantized again, the bf16 base the Q4_1 "
              "GGUF dequantized; the project's restored noise (aqn_mode restored). Not the paper's 3B-14B models."]
    (out / "NOTES.md").write_text("\n".join(lines) + "\n")


def figure(out: Path, res: dict) -> Path | None:
    """dose_response.png: mean final pass@1 per arm over sigma_start (95% t CI over blocks), and each noisy
    arm minus no noise on its base (paired, 95% t CI)."""
    seeds, runs = res["seeds"], res["runs"]
    if len(seeds) < 2:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x_of = {s: i for i, s in enumerate(LEVELS)}
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.8))
    for base, levels, color in (("nvfp4", LEVELS, "tab:blue"), ("bf16", (0.0, 1e-2), "tab:orange")):
        xs, ms, errs = [], [], []
        for s in levels:
            p = [runs[(arm_name(base, s), k)]["pass1"] for k in seeds]
            lo, hi = t_ci(p, 0.95)
            xs.append(x_of[s])
            ms.append(statistics.fmean(p))
            errs.append((hi - lo) / 2)
        ax.errorbar(xs, ms, yerr=errs, fmt="o-", color=color, capsize=3, label=f"{base} base")
    for r in [r for r in res["table"] if r["role"] == "primary" and " < " not in r["comparison"]]:
        arm = r["comparison"].split(" - ")[0]
        base, sig = arm.split("-", 1)
        x = x_of[float(sig)] + (0.08 if base == "bf16" else 0)
        bx.errorbar([x], [r["estimate"]], yerr=[[r["estimate"] - r["ci95_low"]], [r["ci95_high"] - r["estimate"]]],
                    fmt="o", color="tab:orange" if base == "bf16" else "tab:blue", capsize=3,
                    mfc="none" if r["decision"] == "no difference shown" else None)
    bx.axhline(0, color="0.5", lw=0.8)
    for a in (ax, bx):
        a.set_xticks(range(len(LEVELS)), ["0", "1e-3", "3e-3", "1e-2"])
        a.set_xlabel("sigma_start (sigma_end = sigma_start / 20)")
    ax.set_ylabel("final pass@1")
    ax.legend(fontsize=8)
    ax.set_title(f"mean over {len(seeds)} blocks, 95% CI", fontsize=9)
    bx.set_ylabel("paired difference vs no noise")
    bx.set_title("noisy minus noise-free, same base (filled: Holm p < 0.05)", fontsize=9)
    fig.suptitle(f"AQN dose-response, small profile, {res['plan']['cap']}-token cap", fontsize=10)
    fig.tight_layout()
    path = out / "dose_response.png"
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- the cap check and the budget
def detectable(n: int, sd: float, alpha: float, power: float = 0.8) -> float:
    """The smallest true mean difference a two-sided paired t-test at ``alpha`` finds with ``power`` (n pairs)."""
    if n < 3:
        return math.nan
    lo, hi = 0.0, 10 * sd
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_test_power(n, mid, sd=sd, alpha=alpha) < power else (lo, mid)
    return hi


def budget_rows(gpu_s_per_block: float, budget_min: float = BUDGET_MIN, gpus: int = GPUS_BUDGET,
                overhead: float = OVERHEAD, sd: float = SD_PAIR) -> dict:
    """Blocks the budget buys at ``gpu_s_per_block`` GPU-seconds a block, and the effects they can detect with
    80% power: a level against no noise at Holm's first step (alpha 0.05 / 5) and at its last (0.05), and the
    trend's slope per level at 0.05 / 5 (its SD sd / sqrt(10): four levels, arms of equal variance)."""
    n = int(budget_min * 60 * gpus * (1 - overhead) // gpu_s_per_block)
    return {"blocks": n, "runs": n * len(ARMS), "d_level_0.01": detectable(n, sd, ALPHA / 5),
            "d_level_0.05": detectable(n, sd, ALPHA), "d_slope_0.01": detectable(n, sd / math.sqrt(10), ALPHA / 5)}


def _last_stage(r: dict) -> float | None:
    """A run's cap-hit rate in its last AQN stage (steps 25-30 at the small profile)."""
    stages = [int(k[len("cap_hit_stage"):]) for k in r if k.startswith("cap_hit_stage")]
    return r[f"cap_hit_stage{max(stages)}"] if stages else None


def cap_check(out: Path, per_gpu: int | None) -> list[dict]:
    """cap_check.csv and cap_check.md from <out>/runs/<arm>-cap<cap>-s<seed>/."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for d in sorted((Path(out) / "runs").glob("*-cap*-s*")):
        arm_cap, _, seed = d.name.rpartition("-s")
        arm, _, cap = arm_cap.rpartition("-cap")
        if arm in ARMS and (r := read_run(d)) is not None:
            groups.setdefault((arm, int(cap)), []).append(r)
    anchor = [r["wall_s"] for r in groups.get((CONTROL, ANCHOR_CAP), []) if r.get("wall_s")]
    scale = ANCHOR_GPU_S / statistics.median(anchor) if anchor else (1 / per_gpu if per_gpu else None)
    rows = []
    for (arm, cap), rs in sorted(groups.items(), key=lambda x: (x[0][1], list(ARMS).index(x[0][0]))):
        hit = [r["cap_hit"] for r in rs if r.get("cap_hit") is not None]
        ev = [r["cap_hit_eval"] for r in rs if r.get("cap_hit_eval") is not None]
        last = [v for r in rs if (v := _last_stage(r)) is not None]
        walls = [r["wall_s"] for r in rs if r.get("wall_s")]
        rows.append({"arm": arm, "cap": cap, "runs": len(rs), "cap_hit": statistics.fmean(hit) if hit else None,
                     "cap_hit_worst_stage": max((v for r in rs for k, v in r.items() if k.startswith("cap_hit_stage")),
                                                default=None),
                     "cap_hit_last_stage": statistics.fmean(last) if last else None,
                     "cap_hit_eval": statistics.fmean(ev) if ev else None, "pass1": statistics.fmean(r["pass1"] for r in rs),
                     "wall_s": statistics.median(walls) if walls else None,
                     "gpu_s": statistics.median(walls) * scale if walls and scale else None})
    out.mkdir(parents=True, exist_ok=True)
    with (out / "cap_check.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["arm"])
        w.writeheader()
        w.writerows(rows)
    how = (f"the equivalence test's {ANCHOR_GPU_S:.1f} GPU s a cap-{ANCHOR_CAP} {CONTROL} run (16 a GPU) x this run's "
           f"median wall / the cap-{ANCHOR_CAP} {CONTROL} runs' here" if anchor else "median wall / runs a GPU")
    lines = ["# Cap check of the AQN dose-response study", "",
             f"Every arm at each cap over a few seeds ({per_gpu} runs a GPU at once); cap hit = completions that reached "
             f"the cap (training: all steps; worst / last stage: the mean of one AQN stage; evaluation: the final one, "
             f"temperature 0.6); the plan asks for under {CAP_LIMIT:.0%} in every arm. GPU s per run = {how}.", "",
             "| cap | arm | runs | cap hit, training | worst stage | last stage | evaluation | final pass@1 | wall s | "
             "GPU s |", "|---|---|---|---|---|---|---|---|---|---|"]

    def f(v, spec=".3f"):
        return "-" if v is None else format(v, spec)

    for r in rows:
        lines.append(f"| {r['cap']} | {r['arm']} | {r['runs']} | {f(r['cap_hit'])} | {f(r['cap_hit_worst_stage'])} | "
                     f"{f(r['cap_hit_last_stage'])} | {f(r['cap_hit_eval'])} | {f(r['pass1'])} | {f(r['wall_s'], '.0f')} | "
                     f"{f(r['gpu_s'], '.1f')} |")
    lines += ["", f"The budget ({BUDGET_MIN} min of a {GPUS_BUDGET}-GPU machine, {OVERHEAD:.0%} of it lost to starts), "
              f"paired SD {SD_PAIR}; detectable = 80% power:", "",
              "| cap | every arm under the limit | GPU s a block | blocks | level vs 0 at 0.01 / at 0.05 | slope at 0.01 |",
              "|---|---|---|---|---|---|"]
    for cap in sorted({r["cap"] for r in rows}):
        rs = [r for r in rows if r["cap"] == cap]
        ok = len(rs) == len(ARMS) and all(max(r["cap_hit"] or 0, r["cap_hit_eval"] or 0) < CAP_LIMIT for r in rs)
        block = sum(r["gpu_s"] for r in rs) if all(r["gpu_s"] for r in rs) and len(rs) == len(ARMS) else None
        b = budget_rows(block) if block else None
        lines.append(f"| {cap} | {'yes' if ok else 'no'} | {f(block, '.0f')} | {b['blocks'] if b else '-'} | "
                     + (f"{b['d_level_0.01']:.3f} / {b['d_level_0.05']:.3f} | {b['d_slope_0.01']:.4f} |" if b else "- | - |"))
    (out / "cap_check.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return rows


# ----------------------------------------------------------------------------- the command line
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.strip().split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="small", choices=("small", "smoke"), help="small: the plan's; smoke: a CPU check")
    ap.add_argument("--plan", default=str(PLAN), help="the plan whose ```aqn_dose block gives cap, seeds, min_blocks")
    ap.add_argument("--out", default=None, help=f"default: {OUT} ({CHECK_OUT} with --check)")
    ap.add_argument("--check", action="store_true", help="the cap check: every arm at each of --caps, --check-seeds")
    ap.add_argument("--caps", nargs="+", type=int, default=[ANCHOR_CAP, 128, 256], help="the caps to check (the "
                    f"cap {ANCHOR_CAP} runs time the others against the equivalence test's)")
    ap.add_argument("--check-seeds", nargs="+", type=int, default=list(CHECK_SEEDS))
    ap.add_argument("--seeds", nargs="+", type=int, default=None, help="the study's seeds (default: the plan's; "
                    "replacement seeds after two technical failures are added here)")
    add_launch_args(ap, parallel=12)
    add_call_bounds(ap, "they continue from their last checkpoint in the next call")
    ap.add_argument("--max-steps", type=int, default=0, help="override max_steps (pipeline checks only)")
    ap.add_argument("--train-flags", default="", help="extra `qerl train` flags that do not change the computation")
    ap.add_argument("--archive", default=None, metavar="PATH.tar.gz", help="pack <out> without checkpoints into this "
                    "tarball at the end, also when the runs or the analysis fail")
    ap.add_argument("--analyze-only", action="store_true", help="run nothing; rebuild the analysis (or the cap check's)")
    ap.add_argument("--dry-run", action="store_true", help="print the runs and commands; run and write nothing")
    return ap.parse_args(argv)


def archive(out: Path, dest: Path) -> Path:
    """<out> as one .tar.gz (paths under out's name), without checkpoints or logs of finished runs."""
    import tarfile

    dest.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(dest, "w:gz") as tar:
        tar.add(out, arcname=out.name, filter=lambda ti: None if "/checkpoints" in ti.name else ti)
    return dest


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        kw = launch_kwargs(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out or (CHECK_OUT if args.check else OUT))
    plan = None if args.check else read_plan(Path(args.plan))
    if not args.check and plan is None:
        print(f"error: no plan at {args.plan}: the study runs the plan's cap and seeds, and the plan is committed "
              "before any run (the cap check, --check, comes first)", file=sys.stderr)
        return 2
    if args.check:
        runs = [(a, s, c) for c in args.caps for s in args.check_seeds for a in ARMS]
    else:
        runs = [(a, s, plan["cap"]) for a, s in study_runs(args.seeds or plan["seeds"])]
    codes: dict[str, int] = {}
    try:
        if not args.analyze_only:
            todo = tasks(args, runs, out, pin=not args.check)
            print(f"aqn_dose{' cap check' if args.check else ''}: {len(runs)} runs, {len(runs) - len(todo)} finished, "
                  f"{len(todo)} to run, {concurrency(**kw)} at once; {out / 'runs'}", flush=True)
            if args.dry_run:
                for t in todo:
                    print(f"  {t.name}" + (f" [GPU {t.gpu}]" if t.gpu is not None else "") + f": {shlex.join(t.command)}")
                return 0
            if todo:
                A.prepare_model(args.profile)
                codes = run_tasks(todo, **kw, time_budget=args.time_budget, stop_at=args.stop_at, git=git_info())
        if args.check:
            cap_check(out, args.per_gpu or (args.parallel // max(len(args.gpus or [0]), 1)))
        else:
            res = analyze(out, plan)
            print(verdict(res))
            print(f"wrote {out / 'table.csv'}, per_seed.csv, dose_response.png, NOTES.md")
    finally:
        if args.archive and out.exists() and not args.dry_run:
            print(f"archive: {archive(out, Path(args.archive))}")
    return 1 if any(c != 0 for c in codes.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
