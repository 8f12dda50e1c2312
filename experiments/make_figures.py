"""Regenerate every figure from results/ (no GPU, no model): the small-scale analogues of the
paper's Table 1, Fig. 4 (reward curves), Fig. 5 (entropy), Fig. 8 (AQN ablation), a step-time
breakdown and the kernel speed plot.

    python -m experiments.make_figures [--results results] [--out results/figures]

Writes table1.png, rewards.png, entropy.png, aqn.png, step_time.png, kernels.png (about 5 s on
2 CPU cores), plus <experiment>.png for each artefact with results at the small profile whose
declaration (results/<experiment>/artefact.json) names a figure, and prints the tables. First every
artefact.json under the results folder is rewritten from its script's declaration (its Outputs), so a
script's change of columns, figure or notebook reaches results/. Missing inputs are skipped with a note.
"""

import argparse

import pandas as pd

from experiments import _common as C
from qerl import plots


def main(argv=None):
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--results", default=str(plots.RESULTS), help="results/ folder to read")
    p.add_argument("--out", default=None, help="where PNGs go (default <results>/figures)")
    args = p.parse_args(argv)
    pd.set_option("display.width", 200)
    pd.set_option("display.max_columns", 20)
    C.redeclare(args.results)
    out = plots.make_all(results=args.results, out_dir=args.out)
    if out["table1"] is not None:
        print(out["table1"].round(3))
    early_late = plots.entropy_early_late(results=args.results)
    if early_late is not None:
        print(early_late.round(3))
    return out


if __name__ == "__main__":
    main()
