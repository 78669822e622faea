"""The solver matrix on CUDA in bf16/fp16/fp32 (fp32 with TF32 on and off), against float64
(tests/solver_cases.py generates it, the same as the CPU's)."""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn.functional as F

import gemmconv
from gemmconv.measuring.verify import rms_range, tolerance

from solver_cases import case_id, check_case, solver_matrix

pytestmark = pytest.mark.gpu

# The TF32 flag changes only fp32 GEMMs: fp32 cases run with it off and on.
GPU_CASES = [
    pytest.param(case, tf32, id=case_id(case) + ("-tf32" if tf32 else ""))
    for case in solver_matrix("cuda", dtypes={torch.bfloat16, torch.float16, torch.float32})
    for tf32 in ((False, True) if case[5] == torch.float32 else (False,))
]


@pytest.mark.parametrize(("case", "tf32"), GPU_CASES)
def test_solver_on_cuda(case, tf32, monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", tf32)
    check_case(case, "cuda", seed=zlib.crc32(case_id(case).encode()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
def test_headline_case_functional_on_cuda(dtype, memory_format, monkeypatch):
    # At this batch the call-time cost model may rightly give a direction to cuDNN
    # (one launch against a gather's); the test is about gemmconv's own solvers.
    monkeypatch.setenv("GEMMCONV_DISABLE", "vendor")
    g = torch.Generator(device="cuda").manual_seed(7)
    x = torch.rand(512, 3, 14, 14, device="cuda", generator=g).mul_(2).sub_(1).to(dtype)
    x = x.contiguous(memory_format=memory_format).requires_grad_(True)
    w = torch.rand(1280, 3, 14, 14, device="cuda", generator=g).sub_(0.5).to(dtype)
    w.requires_grad_(True)
    b = torch.rand(1280, device="cuda", generator=g).to(dtype).requires_grad_(True)
    y = gemmconv.conv2d(x, w, b, stride=14)
    choice = gemmconv.explain(x, w, b, stride=14)
    assert all(c.solver != "vendor" for c in choice.values())
    ref_leaves = [t.detach().double().requires_grad_(True) for t in (x, w, b)]
    y_ref = F.conv2d(*ref_leaves, stride=14)
    tol = tolerance(dtype, "cuda")
    assert y.dtype == dtype and rms_range(y, y_ref) <= tol
    dy = torch.rand_like(y_ref).sub_(0.5)
    y.backward(dy.to(dtype))
    y_ref.backward(dy.to(dtype).double())
    for mine, ref in zip((x, w, b), ref_leaves):
        assert rms_range(mine.grad, ref.grad) <= tol
