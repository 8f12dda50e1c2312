"""Figures and tables from results/ only (no model, no GPU): the notebooks and `make figures` call
these.

Each `plot_*` / `*_table` function reads committed result files with pandas, saves
`<out_dir>/<name>.png` (figures) and returns the matplotlib Figure or a DataFrame. A missing input
prints a note and returns None, so a partial results/ tree never crashes a notebook.

    table1(results)        Table 1 at this scale: accuracy before/after GRPO per method, mean and
                           spread (std) over seeds                         -> table1.png (bars)
    plot_rewards(results)  reward per step per method (mean over seeds, band +- std), Fig. 4
    plot_entropy(results)  training-forward `entropy` and `sampling/entropy` per method, Fig. 5
    plot_aqn(results)      nvfp4_lora vs nvfp4_lora_aqn reward, `aqn/sigma` on a twin axis, Fig. 8
    plot_step_time(results) mean `time/rollout_s` and `time/train_s` per method, stacked bars
    kernel_table(results)  Qwen2.5 decoder-layer linear time per method from results/kernels/h100.json
    plot_curves(results, experiment, by=..., panels=...)  any step metric of an experiment's runs, one
                           line per value of config fields `by`, one panel per value of `panels`
                           (Fig. 4, 7, 8, 9, 10, 16, as their artefact.json declare)
    table2(results)        Table 2: accuracy per model / method on MATH500, AIME24, AIME25, AMC23
                           and their average                                -> table2_bigmath.png
    speed_results(folder)  a speed artefact's results/<table3|rollout>/<gpu>.json as (runs, rows);
                           plot_table3_split(rows), plot_rollout_throughput(rows), speed_summary(runs)
    artefact(name)         an artefact's declaration (results/<name>/artefact.json: its figure, table
                           columns and notebook); experiment_figure(name) draws the declared figure
"""

import json
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: notebooks and CI have no display
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from qerl import formats  # noqa: E402
from qerl.config import METHODS, env, methods, table_bases  # noqa: E402

# QERL_RESULTS points every default at another results folder (the notebooks' tests use it).
RESULTS = Path(env("QERL_RESULTS") or Path(__file__).resolve().parent.parent / "results")
TABLE1 = "table1/small"
# Order the methods as the paper's Table 1 does: the untrained bases, full and LoRA bf16, then the
# 4-bit LoRA variants (qerl.config's Table 1 rows, from the format registry), then the rest.
METHOD_ORDER = list(dict.fromkeys(table_bases() + METHODS + methods()))


def _note(msg):
    print(f"[qerl.plots] skipped: {msg}")


def _order(methods):
    known = [m for m in METHOD_ORDER if m in set(methods)]
    return known + sorted(set(methods) - set(known))


def _out_dir(out_dir, results):
    path = Path(out_dir) if out_dir is not None else Path(results) / "figures"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _save(fig, out_dir, results, name):
    path = _out_dir(out_dir, results) / f"{name}.png"
    # written beside it and renamed: two processes drawing into one folder (the notebooks' scratch folder,
    # parallel test workers) never leave or show a half-written file
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp")
    try:
        fig.savefig(tmp, dpi=120, bbox_inches="tight", format="png")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    print(f"[qerl.plots] wrote {path}")
    return fig


# ---------------------------------------------------------------- loading

def load_table(results=RESULTS, experiment=TABLE1):
    """The long-form table.csv of `experiment`, or None (with a note) if it is missing."""
    path = Path(results) / experiment / "table.csv"
    if not path.exists():
        _note(f"{path} not found")
        return None
    return pd.read_csv(path)


def load_metrics(results=RESULTS, experiment=TABLE1, fields=()):
    """All training steps of all runs in one DataFrame with columns run, method, seed, step, ...

    Only lines that carry a `reward` are kept (the step-0 line holds just the eval before training).
    `fields`: config.json fields to add as columns (e.g. "lora_rank", "model"). Returns None (with
    a note) if there are no runs.
    """
    runs = Path(results) / experiment / "runs"
    frames = []
    for run in sorted(runs.glob("*/metrics.jsonl")) if runs.exists() else []:
        cfg_path = run.parent / "config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        rows = [json.loads(line) for line in run.read_text().splitlines() if line.strip()]
        df = pd.DataFrame([r for r in rows if r.get("reward") is not None])
        if df.empty:
            continue
        df.insert(0, "run", run.parent.name)
        df.insert(1, "method", cfg.get("method", run.parent.name.rsplit("-s", 1)[0]))
        df.insert(2, "seed", cfg.get("seed"))
        for f in fields:
            if f not in ("method", "seed"):
                df[f] = cfg.get(f)
        frames.append(df)
    if not frames:
        _note(f"no metrics.jsonl under {runs}")
        return None
    return pd.concat(frames, ignore_index=True)


