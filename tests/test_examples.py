"""examples/: each script runs on the CPU (it asserts its own claims: the converted
model gives torch's results, the token tensor is a view, the ONNX model holds standard
Conv nodes) and uses only gemmconv's public API."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

import gemmconv

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def test_the_examples_are_there():
    names = {path.stem for path in EXAMPLES}
    assert {
        "timm_vit_training",
        "hf_vision_tower",
        "token_major",
        "torch_compile",
        "export_onnx",
    } <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda path: path.stem)
def test_the_example_runs(path, tmp_path):
    result = subprocess.run(
        [sys.executable, str(path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,  # anything an example writes lands here
        # One intra-op thread: the examples are small, and pytest-xdist runs several at once.
        env={**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "gemmconv.convert:" in result.stdout  # each converts a model and prints the report


def _gemmconv_names(tree: ast.AST) -> list[str]:
    """The dotted names an example reaches through gemmconv: 'gemmconv.convert', ..."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gemmconv"):
            names += [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names if a.name.startswith("gemmconv.")]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id == "gemmconv":
                names.append(f"gemmconv.{node.attr}")
    return names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda path: path.stem)
def test_the_example_uses_only_the_public_api(path):
    public = {f"gemmconv.{name}" for name in gemmconv.__all__}
    public |= {f"gemmconv.nn.{name}" for name in gemmconv.nn.__all__}
    used = _gemmconv_names(ast.parse(path.read_text(encoding="utf-8")))
    assert used, "the example does not use gemmconv"
    assert set(used) <= public, sorted(set(used) - public)
