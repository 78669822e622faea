"""Patch class through an explicit column buffer whose reduction is padded to 16 bytes.

Hopper GEMM kernels need 16-byte aligned leading dimensions: with Kred = 588
(3x14x14) a bf16 GEMM ran 88 us, padded to 592 columns 31 us (H200). When the
column matrix is copied anyway, padding it costs nothing extra: the gather writes
zero columns, the weight gets the same zero columns (it is small), and the GEMM
runs on its fast kernels. Where the column matrix would be a zero-copy view
(point-output), the padded copy costs a pass over x that the faster GEMM may or may
not repay: this is a separate solver so that find (and the cost model) decide.

- forward:     Y = col_p[M, L] @ Wp[K, L]^T             (L = padded Kred)
- bwd-data:    dcol_p = dY @ Wp, its first Kred columns scattered into dx
- bwd-weights: dWp = dY^T @ col_p, its first Kred columns stored into dW

The gather and scatter here are torch copies through permuted views; the Triton
solver (triton_patch) replaces exactly those two steps.
"""

from __future__ import annotations

import math

import torch

from gemmconv.memory_format import Layout
from gemmconv.precision import reduction_mm
from gemmconv.problem import ConvProblem, Direction
from gemmconv.solvers.base import ConvTensors, Solver
from gemmconv.solvers.patch import (
    batched_gemm_is_unaligned,
    patch_class_reasons,
    patches,
    permute_slowdown,
)
from gemmconv.solvers.views import (
    batched_view,
    result_buffer,
    rows,
    rows_view,
    store_rows,
    store_weight_rows,
    weight_rows,
    zero_outside,
)


