"""Local copies of the benchmark datasets from the Hugging Face hub, in the layout `--data-dir` and
QERL_DATA_DIR read: <dir>/<dataset>/<split>.jsonl, the rows as the hub serves them (qerl.data's hub ids:
openai/gsm8k main, HuggingFaceH4/MATH-500, HuggingFaceH4/aime_2024, math-ai/aime25, math-ai/amc23).
With them, runs need no hub access, and the 10 tests on the real datasets (tests/test_data.py) run
instead of skipping.

    python scripts/fetch_data.py data          # or: make data   (needs network; a few MB)
    export QERL_DATA_DIR=$PWD/data
"""

from __future__ import annotations

import sys
from pathlib import Path

from qerl.data import SPLITS, _hub_rows, save_jsonl

DATASETS = ("gsm8k", "math500", "aime24", "aime25", "amc23")  # bigmath (>200k rows) stays on the hub


def fetch(out: Path, names=DATASETS) -> list[Path]:
    """Write <out>/<name>/<split>.jsonl for each dataset and split; returns the files written."""
    written = []
    for name in names:
        for split in SPLITS[name]:
            rows = _hub_rows(name, split, None)
            path = Path(out) / name / f"{split}.jsonl"
            save_jsonl(rows, path)
            print(f"{path}: {len(rows)} rows")
            written.append(path)
    return written


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        sys.exit(__doc__)
    fetch(Path(sys.argv[1]))
    print(f"export QERL_DATA_DIR={Path(sys.argv[1]).resolve()}")
