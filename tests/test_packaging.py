"""The packaging metadata the README's install commands rely on: what a plain install
brings, and what each extra adds."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

PROJECT = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())[
    "project"
]


def _names(requirements: list[str]) -> set[str]:
    """Distribution names of requirement strings, extras kept: 'gemmconv[models]'."""
    names = set()
    for requirement in requirements:
        match = re.match(r"\s*([A-Za-z0-9_.-]+(\[[^\]]*\])?)", requirement)
        names.add(match.group(1).lower())
    return names


def test_a_plain_install_brings_numpy():
    # torch warns "Failed to initialize NumPy" at the first convolution without it.
    assert {"torch", "tqdm", "numpy"} <= _names(PROJECT["dependencies"])


def _with_extras(extra: str) -> set[str]:
    """The distributions an extra brings, the project's own extras it names expanded."""
    names = set()
    for name in _names(PROJECT["optional-dependencies"][extra]):
        match = re.fullmatch(r"gemmconv\[([^\]]*)\]", name)
        if match is None:
            names.add(name)
        else:
            for included in match.group(1).split(","):
                names |= _with_extras(included.strip())
    return names


def test_the_onnx_extra_holds_what_both_exporters_and_their_check_need():
    # torch's default (dynamo) exporter needs onnxscript; both need onnx; onnxruntime
    # runs what they write. tests/roads/test_export.py does all three.
    assert {"onnx", "onnxscript", "onnxruntime"} == _names(PROJECT["optional-dependencies"]["onnx"])
    assert {"onnx", "onnxscript", "onnxruntime"} <= _with_extras("test")


def test_the_extras_hold_what_the_readme_and_the_bench_use():
    extras = {name: _names(reqs) for name, reqs in PROJECT["optional-dependencies"].items()}
    assert {"timm", "transformers"} <= extras["models"]  # the README's model examples
    assert "matplotlib" in extras["bench"]  # gemmconv bench's png
    # The tests import the model libraries and Triton (which torch's CPU build lacks);
    # the README's test command spreads them over the cores with pytest-xdist.
    test = {"pytest", "pytest-xdist", "hypothesis", "ruff", "triton"}
    assert test | extras["models"] | extras["bench"] | extras["onnx"] <= _with_extras("test")


ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_version_is_written_once_in_the_package():
    import gemmconv

    assert "version" not in PROJECT and "version" in PROJECT["dynamic"]
    setuptools = PYPROJECT["tool"]["setuptools"]
    assert setuptools["dynamic"]["version"] == {"attr": "gemmconv.core.version.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", gemmconv.__version__)


def test_the_package_ships_its_type_hints_and_the_license_it_names():
    assert (ROOT / "src" / "gemmconv" / "py.typed").is_file()
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["gemmconv"]
    assert PROJECT["license"] == {"text": "Apache-2.0"}
    license_text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert "END OF TERMS AND CONDITIONS" in license_text


def test_the_package_ships_the_cpp_node_source_it_compiles_at_first_use():
    from gemmconv.roads import native_node

    shipped = PYPROJECT["tool"]["setuptools"]["package-data"]["gemmconv"]
    assert native_node.SOURCE.is_file()
    assert native_node.SOURCE.relative_to(ROOT / "src" / "gemmconv").as_posix() in shipped
