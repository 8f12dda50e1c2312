"""Write notebooks/{table1,rewards,entropy,speed,experiments,table3,rollout}.ipynb from the cell lists below (nbformat), so
the notebooks are reproducible and reviewable as code. They read results/ only (or $QERL_RESULTS, e.g.
your own run root's results/), and draw their figures into a scratch folder: a notebook rewrites
<results>/figures/ only with QERL_WRITE_FIGURES=1 (`make figures` is what redraws the committed ones).

    python -m benchmarks.make_notebooks      # write (outputs empty)
    python -m benchmarks.run_notebooks       # execute them in place: the committed outputs
"""

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"

SETUP = """import os
import tempfile
from pathlib import Path

import pandas as pd
from IPython.display import Image, display
from qerl import plots
pd.set_option("display.precision", 3)

# plots.RESULTS is results/ or $QERL_RESULTS (your own run root's results/). Figures are drawn into a
# scratch folder; QERL_WRITE_FIGURES=1 writes them into <results>/figures/ instead.
WRITE = os.environ.get("QERL_WRITE_FIGURES") == "1"
FIG_DIR = plots.RESULTS / "figures" if WRITE else Path(tempfile.gettempdir()) / "qerl_figures"


def show(name):
    \"\"\"Display <FIG_DIR>/<name>.png (qerl.plots draws with the headless Agg backend).\"\"\"
    display(Image(str(FIG_DIR / f"{name}.png")))"""