# ---------------------------------------------------------------- Table 1

def table1(results=RESULTS, out_dir=None, experiment=TABLE1, name="table1"):
    """Accuracy before/after training per method: mean and sample standard deviation over seeds.

    Untrained baselines (run base-*) have only `accuracy`, reported as `after` with no `before`.
    Saves table1.png (bar chart: before vs after) and returns the DataFrame indexed by method.
    """
    df = load_table(results, experiment)
    if df is None:
        return None
    df = df[df["metric"].isin(["accuracy", "accuracy_before"])]
    g = df.groupby(["method", "metric"])["value"]
    stats = pd.DataFrame({"mean": g.mean(), "std": g.std(), "n": g.count()}).unstack("metric")
    tab = pd.DataFrame({
        "before_mean": stats[("mean", "accuracy_before")] if ("mean", "accuracy_before") in stats else None,
        "before_std": stats[("std", "accuracy_before")] if ("std", "accuracy_before") in stats else None,
        "after_mean": stats[("mean", "accuracy")],
        "after_std": stats[("std", "accuracy")],
        "seeds": stats[("n", "accuracy")].astype(int),
    })
    tab = tab.loc[_order(tab.index)]
    tab["gain"] = tab["after_mean"] - tab["before_mean"]

    fig, ax = plt.subplots(figsize=(9, 4))
    x = range(len(tab))
    half = tab["before_std"].fillna(0)
    ax.bar([i - 0.2 for i in x], tab["before_mean"].fillna(0), 0.4, yerr=half, label="before RL",
           color="0.7", capsize=3)
    trained = tab["before_mean"].notna().tolist()
    for is_trained, label, color in ((True, "after RL", "C0"), (False, "untrained base (evaluated only)", "C7")):
        idx = [i for i in x if trained[i] == is_trained]
        if idx:  # an untrained row is not "after RL": its own bar, its own label
            ax.bar([i + 0.2 for i in idx], tab["after_mean"].iloc[idx], 0.4,
                   yerr=tab["after_std"].fillna(0).iloc[idx], label=label, color=color, capsize=3)
    ax.set_xticks(list(x), tab.index, rotation=30, ha="right")
    ax.set_ylabel("accuracy")
    ax.set_title(f"Table 1 at small scale ({experiment}); bars = mean, whiskers = +- std over seeds")
    ax.legend()
    _save(fig, out_dir, results, name)
    return tab


# ---------------------------------------------------------------- curves

def _curves(ax, m, key, methods, smooth=1, band=True):
    """One line per method: the mean over its runs (seeds) per step, smoothed, with a band of +- one
    standard deviation over the runs where there are several (the label says n)."""
    for i, method in enumerate(methods):
        sub = m[m["method"] == method]
        if key not in sub or sub[key].isna().all():
            continue
        color = f"C{i % 10}"
        per_run = sub.pivot_table(index="step", columns="run", values=key).rolling(smooth, min_periods=1).mean()
        mean, std, n = per_run.mean(axis=1), per_run.std(axis=1), per_run.shape[1]
        ax.plot(mean.index, mean.values, color=color, lw=2, label=f"{method} (n={n})" if n > 1 else method)
        if band and n > 1:
            ax.fill_between(mean.index, mean - std, mean + std, color=color, alpha=0.2, lw=0)
    ax.set_xlabel("step")


def plot_rewards(results=RESULTS, out_dir=None, experiment=TABLE1, smooth=3):
    """Mean reward per step per method (line), +- std over seeds (band); Fig. 4 at this scale.

    `smooth` is a trailing rolling mean over steps (3 by default: the batches are small and noisy).
    """
    m = load_metrics(results, experiment)
    if m is None:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5))
    _curves(ax, m, "reward", _order(m["method"].unique()), smooth)
    ax.set_ylabel(f"reward (rolling mean over {smooth} steps)")
    ax.set_title("Training reward (Fig. 4 analogue)")
    ax.legend(fontsize=8)
    return _save(fig, out_dir, results, "rewards")


