"""Write notebooks/{table1,rewards,entropy,speed,experiments,table3,rollout}.ipynb from the cell lists below (nbformat), so
the notebooks are reproducible and reviewable as code. They read results/ only.

    python -m benchmarks.make_notebooks      # write (outputs empty)
    python -m benchmarks.run_notebooks       # execute them in place
"""

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"

SETUP = """import pandas as pd
from IPython.display import Image, display
from qerl import plots
pd.set_option("display.precision", 3)


def show(name):
    \"\"\"Display results/figures/<name>.png (qerl.plots draws with the headless Agg backend).\"\"\"
    display(Image(str(plots.RESULTS / "figures" / f"{name}.png")))"""

CELLS = {
    "table1": [
        "# Table 1 at small scale\nSmolLM2-135M-Instruct, built-in `arith` task level 0, "
        "GRPO for 30 steps; accuracy on the held-out set before and after RL. Untrained rows "
        "(bf16, nf4, mxfp4, nvfp4) are evaluation only. Reads `results/table1/small/`.",
        SETUP,
        "tab = plots.table1()\ntab",
        "show('table1')",
    ],
    "rewards": [
        "# Reward curves (Fig. 4) and the AQN ablation (Fig. 8)\nMean over seeds (thick), one "
        "thin line per seed; rolling mean over 3 steps.",
        SETUP,
        "plots.plot_rewards()\nshow('rewards')",
        "plots.plot_aqn()\nshow('aqn')",
        "## The figure scripts' runs (experiments/fig4_reward_curves.py, fig8_aqn_ablation.py)\n"
        "GRPO and DAPO across formats (one seed), and NVFP4 LoRA with / without AQN (three seeds).",
        "for name in ['fig4_reward_curves', 'fig8_aqn_ablation']:\n"
        "    if plots.experiment_figure(name) is not None:\n"
        "        show(name)",
    ],
    "entropy": [
        "# Token entropy during RL (Fig. 5)\n`entropy` is measured in the training forward pass, "
        "`sampling/entropy` by the rollout sampler.",
        SETUP,
        "plots.plot_entropy()\nshow('entropy')",
        "plots.entropy_early_late()",
        "## Entropy in the Figure 4 runs (GRPO and DAPO across formats, one seed)",
        "FIG4 = 'fig4_reward_curves/small'\n"
        "if plots.plot_curves(experiment=FIG4, panels='loss_type', keys=('entropy', 'sampling/entropy'),\n"
        "                     name='fig4_entropy', title='Token entropy across formats (fig4 runs, small)') is not None:\n"
        "    show('fig4_entropy')",
        "m = plots.load_metrics(experiment=FIG4, fields=('loss_type',))\n"
        "if m is not None:\n"
        "    last = m['step'].max()\n"
        "    early = m[m['step'] <= 5].groupby(['loss_type', 'method'])['entropy'].mean()\n"
        "    late = m[m['step'] > last - 5].groupby(['loss_type', 'method'])['entropy'].mean()\n"
        "    display(pd.DataFrame({'entropy, first 5 steps': early, 'entropy, last 5 steps': late}))",
    ],
    "speed": [
        "# Where time goes\nStep time split into rollout and training (small runs), and the "
        "H100 kernel benchmark (`results/kernels/h100.json`): bf16 time / 4-bit time for one "
        "decoder layer's linears (> 1 means the 4-bit kernel is faster).",
        SETUP,
        "plots.step_time_table()",
        "plots.plot_step_time()\nshow('step_time')",
        "k = plots.kernel_table()\nk.xs('linear', level='op')[['bf16', 'nvfp4', 'mxfp4', 'nf4', "
        "'bf16/nvfp4', 'bf16/nf4']] if k is not None else None",
        "show('kernels')",
        "pd.DataFrame({'measured': k.attrs['summary'], 'target': k.attrs['targets']}) "
        "if k is not None else None",
    ],
    "experiments": [
        "# The paper's other tables and figures (experiments/table2_bigmath.py, fig*.py)\nEach cell "
        "draws one experiment's figure from `results/<experiment>/small/` (the script's `--profile "
        "small` run: the embedded SmolLM2-135M-Instruct, not the paper's Qwen2.5 models); an experiment "
        "without results yet prints a skip note instead.",
        SETUP,
        "tab2 = plots.experiment_figure('table2_bigmath')\nif tab2 is not None:\n    show('table2_bigmath')\ntab2",
        "FIGURES = ['fig4_reward_curves', 'fig5_entropy', 'fig7_training_reward', 'fig8_aqn_ablation',\n"
        "           'fig9_noise_schedulers', 'fig10_lora_rank', 'fig16_lr_ablation']\n"
        "for name in FIGURES:\n    if plots.experiment_figure(name) is not None:\n        show(name)",
        "tables = {n: plots.load_table(experiment=f'{n}/small') for n in FIGURES}\n"
        "# accuracy after training and mean reward of the last 5 steps, per experiment and run variant\n"
        "rows = {n: t[t.metric.isin(['accuracy', 'reward_last5'])].groupby(['method', 'dataset', 'metric'])"
        "['value'].mean().unstack('metric') for n, t in tables.items() if t is not None}\n"
        "pd.concat(rows) if rows else 'no experiment results under results/ yet'",
    ],
}


