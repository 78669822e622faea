"""The solver matrix on CUDA in bf16/fp16/fp32 (fp32 with TF32 on and off), against float64."""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn.functional as F

import gemmconv
from gemmconv.verify import rms_range, tolerance

from solver_cases import case_id, check_case, solver_matrix

pytestmark = pytest.mark.gpu

GPU_CASES = solver_matrix("cuda", dtypes={torch.bfloat16, torch.float16, torch.float32})


@pytest.fixture(params=[False, True], ids=["tf32_off", "tf32_on"])
def conv_tf32(request):
    saved = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = request.param
    yield request.param
    torch.backends.cudnn.allow_tf32 = saved


@pytest.mark.parametrize("case", GPU_CASES, ids=[case_id(c) for c in GPU_CASES])
def test_solver_on_cuda(case, conv_tf32):
    if case[4] != torch.float32 and conv_tf32:
        pytest.skip("the TF32 flag only affects fp32")
    check_case(case, "cuda", seed=zlib.crc32(case_id(case).encode()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
def test_headline_case_functional_on_cuda(dtype, memory_format):
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
