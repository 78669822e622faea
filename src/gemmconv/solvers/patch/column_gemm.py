"""Patch solvers with a column matrix and one cuBLAS GEMM per direction.

A solver here declares three strategies and this class derives the three directions
and their cost from them:

- ``columns``: where the column matrix comes from (columns.py: a view of x where its
  memory allows, torch's copy, or the Triton pass);
- ``pads_reduction``: whether the column matrix and the weight get zero columns up to
  a 16-byte row (padded_reduction), which keeps the GEMM on its fast kernels;
- ``channels_first``: how a channels-first y or dY with several pixels per sample
  meets the GEMM, whose rows are pixels (ChannelsFirst).
"""

from __future__ import annotations

import enum
from typing import ClassVar

import torch

from gemmconv.core.precision import reduction_mm
from gemmconv.core.problem import ConvProblem, Direction
from gemmconv.solvers.base import ConvTensors
from gemmconv.solvers.invariant import (
    aligned_width,
    cpu_sample_products,
    cuda_rows_chunk,
    store_invariant_rows,
    store_invariant_samples,
)
from gemmconv.solvers.patch import prepared, rows_path
from gemmconv.solvers.patch.columns import ColumnSource
from gemmconv.solvers.patch.cost import output_rows_bytes, torch_permute_slowdown, uncovered_bytes
from gemmconv.solvers.patch.family import PatchFamilySolver
from gemmconv.solvers.patch.mapping import (
    VECTOR_BYTES,
    batched_gemm_is_unaligned,
    column_layout,
    covered_extent,
    padded_reduction,
    padded_weight_rows,
    patches,
    transposed_pixels,
)
from gemmconv.solvers.views import (
    batched_view,
    result_buffer,
    rows,
    rows_view,
    store_batched,
    store_rows,
    store_weight_rows,
    weight_rows_target,
    zero_outside,
)


class ChannelsFirst(enum.Enum):
    # Each sample's [K, P] block through a batched GEMM: Y^T = W @ col^T straight into
    # y's own order, dY read transposed; the weight gradient copies dY to rows (torch).
    BATCHED = "batched"
    # One row-major GEMM and the tiled transpose kernel, where the batched GEMM's
    # leading dimension would be unaligned, and for the weight gradient (rows_path.py).
    ROWS = "rows"