def plot_entropy(results=RESULTS, out_dir=None, experiment=TABLE1, smooth=3, name="entropy"):
    """Training-forward `entropy` (left) and `sampling/entropy` (right) per method; Fig. 5."""
    m = load_metrics(results, experiment)
    if m is None:
        return None
    methods = _order(m["method"].unique())
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, key, title in zip(axes, ["entropy", "sampling/entropy"],
                              ["training forward (entropy)", "rollout sampler (sampling/entropy)"]):
        _curves(ax, m, key, methods, smooth)
        ax.set_title(title)
    axes[0].set_ylabel("mean token entropy (nats)")
    axes[1].legend(fontsize=8)
    fig.suptitle(f"Token entropy during RL (Fig. 5 analogue; {experiment})")
    return _save(fig, out_dir, results, name)


def entropy_early_late(results=RESULTS, experiment=TABLE1, n=5):
    """Mean entropy over the first and last `n` steps per method (over seeds), as a DataFrame."""
    m = load_metrics(results, experiment)
    if m is None:
        return None
    rows = {}
    for method, sub in m.groupby("method"):
        steps = sorted(sub["step"].unique())
        early, late = sub[sub["step"].isin(steps[:n])], sub[sub["step"].isin(steps[-n:])]
        rows[method] = {"entropy_early": early["entropy"].mean(), "entropy_late": late["entropy"].mean(),
                        "sampling_entropy_early": early["sampling/entropy"].mean(),
                        "sampling_entropy_late": late["sampling/entropy"].mean(),
                        "reward_early": early["reward"].mean(), "reward_late": late["reward"].mean()}
    out = pd.DataFrame.from_dict(rows, orient="index")
    return out.loc[_order(out.index)]


def plot_aqn(results=RESULTS, out_dir=None, experiment=TABLE1, smooth=3,
             methods=("nvfp4_lora", "nvfp4_lora_aqn")):
    """AQN ablation (Fig. 8): reward of nvfp4_lora vs nvfp4_lora_aqn, `aqn/sigma` on a twin axis."""
    m = load_metrics(results, experiment)
    if m is None:
        return None
    m = m[m["method"].isin(methods)]
    if m.empty:
        _note(f"no runs of {methods} in {experiment}")
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5))
    _curves(ax, m, "reward", list(methods), smooth)
    ax.set_ylabel(f"reward (rolling mean over {smooth} steps)")
    ax.legend(loc="upper left", fontsize=8)
    aqn = m[m["method"] == methods[-1]]
    if "aqn/sigma" in aqn and aqn["aqn/sigma"].notna().any():
        ax2 = ax.twinx()
        sigma = aqn.groupby("step")["aqn/sigma"].mean()
        ax2.step(sigma.index, sigma.values, where="post", color="k", ls="--", lw=1, label="aqn/sigma")
        ax2.set_ylabel("AQN sigma")
        ax2.legend(loc="upper right", fontsize=8)
    ax.set_title("Adaptive quantization noise ablation (Fig. 8 analogue)")
    return _save(fig, out_dir, results, "aqn")


def step_time_table(results=RESULTS, experiment=TABLE1):
    """Mean seconds per step in rollout and in training per method (over steps and seeds)."""
    m = load_metrics(results, experiment)
    if m is None:
        return None
    cols = [c for c in ["time/rollout_s", "time/train_s", "step_time"] if c in m]
    t = m.groupby("method")[cols].mean()
    return t.loc[_order(t.index)]


def plot_step_time(results=RESULTS, out_dir=None, experiment=TABLE1):
    """Stacked bars: mean `time/rollout_s` and `time/train_s` per step for each method."""
    t = step_time_table(results, experiment)
    if t is None:
        return None
    if not {"time/rollout_s", "time/train_s"} <= set(t.columns):
        _note("metrics lack time/rollout_s or time/train_s")
        return None
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar(t.index, t["time/rollout_s"], label="rollout (generation)", color="C1")
    ax.bar(t.index, t["time/train_s"], bottom=t["time/rollout_s"], label="train (fwd+bwd+step)",
           color="C0")
    ax.set_ylabel("seconds per step (mean)")
    ax.set_title("Where step time goes")
    ax.tick_params(axis="x", rotation=30)
    ax.legend()
    return _save(fig, out_dir, results, "step_time")


