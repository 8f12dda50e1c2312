"""Execute notebooks headless in place with nbclient (kernel python3 from the venv's ipykernel);
exit non-zero on the first cell error.

    python -m benchmarks.run_notebooks [notebooks/table1.ipynb ...]

With no arguments runs every notebooks/*.ipynb (about 5-10 s each on 2 CPU cores).
"""

import argparse
import sys
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
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("notebooks", nargs="*", help="default: notebooks/*.ipynb")
    p.add_argument("--timeout", type=int, default=300, help="seconds per cell")
    args = p.parse_args(argv)
    paths = [Path(n) for n in args.notebooks] or sorted((ROOT / "notebooks").glob("*.ipynb"))
    for path in paths:
        try:
            run(path, args.timeout)
        except Exception as e:  # report which notebook failed, then fail the run
            print(f"FAILED {path}: {e}", file=sys.stderr)
            return 1
        print(f"ok {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
