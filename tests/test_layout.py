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


def _starts_processes(path: Path) -> bool:
    """Whether a file calls subprocess / os process starters (by name, in its code)."""
    for n in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name):
            if (n.value.id, n.attr) in {("subprocess", a) for a in ("Popen", "run", "call", "check_call", "check_output")} \
                    or (n.value.id == "os" and n.attr in ("system", "popen", "spawnv", "execv", "fork")):
                return True
        if isinstance(n, ast.ImportFrom) and n.module == "subprocess":
            return True
    return False


def test_one_file_under_experiments_starts_processes():
    """experiments/launch.py is the one launcher: no other script of experiments/ starts a process."""
    starters = sorted(p.name for p in (ROOT / "experiments").glob("*.py") if _starts_processes(p))
    assert starters == ["launch.py"], starters


def test_no_private_helper_is_imported_across_files():
    """A name with a leading underscore is its own file's: no script imports one from another."""
    bad = []
    for p in sorted([*(ROOT / "experiments").glob("*.py"), *(ROOT / "benchmarks").glob("*.py")]):
        for n in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(n, ast.ImportFrom) and (n.module or "").startswith(("experiments", "benchmarks")):
                pkg = ROOT.joinpath(*n.module.split("."))  # a module of the package (experiments/_common.py) is no helper
                bad += [f"{p.name}: {n.module}.{a.name}" for a in n.names
                        if a.name.startswith("_") and not (pkg / f"{a.name}.py").is_file()]
    assert not bad, bad


def test_the_library_names_no_script():
    """qerl/plots.py reads the artefacts' own declarations (results/<name>/artefact.json): it names no
    module of experiments/ or benchmarks/, not even in a string."""
    text = (ROOT / "qerl" / "plots.py").read_text()
    for word in ("experiments.", "experiments/", "benchmarks.", "benchmarks/", "EXPERIMENT_FIGURES"):
        assert word not in text, f"qerl/plots.py names {word!r}"


def test_artefacts_declare_their_outputs():
    """Each artefact script declares its outputs; the figure names a qerl.plots function, the notebook
    exists and shows the artefact, and every committed artefact.json is the script's declaration now
    (`python -m experiments.make_figures` rewrites them)."""
    import json

    from experiments import _common as C
    from qerl import plots

    arts = {a.name: a for a in C.all_artefacts()}
    assert {"table1", "table2_bigmath", "fig4_reward_curves", "table3", "rollout", "aqn_paired", "aqn_equivalence"} <= set(arts)
    for name, art in arts.items():
        out = art.outputs
        assert out.columns, name
        assert out.figure is None or callable(getattr(plots, out.figure, None)), (name, out.figure)
        assert out.notebook and (ROOT / out.notebook).is_file(), (name, out.notebook)
        assert name in (ROOT / out.notebook).read_text(), f"{out.notebook} does not show {name}"
    for f in sorted((ROOT / "results").rglob("artefact.json")):
        decl = json.loads(f.read_text())
        art = arts[decl["artefact"]]
        assert decl == json.loads(json.dumps(art.outputs.declaration(art.name, art.script))), f"{f} is stale"


def test_no_file_under_benchmarks_mentions_an_issue_number():
    """benchmarks/ holds user tools: what they measure, not which issue asked for it."""
    import re

    pat = re.compile(r"#\d+|\bissues? ?#?\d+", re.I)
    bad = [f"{p.name}:{i}" for p in sorted((ROOT / "benchmarks").rglob("*.py"))
           for i, line in enumerate(p.read_text().splitlines(), 1) if pat.search(line)]
    assert not bad, bad


def test_every_notes_file_is_short():
    """results/<artefact>/NOTES.md gives the current state with its commit; the history is git's."""
    long = {str(p.relative_to(ROOT)): n for p in sorted((ROOT / "results").rglob("NOTES.md"))
            if (n := len(p.read_text().splitlines())) >= 120}
    assert not long, long
