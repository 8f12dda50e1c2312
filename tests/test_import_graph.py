"""The import graph of qerl/: no circles, and the floors import only downwards.

Every module under qerl/ is parsed (ast, nothing is imported) and every ``import`` counts, those
inside functions too: a lazy import still makes a circle between two files. Importing
``a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` first, so a module depends on the packages
above what it imports (except its own packages, which are already being imported).

Run: python -m pytest tests/test_import_graph.py -q
"""

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "qerl"

# What each bottom floor may import from qerl: the number formats import only themselves, the
# kernels only the formats and themselves. Everything else (the layers, the rollout, the step, the
# trainer, the CLI) stands on them.
FLOORS = {
    "qerl.formats": ("qerl.formats",),
    "qerl.kernels": ("qerl.formats", "qerl.kernels"),
}

# Known edges that break the rules today and are being removed; each entry is (importer, imported).
# This list must only shrink: empty it as the edges go.
KNOWN_BAD_EDGES_TO_REMOVE: set = set()


def modules() -> dict[str, tuple[Path, bool]]:
    """{dotted name: (file, is a package)} of every module under qerl/."""
    out = {}
    for f in sorted(PKG.rglob("*.py")):
        parts = list(f.relative_to(ROOT).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (f, is_pkg)
    return out


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_graph() -> dict[str, dict[str, int]]:
    """{module: {qerl module it imports: line}}, with the packages each import runs."""
    mods = modules()

    def resolve(name: str) -> str | None:  # the longest prefix of ``name`` that is a qerl module
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for mod, (path, is_pkg) in mods.items():
        here = mod if is_pkg else mod.rpartition(".")[0]
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [resolve(a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package ``level`` - 1 above this one
                    up = here.split(".")[:len(here.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                # ``from a import b``: the module a.b if there is one, else a name of a
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else resolve(base) for a in node.names]
            else:
                continue
            for t in targets:
                if t is None or not t.startswith("qerl"):
                    continue
                for dep in [*_ancestors(t), t]:
                    if dep in mods and dep != mod and dep not in _ancestors(mod):
                        edges.setdefault(dep, node.lineno)
        graph[mod] = edges
    return graph


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _without_known(graph):
    return {m: {d: ln for d, ln in deps.items() if (m, d) not in KNOWN_BAD_EDGES_TO_REMOVE} for m, deps in graph.items()}


def _floor(mod: str) -> str | None:
    return next((f for f in FLOORS if mod == f or mod.startswith(f + ".")), None)


def test_the_graph_sees_the_imports(tmp_path, monkeypatch):
    """The parser finds what is there: the step imports the training forward; a package's own
    submodules are not edges back; importing a package's module runs (depends on) the package door."""
    g = import_graph()
    assert {"qerl.step", "qerl.train", "qerl.kernels", "qerl.formats.registry"} <= set(g)
    assert "qerl.logprobs" in g["qerl.step"] and "qerl.distributed" in g["qerl.step"]
    assert "qerl.step" in g["qerl.train"]
    assert "qerl.formats" not in g["qerl.formats.nvfp4"]  # its own package
    assert "qerl.rollout" not in g["qerl.rollout.fast"]
    pkg = tmp_path / "qerl"
    (pkg / "door").mkdir(parents=True)
    for f, text in {"__init__.py": "", "door/__init__.py": "", "door/room.py": "",
                    "user.py": "from qerl.door.room import x\nimport qerl.door.room\n"}.items():
        (pkg / f).write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PKG", pkg)
    assert set(import_graph()["qerl.user"]) == {"qerl.door", "qerl.door.room"}  # the door runs first


def test_no_import_cycle():
    cycles = _cycles(_without_known(import_graph()))
    assert not cycles, f"import cycles among qerl modules: {cycles}"


def test_formats_and_kernels_import_nothing_from_above():
    bad = []
    for mod, deps in _without_known(import_graph()).items():
        floor = _floor(mod)
        if floor is None:
            continue
        allowed = FLOORS[floor]
        bad += [f"{mod} imports {d} (line {ln})" for d, ln in deps.items()
                if not any(d == a or d.startswith(a + ".") for a in allowed)]
    assert not bad, "upward imports from the bottom floors:\n" + "\n".join(bad)


def test_known_bad_edges_still_exist():
    """Each allowlisted edge must still be in the code: once it goes, its entry goes too."""
    g = import_graph()
    stale = [e for e in KNOWN_BAD_EDGES_TO_REMOVE if e[1] not in g.get(e[0], {})]
    assert not stale, f"edges gone from the code, remove them from KNOWN_BAD_EDGES_TO_REMOVE: {stale}"
