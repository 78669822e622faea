"""The base of every patch-class solver: the applicability rule they share."""

from __future__ import annotations

from typing import ClassVar

from gemmconv.core.problem import ConvProblem
from gemmconv.kernels import triton_available
from gemmconv.solvers.base import Solver
from gemmconv.solvers.patch.mapping import patch_class_reasons


class PatchFamilySolver(Solver):
    # Whether its kernels are Triton's (refused where triton is not installed).
    needs_triton: ClassVar[bool] = False

    def problem_reasons(self, p: ConvProblem) -> list[str]:
        reasons = patch_class_reasons(p)
        if not reasons:
            reasons = self.strategy_reasons(p)
        if self.needs_triton and not triton_available():
            reasons.append("triton is not installed")
        return reasons

    def strategy_reasons(self, p: ConvProblem) -> list[str]:
        """What the solver's own strategy rejects in a patch-class problem."""
        return []
