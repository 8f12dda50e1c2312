"""Write notebooks/{table1,rewards,entropy,speed,experiments}.ipynb from the cell lists below (nbformat), so
the notebooks are reproducible and reviewable as code. They read results/ only.

    .venv/bin/python experiments/make_notebooks.py      # write (outputs empty)
    .venv/bin/python experiments/run_notebooks.py       # execute them in place
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
    ],
    "entropy": [
        "# Token entropy during RL (Fig. 5)\n`entropy` is measured in the training forward pass, "
        "`sampling/entropy` by the rollout sampler.",
        SETUP,
        "plots.plot_entropy()\nshow('entropy')",
        "plots.entropy_early_late()",
    ],
    "speed": [
        "# Where time goes\nStep time split into rollout and training (small runs), and the "
        "H200 kernel benchmark (`results/kernels/h200.json`): bf16 time / 4-bit time for one "
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
