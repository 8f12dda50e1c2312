"""Reproduce several of the paper's artefacts in one run root: plan the union of their runs, run
each distinct run once (Table 1's nvfp4_lora-s0 is also Fig. 5's and Fig. 8's), then build every
artefact's table.csv, summary.csv / summary.md (mean +- std over seeds) and figure.

    python -m experiments.reproduce --profile small --experiments table1 fig4 fig5 fig8 --dry-run
    python -m experiments.reproduce --profile small --experiments table1 fig4 fig5 fig8 --parallel 4
    python -m experiments.reproduce --profile small --resume runs/reproduce-small-<time>-<sha7> --parallel 4
    python -m experiments.reproduce --profile small --resume runs/reproduce-small-<time>-<sha7> --publish

Each invocation without --resume makes a new root runs/reproduce-<profile>-<UTC time>-<sha7>/
(experiments/_common.py describes the layout, the drift checks and --publish); results/ changes only
with --publish. The small profile (one GPU, the embedded SmolLM2-135M-Instruct): table1 fig4 fig5
fig8 are 37 distinct runs, ~1 h on one H100 at --parallel 4 (each run ~17 GiB of GPU memory).
Experiments: table1 table2 fig4 fig5 fig7 fig8 fig9 fig10 fig16 (or their module names).
"""

from __future__ import annotations

import argparse

from experiments import _common as C

DEFAULT = ("table1", "fig4", "fig5", "fig8")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.strip().split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    C.add_common_args(ap)
    ap.add_argument("--experiments", nargs="+", default=list(DEFAULT), metavar="NAME",
                    help=f"default: {' '.join(DEFAULT)}; any of {' '.join(C.ALIASES)}")
    shared = ap.parse_args(argv)
    exps = [C.load_experiment(n) for n in shared.experiments]
    if len({e.name for e in exps}) != len(exps):
        ap.error(f"an experiment is named twice: {shared.experiments}")
    return C.execute([(e, C.experiment_args(e, shared)) for e in exps], shared, "reproduce")


if __name__ == "__main__":
    raise SystemExit(main())