class ColumnGemmSolver(PatchFamilySolver):
    columns: ClassVar[ColumnSource]
    pads_reduction: ClassVar[bool] = False
    channels_first: ClassVar[ChannelsFirst] = ChannelsFirst.BATCHED
    weight_gradient_multiplies_columns = True

    def reduction_width(self, p: ConvProblem) -> int:
        """Columns of the column matrix and the weight rows the GEMM reads (ld)."""
        return padded_reduction(p) if self.pads_reduction else p.gemm_k

    def gathers_columns(self, p: ConvProblem) -> bool:
        """Whether its column matrix for ``p`` is a copy of x's patches, not x's own memory
        seen as that matrix."""
        return self.columns.buffer_bytes(p, self.reduction_width(p)) > 0

    def cuda_invariance_reasons(self, p: ConvProblem) -> list[str]:
        # On CUDA a 1x1 kernel's invariant form is the pointwise solvers' (per sample,
        # for a channels-first y): the column solvers, which also take a 1x1 stride-1
        # kernel, stand aside so that one family's bits serve every batch size.
        reasons = super().cuda_invariance_reasons(p)
        if all(r == 1 for r in p.kernel):
            reasons.append("a 1x1 kernel's batch-invariant form on CUDA is the pointwise solvers'")
        return reasons

    def uses_rows_path(self, p: ConvProblem) -> bool:
        if self._invariant_on_cuda(p):
            return False  # the invariant GEMM's rows and one transpose instead
        return self.channels_first is ChannelsFirst.ROWS and rows_path.applies(p)

    def _invariant_on_cuda(self, p: ConvProblem) -> bool:
        return p.device_type == "cuda" and self.runs_invariant(p)

    def _invariant_extra_bytes(self, p: ConvProblem) -> int:
        """What the invariant forward on CUDA copies beyond the gather: columns short of
        the GEMM's aligned rows into them, and a channels-first y from rows."""
        moved = 0
        kp = aligned_width(p.gemm_k, p.dtype)
        if self.reduction_width(p) != kp:
            moved += 2 * p.gemm_m * kp * p.element_size
        if transposed_pixels(p) > 0:
            moved += 2 * output_rows_bytes(p) * rows_path.TRANSPOSE_SLOWDOWN
        return int(moved)

    def _dy_rows_copied(self, p: ConvProblem) -> bool:
        # The weight gradient copies a channels-first dY to rows only when a sample has
        # several output pixels; with one, [N, K, 1...] is already [N, K] rows (point 3D
        # channels-first weight gradient ran 0.044 ms on an H200, as fast as its forward).
        return (
            p.direction is Direction.BACKWARD_WEIGHTS
            and transposed_pixels(p) > 0
            and not self.uses_rows_path(p)
        )

    # ---- cost ---------------------------------------------------------------

    def operand_elements(self, p: ConvProblem) -> dict[str, int]:
        return {**super().operand_elements(p), "column matrix": p.gemm_m * self.reduction_width(p)}

    def workspace_bytes(self, p: ConvProblem) -> int:
        ld = self.reduction_width(p)
        if self.uses_rows_path(p):
            return rows_path.workspace_bytes(p, ld)
        workspace = self.columns.buffer_bytes(p, ld)
        if self._dy_rows_copied(p):
            workspace += output_rows_bytes(p)
        return workspace

    def copied_bytes(self, p: ConvProblem) -> int:
        # The gather or scatter reads and writes the column buffer once each.
        moved = 2 * self.columns.buffer_bytes(p, self.reduction_width(p)) * self.columns.slowdown(p)
        if self._invariant_on_cuda(p):
            return int(moved) + self._invariant_extra_bytes(p)
        if p.direction is Direction.BACKWARD_DATA:
            moved += uncovered_bytes(p)
        if self.uses_rows_path(p):
            moved += rows_path.copied_bytes(p)
        elif self._dy_rows_copied(p):
            moved += 2 * output_rows_bytes(p) * torch_permute_slowdown(p.device_type)
        return int(moved)

    def gemm_slowdown(self, p: ConvProblem) -> float:
        # The rows path's in-place Triton GEMM runs behind cuBLAS's rate.
        return rows_path.gemm_slowdown(p) if self.uses_rows_path(p) else 1.0

    def gemm_launches(self, p: ConvProblem) -> int:
        if self._invariant_on_cuda(p):
            chunk = cuda_rows_chunk(aligned_width(p.gemm_k, p.dtype), p.k, p.dtype)
            return -(-max(p.gemm_m, chunk) // chunk) + self.columns.launches
        if self.uses_rows_path(p):
            return rows_path.launches(p, self.reduction_width(p))
        return 1 + self.columns.launches

    def host_launches(self, p: ConvProblem) -> int:
        # The weight's rows are copied each call where they are padded.
        return super().host_launches(p) + (self.reduction_width(p) != p.gemm_k)

    def triton_launches(self, p: ConvProblem) -> int:
        # The Triton gather or scatter, and per pass of the rows path its transpose or, in
        # place of GEMM and transpose, its Triton GEMM.
        if not self.uses_rows_path(p):
            return int(self.columns.triton)
        return (self.columns.triton + 1) * rows_path.passes(p, self.reduction_width(p))

    def gemm_is_aligned(self, p: ConvProblem) -> bool:
        if self._invariant_on_cuda(p):
            return True  # its canonical rows are padded to 16 bytes
        reduction_aligned = (self.reduction_width(p) * p.element_size) % VECTOR_BYTES == 0
        bmm_unaligned = batched_gemm_is_unaligned(p) and not self.uses_rows_path(p)
        return reduction_aligned and not bmm_unaligned

    # ---- the three directions ----------------------------------------------

    def prepare(self, p: ConvProblem, tensors: ConvTensors):
        return prepared.prepare(self, p, tensors) or super().prepare(p, tensors)

    def forward(self, p: ConvProblem, t: ConvTensors, out: torch.Tensor | None) -> torch.Tensor:
        x = t.input
        y = result_buffer(p, x, out)
        ld = self.reduction_width(p)
        wm = padded_weight_rows(t.weight, column_layout(p), ld)
        if self.runs_invariant(p):
            if cpu_sample_products(p):
                return store_invariant_samples(y, patches(x, p), wm, t.bias, p)
            col = self.columns.gather(x, p, ld)
            return store_invariant_rows(y, col, wm, t.bias, p.device_type)
        y3 = batched_view(y) if rows_view(y) is None else None
        if y3 is None:
            store_rows(y, self.columns.gather(x, p, ld), wm.t(), t.bias)
        elif self.uses_rows_path(p):
            rows_path.forward(self.columns, p, x, wm, t.bias, y3)
        else:
            # Channels-first y with several pixels per sample: Y^T per sample,
            # [K, ld] @ [ld, P], lands in y's own order; the weight is broadcast.
            col3 = self.columns.gather(x, p, ld).view(p.n, -1, ld).transpose(1, 2)
            store_batched(y, wm.expand(p.n, *wm.shape), col3, t.bias)
        return y

    def backward_data(
        self, p: ConvProblem, t: ConvTensors, out: torch.Tensor | None
    ) -> torch.Tensor:
        dx = result_buffer(p, t.grad_output, out)
        zero_outside(dx, covered_extent(p))
        ld = self.reduction_width(p)
        wm = padded_weight_rows(t.weight, column_layout(p), ld)
        dy = t.grad_output
        dy_rows = rows_view(dy)
        if dy_rows is not None:
            target = self.columns.in_place_target(dx, p, ld)
            if target is not None:
                torch.mm(dy_rows, wm, out=target)  # no column buffer
            else:
                self.columns.scatter(torch.mm(dy_rows, wm), p, dx)
            return dx
        dy3 = batched_view(dy)
        if dy3 is not None and self.uses_rows_path(p):
            rows_path.backward_data(self.columns, p, dy3, wm, dx)
            return dx
        # Channels-first dY: a batched GEMM reads each sample's [K, P] block
        # transposed, so dY is not copied.
        blocks = dy.reshape(p.n, p.k, -1)
        dcol = torch.bmm(blocks.transpose(1, 2), wm.expand(p.n, *wm.shape))
        self.columns.scatter(dcol.view(-1, ld), p, dx)
        return dx

    def backward_weights(
        self, p: ConvProblem, t: ConvTensors, out: torch.Tensor | None
    ) -> torch.Tensor:
        dy, x = t.grad_output, t.input
        dw = result_buffer(p, x, out)
        ld = self.reduction_width(p)
        order = column_layout(p)
        dy3 = batched_view(dy) if rows_view(dy) is None else None
        if dy3 is not None and self.uses_rows_path(p):
            dw_rows = rows_path.weight_gradient_rows(self.columns, p, x, dy3, ld)
            store_weight_rows(dw, dw_rows[:, : p.gemm_k].to(dw.dtype), order)
            return dw
        col = self.columns.gather(x, p, ld)
        target = weight_rows_target(dw, order) if ld == p.gemm_k else None
        if target is not None:
            reduction_mm(rows(dy).t(), col, out=target)
        else:
            store_weight_rows(dw, reduction_mm(rows(dy).t(), col)[:, : p.gemm_k], order)
        return dw
