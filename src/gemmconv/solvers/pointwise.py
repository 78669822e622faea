"""Pointwise (1x1) convolutions, with and without stride, as GEMMs over channels.

Channels-last: x is already [N*prod(S), C] in memory, so the convolution is one
flat GEMM [M, C] @ [C, K] that reads x and writes y in place. Channels-first: each
sample is [C, prod(S)], so y[n] = W @ x[n] is one batched GEMM with the weight
broadcast (stride 0), again with no copy of x or y.

Strided pointwise reads the subsampled view x[..., ::U]; its dx is zero except at
the strided positions.
"""

from __future__ import annotations

import math

import torch

from gemmconv.core.memory_format import Layout
from gemmconv.core.precision import (
    fp32_workspace_chunk_bytes,
    reduce_batched_products,
    reduction_mm,
)
from gemmconv.core.problem import ConvProblem, Direction
from gemmconv.solvers.base import ConvTensors, Solver
from gemmconv.solvers.invariant import (
    cpu_sample_products,
    cuda_batched_gemm,
    store_invariant_rows,
    store_invariant_samples,
)
from gemmconv.solvers.patch.mapping import channels_last_columns, patch_view, transposed_pixels
from gemmconv.solvers.views import (
    batched_view,
    result_buffer,
    rows,
    store_batched,
    store_rows,
)

# Upper bound for the fp32 partial products of a channels-first weight gradient.
WGRAD_PARTIALS_CAP = 64 << 20


