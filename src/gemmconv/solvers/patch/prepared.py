"""Prepared runs of the column-GEMM solvers: each direction's decisions taken once.

A column-GEMM direction decides, from the problem and its operands' sizes and
strides, where the columns come from, which views the GEMM reads and writes, and
whether the rows path applies; each decision costs Python and each view a torch call.
An eager call with the same metadata takes the same decisions, so a plan keeps them:
the views become ViewRecipes found on meta tensors and the result's strides are
fixed. What runs per call is then the allocation, the weight's rows where they are a
copy, the gather or scatter, the GEMM and (channels-first y or dY with several
pixels) the transpose: the same
kernels, in the same order, as the solver's own direction methods, which stay the
reference (the tests compare the two bitwise) and serve every case not prepared here
(an ``out`` buffer, the per-sample bmm, chunked passes).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gemmconv.precision import conv_gemm_precision, reduction_mm
from gemmconv.problem import ConvProblem, Direction
from gemmconv.solvers.base import ConvTensors
from gemmconv.solvers.patch import rows_path
from gemmconv.solvers.patch.columns import (
    ColumnSource,
    TritonCopyColumns,
    ViewColumns,
    whole_sample_rows,
)
from gemmconv.solvers.patch.mapping import (
    column_layout,
    covered_extent,
    padded_weight_rows,
    patches,
)
from gemmconv.solvers.views import (
    ViewRecipe,
    batched_view,
    meta_like,
    result_buffer,
    rows_view,
    store_weight_rows,
    try_view,
    weight_rows_target,
    zero_outside,
)

Runner = Callable[[ConvTensors], torch.Tensor]


class WeightRows:
    """The weight as GEMM rows [K, ld] (mapping.padded_weight_rows): a view found once
    where the weight's memory already is those rows, else the permuted or padded copy,
    made afresh each call. Keeping the copy while the weight looked unchanged was
    considered and refused: an update through ``weight.data`` moves no version
    counter, so a kept copy could silently be stale."""

    __slots__ = ("layout", "ld", "_view")

    def __init__(self, p: ConvProblem, ld: int, w: torch.Tensor) -> None:
        self.layout, self.ld = column_layout(p), ld
        view = weight_rows_target(w, self.layout) if ld == p.gemm_k else None
        self._view = ViewRecipe.of(view, w)

    def __call__(self, w: torch.Tensor) -> torch.Tensor:
        if self._view is not None:
            return self._view(w)
        return padded_weight_rows(w, self.layout, self.ld)


class Columns:
    """The column matrix [M, ld] of x as the solver's column source makes it, with its
    view (or the permuted view it copies from) found once."""

    __slots__ = ("source", "p", "ld", "_view", "_patches", "_whole_rows", "_shape")

    def __init__(self, source: ColumnSource, p: ConvProblem, ld: int, x: torch.Tensor) -> None:
        self.source, self.p, self.ld = source, p, ld
        self._shape = (p.gemm_m, ld)
        self._view = self._patches = self._whole_rows = None
        if isinstance(source, ViewColumns) and ld == p.gemm_k:
            view = patches(x, p)
            self._patches = ViewRecipe(view, x)
            self._view = ViewRecipe.of(try_view(view, p.gemm_m, p.gemm_k), x)
        elif isinstance(source, TritonCopyColumns):
            self._whole_rows = ViewRecipe.of(whole_sample_rows(x, p), x)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._view is not None:
            return self._view(x)
        if self._patches is not None:
            return self._patches(x).reshape(self._shape[0], -1)  # torch's copy
        if self._whole_rows is not None:
            from gemmconv.kernels.strided_copy import pad_rows

            return pad_rows(x.new_empty(self._shape), self._whole_rows(x))
        return self.source.gather(x, self.p, self.ld)


def _result(p: ConvProblem, like: torch.Tensor) -> tuple[tuple, tuple, torch.Tensor]:
    meta = result_buffer(p, like, None)
    return tuple(meta.shape), meta.stride(), meta


def _allocate(size: tuple, stride: tuple, like: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(size, stride, dtype=like.dtype, device=like.device)


def prepare(solver, p: ConvProblem, t: ConvTensors) -> Runner | None:
    """The prepared run of a column-GEMM solver's direction for operands like ``t``;
    None where the solver's own method must run (a per-sample bmm, chunked passes)."""
    ld = solver.reduction_width(p)
    if solver.uses_rows_path(p) and rows_path.chunk_samples(p, ld) < p.n:
        return None
    meta = ConvTensors(**{name: _meta(v) for name, v in vars(t).items()})
    if p.direction is Direction.FORWARD:
        run = _forward(solver, p, ld, meta)
    else:
        views = _output_views(solver, p, meta.grad_output)
        if views is None:
            return None
        data = p.direction is Direction.BACKWARD_DATA
        run = (_backward_data if data else _backward_weights)(solver, p, ld, meta, *views)
    return None if run is None else with_precision(p, run)


