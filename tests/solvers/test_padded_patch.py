"""patch_padded: the padding itself and where the solver stands aside. Its results against
float64 are checked by the solver matrix (test_solver_matrix.py)."""

from __future__ import annotations

import pytest
import torch

from gemmconv import ConvProblem, Direction, Layout
from gemmconv.solvers import get_solver
from gemmconv.solvers.patch import padded_reduction, padded_weight_rows

from solver_cases import GEOMETRIES, Geometry, problem_for

SOLVER = get_solver("patch_padded")


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
    unaligned = [g for geometries in GEOMETRIES.values() for g in geometries if g.c == 3]
    assert unaligned
    for g in unaligned:
        for direction in Direction:
            p = problem_for(g, 2, Layout.CHANNELS_LAST, torch.float32, "cpu", direction)
            assert SOLVER.estimate_ms(p) > get_solver("patch").estimate_ms(p)
