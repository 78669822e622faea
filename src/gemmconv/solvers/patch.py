"""Patch class (stride == kernel, no padding, unit dilation): im2col is a permutation.

Every input element belongs to at most one patch, so the column matrix is a
reordering of x: viewed as [N, O1, R1, .., Od, Rd, C] (channels-last) or
[N, C, O1, R1, ..] (channels-first) and permuted so each row is one patch. The
column order follows the layout, (c, r..) or (r.., c), so the large operand is
read in its own order and only the small weight is permuted.

- forward:  Y[M, K] = col[M, Kred] @ Wm[K, Kred]^T (+ bias)
- bwd-data: dcol = dY @ Wm, scattered back by the inverse permutation; the
  remainder S - O*R that no patch covers is exactly zero
- bwd-weights: dW = dY^T @ col

Point-output (prod(O) == 1) is the case where, with S == R, the permutation is the
identity on memory: col is x itself, and dx is written in place by the GEMM.
"""

from __future__ import annotations

import math

import torch

from gemmconv.memory_format import Layout
from gemmconv.precision import reduction_mm
from gemmconv.problem import ConvProblem, Direction
from gemmconv.solvers.base import ConvTensors, Solver
from gemmconv.solvers.views import (
    batched_view,
    result_buffer,
    rows,
    rows_view,
    store_rows,
    store_weight_rows,
    try_view,
    weight_rows,
    weight_rows_target,
    zero_outside,
)

# torch's copy through a permuted patch view ran 1.2 TB/s on an H200 against 3.8 TB/s
# for a plain copy of the same bytes (DESIGN.md §7); on the CPU no such gap was seen.
TORCH_PERMUTE_SLOWDOWN = {"cuda": 3.0, "cpu": 1.0}


def permute_slowdown(device_type: str) -> float:
    return TORCH_PERMUTE_SLOWDOWN.get(device_type, 1.0)


def patch_class_reasons(p: ConvProblem) -> list[str]:
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


def patches(t: torch.Tensor, p: ConvProblem) -> torch.Tensor:
    """``t`` [N, C, S..] as a view [N, O1..Od, <patch>] where <patch> is (C, R1..Rd) for a
    channels-first problem and (R1..Rd, C) for channels-last. The remainder beyond
    O*R is cropped away, never read."""
    n, c = t.shape[:2]
    d = p.dims
    outs, kernel = p.output_spatial, p.kernel
    crop = tuple(slice(0, o * r) for o, r in zip(outs, kernel))
    split = [v for o, r in zip(outs, kernel) for v in (o, r)]
    if p.layout is Layout.CHANNELS_FIRST:
        view = t[(slice(None), slice(None), *crop)].view(n, c, *split)
        order = (0, *(2 + 2 * i for i in range(d)), 1, *(3 + 2 * i for i in range(d)))
    else:
        view = t.movedim(1, -1)[(slice(None), *crop)].view(n, *split, c)
        order = (0, *(1 + 2 * i for i in range(d)), *(2 + 2 * i for i in range(d)), 2 * d + 1)
    return view.permute(order)


def batched_gemm_is_unaligned(p: ConvProblem) -> bool:
    """Whether the channels-first per-sample bmm (Y^T = W @ col^T into y, or dcol =
    dY^T @ W) has a leading dimension of P pixels that is not a multiple of 16 bytes:
    cuBLAS then runs its slow kernels (ViT-B/16, P = 196: 0.35 ms against 0.09 ms for
    the aligned GEMM on an H200, bench/results/h200_levers_layouts_run1.json)."""
    pixels = math.prod(p.output_spatial)
    return (
        p.layout is Layout.CHANNELS_FIRST
        and pixels > 1
        and p.direction in (Direction.FORWARD, Direction.BACKWARD_DATA)
        and (pixels * p.element_size) % 16 != 0
    )


def patches_are_views(p: ConvProblem) -> bool:
    """Whether the column matrix is x's own memory (no gather): one patch per sample
    and nothing cropped, in either layout."""
    return math.prod(p.output_spatial) == 1 and p.spatial == p.kernel