CELLS = {
    "table1": [
        "# Table 1 at small scale\nSmolLM2-135M-Instruct, built-in `arith` task level 0, "
        "GRPO for 30 steps; accuracy on the held-out set before and after RL. Untrained rows "
        "(bf16, nf4, mxfp4, nvfp4) are evaluation only. Reads `results/table1/small/`.",
        SETUP,
        "tab = plots.table1(out_dir=FIG_DIR)\ntab",
        "show('table1')",
    ],
    "rewards": [
        "# Reward curves (Fig. 4) and the AQN ablation (Fig. 8)\nMean over seeds, band = +- one "
        "standard deviation over seeds; rolling mean over 3 steps.",
        SETUP,
        "plots.plot_rewards(out_dir=FIG_DIR)\nshow('rewards')",
        "plots.plot_aqn(out_dir=FIG_DIR)\nshow('aqn')",
        "## The figure scripts' runs (experiments.fig4_reward_curves, experiments.fig8_aqn_ablation)\n"
        "GRPO and DAPO across formats, and NVFP4 LoRA with / without AQN (three seeds each).",
        "for name in ['fig4_reward_curves', 'fig8_aqn_ablation']:\n"
        "    if plots.experiment_figure(name, out_dir=FIG_DIR) is not None:\n"
        "        show(name)",
        "## Does AQN help? The pre-registered paired experiment (`results/aqn_paired/`)\n"
        "Fig. 8's three seeds cannot decide it, so `experiments/aqn_paired.py` ran the plan committed first "
        "(`results/aqn_paired/PLAN.md`): NVFP4 LoRA with and without AQN, 16 paired seeds that share prompts, "
        "rollout seeds and the noise-free first stage, GRPO at the Table 1 small settings, evaluation at 16 "
        "samples a problem. Primary endpoint: the paired difference in final pass@1 (bootstrap 95% CI, paired "
        "t-test, sign test). What it decides: only this 135M model on arithmetic, on a base quantized twice "
        "(the Q4_1 GGUF, then NVFP4); not the paper's 3B-14B models.",
        "paired = plots.RESULTS / 'aqn_paired' / 'small'\n"
        "if (paired / 'table.csv').is_file():\n"
        "    tab = pd.read_csv(paired / 'table.csv')\n"
        "    display(tab[['endpoint', 'role', 'comparison', 'n', 'mean_diff', 'ci_low', 'ci_high', 'p_t', 'n_pos',\n"
        "                 'n_neg', 'p_sign', 'verdict']])\n"
        "    display(Image(str(paired / 'paired_differences.png')))\n"
        "else:\n"
        "    print('no results/aqn_paired/small/table.csv here: run `make aqn-paired` on a GPU')",
        "### How to read the secondary rows\n"
        "- The log-prob gap rises with AQN in 16 of 16 seeds by construction: the noise is on in the rollout only, "
        "and the gap is measured against the clean training forward. It shows that the noise is active, not a "
        "mechanism by which AQN would help.\n"
        "- The sampling entropy +0.09 (stage 1: t p = 0.028, sign p = 0.077) is an uncorrected secondary "
        "endpoint, one of eight stage tests (gap and entropy, stages 1-4) with no multiplicity correction; "
        "stages 2-4 are null.\n"
        "- Upstream (NVlabs/QeRL) may run without AQN: it adds the noise to vLLM's model, whose RMSNorm class "
        "is neither transformers class its isinstance test names. A reading of the code, not a run "
        "(`docs/upstream.md`, finding 6).",
        "## Is AQN equivalent to no AQN within 0.02? (`results/aqn_equivalence/`)\n"
        "16 pairs have 80% power only for effects of about 0.057 or more. The equivalence test committed its "
        "plan first (`results/aqn_equivalence/PLAN.md`): the same settings, at least 120 paired seeds, TOST with "
        "margin +-0.02 on final pass@1; verdict: AQN helps, AQN hurts, equivalent within 0.02, or undecided.\n\n"
        "**Verdict (128 pairs at f75a349): AQN hurts NVFP4 LoRA at this profile.** Final pass@1 with AQN minus "
        "without is -0.028 (95% CI -0.045 to -0.012, paired t p = 0.0008), and TOST cannot show equivalence "
        "within 0.02 (p = 0.85). This settles the 135M arithmetic setting with the project's restored noise only, "
        "not the paper's 3B-14B models. The higher sampling entropy under AQN (+0.16 in stage 1) is an "
        "uncorrected secondary endpoint, and the log-prob gap rises by construction. The cell below prints the "
        "verdict that the committed runs give.",
        "equiv = plots.RESULTS / 'aqn_equivalence' / 'small'\n"
        "if (equiv / 'table.csv').is_file():\n"
        "    tab = pd.read_csv(equiv / 'table.csv')\n"
        "    print('verdict:', tab.loc[tab['role'] == 'primary', 'verdict'].item())\n"
        "    display(tab)\n"
        "    display(Image(str(equiv / 'paired_differences.png')))\n"
        "else:\n"
        "    print('no results/aqn_equivalence/small/table.csv here: not run yet (make aqn-equivalence, multi-GPU)')",
        "## Does the AQN effect depend on the noise level, and on the base? (`results/aqn_dose/`)\n"
        "The equivalence test tried one dose on the twice-quantized NVFP4 base. The dose-response study (plan "
        "committed first: `results/aqn_dose/PLAN.md`) runs the NVFP4 base at sigma_start 0, 1e-3, 3e-3 and 1e-2 "
        "and the bf16 base at 0 and 1e-2 (sigma_end = sigma_start / 20), six arms paired by seed, with a "
        "completion cap fixed by a check before the plan. Primary: the NVFP4 trend over the levels and each "
        "noisy arm against no noise on its base, Holm-corrected over the five.",
        "dose = plots.RESULTS / 'aqn_dose' / 'small'\n"
        "if (dose / 'table.csv').is_file():\n"
        "    tab = pd.read_csv(dose / 'table.csv')\n"
        "    display(tab[['endpoint', 'role', 'n', 'estimate', 'ci95_low', 'ci95_high', 'p_t', 'p_holm', 'decision']])\n"
        "    display(Image(str(dose / 'dose_response.png')))\n"
        "else:\n"
        "    print('no results/aqn_dose/small/table.csv here: not run yet (make aqn-dose, multi-GPU)')",
    ],
    "entropy": [
        "# Token entropy during RL (Fig. 5)\n`entropy` is measured in the training forward pass, "
        "`sampling/entropy` by the rollout sampler.",
        SETUP,
        "plots.plot_entropy(out_dir=FIG_DIR)\nshow('entropy')",
        "plots.entropy_early_late()",
        "## Entropy in the Figure 4 runs (GRPO and DAPO across formats, three seeds)",
        "FIG4 = 'fig4_reward_curves/small'\n"
        "if plots.plot_curves(experiment=FIG4, panels='loss_type', keys=('entropy', 'sampling/entropy'),\n"
        "                     name='fig4_entropy', title='Token entropy across formats (fig4 runs, small)',\n                     out_dir=FIG_DIR) is not None:\n"
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
        "plots.plot_step_time(out_dir=FIG_DIR)\nshow('step_time')",
        "k = plots.kernel_table(out_dir=FIG_DIR)\nk.xs('linear', level='op') if k is not None else None",
        "show('kernels')",
        "pd.DataFrame({'measured': k.attrs['summary'], 'target': k.attrs['targets']}) "
        "if k is not None else None",
        "## A rollout decode step\nKernel time per decode step by kind "
        "(`benchmarks/profile_decode.py`, the newest `results/decode_profile/*.json`), wall time marked.",
        "if plots.plot_decode_profile(out_dir=FIG_DIR) is not None:\n    show('decode_profile')",
    ],
    "experiments": [
        "# The paper's other tables and figures (experiments.table2_bigmath, experiments.fig*)\nEach cell "
        "draws one experiment's figure from `results/<experiment>/small/` (the script's `--profile "
        "small` run: the embedded SmolLM2-135M-Instruct, not the paper's Qwen2.5 models); an experiment "
        "without results yet prints a skip note instead.",
        SETUP,
        "tab2 = plots.experiment_figure('table2_bigmath', out_dir=FIG_DIR)\nif tab2 is not None:\n    show('table2_bigmath')\ntab2",
        "FIGURES = ['fig4_reward_curves', 'fig5_entropy', 'fig7_training_reward', 'fig8_aqn_ablation',\n"
        "           'fig9_noise_schedulers', 'fig10_lora_rank', 'fig16_lr_ablation']\n"
        "for name in FIGURES:\n    if plots.experiment_figure(name, out_dir=FIG_DIR) is not None:\n        show(name)",
        "tables = {n: plots.load_table(experiment=f'{n}/small') for n in FIGURES}\n"
        "# accuracy after training and mean reward of the last 5 steps, per experiment and run variant\n"
        "rows = {n: t[t.metric.isin(['accuracy', 'reward_last5'])].groupby(['method', 'dataset', 'metric'])"
        "['value'].mean().unstack('metric') for n, t in tables.items() if t is not None}\n"
        "pd.concat(rows) if rows else 'no experiment results under results/ yet'",
    ],
}


