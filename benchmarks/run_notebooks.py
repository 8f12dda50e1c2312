"""Execute notebooks headless with nbclient (kernel python3 from the venv's ipykernel) against the
committed results/ (or $QERL_RESULTS); exit non-zero on the first notebook with a cell error.

    python -m benchmarks.run_notebooks [notebooks/table1.ipynb ...]   # in place: the committed outputs
    python -m benchmarks.run_notebooks --check                        # execute, write nothing (CI)

With no arguments runs every notebooks/*.ipynb (about 5-10 s each on 2 CPU cores). Figures go to a
scratch folder unless QERL_WRITE_FIGURES=1 (benchmarks/make_notebooks.py).
"""

import argparse
import os
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent


def run(path, timeout=300, write=True):
    """Execute one notebook with cwd = repo root; raises nbclient's CellExecutionError on error."""
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(ROOT)}}).execute()
    if write:
        nbformat.write(nb, path)
    return nb


def main(argv=None):
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("notebooks", nargs="*", help="default: notebooks/*.ipynb")
    p.add_argument("--timeout", type=int, default=300, help="seconds per cell")
    p.add_argument("--check", action="store_true", help="execute only: leave the notebook files as they are")
    args = p.parse_args(argv)
    # The kernel runs in the repository root: a relative results folder keeps this machine's paths out
    # of the outputs.
    os.environ.setdefault("QERL_RESULTS", "results")
    paths = [Path(n) for n in args.notebooks] or sorted((ROOT / "notebooks").glob("*.ipynb"))
    for path in paths:
        t0 = time.time()
        try:
            nb = run(path, args.timeout, write=not args.check)
        except Exception as e:  # report which notebook failed, then fail the run
            print(f"FAILED {path}: {e}", file=sys.stderr)
            return 1
        cells = sum(c.cell_type == "code" for c in nb.cells)
        shown = path.resolve().relative_to(ROOT) if path.resolve().is_relative_to(ROOT) else path
        print(f"executed {shown}: {cells} code cells, no error, {time.time() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
