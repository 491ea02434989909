"""What the import contracts (pyproject.toml's [tool.importlinter], `lint-imports` in `make test`) do not check.

import-linter checks which layer may import which. It does not fail on a circle inside one layer, and the
contract lets each service's factory (app/serving/gateway.py, app/worker/server.py: composition roots that sit in
the core's packages) import endpoints/. So: no import circle anywhere in our packages, counting every import
statement (in functions, under TYPE_CHECKING: a lazy import only hides a circle until the call that runs it), and
nothing below the composition root imports a factory (that would put endpoints/ under the core by the back door).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("app", "clients", "endpoints", "policies", "deploy")
FACTORIES = {"app.serving.gateway", "app.worker.server"}
# The packages below the composition root: none of their modules may import a factory but the factory itself.
LAYERED = ("app.serving", "app.worker", "endpoints", "clients", "policies", "deploy")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every module of ours that `name` imports, wherever the statement is."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if is_package else name.split(".")[:-1]
                here = here[: len(here) - node.level + 1]
                base = ".".join([*here, base] if base else here)
            for alias in node.names:
                # `from package import module` imports the module; `from module import name` the module.
                out.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {m for m in out if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imported(name, path, modules) for name, path in modules.items()}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_circle_finder_finds_a_circle_through_a_lazy_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _circles(graph) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_imports_inside_functions_and_type_checking_count(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from app.serving.job import Job\n"
        "def f():\n    from endpoints import errors\n    import policies.cost\n"
    )
    modules = {"app.serving.job": source, "endpoints": source, "endpoints.errors": source, "policies.cost": source}
    assert _imported("x.m", source, modules) == {"app.serving.job", "endpoints.errors", "policies.cost"}


def test_no_import_circles_lazy_imports_included():
    circles = _circles(_graph())
    assert not circles, "import circles: " + "; ".join(" <-> ".join(c) for c in circles)


def test_only_the_composition_root_imports_a_service_factory():
    offenders = sorted(
        f"{name} -> {target}"
        for name, imported in _graph().items()
        if name.startswith(LAYERED) and name not in FACTORIES
        for target in imported & FACTORIES
    )
    assert not offenders, offenders
