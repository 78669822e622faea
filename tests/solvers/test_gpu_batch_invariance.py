"""gemmconv.batch_invariant() on CUDA: the chunked cuBLAS GEMM (solvers/invariant.py)
and, where cuBLAS is refused, the implicit Triton GEMM, every problem class, dtype and
layout, and the suite's own shapes where the default is not invariant (the SD3 latent
patchify ran 1.95e-3 apart in bf16 on an H100 through cuBLAS).

The CPU twin, tests/solvers/test_batch_invariance.py, holds the same checks; here
each sample of batches of 1, 7 and 64 (head, tail, shuffled, alone in fresh memory,
a slice of the full batch) must equal its row of the full batch bit for bit. At the
chunk budget itself these small problems are shorter than one chunk (a padded
product); the tests with small chunks take the whole and overlapping chunks too."""

from __future__ import annotations

import math

import pytest
import torch
from test_batch_invariance import CASES, LAYOUTS, _conv, _in_layout, check_invariant_forward

import gemmconv
from gemmconv.solvers import invariant

pytestmark = pytest.mark.gpu

# fp64 too: cuBLAS's DGEMM picks its kernel by the shape as the others do.
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _cuda_operands(c, k, spatial, kernel, dtype, layout, full):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(full, c, *spatial, generator=g, device="cuda").to(dtype)
    w = torch.randn(k, c, *kernel, generator=g, device="cuda").to(dtype) / (c * max(kernel)) ** 0.5
    b = torch.randn(k, generator=g, device="cuda").to(dtype)
    return _in_layout(x, layout), _in_layout(w, layout), b


def _check(c, k, spatial, kernel, stride, dtype, layout, full):
    x, w, b = _cuda_operands(c, k, spatial, kernel, dtype, layout, full)
    tolerance = {torch.float32: 1e-2, torch.float16: 2e-2, torch.bfloat16: 1e-1,
                 torch.float64: 1e-10}[dtype]  # fmt: skip
    check_invariant_forward(x, w, b, stride, layout, tolerance)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda v: v.value)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_every_class_on_cuda(case, dtype, layout):
    label, c, k, spatial, kernel, stride = case
    _check(c, k, spatial, kernel, stride, dtype, layout, full=300)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda v: v.value)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_every_class_in_small_chunks(case, dtype, layout, monkeypatch):
    """The chunked GEMM with chunks of 256 rows or 4 samples: whole chunks, the last one
    overlapping the one before, and the padded one, in one batch."""
    label, c, k, spatial, kernel, stride = case
    outputs = math.prod(s // u for s, u in zip(spatial, stride))
    monkeypatch.setattr(invariant, "CUDA_CHUNK_MACS", 4 * c * k * outputs)
    _check(c, k, spatial, kernel, stride, dtype, layout, full=300)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda v: v.value)
@pytest.mark.parametrize("dtype", DTYPES[:3], ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("case", [c for c in CASES if "pointwise" not in c[0]], ids=lambda c: c[0])
def test_implicit_where_cublas_is_refused(case, dtype, layout, monkeypatch):
    """Under torch.use_deterministic_algorithms without CUBLAS_WORKSPACE_CONFIG the
    implicit Triton GEMM is the invariant form of every patch problem."""
    label, c, k, spatial, kernel, stride = case
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    torch.use_deterministic_algorithms(True)
    try:
        x, w, b = _cuda_operands(c, k, spatial, kernel, dtype, layout, full=300)
        with gemmconv.batch_invariant():
            assert gemmconv.explain(x, w, b, stride=stride)["forward"].solver == "patch_implicit"
        tolerance = {torch.float32: 1e-2, torch.float16: 2e-2, torch.bfloat16: 1e-1}[dtype]
        check_invariant_forward(x, w, b, stride, layout, tolerance)
    finally:
        torch.use_deterministic_algorithms(False)


# Patch problems that several column solvers take: each gives the same bits, so that a
# batch size whose selection picks another of them changes nothing.
FAMILY_CASES = [
    ("point_output_588", 3, 32, (14, 14), (14, 14), ("point_output", "patch", "patch_triton")),
    ("patch_588", 3, 32, (28, 28), (14, 14), ("patch", "patch_triton")),
    ("sd3_patchify", 16, 64, (16, 16), (2, 2), ("patch", "patch_triton")),
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda v: v.value)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("case", FAMILY_CASES, ids=lambda c: c[0])
def test_column_solvers_agree_bitwise(case, dtype, layout, monkeypatch):
    label, c, k, spatial, kernel, solvers = case
    x, w, b = _cuda_operands(c, k, spatial, kernel, dtype, layout, full=70)
    conv = _conv(len(spatial))
    results = {}
    with gemmconv.batch_invariant():
        for solver in solvers:
            monkeypatch.setenv("GEMMCONV_SOLVER", solver)
            assert gemmconv.explain(x, w, b, stride=kernel)["forward"].solver == solver
            results[solver] = conv(x, w, b, stride=kernel)
            results[f"{solver}[:7]"] = conv(x[:7], w, b, stride=kernel)
    first = results[solvers[0]]
    for solver in solvers:
        assert torch.equal(results[solver], first), solver
        assert torch.equal(results[f"{solver}[:7]"], first[:7]), solver


# The suite's rows the issue names: Qwen2-VL's embed (one patch a sample) and the SD3
# latent patchify (16 channels, 2x2), at their full batch.
SUITE_CASES = [
    ("qwen2vl", 3, 1280, (2, 14, 14), (2, 14, 14), (2, 14, 14), 8192),
    ("sd3_patchify", 16, 1536, (128, 128), (2, 2), (2, 2), 8),
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda v: v.value)
@pytest.mark.parametrize("case", SUITE_CASES, ids=lambda c: c[0])
def test_suite_shapes_bf16(case, layout):
    label, c, k, spatial, kernel, stride, full = case
    x, w, b = _cuda_operands(c, k, spatial, kernel, torch.bfloat16, layout, full)
    conv = _conv(len(spatial))
    with gemmconv.batch_invariant():
        y = conv(x, w, b, stride=stride)
        for batch in (1, 7, min(64, full)):
            for start in (0, full - batch):
                part = conv(_in_layout(x[start : start + batch].clone(), layout), w, b,
                            stride=stride)  # fmt: skip
                assert torch.equal(part, y[start : start + batch]), (batch, start)
