"""The implicit patch GEMMs where each patch is a whole, dense sample (ROW_ALIGN > 0).

There the kernels (gemmconv.kernels.patch_gemm) skip the patch index map: row m of the
column matrix is the sample's memory, column k is offset k, and the alignment the
host proves (whole_row_alignment) is handed to Triton so that a reduction such as
C*R = 588 loads in 8-byte vectors. The alignment must be proven, never guessed: a
hint that is wrong would load from the wrong addresses, so the geometry tests
include every way a sample can fail to be dense. Each direction is checked against
float64 on fresh random operands with its result pre-filled with NaN, interpreted on
the CPU in fp32 and fp16 and compiled on CUDA (marker gpu) in bf16, fp16 and fp32.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gemmconv.kernels.patch_gemm import (
    patch_gemm_backward_data,
    patch_gemm_forward,
    patch_gemm_weight_grad,
    whole_row_alignment,
)
from gemmconv.kernels.patch_permute import PatchGeometry


def _geometry(x: torch.Tensor, kernel, channels_last_columns: bool) -> PatchGeometry:
    outs = tuple(s // r for s, r in zip(x.shape[2:], kernel))
    return PatchGeometry.of(x, outs, tuple(kernel), channels_last_columns)


def _dense(shape, channels_last: bool = False, dtype=torch.bfloat16) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype)
    if channels_last:
        t = t.to(memory_format=torch.channels_last if len(shape) == 4 else torch.channels_last_3d)
    return t


@pytest.mark.parametrize(
    ("x", "kernel", "cl_columns", "row_strides", "expected"),
    [
        # Point 2D: 3x14x14 = 588 elements, 1176 bytes in bf16: 8-byte vectors.
        (_dense((2, 3, 14, 14)), (14, 14), False, (588,), 4),
        (_dense((2, 3, 14, 14), channels_last=True), (14, 14), True, (588,), 4),
        # fp32: 16 bytes is 4 elements, the most a vector holds.
        (_dense((2, 3, 14, 14), dtype=torch.float32), (14, 14), False, (588,), 4),
        # A weight row stride of 590 allows only 4-byte vectors.
        (_dense((2, 3, 14, 14)), (14, 14), False, (590,), 2),
        # An odd reduction (3x5x5 = 75): whole rows, no alignment beyond one element.
        (_dense((2, 3, 5, 5)), (5, 5), False, (75,), 1),
        (_dense((2, 4, 2, 4)), (2, 4), False, (32,), 8),
        # A point-3D sample (Qwen2-VL's 3x2x14x14).
        (_dense((2, 3, 2, 14, 14)), (2, 14, 14), False, (1176,), 8),
        # The first channels of a wider tensor: each sample's part is still dense, its
        # rows 980 elements apart.
        (_dense((2, 5, 14, 14))[:, :3], (14, 14), False, (588,), 4),
    ],
    ids=[
        "point2d-cf",
        "point2d-cl",
        "point2d-fp32",
        "wld590",
        "odd",
        "aligned8",
        "point3d",
        "channel-prefix",
    ],
)
def test_whole_rows_report_the_alignment_every_row_stride_shares(
    x, kernel, cl_columns, row_strides, expected
):
    g = _geometry(x, kernel, cl_columns)
    assert whole_row_alignment(g, x.element_size(), *row_strides) == expected


@pytest.mark.parametrize(
    ("x", "kernel", "cl_columns"),
    [
        # Several patches a sample.
        (_dense((2, 3, 28, 14)), (14, 14), False),
        # One patch, but a remainder no patch reads: the sample's rows are not dense.
        (_dense((2, 3, 15, 14)), (14, 14), False),
        (_dense((2, 3, 14, 15)), (14, 14), False),
        # A channels-first sample read in the channels-last column order, and back.
        (_dense((2, 3, 14, 14)), (14, 14), True),
        (_dense((2, 3, 14, 14), channels_last=True), (14, 14), False),
        # Every other channel of a wider tensor: a sample's channels are spread out.
        (_dense((2, 6, 14, 14))[:, ::2], (14, 14), False),
        # Every other column of a wider tensor.
        (_dense((2, 3, 14, 28))[..., ::2], (14, 14), False),
    ],
    ids=["patches", "crop-h", "crop-w", "cf-as-cl", "cl-as-cf", "spread-channels", "strided-w"],
)
def test_samples_that_are_not_dense_rows_take_the_index_map(x, kernel, cl_columns):
    assert whole_row_alignment(_geometry(x, kernel, cl_columns), x.element_size(), 588) == 0


def test_a_sample_offset_into_its_storage_still_proves_its_strides_only():
    # The alignment is about strides; the pointer's own alignment Triton specialises on.
    base = _dense((2 * 588 + 1,))
    x = base[1:].view(2, 3, 14, 14)
    assert whole_row_alignment(_geometry(x, (14, 14), False), 2, 588) == 4


def _operands(n, c, k, spatial, layout_cl, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)

    def uniform(shape):
        t = (torch.rand(shape, generator=gen) * 2 - 1).to(dtype)
        if layout_cl:
            fmt = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
            t = t.to(memory_format=fmt)
        return t.to(device)

    x = uniform((n, c, *spatial))
    w = uniform((k, c, *spatial))
    dy = uniform((n, k, *([1] * len(spatial))))
    bias = (torch.rand(k, generator=gen) * 2 - 1).to(dtype).to(device)
    return x, w, dy, bias


def _weight_rows(w: torch.Tensor, cl_columns: bool) -> torch.Tensor:
    rows = w.movedim(1, -1) if cl_columns else w
    return rows.reshape(w.shape[0], -1).contiguous()


TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 6e-2}


def _close(got: torch.Tensor, want: torch.Tensor, dtype) -> None:
    assert not torch.isnan(got).any(), "an element was left unwritten"
    scale = want.abs().max().item() + 1.0
    err = (got.double() - want).abs().max().item()
    assert err <= TOLERANCE[dtype] * scale, f"max error {err:.3g} at scale {scale:.3g}"


def _check_three_directions(n, c, k, spatial, cl, dtype, device, seed):
    x, w, dy, bias = _operands(n, c, k, spatial, cl, dtype, device, seed)
    kernel = tuple(spatial)
    g = _geometry(x, kernel, cl)
    wm = _weight_rows(w, cl)
    assert whole_row_alignment(g, x.element_size(), wm.stride(0)) > 0
    conv = F.conv2d if len(spatial) == 2 else F.conv3d

    y = torch.full((n, k, *([1] * len(spatial))), float("nan"), dtype=dtype, device=device)
    patch_gemm_forward(x, wm, bias, kernel, cl, out=y)
    _close(y, conv(x.double(), w.double(), bias.double(), stride=kernel), dtype)

    dx = torch.full_like(x, float("nan"))
    patch_gemm_backward_data(dy, wm, kernel, cl, dx)
    x64 = x.double().requires_grad_()
    w64 = w.double().requires_grad_()
    conv(x64, w64, stride=kernel).backward(dy.double())
    _close(dx, x64.grad, dtype)

    rows = patch_gemm_weight_grad(dy, x, kernel, cl, splits=3)
    _close(rows, _weight_rows(w64.grad, cl), dtype)


# Point 2D's reduction (588, 4-element vectors), an odd one (75) and a point-3D sample.
WHOLE_ROW_SHAPES = [(3, (14, 14)), (3, (5, 5)), (2, (2, 3, 4))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("cl", [False, True], ids=["cf", "cl"])
@pytest.mark.parametrize(("c", "spatial"), WHOLE_ROW_SHAPES, ids=["588", "75", "3d"])
def test_whole_row_kernels_match_float64_interpreted(c, spatial, cl, dtype):
    _check_three_directions(37, c, 20, spatial, cl, dtype, torch.device("cpu"), seed=len(spatial))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"]
)
@pytest.mark.parametrize("cl", [False, True], ids=["cf", "cl"])
@pytest.mark.parametrize(("c", "spatial"), WHOLE_ROW_SHAPES, ids=["588", "75", "3d"])
def test_whole_row_kernels_match_float64_on_cuda(c, spatial, cl, dtype):
    # 300 samples and 200 channels: several row and channel tiles, masked tails.
    _check_three_directions(300, c, 200, spatial, cl, dtype, torch.device("cuda"), seed=3)
