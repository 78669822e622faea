"""patch_padded: the patch mapping with the reduction padded to 16 bytes, against float64."""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch

from gemmconv import ConvProblem, Direction, Layout
from gemmconv.solvers import get_solver
from gemmconv.solvers.patch import padded_reduction, padded_weight_rows

from solver_cases import Geometry, case_id, check_case, problem_for

# C = 3 with odd kernels: Kred is odd in 1-D, 2-D and 3-D, unaligned in every dtype.
GEOMETRIES = [
    Geometry("remainder", spatial=(11, 7, 8), kernel=(5, 3, 3), stride=(5, 3, 3), c=3),
    Geometry("point", spatial=(5, 3, 3), kernel=(5, 3, 3), stride=(5, 3, 3), c=3),
    Geometry("point_cropped", spatial=(7, 4, 5), kernel=(5, 3, 3), stride=(5, 3, 3), c=3),
]
SOLVER = get_solver("patch_padded")
CASES = [
    (SOLVER, g, dims, layout, dtype, direction)
    for g, dims, layout, dtype, direction in itertools.product(
        GEOMETRIES,
        (1, 2, 3),
        list(Layout),
        (torch.float32, torch.float16, torch.bfloat16),
        list(Direction),
    )
]


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_patch_padded_matches_float64_reference(case):
    check_case(case, "cpu", seed=zlib.crc32(case_id(case).encode()))


def test_padding_reaches_the_next_16_byte_multiple():
    p = ConvProblem.from_sizes(2, 3, 8, (14, 14), 14, 14, dtype=torch.bfloat16)
    assert (p.gemm_k, padded_reduction(p)) == (588, 592)
    assert padded_reduction(ConvProblem.from_sizes(2, 3, 8, (14, 14), 14, 14)) == 588
    p3 = ConvProblem.from_sizes(2, 3, 8, (5,), 5, 5, dtype=torch.float16)
    assert (p3.gemm_k, padded_reduction(p3)) == (15, 16)


@pytest.mark.parametrize("layout", list(Layout))
def test_padded_weight_has_zero_columns_in_the_layouts_order(layout):
    w = torch.rand(4, 3, 5, 3) + 0.5
    wp = padded_weight_rows(w, layout, 48)
    assert wp.shape == (4, 48)
    assert torch.equal(wp[:, 45:], torch.zeros(4, 3))
    order = w if layout is Layout.CHANNELS_FIRST else w.movedim(1, -1)
    assert torch.equal(wp[:, :45], order.reshape(4, 45))


def test_aligned_reduction_is_left_to_the_plain_patch_solver():
    g = Geometry("aligned", spatial=(8, 4), kernel=(4, 2), stride=(4, 2), c=4)
    p = problem_for(g, 2, Layout.CHANNELS_FIRST, torch.float32, "cpu", Direction.FORWARD)
    assert any("already 16-byte aligned" in r for r in SOLVER.not_supported_reasons(p))


def test_on_the_cpu_padding_never_ranks_ahead_of_the_unpadded_mapping():
    for g in GEOMETRIES:
        for direction in Direction:
            p = problem_for(g, 2, Layout.CHANNELS_LAST, torch.float32, "cpu", direction)
            assert SOLVER.estimate_ms(p) > get_solver("patch").estimate_ms(p)
