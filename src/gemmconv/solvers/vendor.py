"""The vendor path: aten's convolution and convolution_backward (cuDNN on CUDA, the
native kernels on CPU). It applies to every problem, so nothing is ever left without
a correct solver."""

from __future__ import annotations

import torch

from gemmconv.problem import ConvProblem
from gemmconv.solvers.base import ConvTensors, Solver

# The vendor's general kernels reach about this fraction of the GEMM floor on the
# problems gemmconv targets (measured on an H200: 1x1 NHWC at the floor, patch
# embeddings 5-40x off it); the estimate only has to rank it behind a real GEMM.
VENDOR_EFFICIENCY = 0.5


class VendorSolver(Solver):
    id = "vendor"
    handles_empty = True

    def estimate_ms(self, problem: ConvProblem, rates=None) -> float:
        return super().estimate_ms(problem, rates) / VENDOR_EFFICIENCY

    def gemm_is_aligned(self, problem: ConvProblem) -> bool:
        return True

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
