"""The patch-class solvers (stride == kernel, no padding): one mapping, several strategies.

- mapping.py: the geometry, the column order and the patches view every solver shares
- cost.py: the measured cost terms of the family
- columns.py: column sources (a view of x, torch's copy, the Triton pass)
- rows_path.py: channels-first y or dY through a row-major GEMM and a transpose
- family.py, column_gemm.py, implicit.py: the solver bases
- solvers.py: the registered solvers, each a choice of strategies
"""

from __future__ import annotations

from gemmconv.solvers.patch.column_gemm import ChannelsFirst
from gemmconv.solvers.patch.cost import torch_permute_slowdown
from gemmconv.solvers.patch.mapping import (
    column_layout,
    covered_extent,
    padded_reduction,
    padded_weight_rows,
    patch_class_reasons,
    patches,
)
from gemmconv.solvers.patch.solvers import (
    ImplicitPatchSolver,
    PaddedPatchSolver,
    PatchSolver,
    PointOutputSolver,
    TritonPatchSolver,
)

__all__ = [
    "ChannelsFirst",
    "ImplicitPatchSolver",
    "PaddedPatchSolver",
    "PatchSolver",
    "PointOutputSolver",
    "TritonPatchSolver",
    "column_layout",
    "covered_extent",
    "padded_reduction",
    "padded_weight_rows",
    "patch_class_reasons",
    "patches",
    "torch_permute_slowdown",
]