class PatchSolver(Solver):
    id = "patch"

    def problem_reasons(self, p: ConvProblem) -> list[str]:
        return patch_class_reasons(p)

    # ---- cost ---------------------------------------------------------------

    def _col_bytes(self, p: ConvProblem) -> int:
        return 0 if patches_are_views(p) else p.gemm_m * p.gemm_k * p.element_size

    def _dy_rows_copied(self, p: ConvProblem) -> bool:
        # rows() copies a channels-first dY only when a sample has several output
        # pixels; with one, [N, K, 1...] is already [N, K] rows (point 3D channels-first
        # weight gradient ran 0.044 ms on an H200, as fast as its forward).
        return (
            p.direction is Direction.BACKWARD_WEIGHTS
            and p.layout is Layout.CHANNELS_FIRST
            and math.prod(p.output_spatial) > 1
        )

    def workspace_bytes(self, p: ConvProblem) -> int:
        extra = 0
        if self._dy_rows_copied(p):
            extra = p.gemm_m * p.k * p.element_size  # dY to rows order
        return self._col_bytes(p) + extra

    def copied_bytes(self, p: ConvProblem) -> int:
        # A gather or scatter reads and writes the column buffer once each, through a
        # permuted view (slower than a plain copy on a GPU).
        slowdown = permute_slowdown(p.device_type)
        moved = 2 * self._col_bytes(p) * slowdown
        if p.direction is Direction.BACKWARD_DATA:
            covered = math.prod(o * r for o, r in zip(p.output_spatial, p.kernel))
            moved += (math.prod(p.spatial) - covered) * p.n * p.c * p.element_size
        if self._dy_rows_copied(p):
            moved += 2 * p.gemm_m * p.k * p.element_size * slowdown
        return int(moved)

    def gemm_is_aligned(self, p: ConvProblem) -> bool:
        return super().gemm_is_aligned(p) and not batched_gemm_is_unaligned(p)

    # ---- the three directions ----------------------------------------------

    def forward(self, p: ConvProblem, t: ConvTensors, out: torch.Tensor | None) -> torch.Tensor:
        x, w = t.input, t.weight
        y = result_buffer(p, x, out)
        col = patches(x, p).reshape(p.gemm_m, p.gemm_k)
        wm = weight_rows(w, p.layout)
        if rows_view(y) is None and batched_view(y) is not None:
            # Channels-first y with several pixels per sample: compute Y^T per sample,
            # [K, Kred] @ [Kred, P], so the result lands in y's own order.
            pixels = math.prod(p.output_spatial)
            col3 = col.view(p.n, pixels, p.gemm_k).transpose(1, 2)
            torch.bmm(wm.expand(p.n, *wm.shape), col3, out=batched_view(y))
            if t.bias is not None:
                y.add_(t.bias.view(1, -1, *([1] * p.dims)))
            return y
        store_rows(y, col, wm.t(), t.bias)
        return y

    def backward_data(
        self, p: ConvProblem, t: ConvTensors, out: torch.Tensor | None
    ) -> torch.Tensor:
        dy, w = t.grad_output, t.weight
        dx = result_buffer(p, dy, out)
        zero_outside(dx, tuple(o * r for o, r in zip(p.output_spatial, p.kernel)))
        wm = weight_rows(w, p.layout)
        target = patches(dx, p)
        dy_rows = rows_view(dy)
        if dy_rows is None:
            # Channels-first dY: a batched GEMM reads each sample's [K, P] block
            # transposed, so dY is not copied.
            dy3 = dy.reshape(p.n, p.k, -1)
            dcol = torch.bmm(dy3.transpose(1, 2), wm.expand(p.n, *wm.shape))
            target.copy_(dcol.view(target.shape))
            return dx
        target_rows = try_view(target, p.gemm_m, p.gemm_k)
        if target_rows is not None:
            torch.mm(dy_rows, wm, out=target_rows)  # in place: no column buffer
        else:
            target.copy_(torch.mm(dy_rows, wm).view(target.shape))
        return dx

    def backward_weights(
        self, p: ConvProblem, t: ConvTensors, out: torch.Tensor | None
    ) -> torch.Tensor:
        dy, x = t.grad_output, t.input
        dw = result_buffer(p, x, out)
        col = patches(x, p).reshape(p.gemm_m, p.gemm_k)
        dy_rows = rows(dy)
        target = weight_rows_target(dw, p.layout)
        if target is not None:
            reduction_mm(dy_rows.t(), col, out=target)
        else:
            store_weight_rows(dw, reduction_mm(dy_rows.t(), col), p.layout)
        return dw


class PointOutputSolver(PatchSolver):
    """The patch mapping restricted to one output pixel per sample (x spatial in
    [R, 2R-1]). With x spatial == R it runs with no copy in any direction: col and
    dx are x's and dx's own memory viewed as [N, Kred]."""

    id = "point_output"

    def problem_reasons(self, p: ConvProblem) -> list[str]:
        reasons = super().problem_reasons(p)
        if not reasons and math.prod(p.output_spatial) != 1:
            reasons.append(
                f"output spatial {p.output_spatial} is not all ones "
                f"(input {p.spatial} not within [kernel, 2*kernel-1])"
            )
        return reasons
