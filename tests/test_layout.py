"""Where things live, checked by reading the files (nothing is run): the trainer only trains, the
interfaces take what their callers need, the library names no script, one launcher starts processes,
and each measured number is written once.

Run: python -m pytest tests/test_layout.py -q   (about 1 s)
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _tree(rel: str) -> ast.Module:
    return ast.parse((ROOT / rel).read_text(), rel)


def _defined(rel: str) -> set[str]:
    """Names of the functions and classes defined anywhere in a file."""
    return {n.name for n in ast.walk(_tree(rel)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


def test_the_trainer_only_trains():
    """qerl/train.py is the loop: under 350 lines, and checkpoints are read and written in qerl/checkpoint.py."""
    lines = (ROOT / "qerl" / "train.py").read_text().splitlines()
    assert len(lines) < 350, f"qerl/train.py has {len(lines)} lines"
    ckpt = {n for n in _defined("qerl/train.py") if "checkpoint" in n or n.startswith(("save_", "load_", "read_"))}
    assert not ckpt, f"qerl/train.py defines checkpoint readers/writers {sorted(ckpt)}: they belong in qerl/checkpoint.py"
    assert {"save_checkpoint", "load_checkpoint", "load_trainable", "read_checkpoint_config"} <= _defined("qerl/checkpoint.py")
