"""Patch class with the permutation done by one Triton pass (gemmconv.kernels.patch_permute).

The same mapping as patch_padded (column buffer padded to a 16-byte reduction, one
cuBLAS GEMM), but the gather x -> col and the scatter dcol -> dx each run as one
kernel that reads through x's strides and writes the dense side in full rows, with
the zero padding written in the same pass. torch's copy through a permuted view
ran at 1.2 TB/s on an H200, a third of a plain copy; this kernel aims at the copy rate.
Padding is applied only when the reduction is unaligned; aligned problems (ViT-B/16,
Kred = 768) still gain the faster gather.
"""

from __future__ import annotations

import torch

from gemmconv.kernels import triton_available
from gemmconv.memory_format import Layout
from gemmconv.problem import ConvProblem, Direction
from gemmconv.solvers.padded_patch import PaddedPatchSolver
from gemmconv.solvers.patch import patch_class_reasons

# Cost of the kernel's pass relative to a plain device copy of the same bytes: the
# strided side is read in short runs (R elements), so allow a quarter more time.
TRITON_PERMUTE_SLOWDOWN = 1.25
# Its scatter (backward-data), when the contiguous run of a patch row (R elements
# channels-first, R*C channels-last) is not a whole number of 16-byte vectors, stores
# element by element. On an H200 (bench/results/h200.json, torch 2.11) it moved about
# 280 GB/s channels-first, 15x behind a plain copy (point 2D/3D and ConvNeXt downsample
# backward-data rows), and about 1 TB/s channels-last, 4x (point 2D, 84-byte runs);
# fitted to those rows.
TRITON_UNALIGNED_SCATTER_SLOWDOWN = {Layout.CHANNELS_FIRST: 15.0, Layout.CHANNELS_LAST: 4.0}
VECTOR_BYTES = 16


class TritonPatchSolver(PaddedPatchSolver):
    id = "patch_triton"
    devices = frozenset({"cuda"})

    def problem_reasons(self, p: ConvProblem) -> list[str]:
        reasons = patch_class_reasons(p)
        if all(r == 1 for r in p.kernel):
            # A 1x1 "patch" is the pointwise solvers' job; and the one failing case the
            # H200 property test found for this solver (1-D, kernel 1, channels-last
            # backward-data left non-finite values) is in this regime, not yet triaged.
            reasons.append(f"kernel {p.kernel} is 1x1 (pointwise solvers cover it)")
        if not triton_available():
            reasons.append("triton is not installed")
        return reasons

    def permute_slowdown(self, p: ConvProblem) -> float:
        if p.direction is Direction.BACKWARD_DATA:
            run = p.kernel[-1] * p.element_size
            if p.layout is Layout.CHANNELS_LAST:
                run *= p.c
            if run % VECTOR_BYTES:
                return TRITON_UNALIGNED_SCATTER_SLOWDOWN[p.layout]
        return TRITON_PERMUTE_SLOWDOWN

    def gather(self, x: torch.Tensor, p: ConvProblem, ld: int) -> torch.Tensor:
        from gemmconv.kernels.patch_permute import gather_patches

        col = x.new_empty(p.gemm_m, ld)
        channels_last = p.layout is Layout.CHANNELS_LAST
        return gather_patches(x, p.output_spatial, p.kernel, channels_last, out=col)

    def scatter(self, dcol: torch.Tensor, p: ConvProblem, dx: torch.Tensor) -> None:
        from gemmconv.kernels.patch_permute import scatter_patches

        channels_last = p.layout is Layout.CHANNELS_LAST
        scatter_patches(dcol, p.output_spatial, p.kernel, channels_last, dx)
