"""The patch mapping: geometry and column order shared by every patch-class solver.

Patch class: stride == kernel, no padding, unit dilation, one group. Every input
element belongs to at most one patch, so the column matrix is a reordering of x:
viewed as [N, C, O1, R1, ..] (channels-first) or [N, O1, R1, .., C] (channels-last)
and permuted so that each row is one patch.

- forward:     Y[M, K] = col[M, Kred] @ Wm[K, Kred]^T (+ bias)
- bwd-data:    dcol = dY @ Wm, scattered back by the inverse permutation; the
  remainder S - O*R that no patch covers is exactly zero
- bwd-weights: dW = dY^T @ col

The column order, (c, r..) or (r.., c), follows the memory order of the large tensor
that is gathered or scattered: x in the forward and weight gradient, dx in
backward-data. That tensor is then read and written in runs of its own order; only
the small weight is flattened to match (a permuted copy of it is cheap).

Point-output (prod(O) == 1) with S == R is the case where the permutation is the
identity on memory: col is x itself, and dx is written in place by the GEMM.
"""

from __future__ import annotations

import math

import torch

from gemmconv.core import cached_zeros
from gemmconv.core.memory_format import Layout, output_layout
from gemmconv.core.problem import ConvProblem, Direction
from gemmconv.core.sizes import round_up
from gemmconv.solvers.views import weight_rows

VECTOR_BYTES = 16  # GEMM operand rows and vector loads want this alignment


def patch_class_reasons(p: ConvProblem) -> list[str]:
    """Why ``p`` is not a patch-class problem (empty when it is)."""
    reasons = []
    if p.stride != p.kernel:
        reasons.append(f"stride {p.stride} != kernel {p.kernel}")
    if any(p.padding):
        reasons.append(f"padding {p.padding} != 0")
    if any(d != 1 for d in p.dilation):
        reasons.append(f"dilation {p.dilation} != 1")
    if p.groups != 1:
        reasons.append(f"groups {p.groups} != 1")
    if any(o < 1 for o in p.output_spatial):
        reasons.append(f"output spatial size {p.output_spatial} is empty")
    return reasons


def covered_extent(p: ConvProblem) -> tuple[int, ...]:
    """Per spatial dimension, how many positions some patch covers (O * R)."""
    return tuple(o * r for o, r in zip(p.output_spatial, p.kernel))


def result_layout(p: ConvProblem) -> Layout:
    """The layout of y, dY and dx as a direction meets them (the one F.conv* gives)."""
    return output_layout(p.layout, p.dims, p.dtype, p.device_type)


def column_layout(p: ConvProblem) -> Layout:
    """The column order: the layout of x (forward, weight gradient) or dx (backward-data)."""
    if p.direction is Direction.BACKWARD_DATA:
        return result_layout(p)
    return p.input_layout


def channels_last_columns(p: ConvProblem) -> bool:
    return column_layout(p) is Layout.CHANNELS_LAST


def patches(t: torch.Tensor, p: ConvProblem) -> torch.Tensor:
    """``t`` [N, C, S..] as a view [N, O1..Od, <patch>] where <patch> is (C, R1..Rd) or
    (R1..Rd, C), in the problem's column order. The remainder beyond O*R is cropped
    away, never read."""
    return patch_view(t, p.output_spatial, p.kernel, channels_last_columns(p))


def patch_view(
    t: torch.Tensor, outputs: tuple[int, ...], kernel: tuple[int, ...], channels_last: bool
) -> torch.Tensor:
    """``patches`` from the geometry alone: ``outputs`` patches of ``kernel`` a side,
    the patch's elements in (R1..Rd, C) order where ``channels_last``, else (C, R1..Rd)."""
    n, c = t.shape[:2]
    d = len(kernel)
    crop = tuple(slice(0, o * r) for o, r in zip(outputs, kernel))
    split = [v for o, r in zip(outputs, kernel) for v in (o, r)]
    if channels_last:
        view = t.movedim(1, -1)[(slice(None), *crop)].view(n, *split, c)
        order = (0, *(1 + 2 * i for i in range(d)), *(2 + 2 * i for i in range(d)), 2 * d + 1)
    else:
        view = t[(slice(None), slice(None), *crop)].view(n, c, *split)
        order = (0, *(2 + 2 * i for i in range(d)), 1, *(3 + 2 * i for i in range(d)))
    return view.permute(order)


def patches_are_views(p: ConvProblem) -> bool:
    """Whether the column matrix is x's (or dx's) own memory: one patch per sample and
    nothing cropped (the column order is that memory's order)."""
    return math.prod(p.output_spatial) == 1 and p.spatial == p.kernel


def transposed_pixels(p: ConvProblem) -> int:
    """Pixels per sample where y or dY is channels-first with several of them, so that
    each sample's [K, P] block meets the GEMM (whose rows are pixels) transposed; else 0."""
    pixels = math.prod(p.output_spatial)
    return pixels if result_layout(p) is Layout.CHANNELS_FIRST and pixels > 1 else 0


def batched_gemm_is_unaligned(p: ConvProblem) -> bool:
    """Whether the channels-first per-sample bmm (Y^T = W @ col^T into y, or dcol =
    dY^T @ W) has a leading dimension of P pixels that is not a multiple of 16 bytes:
    cuBLAS then runs its slow kernels (ViT-B/16, P = 196: 0.35 ms against 0.09 ms for
    the aligned GEMM on an H200, bench/results/h200_levers_layouts_run1.json)."""
    pixels = transposed_pixels(p)
    return (
        pixels > 0
        and p.direction in (Direction.FORWARD, Direction.BACKWARD_DATA)
        and (pixels * p.element_size) % VECTOR_BYTES != 0
    )


def padded_reduction(p: ConvProblem) -> int:
    """Kred rounded up so that a row of it is a multiple of 16 bytes.

    Hopper GEMM kernels need 16-byte aligned leading dimensions: with Kred = 588
    (3x14x14) a bf16 GEMM ran 88 us, padded to 592 columns 31 us (H200)."""
    per_vector = max(1, VECTOR_BYTES // p.element_size)
    return round_up(p.gemm_k, per_vector)


def padded_weight_rows(weight: torch.Tensor, layout: Layout, ld: int) -> torch.Tensor:
    """The weight as [K, ld] in the column order of ``layout``, zeros beyond Kred."""
    wm = weight_rows(weight, layout)
    if wm.shape[1] == ld:
        return wm
    # One kernel: F.pad would launch two (cached_zeros).
    return torch.cat([wm, cached_zeros.zeros((wm.shape[0], ld - wm.shape[1]), wm)], dim=1)