def speed_load(folder: str) -> str:
    """The first code cell of a speed notebook: results/<folder>/<gpu>.json into `runs` and `rows`."""
    return f"""import os
import tempfile
from pathlib import Path

import pandas as pd
from IPython.display import Image, display
from qerl import plots
pd.set_option("display.precision", 2)

# QERL_RESULTS points the notebook at another results folder (your own run root's results/).
# Figures are drawn into a scratch folder; QERL_WRITE_FIGURES=1 writes them into <results>/figures/.
RESULTS = Path(os.environ.get("QERL_RESULTS", "results"))
WRITE = os.environ.get("QERL_WRITE_FIGURES") == "1"
FIG_DIR = RESULTS / "figures" if WRITE else Path(tempfile.gettempdir()) / "qerl_figures"
runs, rows = plots.speed_results("{folder}", RESULTS)
plots.declared_columns(rows, "{folder}", RESULTS)  # the columns results/{folder}/artefact.json declares"""


def speed_plot(fn: str, name: str) -> str:
    return f"""if plots.{fn}(rows, results=RESULTS, out_dir=FIG_DIR) is not None:
    display(Image(str(FIG_DIR / "{name}.png")))"""


SPEED_SUMMARY = """for gpu, table in plots.speed_summary(runs).items():
    display(table)"""

CELLS["table3"] = [
    "# Table 3: where the GRPO step time goes\nOne full GRPO step (rollout with the fast engine, old "
    "log-probs, one policy update) for bf16 LoRA, QLoRA (bitsandbytes NF4) and NVFP4 on random-weight "
    "Qwen2.5 architectures, prompt 256 and fixed-length completions; peak memory, model size, and the "
    "32B model under an 80 GiB cap. Reads `results/table3/<gpu>.json` from "
    "`python -m experiments.table3_speed_memory` (a missing folder prints a note); `paper_*` columns are the "
    "paper's values, a reference only.",
    speed_load("table3"),
    speed_plot("plot_table3_split", "table3_step_split"),
    SPEED_SUMMARY,
]

CELLS["rollout"] = [
    "# Rollout throughput (paper Tables 5-9, Figure 11)\nThe fast engine (static KV cache, CUDA graphs) on "
    "random-weight Qwen2.5 architectures: bf16 LoRA, bitsandbytes NF4, MXFP4 and NVFP4, plus HF `generate` in "
    "bf16 (what a user gets without an engine; a shorter completion, a per-token rate). Reads "
    "`results/rollout/<gpu>.json` from `python -m experiments.rollout_throughput`; `paper_*` columns are the "
    "paper's vLLM numbers, a reference only.",
    speed_load("rollout"),
    speed_plot("plot_rollout_throughput", "rollout_throughput"),
    SPEED_SUMMARY,
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
