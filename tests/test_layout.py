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


def test_the_step_takes_what_training_needs():
    """qerl.step.step has no benchmark-only parameters: benchmarks call the public phases themselves."""
    import inspect

    from qerl import step as qstep

    params = set(inspect.signature(qstep.step).parameters)
    assert not params & {"advantages", "ro", "reuse", "ignore_eos", "timer"}, sorted(params)
    assert {"rollout", "score", "logprobs", "update"} <= set(vars(qstep))  # the phases, public


def _qerl_imports(rel: str) -> set[str]:
    out = set()
    for n in ast.walk(_tree(rel)):
        if isinstance(n, ast.Import):
            out |= {a.name for a in n.names}
        elif isinstance(n, ast.ImportFrom) and n.module:
            out.add(n.module)
    return {m for m in out if m.startswith("qerl")}


def test_the_training_forward_stands_below_the_rollout():
    """qerl/logprobs.py imports nothing from qerl.rollout: the forward both use is qerl/forward.py."""
    assert not {m for m in _qerl_imports("qerl/logprobs.py") if m.startswith("qerl.rollout")}
    assert "qerl.forward" in _qerl_imports("qerl/logprobs.py")
    assert not _qerl_imports("qerl/forward.py")
