"""The vendor path: aten's convolution and convolution_backward (cuDNN on CUDA, the
native kernels on CPU). It applies to every problem, so nothing is ever left without
a correct solver."""

from __future__ import annotations

import math

import torch

from gemmconv.memory_format import Layout
from gemmconv.problem import ConvProblem
from gemmconv.solvers.base import ConvTensors, Solver

# The fraction of the GEMM floor the vendor's general kernels reach, by problem class
# (measured on an H200, DESIGN.md §7: 1x1 NHWC at the floor; patch embeddings with
# 14x14 and 16x16 kernels 20-25x off it; small patches and other kernels unmeasured,
# so in between). The estimate only has to rank the vendor behind a real GEMM where
# one exists; find measures the truth.
VENDOR_EFFICIENCY = 0.5
VENDOR_EFFICIENCY_POINTWISE = 0.8
VENDOR_EFFICIENCY_SMALL_PATCH = 0.33
# Small patches channels-first: DiT-XL/2 and ConvNeXt downsample (2x2) reached 0.12-0.25
# of the floor on an H200 in every direction (bench/results/h200.json).
VENDOR_EFFICIENCY_SMALL_PATCH_CHANNELS_FIRST = 0.2
# Large patches (16 taps or more): cuDNN reached 0.007-0.45 of the floor over the 48
# such rows of the H200 suite (bench/results/h200.json), 0.038 at the median (0.024
# for the point 2D forward). The CPU's kernels were not measured per row: kept at 0.1.
VENDOR_EFFICIENCY_LARGE_PATCH = {"cuda": 0.04, "cpu": 0.1}
LARGE_PATCH_TAPS = 16


def vendor_efficiency(p: ConvProblem) -> float:
    if all(r == 1 for r in p.kernel):
        return VENDOR_EFFICIENCY_POINTWISE
    if p.stride == p.kernel and not any(p.padding) and all(d == 1 for d in p.dilation):
        if math.prod(p.kernel) >= LARGE_PATCH_TAPS:
            return VENDOR_EFFICIENCY_LARGE_PATCH.get(p.device_type, 0.1)
        if p.layout is Layout.CHANNELS_FIRST:
            return VENDOR_EFFICIENCY_SMALL_PATCH_CHANNELS_FIRST
        return VENDOR_EFFICIENCY_SMALL_PATCH
    return VENDOR_EFFICIENCY


class VendorSolver(Solver):
    id = "vendor"
    handles_empty = True
    max_operand_elements = None  # aten splits large convolutions itself (or raises as F.conv*)
    # cuDNN and the CPU kernels pick their deterministic algorithms under
    # torch.use_deterministic_algorithms, as F.conv* does.
    uses_cublas = False

    def work_ms(self, problem: ConvProblem, rates) -> float:
        return super().work_ms(problem, rates) / vendor_efficiency(problem)

    def gemm_is_aligned(self, problem: ConvProblem) -> bool:
        return True

    def host_launches(self, problem: ConvProblem) -> int:
        return 1  # one aten call, which allocates its own result

    def _args(self, p: ConvProblem):
        return (list(p.stride), list(p.padding), list(p.dilation), False, [0] * p.dims, p.groups)

    def forward(self, p: ConvProblem, t: ConvTensors, out: torch.Tensor | None) -> torch.Tensor:
        y = torch.ops.aten.convolution(t.input, t.weight, t.bias, *self._args(p))
        return _deliver(y, out)

    def backward_data(
        self, p: ConvProblem, t: ConvTensors, out: torch.Tensor | None
    ) -> torch.Tensor:
        # convolution_backward reads the input only for its shape (as torch.nn.grad does).
        x_like = t.input if t.input is not None else _placeholder(t.grad_output, p.input_shape)
        dx, _, _ = torch.ops.aten.convolution_backward(
            t.grad_output, x_like, t.weight, None, *self._args(p), [True, False, False]
        )
        return _deliver(dx, out)

    def backward_weights(
        self, p: ConvProblem, t: ConvTensors, out: torch.Tensor | None
    ) -> torch.Tensor:
        w_like = t.weight if t.weight is not None else _placeholder(t.grad_output, p.weight_shape)
        _, dw, _ = torch.ops.aten.convolution_backward(
            t.grad_output, t.input, w_like, None, *self._args(p), [False, True, False]
        )
        return _deliver(dw, out)


def _placeholder(like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    return like.new_empty(1).expand(shape)


def _deliver(result: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return result
    out.copy_(result)
    return out
