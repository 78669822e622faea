"""The measured cost terms of the patch family: how fast its copies and kernels run
relative to a plain device copy or cuBLAS, and the byte counts they apply to.

Every factor here was fitted to H200 measurements (the files named with it); the
solvers combine them with the device's rates (gemmconv.device_rates).
"""

from __future__ import annotations

import math

from gemmconv.memory_format import Layout
from gemmconv.problem import ConvProblem
from gemmconv.solvers.patch.mapping import column_layout, covered_extent

# torch's copy through a permuted patch view ran 1.2 TB/s on an H200 against 3.8 TB/s
# for a plain copy of the same bytes; on the CPU no such gap was seen.
TORCH_PERMUTE_SLOWDOWN = {"cuda": 3.0, "cpu": 1.0}

# The Triton permutation pass (kernels/patch_permute.py) against a plain copy: the
# strided side is read in short runs (R elements), so allow a quarter more time.
TRITON_PERMUTE_SLOWDOWN = 1.25
# Its scatter (backward-data), when the contiguous run of a patch row is not a whole
# number of 16-byte vectors, stores element by element. On an H200
# (bench/results/h200.json, torch 2.11) it moved about 280 GB/s in the channels-first
# column order, 15x behind a plain copy (point 2D/3D and ConvNeXt downsample
# backward-data rows), and about 1 TB/s in the channels-last one, 4x (point 2D,
# 84-byte runs); fitted to those rows.
TRITON_UNALIGNED_SCATTER_SLOWDOWN = {Layout.CHANNELS_FIRST: 15.0, Layout.CHANNELS_LAST: 4.0}
# Point-output rows copied as 8-byte words (pad_rows): 22.4 MB in 11 us on an H200,
# about 2 TB/s against 4.2 for a plain copy (bench/results/h200_levers_layouts_run1.json).
WORD_COPY_SLOWDOWN = 2.0
# The tiled transpose kernel (kernels/strided_copy.py) against a plain copy.
TRANSPOSE_SLOWDOWN = 1.25

# Fraction of cuBLAS's matrix rate the implicit Triton GEMM with gathered A loads
# reaches on long contiguous runs and a 16-byte-aligned reduction: 0.47-0.54 on an
# H200 (bench/results/h200.json, torch 2.11: ViT-B/16, SAM ViT-H and VideoMAE
# channels-last forward, 0.14-0.18 ms for 0.08 ms of cuBLAS-rate flops); fitted to
# those rows. An unaligned reduction costs the device's unaligned_slowdown as for
# cuBLAS (masked tails, no 16-byte loads: CLIP-L/14 and point 2D, C*R = 588, ran
# 0.13-0.16).
IMPLICIT_GEMM_EFFICIENCY = 0.5
# The split weight-gradient kernel reached 3-4% of the bf16 matrix rate on an H200
# (same file: ViT-B/16 1.73 ms, CLIP-L/14 3.83 ms, point 3D 1.22 ms for 0.04-0.11 ms
# of cuBLAS-rate flops); fitted to those rows.
IMPLICIT_WGRAD_EFFICIENCY = 0.035
# Gathered loads reached the rates above only on contiguous runs of this many bytes;
# shorter runs waste the rest of each memory transaction. Fitted to the same file:
# channels-first rows (runs of R bytes) ran at 0.3-0.6x of their channels-last twins
# (runs of R*C), ViT-B/16 (32-byte runs) at 0.6x, DiT-XL/2 (4-byte runs) at 0.5x.
FULL_RATE_RUN_BYTES = 64
# The implicit forward stores the output tile by tile at about 1.4 TB/s on an H200,
# 3x slower than a plain copy (bench/results/h200.json, torch 2.11: DiT-XL/2
# channels-last forward wrote its 151 MB output in 0.105 ms); fitted to that row.
IMPLICIT_OUTPUT_STORE_SLOWDOWN = 3.0


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