def speed_load(folder: str, script: str, extra: str = "") -> str:
    """The first code cell of a speed notebook: read results/<folder>/<gpu>.json into `runs` and `rows`."""
    return f"""import json
import os
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
pd.set_option("display.precision", 2)

# QERL_RESULTS points the notebook at another results folder (the tests use it).
RESULTS = Path(os.environ.get("QERL_RESULTS", "results")) / "{folder}"
runs = {{f.stem: json.loads(f.read_text()) for f in sorted(RESULTS.glob("*.json"))}}
rows = pd.DataFrame([{{**r, "gpu": g}} for g, run in runs.items() for r in run["rows"]]) if runs else None
if rows is None:
    print(f"no results in {{RESULTS}}/ yet: run experiments/{script} on a GPU (see its docstring)"){extra}"""


TABLE3_LOAD = speed_load("table3", "table3_speed_memory.py")

TABLE3_ROWS = """COLS = ["gpu", "model", "method", "batch", "grad_ckpt", "completion_len", "step_s", "rollout_s", "logprob_s",
        "update_s", "rollout_share", "peak_gib", "model_size_gb", "paper_model_size_gb", "paper_s_per_step",
        "memory_cap_gib", "oom", "oom_phase"]
rows.reindex(columns=COLS) if rows is not None else None"""

TABLE3_PLOT = """def plot_split(rows):
    \"\"\"Stacked bars: rollout / old log-probs / policy update seconds of each measured step.\"\"\"
    ok = rows[rows["step_s"].notna()] if rows is not None and "step_s" in rows else None
    if ok is None or ok.empty:
        print("no completed GRPO steps to plot")
        return
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
    plt.tight_layout()
    out = RESULTS.parent / "figures" / "table3_step_split.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.show()


plot_split(rows)"""

TABLE3_SUMMARY = """for gpu, run in runs.items():
    print(f"{gpu}: git {run.get('git_sha')}, {run.get('date')}")
    display(pd.DataFrame({"measured": run["summary"], "target": run.get("targets", {}),
                          "from": run.get("summary_notes", {})}))
    for r in run["rows"]:
        if r.get("oom") or r.get("error"):
            print(f"  {r['model']} {r['method']} bs{r['batch']}: {'OOM' if r.get('oom') else 'FAILED'} in "
                  f"{r.get('oom_phase') or r.get('failed_phase')}: {str(r.get('error'))[:120]}")"""

CELLS["table3"] = [
    "# Table 3: where the GRPO step time goes\nOne full GRPO step (rollout with the fast engine, old "
    "log-probs, one policy update) for bf16 LoRA, QLoRA (bitsandbytes NF4) and NVFP4 on random-weight "
    "Qwen2.5 architectures, prompt 256 and fixed-length completions; peak memory, model size, and the "
    "32B model under an 80 GiB cap. Reads `results/table3/<gpu>.json` from "
    "`benchmarks/table3_speed_memory.py` (a missing folder prints a note); `paper_*` columns are the "
    "paper's values, a reference only.",
    TABLE3_LOAD,
    TABLE3_ROWS,
    TABLE3_PLOT,
    TABLE3_SUMMARY,
]


ROLLOUT_LOAD = speed_load("rollout", "rollout_throughput.py", """
else:
    cols = ["gpu", "model", "method", "batch", "lora_rank", "completion_len", "tokens_per_s", "ms_per_decode_step",
            "roofline_fraction", "peak_gib", "paper_vllm_tokens_per_s"]
    display(rows.reindex(columns=cols))""")

ROLLOUT_PLOT = """def plot_throughput(rows):
    \"\"\"Figure 11 at this scale: generated tokens/s per method, one panel per batch size.\"\"\"
    if rows is None or rows.empty:
        print("nothing to plot")
        return
    batches = sorted(rows["batch"].unique())
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 3.8), squeeze=False)
    methods = [m for m in ["bf16", "nf4", "mxfp4", "nvfp4", "hf_generate_bf16"] if m in set(rows["method"])]
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
    plt.tight_layout()
    out = RESULTS.parent / "figures" / "rollout_throughput.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.show()


plot_throughput(rows)"""

CELLS["rollout"] = [
    "# Rollout throughput (paper Tables 5-9, Figure 11)\nThe fast engine (static KV cache, CUDA graphs) on "
    "random-weight Qwen2.5 architectures: bf16 LoRA, bitsandbytes NF4, MXFP4 and NVFP4, plus HF `generate` in "
    "bf16 (what a user gets without an engine; a shorter completion, a per-token rate). Reads "
    "`results/rollout/<gpu>.json` from `benchmarks/rollout_throughput.py`; `paper_*` columns are the "
    "paper's vLLM numbers, a reference only.",
    ROLLOUT_LOAD,
    ROLLOUT_PLOT,
    TABLE3_SUMMARY,
]


def build(name):
    """The notebook `name` (a key of CELLS) as an nbformat node, with a python3 kernelspec."""
    if name not in CELLS:
        raise ValueError(f"unknown notebook {name!r}; allowed: {sorted(CELLS)}")
    cells = [new_markdown_cell(c) if c.startswith("#") else new_code_cell(c) for c in CELLS[name]]
    return new_notebook(cells=cells, metadata={
        "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})


def main():
    NOTEBOOKS.mkdir(exist_ok=True)
    for name in CELLS:
        path = NOTEBOOKS / f"{name}.ipynb"
        nbformat.write(build(name), path)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
