"""The package's layers: every import runs downward, and nothing forms a circle.

On the model of torchao's test/test_lean_import.py, but read from the source rather
than from a process: each module's imports are parsed with ``ast``, those inside
functions (lazy imports) and under ``if TYPE_CHECKING`` included, and so are module
names given as strings (``importlib.import_module("gemmconv.bench.suite")``). Each
module belongs to the layer of its folder (ARCHITECTURE.md); the package root holds
the public API only.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# Bottom to top. A module may import modules of its own layer and of layers below it.
LAYERS = (
    "kernels",  # Triton kernels: import nothing else of gemmconv
    "core",  # problem, layouts, precision, arguments, the cost table as data
    "solvers",  # the registry and every solver
    "measuring",  # operands, timing, verification
    "selection",  # modes, dispatch, find, the find database, calibration, explanations
    "roads",  # eager road, custom ops and their autograd, torch.func, export and ONNX
    "api",  # the package root: gemmconv, functional, nn, convert, profiling
    "terminal",  # usage errors, progress bars, long-run warnings
    "bench",  # benchmark tooling, imported by the bench command only
    "cli",  # the gemmconv command
)
RANK = {layer: rank for rank, layer in enumerate(LAYERS)}
# The modules of the package root, the public API. Any other module there is an error:
# it belongs in a layer's folder.
API_MODULES = {
    "gemmconv",
    "gemmconv.functional",
    "gemmconv.nn",
    "gemmconv.convert",
    "gemmconv.profiling",
}
# `python -m gemmconv` has to live in the root; it is the command.
ENTRY_POINTS = {"gemmconv.__main__": "cli"}


def modules_under(src: Path, package: str = "gemmconv") -> dict[str, Path]:
    """Module name -> file, for every Python file of ``package`` under ``src``."""
    modules = {}
    for path in sorted((src / package).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """The innermost module of ``modules`` that ``name`` names or lies in."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _is_get_logger(node: ast.Call) -> bool:
    func = node.func
    return (isinstance(func, ast.Attribute) and func.attr == "getLogger") or (
        isinstance(func, ast.Name) and func.id == "getLogger"
    )


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ``modules`` that ``module`` imports anywhere in its file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    logger_names = {
        id(arg)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and _is_get_logger(node)
        for arg in node.args
    }
    found: set[str | None] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(_known(alias.name, modules) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            for alias in node.names:
                # `from gemmconv.selection import dispatch` imports the module dispatch.
                found.add(_known(f"{name}.{alias.name}", modules) or _known(name, modules))
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and "." in node.value
            and node.value in modules
            and id(node) not in logger_names
        ):
            # A submodule named in full, as importlib.import_module takes it (a bare
            # "gemmconv" is a cache folder's name as often as the package's).
            found.add(node.value)
    return {name for name in found if name is not None and name != module}


def import_graph(src: Path, package: str = "gemmconv") -> dict[str, set[str]]:
    modules = modules_under(src, package)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def layer_of(module: str) -> str:
    if module in ENTRY_POINTS:
        return ENTRY_POINTS[module]
    if module in API_MODULES:
        return "api"
    folder = module.split(".")[1] if module.count(".") else ""
    if folder in RANK and folder != "api":
        return folder
    raise ValueError(
        f"module {module!r}: not in a layer's folder ({', '.join(LAYERS)}) and not one "
        f"of the public API's modules ({', '.join(sorted(API_MODULES))})"
    )


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import from a layer into one above it, as 'a (layer) -> b (layer)'."""
    return [
        f"{source} ({layer_of(source)}) -> {target} ({layer_of(target)})"
        for source, targets in sorted(graph.items())
        for target in sorted(targets)
        if RANK[layer_of(target)] > RANK[layer_of(source)]
    ]


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: strongly connected sets of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


# ---- the package -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(SRC)


def test_every_module_is_in_a_layer(graph):
    for module in graph:
        layer_of(module)  # raises naming the module otherwise


def test_no_module_imports_from_a_layer_above_its_own(graph):
    assert upward_imports(graph) == []


def test_no_import_circles(graph):
    assert circles(graph) == []


def test_the_kernels_import_nothing_else_of_gemmconv(graph):
    outside = {
        f"{source} -> {target}"
        for source, targets in graph.items()
        if layer_of(source) == "kernels"
        for target in targets
        if layer_of(target) != "kernels"
    }
    assert outside == set()


def test_the_graph_sees_lazy_and_by_name_imports(graph):
    # A lazy import inside a function, and the bench command's import by name.
    assert "gemmconv.selection.finddb" in graph["gemmconv.selection.calibrate"]
    assert "gemmconv.bench.suite" in graph["gemmconv.cli.commands"]


def test_import_and_a_first_convolution_load_no_tooling():
    code = (
        "import gemmconv, torch, sys\n"
        "gemmconv.conv2d(torch.randn(1, 3, 32, 32), torch.randn(8, 3, 16, 16), stride=16)\n"
        "print([m for m in sys.modules if m.startswith(('gemmconv.bench', 'gemmconv.cli',"
        " 'gemmconv.terminal')) or (m.startswith('gemmconv') and 'bench' in m)])\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(SRC)},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert result.stdout.strip() == "[]", result.stdout + result.stderr


# ---- the checker catches what it should --------------------------------------------------


def _plant(tmp_path: Path, files: dict[str, str]) -> dict[str, set[str]]:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return import_graph(tmp_path)


_TREE = {
    "gemmconv/__init__.py": "from gemmconv.core import problem\n",
    "gemmconv/core/__init__.py": "",
    "gemmconv/core/problem.py": "import torch\n",
    "gemmconv/selection/__init__.py": "",
    "gemmconv/selection/dispatch.py": "from gemmconv.core.problem import torch\n",
}


def test_a_clean_synthetic_tree_passes(tmp_path):
    graph = _plant(tmp_path, _TREE)
    assert graph["gemmconv.selection.dispatch"] == {"gemmconv.core.problem"}
    assert upward_imports(graph) == [] and circles(graph) == []


def test_a_planted_lazy_upward_import_fails(tmp_path):
    planted = """
        import torch

        def decide():
            from ..selection import dispatch  # lazy, relative: still an import
            return dispatch
    """
    graph = _plant(tmp_path, {**_TREE, "gemmconv/core/problem.py": planted})
    assert upward_imports(graph) == [
        "gemmconv.core.problem (core) -> gemmconv.selection.dispatch (selection)"
    ]
    assert circles(graph) == [["gemmconv.core.problem", "gemmconv.selection.dispatch"]]


def test_a_planted_import_by_name_and_a_circle_in_one_layer_fail(tmp_path):
    files = {
        **_TREE,
        "gemmconv/selection/find.py": "import gemmconv.selection.dispatch\n",
        "gemmconv/selection/dispatch.py": (
            "import importlib\n"
            "from gemmconv.selection import find\n"
            "importlib.import_module('gemmconv.cli.commands')\n"
        ),
        "gemmconv/cli/__init__.py": "",
        "gemmconv/cli/commands.py": "",
    }
    graph = _plant(tmp_path, files)
    assert upward_imports(graph) == [
        "gemmconv.selection.dispatch (selection) -> gemmconv.cli.commands (cli)"
    ]
    assert circles(graph) == [["gemmconv.selection.dispatch", "gemmconv.selection.find"]]


def test_a_module_outside_the_layers_is_named(tmp_path):
    graph = _plant(tmp_path, {**_TREE, "gemmconv/helpers.py": ""})
    with pytest.raises(ValueError, match="'gemmconv.helpers': not in a layer's folder"):
        [layer_of(module) for module in graph]
