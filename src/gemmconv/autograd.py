"""The differentiable convolution: forward, backward-data and backward-weights, each
routed to the solver dispatch picks for its own problem."""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from gemmconv.dispatch import solver_for
from gemmconv.memory_format import Layout, is_dense_in, to_layout
from gemmconv.problem import ConvProblem, Direction
from gemmconv.solvers import ConvTensors
from gemmconv.solvers.views import bias_grad


def dense(t: torch.Tensor, layout: Layout) -> torch.Tensor:
    """``t`` as is when it is dense in either layout, else a dense copy in ``layout``.

    Slices, expanded (stride-0) gradients and other views are copied once here, as
    torch's own convolutions copy them, so solvers only ever see dense operands.
    """
    expanded = any(st == 0 and size > 1 for st, size in zip(t.stride(), t.shape))
    if not expanded and (
        is_dense_in(t, Layout.CHANNELS_FIRST) or is_dense_in(t, Layout.CHANNELS_LAST)
    ):
        return t
    return to_layout(t, layout)


def run_direction(problem: ConvProblem, tensors: ConvTensors) -> torch.Tensor:
    return solver_for(problem).run(problem, tensors)


class ConvFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, stride, padding, dilation, groups):
        problem = ConvProblem.from_tensors(x, w, b, stride, padding, dilation, groups)
        x, w = dense(x, problem.layout), dense(w, problem.layout)
        y = run_direction(problem, ConvTensors(input=x, weight=w, bias=b))
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # Keep only what the backward pass will read.
        ctx.save_for_backward(x if need_dw else None, w if need_dx else None)
        ctx.problem = problem
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        problem: ConvProblem = ctx.problem
        dy = dense(dy, problem.layout)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            p = problem.with_direction(Direction.BACKWARD_DATA)
            dx = run_direction(p, ConvTensors(grad_output=dy, weight=w))
        if ctx.needs_input_grad[1]:
            p = problem.with_direction(Direction.BACKWARD_WEIGHTS)
            dw = run_direction(p, ConvTensors(grad_output=dy, input=x))
        if ctx.needs_input_grad[2]:
            db = bias_grad(dy)
        return dx, dw, db, None, None, None, None