# ---------------------------------------------------------------- experiment curves and Table 2

def _sort_col(col):
    """Sort key for a config column: methods in Table 1 order, anything else by its own value."""
    if col.name == "method":
        return col.map(lambda m: METHOD_ORDER.index(m) if m in METHOD_ORDER else len(METHOD_ORDER))
    return col


def plot_curves(results=RESULTS, experiment=None, by=("method",), panels=None, keys=("reward",), name=None,
                title="", smooth=3, out_dir=None, panel_names=None):
    """Step curves of an experiment's runs (the figure scripts'): one line per value of the config
    fields `by` (mean over seeds, band = +- std), one column of panels per value of the
    config field `panels` (e.g. "model", "loss_type"), one row per metric in `keys`.

    Saves <name>.png (default: the experiment with "/" -> "-") and returns the Figure, or None.
    """
    by = (by,) if isinstance(by, str) else tuple(by)
    m = load_metrics(results, experiment, fields=by + ((panels,) if panels else ()))
    if m is None:
        return None
    first = m.drop_duplicates("run").sort_values(list(by), key=_sort_col)
    run_label = {r["run"]: ", ".join(str(r[f]) if f == "method" else f"{f}={r[f]}" for f in by)
                 for _, r in first.iterrows()}
    order = list(dict.fromkeys(run_label[r] for r in first["run"]))
    # _curves draws one line per "method": the line's label goes there, the panel's value is kept apart first
    # (panels="method" would otherwise split the panels by the line labels)
    m = m.assign(_panel=m[panels] if panels else None, method=m["run"].map(run_label))
    pvals = sorted(m["_panel"].dropna().unique(), key=str) if panels else [None]
    fig, axes = plt.subplots(len(keys), len(pvals), figsize=(6.5 * len(pvals), 4 * len(keys)), squeeze=False)
    for j, pv in enumerate(pvals):
        sub = m if pv is None else m[m["_panel"] == pv]
        for i, key in enumerate(keys):
            ax = axes[i][j]
            sm = 1 if key.startswith("aqn/") else smooth  # the sigma schedule is a step function: draw it raw
            _curves(ax, sub, key, [o for o in order if o in set(sub["method"])], sm)
            ax.set_ylabel(f"{key} (rolling mean over {sm} steps)" if sm > 1 else key)
            if pv is not None and i == 0:
                ax.set_title((panel_names or {}).get(pv, f"{panels}={pv}"))
            ax.legend(fontsize=7)
    fig.suptitle(title or str(experiment))
    fig.tight_layout()
    return _save(fig, out_dir, results, name or str(experiment).replace("/", "-"))


def table2(results=RESULTS, out_dir=None, experiment="table2_bigmath/small", name="table2_bigmath",
           datasets=("math500", "aime24", "aime25", "amc23")):
    """Table 2: mean accuracy (over seeds) per model and method on each benchmark, plus `average`
    over the four Table 2 benchmarks present. Other evaluated sets (e.g. arith) are kept as columns.
    Saves <name>.png (grouped bars per model) and returns the DataFrame indexed by (model, method).
    """
    df = load_table(results, experiment)
    if df is None:
        return None
    acc = df[df["metric"] == "accuracy"]
    if acc.empty:
        _note(f"no accuracy rows in {experiment}")
        return None
    tab = acc.pivot_table(index=["model", "method"], columns="dataset", values="value", aggfunc="mean")
    present = [d for d in datasets if d in tab.columns]
    if present:
        tab["average"] = tab[present].mean(axis=1)
    tab["seeds"] = acc.groupby(["model", "method"])["run"].nunique()
    rank = {m: i for i, m in enumerate(METHOD_ORDER)}  # "nvfp4_lora (lr=3e-05)" sorts as nvfp4_lora
    tab = tab.loc[sorted(tab.index, key=lambda ix: (ix[0], rank.get(ix[1].split(" ")[0], len(rank)), ix[1]))]
    cols = present + (["average"] if present else []) + [c for c in tab.columns if c not in present + ["average", "seeds"]]
    models = list(dict.fromkeys(tab.index.get_level_values("model")))
    fig, axes = plt.subplots(1, len(models), figsize=(7 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        sub = tab.loc[model][cols]
        width = 0.8 / max(len(cols), 1)
        for k, c in enumerate(cols):
            ax.bar([i + k * width for i in range(len(sub))], sub[c].fillna(0), width, label=c)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(sub))], sub.index, rotation=30, ha="right")
        ax.set_ylabel("accuracy (pass@1)")
        ax.set_title(model)
        ax.legend(fontsize=7)
    fig.suptitle(f"Table 2 ({experiment})")
    fig.tight_layout()
    _save(fig, out_dir, results, name)
    plt.close(fig)
    return tab


