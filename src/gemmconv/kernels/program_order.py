"""The grouped program order the tiled GEMM kernels share."""

from __future__ import annotations

import triton.language as tl

from gemmconv.kernels.patch_index import DeviceHelper


def _grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  GROUP_M: tl.constexpr):  # fmt: skip
    """The (row tile, column tile) of program ``pid`` over an [M, N] output, taken in
    groups of GROUP_M row tiles so that consecutive programs share the same column
    tiles of the right-hand operand in L2."""
    tiles_m = (M + BLOCK_M - 1) // BLOCK_M  # not tl.cdiv: a jit helper the interpreter lacks
    tiles_n = (N + BLOCK_N - 1) // BLOCK_N
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.where(tiles_m - first_m < GROUP_M, tiles_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_rows, (pid % per_group) // group_rows


grouped_tile = DeviceHelper(_grouped_tile)
