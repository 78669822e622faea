"""The solver registry, in preference order: ties in the cost model go to the earlier."""

from __future__ import annotations

from gemmconv.solvers.base import ConvTensors, Solver
from gemmconv.solvers.im2col import Im2colSolver
from gemmconv.solvers.patch import (
    ImplicitPatchSolver,
    PaddedPatchSolver,
    PatchSolver,
    PointOutputSolver,
    TritonPatchSolver,
)
from gemmconv.solvers.pointwise import PointwiseSolver, StridedPointwiseSolver
from gemmconv.solvers.vendor import VendorSolver

SOLVERS: tuple[Solver, ...] = (
    PointOutputSolver(),
    # Ahead of patch: on a 1x1 stride-1 kernel, which both take, their costs can tie.
    PointwiseSolver(),
    StridedPointwiseSolver(),
    PatchSolver(),
    PaddedPatchSolver(),
    TritonPatchSolver(),
    ImplicitPatchSolver(),
    Im2colSolver(),
    VendorSolver(),
)

_BY_ID = {s.id: s for s in SOLVERS}


def solver_ids() -> list[str]:
    """Every solver's id, in registry order (the order that breaks ties)."""
    return [s.id for s in SOLVERS]


def get_solver(solver_id: str) -> Solver:
    """The solver with this id; ValueError naming every known id otherwise."""
    try:
        return _BY_ID[solver_id]
    except KeyError:
        raise ValueError(
            f"solver={solver_id!r}: unknown solver id; expected one of {', '.join(_BY_ID)}"
        ) from None


__all__ = ["SOLVERS", "ConvTensors", "Solver", "get_solver", "solver_ids"]