def padded_reduction(p: ConvProblem) -> int:
    """Kred rounded up so that a row of it is a multiple of 16 bytes."""
    per_16_bytes = max(1, 16 // p.element_size)
    return -(-p.gemm_k // per_16_bytes) * per_16_bytes


def padded_weight_rows(weight: torch.Tensor, layout: Layout, ld: int) -> torch.Tensor:
    """The weight as [K, ld] in the column order of ``layout``, zeros beyond Kred."""
    wm = weight_rows(weight, layout)
    if wm.shape[1] == ld:
        return wm
    wp = weight.new_zeros(wm.shape[0], ld)
    wp[:, : wm.shape[1]] = wm
    return wp


def covered_extent(p: ConvProblem) -> tuple[int, ...]:
    return tuple(o * r for o, r in zip(p.output_spatial, p.kernel))


class PaddedPatchSolver(Solver):
    id = "patch_padded"

    # ---- applicability ------------------------------------------------------

    def problem_reasons(self, p: ConvProblem) -> list[str]:
        reasons = patch_class_reasons(p)
        if not reasons and padded_reduction(p) == p.gemm_k:
            reasons.append(
                f"reduction {p.gemm_k} x {p.element_size} bytes is already 16-byte aligned"
            )
        return reasons

    def operand_elements(self, p: ConvProblem) -> dict[str, int]:
        return {**super().operand_elements(p), "column matrix": p.gemm_m * padded_reduction(p)}

    # ---- cost ---------------------------------------------------------------

    def permute_slowdown(self, p: ConvProblem) -> float:
        return permute_slowdown(p.device_type)

    def _col_bytes(self, p: ConvProblem) -> int:
        return p.gemm_m * padded_reduction(p) * p.element_size

    def _dy_rows_copied(self, p: ConvProblem) -> bool:
        # Channels-first dY with several pixels per sample is copied to rows for wgrad.
        return (
            p.direction is Direction.BACKWARD_WEIGHTS
            and p.layout is Layout.CHANNELS_FIRST
            and math.prod(p.output_spatial) > 1
        )

    def workspace_bytes(self, p: ConvProblem) -> int:
        ws = self._col_bytes(p)
        if self._dy_rows_copied(p):
            ws += p.gemm_m * p.k * p.element_size
        return ws

    def copied_bytes(self, p: ConvProblem) -> int:
        # The gather (or scatter) reads the patches once and writes the buffer once.
        moved = 2 * self._col_bytes(p) * self.permute_slowdown(p)
        if p.direction is Direction.BACKWARD_DATA:
            uncovered = math.prod(p.spatial) - math.prod(covered_extent(p))
            moved += uncovered * p.n * p.c * p.element_size
        if self._dy_rows_copied(p):
            moved += 2 * p.gemm_m * p.k * p.element_size * permute_slowdown(p.device_type)
        return int(moved)

    def gemm_launches(self, p: ConvProblem) -> int:
        return 2  # the gather or scatter, and the GEMM

    def gemm_is_aligned(self, p: ConvProblem) -> bool:
        return not batched_gemm_is_unaligned(p)  # the reduction is padded

    def estimate_ms(self, p: ConvProblem, rates=None) -> float:
        estimate = super().estimate_ms(p, rates)
        if p.device_type != "cuda":
            # The alignment cliff is a GPU GEMM property: on the CPU padding only
            # adds its copy, so never rank this ahead of the unpadded mapping there.
            from gemmconv.solvers.patch import PatchSolver

            estimate += PatchSolver().estimate_ms(p, rates)
        return estimate

    # ---- the two data movements (torch copies here) -------------------------

    def gather(self, x: torch.Tensor, p: ConvProblem, ld: int) -> torch.Tensor:
        """The column matrix [M, ld] of x, zeros in the padding columns."""
        col = x.new_empty(p.gemm_m, ld)
        if ld > p.gemm_k:
            col[:, p.gemm_k :].zero_()
        source = patches(x, p)
        col[:, : p.gemm_k].view(source.shape).copy_(source)
        return col

    def scatter(self, dcol: torch.Tensor, p: ConvProblem, dx: torch.Tensor) -> None:
        """Write the first Kred columns of dcol [M, ld] into dx's patch positions."""
        target = patches(dx, p)
        target.copy_(dcol[:, : p.gemm_k].view(target.shape))

    # ---- the three directions ----------------------------------------------

    def forward(self, p: ConvProblem, t: ConvTensors, out: torch.Tensor | None) -> torch.Tensor:
        x = t.input
        ld = padded_reduction(p)
        y = result_buffer(p, x, out)
        col = self.gather(x, p, ld)
        wp = padded_weight_rows(t.weight, p.layout, ld)
        if rows_view(y) is None and batched_view(y) is not None:
            # Channels-first y with several pixels per sample: Y^T per sample,
            # [K, L] @ [L, P], lands in y's own order; the weight is broadcast.
            pixels = math.prod(p.output_spatial)
            col3 = col.view(p.n, pixels, ld).transpose(1, 2)
            torch.bmm(wp.expand(p.n, *wp.shape), col3, out=batched_view(y))
            if t.bias is not None:
                y.add_(t.bias.view(1, -1, *([1] * p.dims)))
            return y
        store_rows(y, col, wp.t(), t.bias)
        return y

    def backward_data(
        self, p: ConvProblem, t: ConvTensors, out: torch.Tensor | None
    ) -> torch.Tensor:
        dy = t.grad_output
        ld = padded_reduction(p)
        dx = result_buffer(p, dy, out)
        zero_outside(dx, covered_extent(p))
        wp = padded_weight_rows(t.weight, p.layout, ld)
        dy_rows = rows_view(dy)
        if dy_rows is None:
            # Channels-first dY: the batched GEMM reads each sample's [K, P] transposed.
            dy3 = dy.reshape(p.n, p.k, -1)
            dcol = torch.bmm(dy3.transpose(1, 2), wp.expand(p.n, *wp.shape)).view(p.gemm_m, ld)
        else:
            dcol = torch.mm(dy_rows, wp)
        self.scatter(dcol, p, dx)
        return dx

    def backward_weights(
        self, p: ConvProblem, t: ConvTensors, out: torch.Tensor | None
    ) -> torch.Tensor:
        ld = padded_reduction(p)
        dw = result_buffer(p, t.input, out)
        col = self.gather(t.input, p, ld)
        dw_padded = reduction_mm(rows(t.grad_output).t(), col)
        store_weight_rows(dw, dw_padded[:, : p.gemm_k], p.layout)
        return dw
