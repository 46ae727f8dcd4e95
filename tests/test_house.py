"""The package's house rules, read from its sources.

- No import circle between the package's modules.
- No module imports a private (``_name``) name of another module of the package.
- No function has more than 80 lines of code (docstring, blank and comment lines not counted).
- No ``isinstance``/``type(...) is`` on a concrete manifold class outside ``manifolds/``:
  code outside the geometry asks the manifold.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

import geoopt_quotient
from geoopt_quotient import manifolds
from geoopt_quotient.manifolds.base import QuotientManifold

PACKAGE = Path(geoopt_quotient.__file__).parent
MAX_FUNCTION_LINES = 80


def _modules() -> Dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()
TREES = {name: ast.parse(path.read_text()) for name, path in MODULES.items()}


def _imported(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".")
    if MODULES[module].name != "__init__.py":
        package = package[:-1]
    package = package[: len(package) - node.level + 1]
    return ".".join(package + ([node.module] if node.module else []))


def _imports(module: str) -> Iterator[Tuple[str, str]]:
    """``(module imported, name imported from it or "")`` for the package's own imports."""
    for node in ast.walk(TREES[module]):
        if isinstance(node, ast.ImportFrom):
            source = _imported(module, node)
            for alias in node.names:
                if f"{source}.{alias.name}" in MODULES:
                    yield f"{source}.{alias.name}", ""
                elif source in MODULES:
                    yield source, alias.name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in MODULES:
                    yield alias.name, ""


def _circles() -> List[List[str]]:
    graph = {m: {target for target, _ in _imports(m)} - {m} for m in MODULES}
    order: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    components = []

    def visit(node: str) -> None:
        order[node] = low[node] = len(order)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in order:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], order[target])
        if low[node] == order[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for module in MODULES:
        if module not in order:
            visit(module)
    return components


def _lines_of_code(function: ast.AST, source: List[str]) -> int:
    body = function.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    lines = set()
    for statement in body:
        for number in range(statement.lineno, statement.end_lineno + 1):
            text = source[number - 1].strip()
            if text and not text.startswith("#"):
                lines.add(number)
    return len(lines)


def test_no_import_circle():
    assert _circles() == []


def test_no_module_imports_a_private_name_of_another():
    private = [
        f"{module} imports {name} from {source}"
        for module in MODULES
        for source, name in _imports(module)
        if name.startswith("_") and not name.startswith("__") and source != module
    ]
    assert private == []


def test_no_function_over_80_lines_of_code():
    long = []
    for module, tree in TREES.items():
        source = MODULES[module].read_text().splitlines()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = _lines_of_code(node, source)
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{module}.{node.name}: {lines} lines")
    assert long == []


def _concrete_manifolds() -> Set[str]:
    return {
        name
        for name, value in vars(manifolds).items()
        if inspect.isclass(value)
        and issubclass(value, QuotientManifold.__mro__[-2])
        and not inspect.isabstract(value)
        and value is not QuotientManifold
    }


def test_no_class_switch_on_a_concrete_manifold_outside_manifolds():
    concrete = _concrete_manifolds()
    assert {"GLQuotient", "AdaptiveEuclidean"} <= concrete  # the check can see them
    switches = []
    for module, tree in TREES.items():
        if module.startswith("geoopt_quotient.manifolds"):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "id", None)
            if name in ("isinstance", "issubclass") and len(node.args) == 2:
                classes = node.args[1]
                names = {getattr(c, "id", getattr(c, "attr", None)) for c in ast.walk(classes)}
                if names & concrete:
                    switches.append(f"{module}:{node.lineno}")
    for module, tree in TREES.items():
        if module.startswith("geoopt_quotient.manifolds"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare) and any(isinstance(o, ast.Is) for o in node.ops):
                names = {getattr(c, "id", getattr(c, "attr", None)) for c in ast.walk(node)}
                if names & concrete:
                    switches.append(f"{module}:{node.lineno}")
    assert switches == []
