"""qerl.kernels is entered through one door, and the kernels and formats import nothing above them.

- No module outside qerl/kernels imports a submodule of qerl.kernels (``import qerl.kernels.x``,
  ``from qerl.kernels.x import ...``, ``from qerl.kernels import x``): every caller goes through the
  names qerl/kernels/__init__.py defines, so the kernel families can move behind it.
- qerl/formats imports only qerl.formats; qerl/kernels only qerl.kernels and qerl.formats (nothing of
  the rollout, the step, the trainer, the CLI or any other floor above them).
- Outside qerl/formats no module compares a value with a format name (``fmt == "nvfp4"``): they
  ask the registry (spec properties, formats.is_dense).
- The door itself: its names resolve, and importing it loads no Triton kernel module.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from qerl import formats

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "qerl" / "kernels"
SUBMODULES = {p.stem for p in KERNELS.glob("*.py") if p.stem != "__init__"}
# Tools allowed to import kernel submodules directly (none today: kernel_families names families through
# the door's linear_tuned).
KERNEL_TOOLS: set = set()
# Modules whose format compares are still to be moved to the registry helpers.
FORMAT_COMPARE_PENDING: set = set()


def _py_files(*dirs):
    return sorted(p for d in dirs for p in (ROOT / d).rglob("*.py") if "__pycache__" not in p.parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in ``path``, ``from a import b`` giving both a and a.b."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return found


def _submodule_imports(path: Path) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{line}: {mod}" for line, mod in _imports(path)
            if mod.startswith("qerl.kernels.") and mod.split(".")[2] in SUBMODULES]


def test_the_scan_finds_submodule_imports(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import qerl.kernels.ops\nfrom qerl.kernels.mma import applies\nfrom qerl.kernels import plan\n"
                   "from qerl.kernels import linear, Weight\nfrom qerl import kernels\n")
    mods = [mod for _, mod in _imports(src) if mod.startswith("qerl.kernels.") and mod.split(".")[2] in SUBMODULES]
    assert mods == ["qerl.kernels.ops", "qerl.kernels.mma", "qerl.kernels.mma.applies", "qerl.kernels.plan"]


@pytest.mark.parametrize("path", [p for p in _py_files("qerl", "benchmarks", "experiments")
                                  if KERNELS not in p.parents and p not in KERNEL_TOOLS],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_outside_kernels_imports_a_kernel_submodule(path):
    hits = _submodule_imports(path)
    assert not hits, "import the kernels through qerl.kernels (its __init__), not its submodules:\n" + "\n".join(hits)


@pytest.mark.parametrize("floor,allowed", [("formats", ("qerl.formats",)),
                                           ("kernels", ("qerl.kernels", "qerl.formats"))])
def test_kernels_and_formats_import_nothing_above_them(floor, allowed):
    hits = []
    for path in _py_files(f"qerl/{floor}"):
        for line, mod in _imports(path):
            if mod == "qerl" or not mod.startswith("qerl."):
                continue  # `from qerl import formats` also yields qerl.formats, checked below
            if not any(mod == a or mod.startswith(a + ".") for a in allowed):
                hits.append(f"{path.relative_to(ROOT)}:{line}: {mod}")
    assert not hits, f"qerl/{floor} imports from above it:\n" + "\n".join(hits)


def _format_compares(path: Path, names) -> list[str]:
    hits = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Compare):
            for side in (node.left, *node.comparators):
                if isinstance(side, ast.Constant) and side.value in names:
                    hits.append(f"{path.relative_to(ROOT)}:{node.lineno}: compares with {side.value!r}")
    return hits


def test_no_format_name_compares_outside_the_registry():
    names = set(formats.names()) | {formats.DENSE}
    hits = []
    for path in _py_files("qerl"):
        if ROOT / "qerl" / "formats" in path.parents or path in FORMAT_COMPARE_PENDING:
            continue
        hits += _format_compares(path, names)
    assert not hits, "ask the registry (spec properties, formats.is_dense) instead:\n" + "\n".join(hits)


def test_the_door_serves_its_names_without_loading_triton_modules():
    code = ("import sys, qerl.kernels as k, qerl.qlinear, qerl.quantize\n"
            "loaded = sorted(m for m in sys.modules if m.startswith('qerl.kernels.'))\n"
            "print(loaded)\n"
            "assert all(m.split('.')[2] in ('bnb', 'gumbel') for m in loaded), loaded\n"
            "for name in k.__all__:\n"
            "    assert getattr(k, name) is not None, name\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_spec_properties_decide_the_kernel_scale_mode():
    pytest.importorskip("triton")
    from qerl.kernels import common

    assert common.scale_mode("nvfp4") is True and common.scale_mode("mxfp4") is False
    with pytest.raises(ValueError, match="nf4"):
        common.scale_mode("nf4")
    spec = formats.get("nvfp4")
    assert (spec.code, spec.scale_kind, spec.has_global_scale) == ("e2m1", "e4m3", True)
    assert not formats.get("mxfp4").has_global_scale