class PointwiseSolver(Solver):
    id = "pointwise"
    # Its forward runs the invariant GEMM (solvers/invariant.py) on either device: on
    # CUDA per sample for a channels-first y with several pixels, as its default does.
    batch_invariant_devices = frozenset({"cpu", "cuda"})
    # Its operands are x, y and their views or torch's copies: under the switch on CUDA
    # only the chunks' operands meet the 32-bit limit.
    chunked_invariant_operands = True

    def problem_reasons(self, p: ConvProblem) -> list[str]:
        reasons = []
        if any(r != 1 for r in p.kernel):
            reasons.append(f"kernel {p.kernel} is not 1x1")
        if any(p.padding):
            reasons.append(f"padding {p.padding} != 0")
        if p.groups != 1:
            reasons.append(f"groups {p.groups} != 1")
        reasons += self.stride_reasons(p)
        return reasons

    def stride_reasons(self, p: ConvProblem) -> list[str]:
        if any(u != 1 for u in p.stride):
            return [f"stride {p.stride} != 1"]
        return []

    # ---- the operand x as the GEMM sees it ----------------------------------

    def source(self, x: torch.Tensor, p: ConvProblem) -> torch.Tensor:
        """The input pixels the GEMM reads (all of them, for stride 1)."""
        return x

    def dx_target(self, dx: torch.Tensor, p: ConvProblem) -> torch.Tensor:
        """Where in dx the GEMM's result goes (all of it, for stride 1)."""
        return dx

    def subsample_is_copied(self, p: ConvProblem) -> bool:
        return False

    # ---- cost ---------------------------------------------------------------

    def _x_rows_bytes(self, p: ConvProblem) -> int:
        return p.gemm_m * p.c * p.element_size

    def wgrad_through_rows(self, p: ConvProblem) -> bool:
        """Whether a channels-first weight gradient copies dY and x (channel-major) for
        one GEMM: on the CPU, where a long fp32 GEMM is as accurate as the vendor
        (precision.py) and the per-sample products' two-level sum needs fp64."""
        return (
            p.direction is Direction.BACKWARD_WEIGHTS
            and p.layout is Layout.CHANNELS_FIRST
            and p.device_type == "cpu"
        )

    def _rows_copy_bytes(self, p: ConvProblem) -> int:
        # dY to rows, and x unless its subsample copy already is those rows.
        channels = p.k if self.subsample_is_copied(p) else p.k + p.c
        return p.gemm_m * channels * p.element_size

    def workspace_bytes(self, p: ConvProblem) -> int:
        ws = self._x_rows_bytes(p) if self.subsample_is_copied(p) else 0
        if self.wgrad_through_rows(p):
            ws += self._rows_copy_bytes(p)
        elif p.direction is Direction.BACKWARD_WEIGHTS and p.layout is Layout.CHANNELS_FIRST:
            ws += fp32_workspace_chunk_bytes(p.n, p.k, p.c, WGRAD_PARTIALS_CAP)
        return ws

    def copied_bytes(self, p: ConvProblem) -> int:
        moved = 2 * self._x_rows_bytes(p) if self.subsample_is_copied(p) else 0
        if p.direction is Direction.BACKWARD_DATA and self.subsample_is_copied(p):
            moved += math.prod(p.input_shape) * p.element_size  # zero fill of dx
        if self.wgrad_through_rows(p):
            moved += 2 * self._rows_copy_bytes(p)
        elif p.direction is Direction.BACKWARD_WEIGHTS and p.layout is Layout.CHANNELS_FIRST:
            moved += 2 * fp32_workspace_chunk_bytes(p.n, p.k, p.c, WGRAD_PARTIALS_CAP)
        return moved

    # ---- the three directions ----------------------------------------------

    def prepare(self, p: ConvProblem, tensors: ConvTensors):
        if self.runs_invariant(p):
            return super().prepare(p, tensors)  # the run itself: forward() takes that form
        if not self.subsample_is_copied(p):
            from gemmconv.solvers import pointwise_prepared

            prepared = pointwise_prepared.prepare(self, p, tensors)
            if prepared is not None:
                return prepared
        return super().prepare(p, tensors)

    def forward(self, p: ConvProblem, t: ConvTensors, out: torch.Tensor | None) -> torch.Tensor:
        x = self.source(t.input, p)
        y = result_buffer(p, x, out)
        w = t.weight.reshape(p.k, p.c)
        if self.runs_invariant(p):
            return self.invariant_forward(p, x, w, t.bias, y)
        if p.layout is Layout.CHANNELS_LAST:
            store_rows(y, rows(x), w.t(), t.bias)
        else:
            x3 = x.reshape(p.n, p.c, -1)
            store_batched(y, w.expand(p.n, p.k, p.c), x3, t.bias)
        return y

    def invariant_forward(
        self, p: ConvProblem, x: torch.Tensor, w: torch.Tensor, bias, y: torch.Tensor
    ) -> torch.Tensor:
        """y from the pixels ``x`` reads (the source), batch-invariant: the invariant GEMM
        over x's rows [pixels, C] (solvers/invariant.py), or on CUDA, for a
        channels-first y with several pixels a sample, W @ x[n] per sample in batched
        products of a fixed sample count (no transpose of x or y); on the CPU, where a
        sample's product is large enough, each sample alone, as the patch solvers
        multiply the same problem's (cpu_sample_products)."""
        if cpu_sample_products(p):
            ones = (1,) * p.dims
            x_patches = patch_view(x, p.output_spatial, ones, channels_last_columns(p))
            return store_invariant_samples(y, x_patches, w, bias, p)
        if p.device_type == "cuda" and transposed_pixels(p) > 0:
            y3 = batched_view(y)
            target = y3 if y3 is not None else y.new_empty(p.n, p.k, math.prod(p.output_spatial))
            cuda_batched_gemm(w, x.reshape(p.n, p.c, -1), bias, target)
            if y3 is None:
                y.copy_(target.view(y.shape))
            return y
        return store_invariant_rows(y, rows(x), w, bias, p.device_type)

    def backward_data(
        self, p: ConvProblem, t: ConvTensors, out: torch.Tensor | None
    ) -> torch.Tensor:
        dy = t.grad_output
        dx = result_buffer(p, dy, out)
        target = self.dx_target(dx, p)
        w = t.weight.reshape(p.k, p.c)
        if p.layout is Layout.CHANNELS_LAST:
            store_rows(target, rows(dy), w)
        else:
            dy3 = dy.reshape(p.n, p.k, -1)
            store_batched(target, w.t().expand(p.n, p.c, p.k), dy3)
        return dx

    def backward_weights(
        self, p: ConvProblem, t: ConvTensors, out: torch.Tensor | None
    ) -> torch.Tensor:
        dy = t.grad_output
        x = self.source(t.input, p)
        dw = result_buffer(p, x, out)
        dw_rows = dw.view(p.k, p.c)  # a [K, C, 1..] tensor is [K, C] in either layout
        if p.layout is Layout.CHANNELS_LAST:
            reduction_mm(rows(dy).t(), rows(x), out=dw_rows)
        elif self.wgrad_through_rows(p):
            # [K, N*P] @ [N*P, C]: dY and x copied channel-major, whole runs of P pixels
            # at a time, where copies to rows [N*P, C] transpose every sample (a bf16
            # ResNet 1x1 at batch 8, 256 -> 64 at 56x56, on the 2-core EPYC: copies and
            # GEMM 1.65 ms against 4.16, x's transpose alone 2.2).
            reduction_mm(_channel_major(dy, p), _channel_major(x, p).t(), out=dw_rows)
        else:
            # sum over samples of dY[n] [K, P] @ x[n]^T [P, C], in fp32 throughout.
            dy3 = dy.reshape(p.n, p.k, -1)
            x3 = x.reshape(p.n, p.c, -1)
            dw_rows.copy_(reduce_batched_products(dy3, x3.transpose(1, 2), WGRAD_PARTIALS_CAP))
        return dw


def _channel_major(t: torch.Tensor, p: ConvProblem) -> torch.Tensor:
    """Channels-first ``t`` [N, channels, S..] as [channels, N * pixels]: a copy of
    whole pixel runs (a view for one sample)."""
    return t.reshape(p.n, t.shape[1], -1).transpose(0, 1).reshape(t.shape[1], -1)


class StridedPointwiseSolver(PointwiseSolver):
    id = "strided_pointwise"

    # Its forward runs pointwise's invariant form on the subsample, which it copies
    # anyway (to rows, or per sample for a channels-first y).
    def stride_reasons(self, p: ConvProblem) -> list[str]:
        if all(u == 1 for u in p.stride):
            return [f"stride {p.stride} is 1 in every dimension (pointwise)"]
        return []

    def _strided(self, t: torch.Tensor, p: ConvProblem) -> torch.Tensor:
        steps = zip(p.view_steps, p.output_spatial)
        return t[(slice(None), slice(None), *(slice(0, (o - 1) * u + 1, u) for u, o in steps))]

    def source(self, x: torch.Tensor, p: ConvProblem) -> torch.Tensor:
        return self._strided(x, p)

    def dx_target(self, dx: torch.Tensor, p: ConvProblem) -> torch.Tensor:
        dx.zero_()
        return self._strided(dx, p)

    def subsample_is_copied(self, p: ConvProblem) -> bool:
        return True
