"""The package's shape (docs/ARCHITECTURE.md section 1): no import circles, models never import kernels, and
no source file over 500 lines unless docs/ARCHITECTURE.md says why. Read from the sources (ast), so
function-local imports count too: a circle broken only by a local import is still a circle."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "clover_lite"
MAX_LINES = 500


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that `path` imports anywhere in it (`from pkg import name` counts the module
    `pkg.name` where that is one, else `pkg`)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in modules and t != name}
    return found


def import_graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): imports_of(p, modules) for p in paths}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle (as a path a -> ... -> a), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_package_has_no_import_circle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_circle_finder_finds_circles():
    # Package __init__ modules count: a sub-package's __init__ importing a sibling that imports it back.
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_import_reader_sees_local_and_relative_imports(tmp_path, monkeypatch):
    pkg = tmp_path / "clover_lite"
    (pkg / "models").mkdir(parents=True)
    (pkg / "kernels").mkdir()
    for f in ("__init__.py", "models/__init__.py", "kernels/__init__.py", "kernels/norm.py"):
        (pkg / f).write_text("")
    (pkg / "models" / "layers.py").write_text("def f():\n    from ..kernels import norm\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    modules = {module_name(p) for p in pkg.rglob("*.py")}
    assert imports_of(pkg / "models" / "layers.py", modules) == {"clover_lite.kernels.norm"}


def test_models_never_import_kernels():
    """The model is plain PyTorch; kernels/dispatch.py installs the kernel-backed forwards at load."""
    bad = {m: sorted(t for t in deps if t.startswith("clover_lite.kernels"))
           for m, deps in import_graph().items() if m.startswith("clover_lite.models")}
    assert not {m: d for m, d in bad.items() if d}


def test_long_files_are_explained():
    """No source file over 500 lines unless docs/ARCHITECTURE.md names it (and says why)."""
    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    long = {str(p.relative_to(ROOT)): n for p in sorted(PACKAGE.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    unexplained = {f: n for f, n in long.items()
                   if not re.search(re.escape(f.removeprefix("clover_lite/")) + r"\b", doc)}
    assert not unexplained, f"over {MAX_LINES} lines and not in docs/ARCHITECTURE.md: {unexplained}"
