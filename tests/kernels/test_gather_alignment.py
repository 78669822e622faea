"""GATHER_ALIGN: what the host proves about the general index map's loads, so that
Triton issues vector copies through runs it cannot see aligned itself (14 pixels,
strides not divisible by 16). The hints change no value, so the kernels' CPU and GPU
correctness tests cover it; this checks the proof."""

from __future__ import annotations

import pytest
import torch

from gemmconv.kernels.patch_gemm import gather_alignment
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