def with_precision(p: ConvProblem, run: Runner) -> Runner:
    """``run`` under the problem's GEMM accumulation rules, as Solver.run applies them."""
    precision = (p.dtype, p.device_type)

    def runner(tensors: ConvTensors) -> torch.Tensor:
        with conv_gemm_precision(*precision):
            return run(tensors)

    return runner


def _meta(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else meta_like(t)


def _forward(solver, p: ConvProblem, ld: int, t: ConvTensors):
    size, stride, y = _result(p, t.input)
    views = _output_views(solver, p, y)
    if views is None:
        return None
    y_rows, y3, through_rows = views
    columns = Columns(solver.columns, p, ld, t.input)
    weight_rows = WeightRows(p, ld, t.weight)

    def forward(t: ConvTensors) -> torch.Tensor:
        x = t.input
        y = _allocate(size, stride, x)
        wm = weight_rows(t.weight)
        if through_rows:
            rows_path.forward(solver.columns, p, x, wm, t.bias, y3(y))
        elif t.bias is None:
            torch.mm(columns(x), wm.t(), out=y_rows(y))
        else:
            torch.addmm(t.bias, columns(x), wm.t(), out=y_rows(y))
        return y

    return forward


def _output_views(solver, p: ConvProblem, t: torch.Tensor):
    """How the GEMM meets y or dY: (rows view, [N, K, P] view, whether the rows path
    runs), each view a recipe or None; None where neither prepared way applies (a copy
    to rows, or the per-sample bmm: the solver's own method runs then)."""
    rows = ViewRecipe.of(rows_view(t), t)
    blocks = ViewRecipe.of(batched_view(t), t)
    through_rows = rows is None and blocks is not None and solver.uses_rows_path(p)
    if rows is None and not through_rows:
        return None
    return rows, blocks, through_rows


def _backward_data(solver, p: ConvProblem, ld: int, t: ConvTensors, dy_rows, dy3, through_rows):
    size, stride, dx = _result(p, t.grad_output)
    covered = covered_extent(p)
    cropped = covered != tuple(p.spatial)
    target = ViewRecipe.of(solver.columns.in_place_target(dx, p, ld), dx)
    weight_rows = WeightRows(p, ld, t.weight)
    columns = solver.columns

    def backward_data(t: ConvTensors) -> torch.Tensor:
        dy = t.grad_output
        dx = _allocate(size, stride, dy)
        if cropped:
            zero_outside(dx, covered)
        wm = weight_rows(t.weight)
        if through_rows:
            rows_path.backward_data(columns, p, dy3(dy), wm, dx)
        elif target is not None:
            torch.mm(dy_rows(dy), wm, out=target(dx))
        else:
            columns.scatter(torch.mm(dy_rows(dy), wm), p, dx)
        return dx

    return backward_data


def _backward_weights(solver, p: ConvProblem, ld: int, t: ConvTensors, dy_rows, dy3, through_rows):
    size, stride, dw = _result(p, t.input)
    order = column_layout(p)
    target = ViewRecipe.of(weight_rows_target(dw, order), dw) if ld == p.gemm_k else None
    columns = Columns(solver.columns, p, ld, t.input)
    k = p.gemm_k

    def backward_weights(t: ConvTensors) -> torch.Tensor:
        dy, x = t.grad_output, t.input
        dw = _allocate(size, stride, x)
        if through_rows:
            rows = rows_path.weight_gradient_rows(solver.columns, p, x, dy3(dy), ld)
            store_weight_rows(dw, rows[:, :k].to(dw.dtype), order)
        elif target is not None:
            reduction_mm(dy_rows(dy).t(), columns(x), out=target(dw))
        else:
            store_weight_rows(dw, reduction_mm(dy_rows(dy).t(), columns(x))[:, :k], order)
        return dw

    return backward_weights


__all__ = ["Columns", "Runner", "WeightRows", "prepare", "with_precision"]
