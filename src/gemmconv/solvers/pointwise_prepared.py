"""Prepared runs of the stride-1 pointwise solver (solvers/patch/prepared.py says why).

Its directions are one GEMM over views of x, y, dY and dx: rows [pixels, channels]
for channels-last memory, per-sample blocks [N, channels, pixels] for channels-first.
Here those views are ViewRecipes found once, so a call is its allocation and the GEMM
(and the bias for a channels-first y). Where an operand has no such view (it would be
copied to rows), or for the channels-first weight gradient (a batched reduction in a
wider type), the solver's own method runs.
"""

from __future__ import annotations

import torch

from gemmconv.core.memory_format import Layout
from gemmconv.core.precision import reduction_mm
from gemmconv.core.problem import ConvProblem, Direction
from gemmconv.solvers.base import ConvTensors
from gemmconv.solvers.prepared_run import (
    ResultBuffer,
    Runner,
    meta_operands,
    with_precision_returning,
)
from gemmconv.solvers.views import (
    ViewRecipe,
    batched_view,
    rows_view,
    try_view,
)


def _views(t: torch.Tensor, layout: Layout) -> ViewRecipe | None:
    """``t`` [N, C, S..] as the GEMM reads it in ``layout``: rows or per-sample blocks."""
    return ViewRecipe.of(rows_view(t) if layout is Layout.CHANNELS_LAST else batched_view(t), t)


def prepare(solver, p: ConvProblem, t: ConvTensors) -> Runner | None:
    """The prepared run of the stride-1 pointwise solver for operands like ``t``; None
    where the solver's own method must run."""
    channels_last = p.layout is Layout.CHANNELS_LAST
    if p.direction is Direction.BACKWARD_WEIGHTS and not (
        channels_last or solver.wgrad_through_rows(p)
    ):
        return None
    layout = Layout.CHANNELS_LAST if p.direction is Direction.BACKWARD_WEIGHTS else p.layout
    meta = meta_operands(t)
    # The operand the GEMM streams (x, or dY) and the other one (the weight, or x).
    first = meta.input if p.direction is Direction.FORWARD else meta.grad_output
    second = meta.weight if p.direction is not Direction.BACKWARD_WEIGHTS else meta.input
    allocate = ResultBuffer(p, first)
    result = allocate.meta
    first_view = _views(first, layout)
    if p.direction is Direction.BACKWARD_WEIGHTS:
        second_view = _views(second, layout)
        result_view = ViewRecipe.of(try_view(result, p.k, p.c), result)
    else:
        second_view = ViewRecipe.of(try_view(second, p.k, p.c), second)  # the weight [K, C]
        result_view = _views(result, layout)
    if None in (first_view, second_view, result_view):
        return None
    # Their frameless forms, called on every run.
    first_view, second_view, result_view = first_view.apply, second_view.apply, result_view.apply
    n, k, c = p.n, p.k, p.c
    bias_shape = (1, k, *([1] * p.dims))

    def forward(t: ConvTensors) -> torch.Tensor:
        x, bias = t.input, t.bias
        y = allocate(x)
        w = second_view(t.weight)
        if channels_last:
            if bias is None:
                torch.mm(first_view(x), w.t(), out=result_view(y))
            else:
                torch.addmm(bias, first_view(x), w.t(), out=result_view(y))
        else:
            torch.bmm(w.expand(n, k, c), first_view(x), out=result_view(y))
            if bias is not None:
                y.add_(bias.view(bias_shape))
        return y

    def backward_data(t: ConvTensors) -> torch.Tensor:
        dy = t.grad_output
        dx = allocate(dy)
        w = second_view(t.weight)
        if channels_last:
            torch.mm(first_view(dy), w, out=result_view(dx))
        else:
            torch.bmm(w.t().expand(n, c, k), first_view(dy), out=result_view(dx))
        return dx

    def backward_weights(t: ConvTensors) -> torch.Tensor:
        dy, x = t.grad_output, t.input
        dw = allocate(x)
        reduction_mm(first_view(dy).t(), second_view(x), out=result_view(dw))
        return dw

    run = {
        Direction.FORWARD: forward,
        Direction.BACKWARD_DATA: backward_data,
        Direction.BACKWARD_WEIGHTS: backward_weights,
    }[p.direction]
    return with_precision_returning(p, run, allocate)


__all__ = ["prepare"]
