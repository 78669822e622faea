"""The implicit GEMMs compile for a Hopper GPU: Triton's interpreter (the other CPU
tests) runs a kernel's Python, never its compiler, so a kernel that cannot compile
passes there (a device function returning int32 on one constexpr branch and int64 on
another did). Compiled here for sm_90 without a GPU (kernels/offline.py), a few seconds
a kernel."""

from __future__ import annotations

import math

import pytest
import torch

from gemmconv.kernels import patch_gemm
from gemmconv.kernels.offline import load_widths, sm90_ptx

CPU = torch.device("cpu")


def _operands(shape, kernel, k, channels_last):
    """Meta x [N, C, S..], W rows [K, Kred] and y [N, K, O..] in bf16."""
    memory = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
    x = torch.empty(shape, device="meta", dtype=torch.bfloat16)
    outs = tuple(s // r for s, r in zip(shape[2:], kernel))
    y = torch.empty(shape[0], k, *outs, device="meta", dtype=torch.bfloat16)
    if channels_last:
        x, y = x.to(memory_format=memory), y.to(memory_format=memory)
    w = torch.empty(k, shape[1] * math.prod(kernel), device="meta", dtype=torch.bfloat16)
    return x, w, y


# (name, x shape, kernel, output channels, channels-last): the suite's classes, full size.
GEOMETRIES = [
    ("point2d whole rows", (9500, 3, 14, 14), (14, 14), 1280, False),
    ("clip_l14 cf: runs of 14", (128, 3, 336, 336), (14, 14), 1024, False),
    ("convnext cf: rows of 56", (128, 192, 56, 56), (2, 2), 384, False),
    ("wan cf 3d: rows of 104", (1, 16, 21, 60, 104), (1, 2, 2), 5120, False),
    ("vit_b16 cl", (256, 3, 224, 224), (16, 16), 768, True),
]


@pytest.mark.parametrize(("name", "shape", "kernel", "k", "last"), GEOMETRIES,
                         ids=[g[0] for g in GEOMETRIES])  # fmt: skip
def test_the_three_kernels_compile_for_sm90(name, shape, kernel, k, last):
    x, w, y = _operands(shape, kernel, k, last)
    forward = patch_gemm.forward_launch(x, w, None, kernel, last, y, False, CPU)
    backward_data = patch_gemm.backward_data_launch(y, w, kernel, last, x, False, CPU)
    weight_grad = patch_gemm.weight_grad_launch(y, x, kernel, last, 4, False, CPU)
    partials = torch.empty(weight_grad.partials_shape, device="meta")
    for ptx in (
        sm90_ptx(forward, (x, w, None, y)),
        sm90_ptx(backward_data, (y, w, x)),
        sm90_ptx(weight_grad.launch, (y, x, partials)),
    ):
        assert load_widths(ptx)["wgmma"] == 1, name
