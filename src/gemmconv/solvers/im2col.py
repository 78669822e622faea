"""The general GEMM path: an explicit column buffer, any stride, padding, dilation, groups.

The input is padded, and its sliding windows are taken as a strided view
[N, G, Cg, O1..Od, R1..Rd] (Tensor.unfold per dimension, then every D-th tap);
one copy turns that into the column buffer [G, M, Cg*prod(R)]. Each group is one
GEMM of a batched call. Backward-data scatters the column gradient back with one
strided accumulation per kernel tap (windows overlap when stride < kernel).
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F

from gemmconv.core.precision import reduction_bmm
from gemmconv.core.problem import ConvProblem, Direction
from gemmconv.solvers.base import ConvTensors, Solver
from gemmconv.solvers.patch.cost import torch_permute_slowdown
from gemmconv.solvers.views import result_buffer


def _windows(x_padded: torch.Tensor, p: ConvProblem) -> torch.Tensor:
    """Strided view [N, G, Cg, O1..Od, R1..Rd] of the padded input."""
    win = x_padded
    for i, (r, step, dil, o) in enumerate(
        zip(p.kernel, p.view_steps, p.dilation, p.output_spatial)
    ):
        span = dil * (r - 1) + 1
        # Narrowed to what the windows cover, so that the unit step of a dimension with
        # one output position gives exactly one window.
        win = win.narrow(2 + i, 0, span + step * (o - 1)).unfold(2 + i, span, step)
    taps = (slice(None),) * (2 + p.dims) + tuple(slice(None, None, dil) for dil in p.dilation)
    win = win[taps]
    cg = p.c // p.groups
    return win.view(p.n, p.groups, cg, *win.shape[2:])


def _pad(x: torch.Tensor, p: ConvProblem) -> torch.Tensor:
    if not any(p.padding):
        return x
    pads = [v for pad in reversed(p.padding) for v in (pad, pad)]
    return F.pad(x, pads)


class Im2colSolver(Solver):
    id = "im2col"

    def invariance_reasons(self, p: ConvProblem) -> list[str]:
        # Its batched GEMM over groups is the library's choice by shape.
        return ["its batched GEMM (any convolution, as columns) is not batch-invariant"]

    def problem_reasons(self, p: ConvProblem) -> list[str]:
        if any(o < 1 for o in p.output_spatial):
            return [f"output spatial size {p.output_spatial} is empty"]
        return []

    # ---- cost ---------------------------------------------------------------

    def _col_bytes(self, p: ConvProblem) -> int:
        return p.groups * p.gemm_m * p.gemm_k * p.element_size

    def _dy_bytes(self, p: ConvProblem) -> int:
        return p.gemm_m * p.k * p.element_size

    def _padded_bytes(self, p: ConvProblem) -> int:
        padded = [s + 2 * pad for s, pad in zip(p.spatial, p.padding)]
        return p.n * p.c * math.prod(padded) * p.element_size if any(p.padding) else 0

    def workspace_bytes(self, p: ConvProblem) -> int:
        ws = self._col_bytes(p) + self._padded_bytes(p)
        if p.direction is not Direction.FORWARD:
            ws += self._dy_bytes(p)
        return ws

    def copied_bytes(self, p: ConvProblem) -> int:
        # The column buffer and the padded input are each written and read once; y (or
        # dY) is reordered between group-major and the tensor's layout. The gather and
        # the reorder are copies through permuted views (slower than a plain copy on GPUs).
        slowdown = torch_permute_slowdown(p.device_type)
        reorder = (2 * self._col_bytes(p) + 2 * self._dy_bytes(p)) * slowdown
        moved = int(reorder) + 2 * self._padded_bytes(p)
        if p.direction is Direction.BACKWARD_DATA:
            # Each tap's accumulation reads and writes its slice of the fp32 dx buffer.
            moved += 2 * self._col_bytes(p) + math.prod(p.input_shape) * 4
        return moved

    def gemm_launches(self, p: ConvProblem) -> int:
        return 1 + (math.prod(p.kernel) if p.direction is Direction.BACKWARD_DATA else 0)

    def host_launches(self, p: ConvProblem) -> int:
        # Besides its GEMMs and the result's allocation, each direction issues two copies
        # (the columns or dY in, the result out), a zero fill for backward-data, the
        # bias's addition and the padding where there are some, and a dozen views that
        # cost the host about one more op together. ViT-B/16's forward at batch 32 took
        # 100 us of host issue on an H100 (torch 2.11): priced at one op (25 us), im2col
        # won its estimate by 2 us over patch_implicit, whose call ran 44 us to its 117.
        ops = self.gemm_launches(p) + 3
        if p.direction is Direction.BACKWARD_DATA:
            ops += 1
        if p.direction is Direction.FORWARD and p.has_bias:
            ops += 1
        return ops + (1 if any(p.padding) else 0) + 1

    def allocations(self, p: ConvProblem) -> int:
        return 1

    # ---- shared operand shapes ---------------------------------------------

    def _columns(self, x: torch.Tensor, p: ConvProblem) -> torch.Tensor:
        """The column buffer [G, M, Cg*prod(R)] (a copy)."""
        win = _windows(_pad(x, p), p)  # [N, G, Cg, O.., R..]
        d = p.dims
        order = (1, 0, *range(3, 3 + d), 2, *range(3 + d, 3 + 2 * d))
        return win.permute(order).reshape(p.groups, p.gemm_m, p.gemm_k)

    def _weight_groups(self, w: torch.Tensor, p: ConvProblem) -> torch.Tensor:
        return w.reshape(p.groups, p.gemm_n, p.gemm_k)

    def _dy_groups(self, dy: torch.Tensor, p: ConvProblem) -> torch.Tensor:
        """dY as [G, M, Kg] (a copy unless already in that order)."""
        d = p.dims
        split = dy.view(p.n, p.groups, p.gemm_n, *p.output_spatial)
        order = (1, 0, *range(3, 3 + d), 2)
        return split.permute(order).reshape(p.groups, p.gemm_m, p.gemm_n)

    # ---- the three directions ----------------------------------------------

    def forward(self, p: ConvProblem, t: ConvTensors, out: torch.Tensor | None) -> torch.Tensor:
        y = result_buffer(p, t.input, out)
        col = self._columns(t.input, p)
        wg = self._weight_groups(t.weight, p)
        yg = torch.bmm(col, wg.transpose(1, 2))  # [G, M, Kg]
        d = p.dims
        yg = yg.view(p.groups, p.n, *p.output_spatial, p.gemm_n)
        order = (1, 0, 2 + d, *range(2, 2 + d))
        y.view(p.n, p.groups, p.gemm_n, *p.output_spatial).copy_(yg.permute(order))
        if t.bias is not None:
            y.add_(t.bias.view(1, -1, *([1] * d)))
        return y

    def backward_data(
        self, p: ConvProblem, t: ConvTensors, out: torch.Tensor | None
    ) -> torch.Tensor:
        dx = result_buffer(p, t.grad_output, out)
        dcol = torch.bmm(self._dy_groups(t.grad_output, p), self._weight_groups(t.weight, p))
        d = p.dims
        cg = p.c // p.groups
        # [G, M, Cg*R] -> [N, G, Cg, O.., R..], matching the window view's order
        dcol = dcol.view(p.groups, p.n, *p.output_spatial, cg, *p.kernel)
        dcol = dcol.permute(1, 0, 2 + d, *range(2, 2 + d), *range(3 + d, 3 + 2 * d))
        padded = [s + 2 * pad for s, pad in zip(p.spatial, p.padding)]
        acc_dtype = p.dtype if p.dtype == torch.float64 else torch.float32
        dx_padded = torch.zeros(
            (p.n, p.groups, cg, *padded), dtype=acc_dtype, device=t.grad_output.device
        )
        for tap in itertools.product(*(range(r) for r in p.kernel)):
            region = tuple(
                slice(i * dil, i * dil + step * (o - 1) + 1, step)
                for i, dil, step, o in zip(tap, p.dilation, p.view_steps, p.output_spatial)
            )
            dx_padded[(slice(None),) * 3 + region] += dcol[(Ellipsis, *tap)]
        inner = tuple(slice(pad, pad + s) for pad, s in zip(p.padding, p.spatial))
        dx.view(p.n, p.groups, cg, *p.spatial).copy_(dx_padded[(slice(None),) * 3 + inner])
        return dx

    def backward_weights(
        self, p: ConvProblem, t: ConvTensors, out: torch.Tensor | None
    ) -> torch.Tensor:
        dw = result_buffer(p, t.input, out)
        col = self._columns(t.input, p)
        dyg = self._dy_groups(t.grad_output, p)
        dwg = reduction_bmm(dyg.transpose(1, 2), col)  # [G, Kg, Cg*R]
        dw.copy_(dwg.view(dw.shape))
        return dw