# ---------------------------------------------------------------- kernels

def kernel_table(results=RESULTS, out_dir=None, name="kernels/h100.json"):
    """Decoder-layer linear time (ms, sum over the seven projections) per model, op, M and method.

    Rows name shared shapes like "q_proj/o_proj"; each name counts once per projection it stands
    for, as the kernel benchmark's own summary does. Adds bf16/<fmt> speedup columns
    (> 1 means the 4-bit kernel is faster). Saves kernels.png (speedup of nvfp4 over bf16 vs M).
    """
    path = Path(results) / name
    if not path.exists():
        _note(f"{path} not found")
        return None
    data = json.loads(path.read_text())
    df = pd.DataFrame(data.get("rows", []))
    if df.empty:
        _note(f"{path} has no rows")
        return None
    df["layer_ms"] = df["ms"] * df["proj"].str.count("/").add(1)
    tab = df.pivot_table(index=["model", "op", "M"], columns="method", values="layer_ms", aggfunc="sum")
    for fmt in formats.names():
        if fmt in tab and formats.DENSE in tab:
            tab[f"{formats.DENSE}/{fmt}"] = tab[formats.DENSE] / tab[fmt]
    if "bf16/nvfp4" in tab:
        lin = tab.xs("linear", level="op")["bf16/nvfp4"].unstack("model")
        fig, ax = plt.subplots(figsize=(7, 4))
        for model in lin.columns:
            ax.plot(lin.index, lin[model], marker="o", label=model)
        ax.axhline(1.0, color="k", lw=0.8, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("M (tokens in the matmul)")
        ax.set_ylabel("bf16 time / nvfp4 time")
        ax.set_title(f"NVFP4 linear vs bf16 cuBLAS, decoder layer ({data.get('gpu', '?')})")
        ax.legend(fontsize=8)
        _save(fig, out_dir, results, "kernels")
    tab.attrs["summary"] = data.get("summary", {})
    tab.attrs["targets"] = data.get("targets", {})
    return tab


# ---------------------------------------------------------------- speed artefacts (Table 3, rollout)

def speed_results(folder, results=RESULTS):
    """(runs, rows) of a speed artefact: runs = {gpu: results/<folder>/<gpu>.json}, rows = every row
    as a DataFrame with a `gpu` column, its declared columns first (results/<folder>/artefact.json);
    (runs, None) with a note when nothing was measured yet."""
    path = Path(results) / folder
    runs = {f.stem: json.loads(f.read_text()) for f in sorted(path.glob("*.json")) if f.name != ARTEFACT}
    if not runs:
        print(f"no results in {path}/ yet: its artefact script writes them on a GPU (`make help` lists the targets)")
        return runs, None
    rows = pd.DataFrame([{**r, "gpu": g} for g, run in runs.items() for r in run["rows"]])
    cols = [c for c in (artefact(folder, results) or {}).get("columns", []) if c in rows]
    return runs, rows[cols + [c for c in rows if c not in cols]]


def declared_columns(rows, name, results=RESULTS):
    """`rows` restricted to the columns artefact `name` declares, in its order (all of them when it
    declares none); None stays None."""
    if rows is None:
        return None
    cols = (artefact(name, results) or {}).get("columns")
    return rows.reindex(columns=cols) if cols else rows


def speed_summary(runs):
    """{gpu: DataFrame of measured summary vs target}; prints each run's provenance and its failed rows."""
    out = {}
    for gpu, run in runs.items():
        print(f"{gpu}: git {run.get('git_sha')}, {run.get('date')}")
        out[gpu] = pd.DataFrame({"measured": run["summary"], "target": run.get("targets", {}),
                                 "from": run.get("summary_notes", {})})
        for r in run["rows"]:
            if r.get("oom") or r.get("error"):
                print(f"  {r['model']} {r['method']} bs{r['batch']}: {'OOM' if r.get('oom') else 'FAILED'} in "
                      f"{r.get('oom_phase') or r.get('failed_phase')}: {str(r.get('error'))[:120]}")
    return out


def plot_table3_split(rows, results=RESULTS, out_dir=None, name="table3_step_split"):
    """Stacked bars: rollout / old log-probs / policy update seconds of each measured GRPO step
    (results/table3/<gpu>.json rows) -> table3_step_split.png; None without a completed step."""
    ok = rows[rows["step_s"].notna()] if rows is not None and "step_s" in rows else None
    if ok is None or ok.empty:
        _note("no completed GRPO steps to plot")
        return None
    ok = ok.sort_values(["gpu", "model", "batch", "grad_ckpt", "method"])
    labels = [f"{r.gpu} {r.model} bs{r.batch} {'GC' if r.grad_ckpt else 'no GC'} C={r.completion_len} | {r.method}"
              for r in ok.itertuples()]
    y = list(range(len(ok)))
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(ok) + 1.5))
    left = [0.0] * len(ok)
    for phase, color in (("rollout_s", "tab:blue"), ("logprob_s", "tab:orange"), ("update_s", "tab:green")):
        ax.barh(y, ok[phase], left=left, color=color, label=phase[:-2])
        left = [a + b for a, b in zip(left, ok[phase])]
    for i, r in enumerate(ok.itertuples()):
        ax.text(r.step_s, i, f" {r.step_s:.1f} s, {100 * r.rollout_share:.0f}% rollout, {r.peak_gib:.0f} GiB",
                va="center", fontsize=8)
    ax.set_yticks(y, labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds per GRPO step (random weights; results/table3/<gpu>.json)")
    ax.set_xlim(0, max(left) * 1.45)
    ax.legend(loc="lower right")
    return _save(fig, out_dir, results, name)


def plot_rollout_throughput(rows, results=RESULTS, out_dir=None, name="rollout_throughput"):
    """Figure 11 at this scale: generated tokens/s per method, one panel per batch size
    (results/rollout/<gpu>.json rows) -> rollout_throughput.png; None without rows."""
    if rows is not None and "lengths" in rows:  # length-mix rows report useful tokens/s: not this figure
        rows = rows[rows["lengths"].isna() | (rows["lengths"] == "fixed")]
    if rows is None or rows.empty:
        _note("no rollout rows to plot")
        return None
    batches = sorted(rows["batch"].unique())
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 3.8), squeeze=False)
    methods = [m for m in table_bases() + ("hf_generate_bf16",) if m in set(rows["method"])]
    for ax, bs in zip(axes[0], batches):
        sub = rows[rows["batch"] == bs]
        models = sorted(sub["model"].unique())
        width = 0.8 / max(len(methods), 1)
        for j, m in enumerate(methods):
            vals = [sub[(sub["model"] == mo) & (sub["method"] == m)]["tokens_per_s"].max() for mo in models]
            ax.bar([i + j * width for i in range(len(models))], vals, width, label=m)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(models))], models)
        ax.set_title(f"batch {bs}")
        ax.set_ylabel("generated tokens / s")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("rollout throughput, random weights, prompt 256 (results/rollout/<gpu>.json)")
    fig.tight_layout()
    return _save(fig, out_dir, results, name)


