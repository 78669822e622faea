"""Every solver x direction x dims x layout x dtype it declares, on the CPU, against float64."""

from __future__ import annotations

import zlib

import pytest

from solver_cases import case_id, check_case, solver_matrix

CPU_CASES = solver_matrix("cpu")


@pytest.mark.parametrize("case", CPU_CASES, ids=[case_id(c) for c in CPU_CASES])
def test_solver_matches_float64_reference(case):
    check_case(case, "cpu", seed=zlib.crc32(case_id(case).encode()))


def test_matrix_covers_every_declared_capability():
    ids = {case[0].id for case in CPU_CASES}
    assert ids == {"point_output", "patch", "pointwise", "strided_pointwise", "im2col", "vendor"}
    dims = {case[2] for case in CPU_CASES}
    assert dims == {1, 2, 3}
    assert len(CPU_CASES) > 500
