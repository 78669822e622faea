"""The solver matrix on the CPU: every registered solver, in every spatial dimension,
layout, dtype and direction it declares, against float64 and the vendor; and the
matrix itself, which must hold every registered solver (tests/solver_cases.py says
how the cases are generated)."""

from __future__ import annotations

import zlib

import pytest

from gemmconv.solvers import SOLVERS, get_solver, solver_ids

from solver_cases import (
    case_id,
    check_case,
    full_product_first,
    interpreted,
    matrix_dtypes,
    solver_cases,
    solver_matrix,
)

CPU_CASES = solver_matrix("cpu")


@pytest.mark.parametrize("case", CPU_CASES, ids=[case_id(c) for c in CPU_CASES])
def test_solver_matches_float64_reference(case, monkeypatch):
    solver = case[0]
    if interpreted(solver):
        # Declared for CUDA only; on the CPU its kernels run in Triton's interpreter.
        monkeypatch.setattr(type(solver), "devices", solver.devices | {"cpu"})
    check_case(case, "cpu", seed=zlib.crc32(case_id(case).encode()))


def test_the_cpu_matrix_holds_every_registered_solver():
    assert [s for s in solver_ids() if not solver_cases(get_solver(s), "cpu")] == []
    ids = [case_id(c) for c in CPU_CASES]
    assert len(set(ids)) == len(ids)
    assert all(i.startswith(f"{c[0].id}-") for i, c in zip(ids, CPU_CASES))


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
@pytest.mark.parametrize("solver", SOLVERS, ids=lambda s: s.id)
def test_every_declared_capability_has_cases(solver, device_type):
    """On each device a solver declares (and on the CPU for an interpreted one), its
    cases cover every spatial dimension, layout, dtype and direction it declares, all
    together on its first geometry (on the CPU at least)."""
    cases = solver_cases(solver, device_type)
    if device_type not in solver.devices and not (device_type == "cpu" and interpreted(solver)):
        assert cases == []
        return
    assert cases, f"{solver.id} declares {device_type} but the matrix has no case for it"
    declared = {
        3: set(solver.spatial_dims),
        4: set(solver.layouts),
        5: set(matrix_dtypes(solver, device_type)),
        6: set(solver.directions),
    }
    for position, values in declared.items():
        assert {c[position] for c in cases} == values, (solver.id, position)
    if not full_product_first(solver, device_type):
        return
    first = cases[0][2]
    full = {c[3:] for c in cases if c[2] == first}
    assert len(full) == len(solver.spatial_dims) * len(solver.layouts) * len(
        matrix_dtypes(solver, device_type)
    ) * len(solver.directions), f"{solver.id}: the first geometry misses a combination"