DECODE_CATEGORIES = ("4-bit linear", "cuBLAS GEMM", "qerl fused", "attention", "sampling", "other")


def load_decode_profile(results=RESULTS, name=None):
    """The newest results/decode_profile/*.json (by its provenance date), or ``name`` under results/."""
    folder = Path(results) / "decode_profile"
    if name is not None:
        paths = [Path(results) / name]
    else:
        paths = sorted(folder.glob("*.json")) if folder.exists() else []
    runs = []
    for path in paths:
        if path.exists():
            d = json.loads(path.read_text())
            runs.append((d.get("provenance", {}).get("date", ""), path, d))
    if not runs:
        _note(f"no decode profile under {folder}")
        return None
    date, path, d = max(runs, key=lambda r: r[0])
    d["_path"] = str(path)
    return d


def plot_decode_profile(results=RESULTS, out_dir=None, name="decode_profile", profile=None):
    """Where a decode step's time goes (results/decode_profile/): kernel ms per step by kind,
    one stacked bar per method and batch (and setting, in an A/B profile), the wall time per step marked
    -> decode_profile.png."""
    d = profile if profile is not None else load_decode_profile(results)
    if d is None or not d.get("rows"):
        return None
    rows = sorted(d["rows"], key=lambda r: (r["batch"], not formats.is_dense(r["method"])))
    # an A/B profile (several settings of a switch a method and batch): the switch in each bar's label
    varied = [k for k in ("attention", "pdl", "lora_a_beside", "stream_k") if len({str(r.get(k)) for r in rows}) > 1]
    labels = [" ".join([f"{r['method']} bs{r['batch']}"] + [f"{k}={r.get(k)}" for k in varied]) for r in rows]
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(rows) + 1.5))
    left = [0.0] * len(rows)
    for cat in DECODE_CATEGORIES:
        vals = [r["categories"].get(cat, {}).get("ms", 0.0) for r in rows]
        ax.barh(labels, vals, left=left, label=cat)
        left = [a + b for a, b in zip(left, vals)]
    ax.scatter([r["step_ms"] for r in rows], labels, color="k", marker="|", s=200, zorder=3,
               label="wall time per step")
    ax.invert_yaxis()
    ax.set_xlabel("ms per decode step")
    prov = d.get("provenance", {})
    ax.set_title(f"decode step, {d.get('settings', {}).get('model', '?')} "
                 f"({prov.get('gpu', '?')}, {str(prov.get('git_sha', '?'))[:7]})", fontsize=10)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    return _save(fig, out_dir, results, name)


