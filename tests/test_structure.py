"""Structure rules of the repository (#16), checked by scanning its files.

- Nothing edits the import path: every script runs as a module (`python -m ...`).
- The format registry (qerl/formats/) is the only place that lists format names: any other
  list, tuple, set or dict literal in the package, experiments/ or benchmarks/ that names two
  or more registered formats (as "nvfp4" or as a method "nvfp4_lora...") is a second table
  that the next format would have to be added to by hand. Tables of numbers the paper reports
  (module constants named PAPER*) are data about named methods, not lists, and are exempt, as are
  the kernel implementations of particular formats (KERNEL_IMPLEMENTATIONS).
"""

import ast
import subprocess
from pathlib import Path

import pytest

from qerl import formats

ROOT = Path(__file__).resolve().parent.parent
CODE_DIRS = ("qerl", "experiments", "benchmarks")
REGISTRY = ROOT / "qerl" / "formats"
# Kernel implementations of particular formats (the bitsandbytes NF4 bridge, which passes bitsandbytes
# its own quant_type name); which formats have a kernel is the registry's (spec.kernels). The FP4
# kernels branch on the spec's scale kind, not on names.
KERNEL_IMPLEMENTATIONS = (ROOT / "qerl" / "kernels" / "bnb.py",)


def _repo_files() -> list[Path]:
    """Tracked and untracked-but-not-ignored files (git), else every file outside .git."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
        files = [ROOT / line for line in out.splitlines() if line]
    except (OSError, subprocess.CalledProcessError):
        files = [p for p in ROOT.rglob("*") if ".git" not in p.parts]
    return [p for p in files if p.is_file()]


def _python_files(dirs=CODE_DIRS) -> list[Path]:
    return sorted(p for p in _repo_files() if p.suffix == ".py" and p.relative_to(ROOT).parts[0] in dirs)


def _text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


# The one edit allowed: the installed `qerl` command puts the working folder on the path, as `python -m qerl`
# does, so that a reward module:function next to the user's config imports (qerl.cli.working_dir_on_path).
PATH_EDITS_ALLOWED = {("qerl/cli.py", "sys.path." + "append(cwd)")}


def test_no_import_path_edits():
    needles = ("sys.path." + "insert", "sys.path." + "append", "sys.path " + "+=")  # split: this file is scanned too
    hits = []
    for path in _repo_files():
        text = _text(path)
        if text is None:
            continue
        for i, line in enumerate(text.splitlines(), 1):
            if any(n in line for n in needles) and (str(path.relative_to(ROOT)), line.strip()) not in PATH_EDITS_ALLOWED:
                hits.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not hits, "edits of the import path (run scripts with python -m instead):\n" + "\n".join(hits)


def _format_named(value: str, names: tuple[str, ...]) -> str | None:
    """The registered format a string names: the format itself or a method "<fmt>_..."."""
    for fmt in names:
        if value == fmt or value.startswith(fmt + "_"):
            return fmt
    return None


def format_lists(source: str, names: tuple[str, ...]) -> list[tuple[int, list[str]]]:
    """(line, strings) of every collection literal in `source` whose strings name >= 2 formats."""
    tree = ast.parse(source)
    paper = {id(n) for a in ast.walk(tree) if isinstance(a, ast.Assign)
             and any(isinstance(t, ast.Name) and t.id.startswith("PAPER") for t in a.targets)
             for n in ast.walk(a.value)}
    found = []
    for node in ast.walk(tree):
        if id(node) in paper:
            continue
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            elts = node.elts
        elif isinstance(node, ast.Dict):
            elts = [k for k in node.keys if k is not None]
        else:
            continue
        # strings of the collection and of tuples/lists inside it (rows like ("nvfp4", 16))
        inner = [x for e in elts if isinstance(e, (ast.Tuple, ast.List)) for x in e.elts]
        strings = [e.value for e in elts + inner if isinstance(e, ast.Constant) and isinstance(e.value, str)]
        named = {f for f in (_format_named(s, names) for s in strings) if f}
        if len(named) >= 2:
            found.append((node.lineno, strings))
    return found


def test_the_scan_finds_format_lists():
    names = ("nvfp4", "mxfp4", "nf4")
    src = ('A = ("bf16", "nf4", "mxfp4")\nB = {"nvfp4": 1, "nf4": 2}\nC = ["nf4_lora", "nvfp4_lora_aqn"]\n'
           'D = ("bf16", "nvfp4")\nE = ("nvfp4_lora", "nvfp4_lora_aqn")\nF = {("m", "nvfp4", 2): 1.0}\n'
           'PAPER_T1 = {"nf4_lora": 85.0, "nvfp4_lora": 88.5}\nG = f(["mxfp4",\n "nf4"])\n'
           'H = (("nvfp4", 16), ("mxfp4", 32))\n')
    assert sorted(line for line, _ in format_lists(src, names)) == [1, 2, 3, 8, 10]


@pytest.mark.parametrize("path", _python_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_format_name_lists_outside_the_registry(path):
    if REGISTRY in path.parents or path in KERNEL_IMPLEMENTATIONS:
        return
    hits = format_lists(path.read_text(encoding="utf-8"), formats.names())
    assert not hits, (f"{path.relative_to(ROOT)} lists format names; read them from the registry "
                      f"(qerl.formats.names(), qerl.config.table_bases()/METHODS) instead: {hits}")
