"""The vendor path: aten's convolution and convolution_backward (cuDNN on CUDA, the
native kernels on CPU). It applies to every problem, so nothing is ever left without
a correct solver."""

from __future__ import annotations

import math

import torch

from gemmconv.device_rates import DeviceRates
from gemmconv.memory_format import Layout
from gemmconv.problem import ConvProblem, Direction
from gemmconv.solvers.base import ConvTensors, Solver

# Patch embeddings with at least this many kernel taps are "large" in the cost table.
LARGE_PATCH_TAPS = 16


def vendor_efficiency(p: ConvProblem, rates: DeviceRates) -> float:
    """The fraction of the GEMM floor the vendor's general kernels reach on ``p``: the
    device's fitted factor for the problem's class (device_rates.FACTORS)."""
    if all(r == 1 for r in p.kernel):
        return rates.factor("vendor_pointwise")
    if p.stride == p.kernel and not any(p.padding) and all(d == 1 for d in p.dilation):
        if math.prod(p.kernel) >= LARGE_PATCH_TAPS:
            if math.prod(p.output_spatial) == 1:
                return rates.factor("vendor_point_output")
            if p.direction is Direction.BACKWARD_DATA:
                return rates.factor("vendor_large_patch_backward_data")
            return rates.factor("vendor_large_patch")
        if p.layout is Layout.CHANNELS_FIRST:
            return rates.factor("vendor_small_patch_channels_first")
        if p.direction is Direction.BACKWARD_DATA:
            return rates.factor("vendor_small_patch_backward_data")
        return rates.factor("vendor_small_patch")
    return rates.factor("vendor_other")


class VendorSolver(Solver):
    id = "vendor"
    handles_empty = True
    max_operand_elements = None  # aten splits large convolutions itself (or raises as F.conv*)
    # cuDNN and the CPU kernels pick their deterministic algorithms under
    # torch.use_deterministic_algorithms, as F.conv* does.
    uses_cublas = False

    def work_ms(self, problem: ConvProblem, rates: DeviceRates) -> float:
        return super().work_ms(problem, rates) / vendor_efficiency(problem, rates)

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
        return _deliver(self._backward(p, t, input_grad=True), out)

    def backward_weights(
        self, p: ConvProblem, t: ConvTensors, out: torch.Tensor | None
    ) -> torch.Tensor:
        return _deliver(self._backward(p, t, input_grad=False), out)

    def _backward(self, p: ConvProblem, t: ConvTensors, input_grad: bool) -> torch.Tensor:
        # convolution_backward reads the operand whose gradient it computes only for its
        # shape (as torch.nn.grad does), so a direction's absent operand is a placeholder.
        x = t.input if t.input is not None else _placeholder(t.grad_output, p.input_shape)
        w = t.weight if t.weight is not None else _placeholder(t.grad_output, p.weight_shape)
        mask = [input_grad, not input_grad, False]
        dx, dw, _ = torch.ops.aten.convolution_backward(
            t.grad_output, x, w, None, *self._args(p), mask
        )
        return dx if input_grad else dw


def _placeholder(like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    return like.new_empty(1).expand(shape)


def _deliver(result: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return result
    out.copy_(result)
    return out