# ---------------------------------------------------------------- artefacts' own declarations

# Each artefact (a paper table / figure, a speed table) declares its outputs in its script, which
# writes them next to its results as results/<name>/artefact.json: the table columns, the figure
# and the function below that draws it (with its keywords), the notebook that shows it. This module
# reads those files and knows no script.
ARTEFACT = "artefact.json"


def artefact(name, results=RESULTS):
    """The declaration results/<name>/artefact.json of artefact `name` (a dict), or None if it has none."""
    path = Path(results) / name / ARTEFACT
    return json.loads(path.read_text()) if path.is_file() else None


def artefacts(results=RESULTS):
    """{name: declaration} of every artefact with results under `results`."""
    return {p.parent.name: json.loads(p.read_text()) for p in sorted(Path(results).glob(f"*/{ARTEFACT}"))}


def _drawings():
    """The functions a declaration may name to draw an artefact's figure from results/<name>/<profile>/."""
    return {f.__name__: f for f in (table1, table2, plot_curves, plot_entropy)}


def experiment_figure(name, profile="small", results=RESULTS, out_dir=None):
    """Draw artefact `name`'s figure, as its declaration says, from results/<name>/<profile>/ into
    <name>.png (small) or <name>-<profile>.png; returns the Figure / table, or None (with a note)
    if it has no declaration, declares no figure, or its results are missing."""
    decl = artefact(name, results)
    draw = (decl or {}).get("figure") or {}
    if not draw.get("draw"):
        _note(f"{name}: no figure declared in {Path(results) / name / ARTEFACT}")
        return None
    fns = _drawings()
    if draw["draw"] not in fns:
        raise ValueError(f"{name}: {ARTEFACT} names the drawing {draw['draw']!r}; allowed: {sorted(fns)}")
    kw = dict(draw.get("kwargs") or {})
    if "title" in kw:
        kw["title"] += f", {profile}"
    return fns[draw["draw"]](results=results, out_dir=out_dir, experiment=f"{name}/{profile}",
                             name=name if profile == "small" else f"{name}-{profile}", **kw)


def make_all(results=RESULTS, out_dir=None):
    """Draw every figure; returns {name: figure or table or None}. Never raises on missing data."""
    out = {}
    for name, fn in [("table1", table1), ("rewards", plot_rewards), ("entropy", plot_entropy),
                     ("aqn", plot_aqn), ("step_time", plot_step_time), ("kernels", kernel_table),
                     ("decode_profile", plot_decode_profile)]:
        out[name] = fn(results=results, out_dir=out_dir)
        if isinstance(out[name], plt.Figure):
            plt.close(out[name])
    for name, decl in artefacts(results).items():  # the declared figures at the small profile
        # table1: drawn above; a speed artefact's figure (rollout, table3) is drawn from its <gpu>.json rows
        # by the notebook (speed_results), not from a run folder
        if name != "table1" and (decl.get("figure") or {}).get("draw") in _drawings():
            out[name] = experiment_figure(name, "small", results=results, out_dir=out_dir)
            if isinstance(out[name], plt.Figure):
                plt.close(out[name])
    return out
