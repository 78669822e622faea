"""The cost terms every patch solver shares: the bytes its copies move and how fast
torch moves them; a strategy's own factors stand beside it (columns.py, rows_path.py,
implicit.py)."""

from __future__ import annotations

import math

from gemmconv.core.memory_format import Layout
from gemmconv.core.problem import ConvProblem
from gemmconv.solvers.patch.mapping import column_layout, covered_extent

# torch's copy through a permuted patch view ran 1.2 TB/s on an H200 against 3.8 TB/s
# for a plain copy of the same bytes; on the CPU no such gap was seen.
TORCH_PERMUTE_SLOWDOWN = {"cuda": 3.0, "cpu": 1.0}


def torch_permute_slowdown(device_type: str) -> float:
    return TORCH_PERMUTE_SLOWDOWN.get(device_type, 1.0)


def gathered_run_bytes(p: ConvProblem) -> int:
    """Bytes of one contiguous run of a patch row in memory: a kernel row in the
    channels-first column order, a kernel row of all channels in the channels-last one."""
    run = p.kernel[-1] * p.element_size
    if column_layout(p) is Layout.CHANNELS_LAST:
        run *= p.c
    return run


def uncovered_bytes(p: ConvProblem) -> int:
    """Bytes of dx that no patch covers: backward-data zero-fills them."""
    uncovered = math.prod(p.spatial) - math.prod(covered_extent(p))
    return uncovered * p.n * p.c * p.element_size


def output_rows_bytes(p: ConvProblem) -> int:
    """Bytes of y or dY as [M, K] rows."""
    return p.gemm_m * p.k * p.element_size
