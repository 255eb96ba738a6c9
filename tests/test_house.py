"""The house rules that keep the code navigable, checked on the source: no two modules import each other (at module
level or inside a function; imports for type checkers only, under ``if TYPE_CHECKING:``, never run and do not
count), the sub-packages' public faces stay small, and tests import shared helpers as modules, never a conftest by
name."""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "remat"
TESTS = Path(__file__).resolve().parent

FACE_LIMIT = 50
"""Names the sub-packages' ``__all__`` lists may hold together: what the docs show users."""


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in SRC.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _run_time_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], base]).strip(".")
                found.add(base)
                found.update(f"{base}.{alias.name}" for alias in node.names)
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def _run_time_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of ``tree`` but those under ``if TYPE_CHECKING:``."""
    out, stack = [], [tree]
    while stack:
        node = stack.pop()
        out.append(node)
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and getattr(child.test, "id", None) == "TYPE_CHECKING":
                stack.extend(child.orelse)
                continue
            stack.append(child)
    return out


def test_no_two_modules_import_each_other() -> None:
    graph = _imports()
    pairs = sorted({tuple(sorted((a, b))) for a, targets in graph.items() for b in targets
                    if a in graph.get(b, set()) and not (a.startswith(b + ".") or b.startswith(a + "."))})
    assert not pairs, f"modules importing each other: {pairs}"


def test_the_sub_packages_faces_are_small() -> None:
    names = {}
    for init in SRC.rglob("__init__.py"):
        if init.parent == SRC:
            continue  # the root's face is the product's: remat/__init__.py
        match = re.search(r"__all__\s*=\s*\[(.*?)\]", init.read_text(), re.S)
        names[_module_name(init)] = re.findall(r'"([^"]+)"', match.group(1)) if match else []
    assert sum(map(len, names.values())) <= FACE_LIMIT, names


def test_tests_import_no_conftest_by_name() -> None:
    offenders = [str(p.relative_to(TESTS)) for p in TESTS.rglob("*.py")
                 if re.search(r"^\s*(from conftest import|import conftest)", p.read_text(), re.M)]
    assert not offenders, offenders


FUNCTION_LINES = 50
"""A function's length in src, its docstring included: a reader sees one at a time."""
LONG_FUNCTIONS: dict[str, str] = {
    "remat/estimate/simulate.py:_simulate_step": "one sequence of nested modes (process group, fake mode, tracker, "
    "simulation mode) around the recipe's own step; a split would hand half a dozen live contexts between functions",
    "remat/estimate/simulate.py:_record_blocks": "the hooks that mark each block's forward and backward share one "
    "closure state (the block being recorded, its inputs); apart, that state would be a class for one caller",
}


def test_functions_stay_short_but_for_a_few_with_a_reason() -> None:
    long = set()
    for path in SRC.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for parent in [tree, *(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef))]:
            for node in parent.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    if node.end_lineno - node.lineno + 1 > FUNCTION_LINES:  # type: ignore[operator]
                        owner = f"{parent.name}." if isinstance(parent, ast.ClassDef) else ""
                        long.add(f"{path.relative_to(SRC.parent)}:{owner}{node.name}")
    assert long <= set(LONG_FUNCTIONS), sorted(long - set(LONG_FUNCTIONS))
    assert len(LONG_FUNCTIONS) <= 3
