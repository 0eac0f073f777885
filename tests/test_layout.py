"""The source layout shows the architecture: no import cycles, small modules, few top-level modules.

Every import of a wattwatch module counts, at module level and inside functions alike, so a
function-level import cannot hide a cycle. Only imports under ``if TYPE_CHECKING:`` are left out:
they never run.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = SRC / "wattwatch"

MAX_MODULE_LINES = 550
MAX_TOP_LEVEL_MODULES = 8


def _module_name(path: Path) -> str:
    """Dotted module name of a source file under src/ (a package's __init__ is the package)."""
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _all_modules() -> dict[str, Path]:
    """Every wattwatch module, by dotted name."""
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking_guard(node: ast.If) -> bool:
    """True for ``if TYPE_CHECKING:`` and ``if typing.TYPE_CHECKING:``."""
    test = node.test
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement in the tree, at any depth, except those under ``if TYPE_CHECKING:``."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking_guard(node):
            for child in node.orelse:  # the else branch does run
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _resolve_base(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a ``from X import ...`` names, resolving a relative X."""
    if node.level == 0:
        return node.module or ""
    package = importer.split(".") if is_package else importer.split(".")[:-1]
    if node.level > 1:
        package = package[: -(node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def _nearest_module(name: str, modules: dict[str, Path]) -> str | None:
    """The module that ``name`` loads: itself, or the longest prefix that is a module."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def import_graph() -> dict[str, set[str]]:
    """Runtime import edges between wattwatch modules: importer -> the modules it imports."""
    modules = _all_modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for importer, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        for node in _runtime_imports(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = _resolve_base(importer, is_package, node)
                # ``from pkg import module`` depends on that submodule; ``from pkg import name``
                # depends on what pkg's __init__ runs to define the name.
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
                ]
            for target in targets:
                if not target.startswith("wattwatch"):
                    continue
                resolved = _nearest_module(target, modules)
                if resolved is not None and resolved != importer:
                    graph[importer].add(resolved)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path a -> b -> ... -> a, or None when the graph is acyclic.

    Only explicit imports are edges. Importing a submodule also runs its parent packages'
    __init__ first, but that implicit step is not an edge: a parent package already initialising
    is in sys.modules, so it cannot deadlock a submodule's import. A submodule that imports a
    *name* from its parent package does depend on that __init__, and that explicit import counts.
    """
    white, grey, black = 0, 1, 2
    colour = dict.fromkeys(graph, white)
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        colour[node] = grey
        stack.append(node)
        for nxt in sorted(graph[node]):
            if colour[nxt] == grey:
                return [*stack[stack.index(nxt) :], nxt]
            if colour[nxt] == white:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        colour[node] = black
        return None

    for start in sorted(graph):
        if colour[start] == white:
            found = visit(start)
            if found:
                return found
    return None


def test_import_graph_sees_function_level_and_relative_imports(tmp_path: Path) -> None:
    """The scanner counts an import inside a function and resolves ``from . import x``."""
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from wattwatch.a import hidden\n"
        "def f():\n    from . import b\n    import wattwatch.c\n"
    )
    imports = _runtime_imports(tree)
    assert [type(n).__name__ for n in imports] == ["ImportFrom", "ImportFrom", "Import"]
    relative = imports[1]
    assert isinstance(relative, ast.ImportFrom)
    assert _resolve_base("wattwatch.pkg.mod", False, relative) == "wattwatch.pkg"
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles() -> None:
    """No wattwatch module reaches itself through runtime imports, at any depth."""
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_module_over_the_line_limit() -> None:
    """Every module stays small enough to read as one responsibility."""
    too_long = {
        name: n for name, path in _all_modules().items() if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not too_long, f"modules over {MAX_MODULE_LINES} lines: {too_long}"


def test_few_modules_at_the_top_of_the_package() -> None:
    """The top of src/wattwatch holds a handful of modules; the rest live in packages."""
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, f"{len(top)} top-level modules: {top}"
