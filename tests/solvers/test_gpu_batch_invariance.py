"""gemmconv.batch_invariant() on CUDA: the Triton forms compiled, every problem class,
dtype and layout, and the suite's own shapes where the default is not invariant
(the SD3 latent patchify ran 1.95e-3 apart in bf16 on an H100 through cuBLAS).

The CPU twin, tests/solvers/test_batch_invariance.py, holds the same checks; here
each sample of batches of 1, 7 and 64 (head, tail, shuffled, alone in fresh memory,
a slice of the full batch) must equal its row of the full batch bit for bit."""

from __future__ import annotations

import pytest
import torch
from test_batch_invariance import CASES, LAYOUTS, _conv, _in_layout, check_invariant_forward

import gemmconv

pytestmark = pytest.mark.gpu

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _cuda_operands(c, k, spatial, kernel, dtype, layout, full):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(full, c, *spatial, generator=g, device="cuda").to(dtype)
    w = torch.randn(k, c, *kernel, generator=g, device="cuda").to(dtype) / (c * max(kernel)) ** 0.5
    b = torch.randn(k, generator=g, device="cuda").to(dtype)
    return _in_layout(x, layout), _in_layout(w, layout), b


def _check(c, k, spatial, kernel, stride, dtype, layout, full):
    x, w, b = _cuda_operands(c, k, spatial, kernel, dtype, layout, full)
    tolerance = {torch.float32: 1e-2, torch.float16: 2e-2, torch.bfloat16: 1e-1}[dtype]
    check_invariant_forward(x, w, b, stride, layout, tolerance)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda v: v.value)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_every_class_on_cuda(case, dtype, layout):
    label, c, k, spatial, kernel, stride = case
    _check(c, k, spatial, kernel, stride, dtype, layout, full=300)


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
