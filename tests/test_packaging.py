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


def test_the_test_extra_holds_what_the_onnx_export_tests_use():
    # tests/roads/test_export.py writes ONNX with both of torch's exporters and runs it.
    test_extra = _names(PROJECT["optional-dependencies"]["test"])
    assert {"onnx", "onnxscript", "onnxruntime"} <= test_extra


def test_the_extras_hold_what_the_readme_and_the_bench_use():
    extras = {name: _names(reqs) for name, reqs in PROJECT["optional-dependencies"].items()}
    assert {"timm", "transformers"} <= extras["models"]  # the README's model examples
    assert "matplotlib" in extras["bench"]  # gemmconv bench's png
    # The tests import the model libraries and Triton (which torch's CPU build lacks);
    # the README's test command spreads them over the cores with pytest-xdist.
    test = {"pytest", "pytest-xdist", "hypothesis", "ruff", "gemmconv[models,bench]", "triton"}
    assert test <= extras["test"]


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
