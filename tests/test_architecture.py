"""The package's shape, as docs/architecture.md draws it: calls go down the layers. No import cycle between ssd_trt
modules (imports under ``TYPE_CHECKING`` and inside functions included), the decoding layer never imports the engine
step, only the engine step's users import ``LLMEngine``, and the installed packages carry this project's names.
"""
from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in (ROOT / "ssd_trt").rglob("*.py")}


def owner(name: str) -> str | None:
    """The ssd_trt module a dotted name lives in (the longest prefix that is a module)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in MODULES:
            return ".".join(parts[:end])
    return None


def imported(name: str) -> set[str]:
    """Every ssd_trt module ``name`` imports, wherever the import statement stands."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.Import):
            found |= {owner(alias.name) for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("ssd_trt"):
            found |= {owner(f"{node.module}.{alias.name}") for alias in node.names}
    return found - {None, name}


GRAPH = {name: imported(name) for name in MODULES}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle_between_ssd_trt_modules():
    assert cycles(GRAPH) == []


def test_the_cycle_check_finds_a_cycle():
    """(The check itself can fail: a planted edge back up the layers is a cycle.)"""
    planted = {name: set(edges) for name, edges in GRAPH.items()}
    planted["ssd_trt.decoding.round"].add("ssd_trt.batching.engine")
    assert any("ssd_trt.batching.engine" in cycle for cycle in cycles(planted))


def test_the_decoding_layer_never_imports_the_engine_step():
    upward = {name: sorted(edge for edge in edges if edge.startswith("ssd_trt.batching"))
              for name, edges in GRAPH.items() if name.startswith("ssd_trt.decoding")}
    assert {name: edges for name, edges in upward.items() if edges} == {}


def test_only_the_engine_steps_users_import_it():
    users = {name for name, edges in GRAPH.items() if "ssd_trt.batching.engine" in edges}
    assert users <= {"ssd_trt.runtime", "ssd_trt.serve.core"}      # every frontend serves through the core
    for name in MODULES:       # and nothing below it is handed one
        if name.startswith(("ssd_trt.batching", "ssd_trt.decoding")) and name != "ssd_trt.batching.engine":
            assert "LLMEngine" not in MODULES[name].read_text(), name


def test_the_packages_pyproject_installs_are_every_package_folder():
    """pyproject lists its packages (the plugins folder installs under another name): the list misses none."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {module_name(path) for path in (ROOT / "ssd_trt").rglob("__init__.py")}
    folders |= {"ssd_trt_plugins" + module_name(path)[len("plugins"):]
                for path in (ROOT / "plugins").rglob("__init__.py")}
    assert set(config["packages"]) == folders
    assert config["package-dir"]["ssd_trt_plugins"] == "plugins"


def test_the_installed_plugins_package_has_this_projects_name(tmp_path):
    """Outside the checkout, ``ssd_trt_plugins`` imports and no top-level ``plugins`` package exists (a name any other
    package may take)."""
    probe = ("import importlib.util as u; "
             "print(u.find_spec('plugins') is None, u.find_spec('ssd_trt_plugins.tree_attention.masks') is not None)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True)
    if out.stdout.split() == ["True", "False"]:
        pytest.skip("ssd-trt is not installed in this Python (pip install -e .)")
    assert out.stdout.split() == ["True", "True"]
