"""The alignment hints of the implicit GEMMs: what the host proves about the loads, so
that Triton issues vector copies through runs it cannot see aligned itself (14 pixels,
strides not divisible by 16, output pixels behind the pixel index's divisions). The
hints change no value, only how wide the loads are: this checks the proofs (the
gather's, W's rows', the output pixels'), then the three kernels on geometries they
align (and one whose pointer is not), against float64. Interpreted on the CPU the
hints are no-ops and only the grouped masks are exercised; on CUDA (marker gpu) a wrong
proof is a misaligned vector load, a wrong value or a fault."""

from __future__ import annotations

import math
import zlib

import pytest
import torch
import torch.nn.functional as F

from gemmconv.kernels.patch_gemm import (
    gather_alignment,
    patch_gemm_backward_data,
    patch_gemm_forward,
    patch_gemm_weight_grad,
    pixel_alignment,
)
from gemmconv.kernels.patch_permute import PatchGeometry


def _geometry(x, kernel, channels_last_columns):
    outs = tuple(s // r for s, r in zip(x.shape[2:], kernel))
    return PatchGeometry.of(x, outs, kernel, channels_last_columns)


def _cl(x):
    return x.to(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)


# (name, x, kernel, channels-last columns, bf16 alignment)
ROWS = [
    ("vit_b16 cf", torch.empty(2, 3, 224, 224), (16, 16), False, 8),
    ("clip_l14 cf: runs of 14", torch.empty(2, 3, 336, 336), (14, 14), False, 2),
    ("convnext cf: rows of 56", torch.empty(2, 192, 56, 56), (2, 2), False, 2),
    ("wan cf 3d: rows of 104", torch.empty(1, 16, 3, 60, 104), (1, 2, 2), False, 2),
    ("odd width", torch.empty(2, 3, 4, 15), (2, 3), False, 0),
    ("vit_b16 cl: runs of 48", _cl(torch.empty(2, 3, 224, 224)), (16, 16), True, 8),
    ("clip_l14 cl: runs of 42", _cl(torch.empty(2, 3, 336, 336)), (14, 14), True, 2),
    ("dit cl: runs of 8", _cl(torch.empty(2, 4, 32, 32)), (2, 2), True, 8),
    ("cf read in the cl order: no run", torch.empty(2, 3, 8, 8), (2, 2), True, 0),
    ("last stride not 1", torch.empty(2, 3, 8, 16)[..., ::2], (2, 2), False, 0),
    (
        "odd sample stride",
        torch.empty(120).as_strided((2, 3, 4, 4), (49, 16, 4, 1)),
        (2, 2),
        False,
        0,
    ),
]


@pytest.mark.parametrize(("name", "x", "kernel", "last", "expected"), ROWS,
                         ids=[r[0] for r in ROWS])  # fmt: skip
def test_the_alignment_each_geometry_proves(name, x, kernel, last, expected):
    assert gather_alignment(_geometry(x, kernel, last), 2) == expected


def test_fp32_vectors_are_four_elements_at_most():
    g = _geometry(torch.empty(2, 3, 224, 224), (16, 16), False)
    assert gather_alignment(g, 4) == 4


def test_a_size_one_dimensions_free_stride_does_not_count():
    # A depth of one, read by a kernel of depth one: its stride (7 here, as torch may
    # leave it) is never stepped over, by rows or by runs.
    x = torch.empty(2 * 800).as_strided((2, 3, 1, 16, 16), (800, 256, 7, 16, 1))
    assert gather_alignment(_geometry(x, (1, 8, 8), False), 2) == 8
    # The same stride read within a patch (a depth of two, kernel two) breaks it.
    y = torch.empty(2 * 800).as_strided((2, 3, 2, 16, 16), (800, 256, 7, 16, 1))
    assert gather_alignment(_geometry(y, (2, 8, 8), False), 2) == 0


# (name, shape, kernel, channels-last memory and columns, whether the pointer is off by
# one element): small forms of the rows above, each with the alignment it proves.
KERNEL_CASES = [
    ("vit cf: 8", (2, 3, 32, 32), (16, 16), False, False),
    ("clip cf: runs of 14", (2, 3, 28, 42), (14, 14), False, False),
    ("convnext cf: rows of 56", (2, 4, 4, 56), (2, 2), False, False),
    ("wan cf 3d: rows of 104", (1, 4, 2, 4, 104), (1, 2, 2), False, False),
    ("clip cl: runs of 42", (2, 3, 28, 28), (14, 14), True, False),
    ("dit cl: runs of 8", (2, 4, 8, 8), (2, 2), True, False),
    ("clip cf, pointer off by one", (2, 3, 28, 42), (14, 14), False, True),
]


def _operand(shape, channels_last, offset, dtype, device, seed):
    """A random tensor of ``shape`` (channels-last if asked) whose data starts
    ``offset`` elements into its storage."""
    gen = torch.Generator().manual_seed(seed)
    values = (torch.rand(shape, generator=gen) * 2 - 1).to(dtype)
    if channels_last:
        values = _cl(values)
    storage = torch.full((values.numel() + offset,), float("nan"), dtype=dtype, device=device)
    t = storage[offset:].as_strided(values.shape, values.stride())
    return t.copy_(values)


def _column_order(w: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """W [K, C, R..] as rows in the kernels' column order: (C, R..) or (R.., C)."""
    return (w.movedim(1, -1) if channels_last else w).reshape(w.shape[0], -1)


def _check_kernels(case, dtype, device) -> None:
    name, shape, kernel, last, off = case
    seed = zlib.crc32(repr((name, dtype)).encode())
    x = _operand(shape, last, int(off), dtype, device, seed)
    g = _geometry(x, kernel, last)
    assert gather_alignment(g, x.element_size()) > 1 or off, name
    k = 24
    w = _operand((k, shape[1], *kernel), False, 0, dtype, device, seed + 1)
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[len(kernel)]
    x64 = x.detach().double().requires_grad_(True)
    w64 = w.detach().double().requires_grad_(True)
    ref = conv(x64, w64, stride=kernel)
    dy = _operand(tuple(ref.shape), last, 0, dtype, device, seed + 2)
    dx_ref, dw_ref = torch.autograd.grad(ref, (x64, w64), dy.double())
    # fp32 without TF32 is exact to a few ulps; half precision rounds its output.
    tol = 1e-4 if dtype == torch.float32 else 1.5e-2

    def close(got, want):
        scale = want.abs().max().item()
        assert torch.allclose(got.double(), want, rtol=tol, atol=tol * scale), name

    y = torch.full_like(ref, float("nan"), dtype=dtype)
    if last:
        y = _cl(y)
    else:  # channels-first y and dY: their pixel groups are hinted too
        assert pixel_alignment(y) > 1 and pixel_alignment(dy) > 1, name
    patch_gemm_forward(x, _column_order(w, last), None, kernel, last, out=y)
    close(y, ref.detach())

    dx = torch.full_like(x, float("nan"))
    patch_gemm_backward_data(dy, _column_order(w, last), kernel, last, dx)
    close(dx, dx_ref)

    rows = patch_gemm_weight_grad(dy, x, kernel, last, splits=2)
    close(rows, _column_order(dw_ref, last))
    assert rows.shape == (k, math.prod(kernel) * shape[1])


@pytest.mark.parametrize("case", KERNEL_CASES, ids=[c[0] for c in KERNEL_CASES])
def test_kernels_on_aligned_gathers_interpreted(case):
    _check_kernels(case, torch.float32, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=["bf16", "fp16", "fp32"])  # fmt: skip
@pytest.mark.parametrize("case", KERNEL_CASES, ids=[c[0] for c in KERNEL_CASES])
def test_kernels_on_aligned_gathers_on_cuda(case, dtype):
    _check_kernels(case, dtype, torch.device("cuda"))


@pytest.mark.parametrize(
    ("shape", "kernel", "row_stride", "row_align", "expected"),
    [
        ((1, 3, 14, 14), (14, 14), 588, 0, 4),  # CLIP-L/14's 588: 8-byte rows
        ((1, 3, 14, 14), (14, 14), 592, 0, 4),  # padded rows keep the reduction's vector
        ((1, 3, 16, 16), (16, 16), 768, 0, 8),  # ViT-B/16: 16-byte rows
        ((1, 3, 5, 5), (5, 5), 75, 0, 1),  # an odd reduction: element loads
        ((1, 3, 2, 14, 14), (2, 14, 14), 1184, 8, 8),  # the whole-row form's is W's too
    ],
)
def test_weight_rows_load_in_the_vector_the_reduction_and_stride_allow(
    shape, kernel, row_stride, row_align, expected
):
    from gemmconv.kernels.patch_gemm import _weight_alignment

    g = _geometry(torch.empty(shape), kernel, False)
    rows = torch.empty(4, row_stride, dtype=torch.bfloat16)[:, : g.reduction]
    assert _weight_alignment(g, rows, row_align) == expected


def _meta(shape, memory=torch.contiguous_format):
    return torch.empty(shape, device="meta", dtype=torch.bfloat16).to(memory_format=memory)


@pytest.mark.parametrize(
    ("name", "t", "expected"),
    [
        ("vit_b16 y cf: 196 pixels a sample", _meta((256, 768, 14, 14)), 4),
        ("clip_l14 y cf: 576", _meta((128, 1024, 24, 24)), 8),
        ("wan y cf 3d: 21x30x52", _meta((1, 5120, 21, 30, 52)), 8),
        ("7x7 with 5 channels: odd strides", _meta((2, 5, 7, 7)), 0),
        ("channels-last: no pixel run", _meta((2, 8, 4, 4), torch.channels_last), 0),
        ("a point output: one pixel", _meta((64, 1280, 1, 1)), 0),
        ("every other column: no run", _meta((2, 8, 4, 16))[..., ::2], 0),
        ("rows of 8 in rows of 12: steps of 12", _meta((2, 8, 4, 12))[..., :8], 4),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_the_pixel_alignment_each_output_proves(name, t, expected):
    assert pixel_alignment(t) == expected
