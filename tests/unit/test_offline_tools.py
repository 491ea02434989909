"""The offline tools (app/tools/) apart from the product: nothing but the CLI's handlers imports them, and they import
without their extra (matplotlib, tqdm), naming it when a run needs one."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from app.tools import import_extra

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("app", "clients", "endpoints", "policies", "deploy")
TOOLS = ROOT / "app" / "tools"
CLI = ROOT / "app" / "cli.py"


def _imports_of_tools(tree: ast.AST) -> list[ast.stmt]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        if any(name == "app.tools" or name.startswith("app.tools.") for name in names):
            found.append(node)
    return found


def test_the_product_never_imports_the_tools():
    offenders = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for package in PRODUCT
        for path in sorted((ROOT / package).rglob("*.py"))
        if not path.is_relative_to(TOOLS) and path != CLI
        for node in _imports_of_tools(ast.parse(path.read_text(), str(path)))
    ]
    assert not offenders, offenders


def test_the_cli_imports_the_tools_inside_its_handlers_only():
    tree = ast.parse(CLI.read_text())
    lazy = {id(node) for function in tree.body if isinstance(function, ast.FunctionDef)
            for node in _imports_of_tools(function)}  # fmt: skip
    imports = _imports_of_tools(tree)
    assert imports, "the CLI dispatches to the tools"
    assert all(id(node) in lazy for node in imports), [node.lineno for node in imports if id(node) not in lazy]


def test_every_tool_module_imports_without_the_tools_extra():
    modules = sorted(
        ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__") for path in TOOLS.rglob("*.py")
    )
    blocker = (
        "import importlib, sys\n"
        "class Blocker:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('matplotlib', 'tqdm'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Blocker())\n"
        f"for module in {modules!r}:\n"
        "    importlib.import_module(module)\n"
        "from app.tools import import_extra\n"
        "import_extra('matplotlib')\n"
    )
    run = subprocess.run([sys.executable, "-c", blocker], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stderr
    assert run.stderr.strip() == (
        "error: matplotlib is not installed; the offline tools need their extra: pip install -e '.[tools]'"
    )


def test_import_extra_returns_the_module_when_installed():
    assert import_extra("json").dumps([1]) == "[1]"
    with pytest.raises(SystemExit, match=r"no_such_module_here is not installed; .*pip install -e '\.\[tools\]'"):
        import_extra("no_such_module_here")
