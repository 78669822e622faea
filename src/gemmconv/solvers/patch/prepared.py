"""Prepared runs of the column-GEMM solvers: each direction's decisions taken once.

A column-GEMM direction decides, from the problem and its operands' sizes and
strides, where the columns come from, which views the GEMM reads and writes, and
whether the rows path applies; each decision costs Python and each view a torch call.
An eager call with the same metadata takes the same decisions, so a plan keeps them:
the views become ViewRecipes found on meta tensors and the result's strides are
fixed. What runs per call is then the allocation, the weight's rows where they are a
copy, the gather or scatter, the GEMM (or the per-sample batched GEMM) and, on the
rows path, the transpose where its GEMM does not write y or read dY in place (one
pass, its size known here): the same kernels, in the same order, as the solver's own
direction methods, which stay the reference (the tests compare the two bitwise) and
serve every case not prepared here (an ``out`` buffer, chunked passes). Each column
source prepares its own gather (ColumnSource.prepared_gather).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from gemmconv.core.memory_format import empty_in
from gemmconv.core.precision import reduction_mm_of
from gemmconv.core.problem import ConvProblem, Direction
from gemmconv.solvers.base import ConvTensors
from gemmconv.solvers.invariant import (
    cpu_sample_products,
    store_invariant_rows,
    store_invariant_samples,
)
from gemmconv.solvers.patch import rows_path
from gemmconv.solvers.patch.mapping import (
    column_layout,
    covered_extent,
    padded_weight_rows,
    patches,
)
from gemmconv.solvers.prepared_run import (
    ResultBuffer,
    Runner,
    meta_operands,
    with_precision,
    with_precision_returning,
)
from gemmconv.solvers.views import (
    ViewRecipe,
    batched_view,
    meta_like,
    rows,
    rows_view,
    store_weight_rows,
    weight_rows_target,
    zero_outside,
)


def _weight_rows(
    p: ConvProblem, ld: int, w: torch.Tensor
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The weight as GEMM rows [K, ld] (mapping.padded_weight_rows): a view found once
    where the weight's memory already is those rows, else the permuted or padded copy,
    made afresh each call. Keeping the copy while the weight looked unchanged was
    considered and refused: an update through ``weight.data`` moves no version
    counter, so a kept copy could silently be stale."""
    layout = column_layout(p)
    view = ViewRecipe.of(weight_rows_target(w, layout), w) if ld == p.gemm_k else None
    if view is not None:
        return view.apply
    return lambda w: padded_weight_rows(w, layout, ld)


def prepare(solver, p: ConvProblem, t: ConvTensors) -> Runner | None:
    """The prepared run of a column-GEMM solver's direction for operands like ``t``;
    None where the solver's own method must run (chunked passes)."""
    ld = solver.reduction_width(p)
    if solver.uses_rows_path(p) and rows_path.chunk_samples(p, ld) < p.n:
        return None
    meta = meta_operands(t)
    if p.direction is Direction.FORWARD:
        result = ResultBuffer(p, meta.input)
        if solver.runs_invariant(p):
            forward = _invariant_forward(solver, p, ld, meta, result)
        else:
            forward = _forward(solver, p, ld, meta, result)
        return None if forward is None else ColumnKeepingForward(p, ld, forward, result.stride)
    views = _output_views(solver, p, meta.grad_output)
    if views is None:
        return None
    data = p.direction is Direction.BACKWARD_DATA
    result = ResultBuffer(p, meta.grad_output if data else meta.input)
    run = (_backward_data if data else _backward_weights)(solver, p, ld, meta, result, views)
    return None if run is None else with_precision_returning(p, run, result)


def _forward(solver, p: ConvProblem, ld: int, t: ConvTensors, result: ResultBuffer):
    views = _output_views(solver, p, result.meta)
    if views is None:
        return None
    y_rows, y3, through_rows = views
    in_place = through_rows and rows_path.in_place(p)
    if in_place:  # a Triton kernel: imported where it runs (Triton may be absent)
        from gemmconv.kernels.pixel_rows_gemm import rows_into_channels_first
    columns = solver.columns.prepared_gather(t.input, p, ld)
    weight_rows = _weight_rows(p, ld, t.weight)
    bias_shape = (1, -1, *([1] * p.dims))
    # Where y's memory is exactly its rows [M, K] in order (a channels-last y, or one
    # pixel a sample), F.linear allocates them and y is their view: one torch call in
    # place of the allocation, the rows view and the weight's transposed view.
    y_is_rows = y_rows is not None and y_rows.offset == 0 and y_rows.stride == (p.k, 1)
    # Where y's memory is exactly the per-sample blocks [N, K, P] in order (a dense
    # channels-first y), bmm allocates them and y is their view, as for y_is_rows: two
    # torch calls fewer, and DiT-XL/2's channels-first forward is host-bound on slower
    # hosts (0.96x the rewrite in bench/results/h200.md with the same device time).
    y_is_blocks = (
        y_rows is None
        and not through_rows
        and y3.offset == 0
        and y3.stride == (y3.size[1] * y3.size[2], y3.size[2], 1)
        and y3.size[0] * y3.stride[0] == result.meta.numel()
    )
    if y_rows is None and not through_rows and not y_is_blocks:
        return None  # a y no solver allocates: the solver's own method runs

    def forward(
        x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if y_is_rows:
            col = columns(x)
            return result.over(F.linear(col, weight_rows(weight), bias)), col
        if y_is_blocks:  # Y^T per sample, in y's own order (store_batched)
            col = columns(x)
            wm = weight_rows(weight)
            blocks = torch.bmm(wm.expand(p.n, *wm.shape), col.view(p.n, -1, ld).transpose(1, 2))
            y = result.over(blocks)
            if bias is not None:
                y.add_(bias.view(bias_shape))
            return y, col
        y = result(x)
        wm = weight_rows(weight)
        if in_place:  # the rows path's one pass, its GEMM writing y (rows_path.forward)
            col = columns(x)
            rows_into_channels_first(col, wm, bias, y3(y))
            return y, col
        if through_rows:  # in one pass of p.n samples: prepare() refuses chunked ones
            return y, rows_path.forward(solver.columns, p, x, wm, bias, y3(y), p.n, fused=False)
        col = columns(x)
        if bias is None:
            torch.mm(col, wm.t(), out=y_rows(y))
        else:
            torch.addmm(bias, col, wm.t(), out=y_rows(y))
        return y, col

    return forward


def _invariant_forward(solver, p: ConvProblem, ld: int, t: ConvTensors, result: ResultBuffer):
    """The batch-invariant forward (solvers/invariant.py): the same columns, multiplied
    in fixed-shape row chunks; y and the columns, as _forward's run returns them. On
    the CPU, where each sample is multiplied alone, y from x's patches, and no columns
    (the weight gradient gathers its own)."""
    weight_rows = _weight_rows(p, ld, t.weight)
    if cpu_sample_products(p):
        patch_view = ViewRecipe(patches(t.input, p), t.input).apply

        def per_sample(
            x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
        ) -> tuple[torch.Tensor, None]:
            y = result(x)
            return store_invariant_samples(y, patch_view(x), weight_rows(weight), bias, p), None

        return per_sample
    columns = solver.columns.prepared_gather(t.input, p, ld)
    device = p.device_type  # whose policy: the problem's device

    def forward(
        x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        col = columns(x)
        return store_invariant_rows(result(x), col, weight_rows(weight), bias, device), col

    return forward


class ColumnKeepingForward:
    """A prepared forward that can also return the column matrix [M, ld] its GEMM read
    (``keeping_columns(input, weight, bias)``: y and the columns, None where the pass
    was chunked) and turn that matrix and dY into dW (``weight_gradient``): a call that
    needs the weight gradient then gathers once, in the forward, as the reshape +
    linear rewrite does, instead of again in the backward. dW is the same GEMM the
    solvers' weight gradient runs, on the same columns. ``keeping_columns`` takes the
    operands apart, as the eager road holds them: no ConvTensors is built and none of
    this class's methods runs."""

    __slots__ = ("keeping_columns", "result_strides", "_p", "_ld", "_product", "_by_strides",
                 "_transpose_dy", "_read_dy")  # fmt: skip

    def __init__(self, p: ConvProblem, ld: int, forward, result_strides: tuple[int, ...]) -> None:
        self.keeping_columns = with_precision(p, forward)
        self.result_strides = result_strides  # of every y it returns (a ResultBuffer's)
        self._p, self._ld = p, ld
        self._product = with_precision(p, _weight_gradient_product(p, ld))
        # dW from dY and the columns per dY strides; a call meets one or two.
        self._by_strides: dict[tuple[int, ...], Callable[..., torch.Tensor]] = {}
        # A dense channels-first dY is copied to rows by the transpose kernel where it
        # runs, as the solvers' own weight gradient does (rows_path); torch's copy
        # through the transposed view ran 3-5x slower on an H200. Where the rows path's
        # GEMMs run in place, dW reads it as it is instead.
        self._transpose_dy = rows_path.transpose_kernel_runs(p)
        self._read_dy = rows_path.weight_gradient_reads_dy(p)

    def __call__(self, t: ConvTensors) -> torch.Tensor:
        return self.keeping_columns(t.input, t.weight, t.bias)[0]

    def weight_gradient(self, dy: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
        """dW from dY and the columns of the same call's forward."""
        from_dy = self._by_strides.get(dy.stride())
        if from_dy is None:
            from_dy = self._weight_gradient_for(dy)
        return from_dy(dy, col)

    def _weight_gradient_for(self, dy: torch.Tensor) -> Callable[..., torch.Tensor]:
        """How dW comes from a dY of ``dy``'s strides and the columns: dY's rows
        transposed (a view where dY is token-major, else a copy) into the product, or
        a dense channels-first dY read in place; found and kept."""
        if len(self._by_strides) >= _DY_LAYOUTS_MAX:
            self._by_strides.clear()
        meta = meta_like(dy)
        rows_t = rows_view(meta)
        product = self._product
        dense = meta.is_contiguous()
        if rows_t is not None:
            # dY's rows, transposed, as one view: a .t() per call less.
            view = ViewRecipe(rows_t.t(), meta).apply

            def from_dy(dy: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
                return product(view(dy), col)

        elif self._read_dy and dense:
            from_dy = _channels_first_weight_gradient(self._p, self._ld, meta)
        else:
            copy = rows_path.channels_first_rows if self._transpose_dy and dense else rows

            def from_dy(dy: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
                return product(copy(dy).t(), col)

        self._by_strides[dy.stride()] = from_dy
        return from_dy


def _channels_first_weight_gradient(
    p: ConvProblem, ld: int, dy: torch.Tensor
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """dW from a dense channels-first dY like ``dy`` (meta), read in place by the rows
    path's weight-gradient kernel, and the forward's columns [M, ld]: the product's
    [K, Kred] rows land in dW's own memory where that is a view, else are copied in."""
    from gemmconv.kernels.pixel_rows_gemm import channels_first_weight_gradient

    dy3 = ViewRecipe(batched_view(dy), dy).apply
    k = p.gemm_k
    splits = rows_path.in_place_splits(p, p.gemm_m, k, torch.device(p.device_type))
    order = column_layout(p)
    meta_dw = empty_in(p.weight_shape, p.layout, p.dtype, torch.device("meta"))
    size, stride = tuple(meta_dw.shape), meta_dw.stride()
    dw_rows = ViewRecipe.of(weight_rows_target(meta_dw, order), meta_dw)
    # The reduction's first k columns; past them a padded ld's columns hold padding.
    columns = (lambda col: col) if ld == k else (lambda col: col[:, :k])

    def weight_gradient(dy: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
        dw = torch.empty_strided(size, stride, dtype=col.dtype, device=col.device)
        if dw_rows is not None:
            channels_first_weight_gradient(dy3(dy), columns(col), dw_rows(dw), splits)
        else:
            product = col.new_empty(p.k, k)
            channels_first_weight_gradient(dy3(dy), columns(col), product, splits)
            store_weight_rows(dw, product, order)
        return dw

    return weight_gradient


def _weight_gradient_product(
    p: ConvProblem, ld: int
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """dW from dY's rows transposed [K, M] and the columns [M, ld]: the long-reduction
    GEMM, its [K, ld] result delivered as dW dense in the problem's layout (as the
    solvers' weight gradient returns it), with every decision about where the product
    goes taken here, once."""
    mm = reduction_mm_of(p.dtype, p.device_type, p.gemm_m, p.k, ld)
    order = column_layout(p)
    k = p.gemm_k
    dw = empty_in(p.weight_shape, p.layout, p.dtype, torch.device("meta"))
    size, stride = tuple(dw.shape), dw.stride()
    target = weight_rows_target(dw, order) if ld == k else None
    if target is not None and target.stride() == (ld, 1):
        # dW's memory is the product's [K, ld] rows in order: dW is their view.
        return lambda dy_rows_t, col: mm(dy_rows_t, col).as_strided(size, stride)
    dw_rows = ViewRecipe.of(target, dw)

    def product(dy_rows_t: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
        dw = torch.empty_strided(size, stride, dtype=col.dtype, device=col.device)
        if dw_rows is not None:
            mm(dy_rows_t, col, out=dw_rows(dw))
        else:
            store_weight_rows(dw, mm(dy_rows_t, col)[:, :k], order)
        return dw

    return product


_DY_LAYOUTS_MAX = 8


def _output_views(solver, p: ConvProblem, t: torch.Tensor):
    """How the GEMM meets y or dY: (rows view, [N, K, P] view, whether the rows path
    runs), each view a recipe or None; without a rows view and the rows path, the
    per-sample bmm reads or writes the [N, K, P] blocks. None where ``t`` is dense in
    neither layout (the solver's own method runs then)."""
    rows = ViewRecipe.of(rows_view(t), t)
    blocks = ViewRecipe.of(batched_view(t), t)
    if rows is None and blocks is None:
        return None
    return rows, blocks, rows is None and solver.uses_rows_path(p)


def _backward_data(solver, p: ConvProblem, ld: int, t: ConvTensors, result: ResultBuffer, views):
    dy_rows, dy3, through_rows = views
    in_place = through_rows and rows_path.in_place(p)
    if in_place:  # as in _forward
        from gemmconv.kernels.pixel_rows_gemm import channels_first_into_rows
    covered = covered_extent(p)
    cropped = covered != tuple(p.spatial)
    target = ViewRecipe.of(solver.columns.in_place_target(result.meta, p, ld), result.meta)
    weight_rows = _weight_rows(p, ld, t.weight)
    columns = solver.columns
    scatter = columns.prepared_scatter(result.meta, p, ld)
    pixel_rows = p.gemm_m
    # Where dx's memory is exactly the product's rows in order (one patch a sample),
    # the product allocates it and dx is its view, as the forward's y_is_rows.
    dx_is_rows = (
        dy_rows is not None
        and target is not None
        and target.offset == 0
        and target.stride == (ld, 1)
        and target.size[0] * ld == result.meta.numel()
    )

    def backward_data(t: ConvTensors) -> torch.Tensor:
        dy = t.grad_output
        if dx_is_rows:
            return result.over(torch.mm(dy_rows(dy), weight_rows(t.weight)))
        dx = result(dy)
        if cropped:
            zero_outside(dx, covered)
        wm = weight_rows(t.weight)
        if in_place:  # the rows path's one pass, its GEMM reading dY (rows_path.backward_data)
            dcol = dy.new_empty(pixel_rows, ld)
            channels_first_into_rows(dy3(dy), wm, dcol)
            scatter(dcol, dx)
        elif through_rows:
            rows_path.backward_data(columns, p, dy3(dy), wm, dx, p.n, fused=False)
        elif dy_rows is None:
            # Channels-first dY: each sample's [K, P] block read transposed, no copy.
            dcol = torch.bmm(dy3(dy).transpose(1, 2), wm.expand(p.n, *wm.shape))
            scatter(dcol.view(-1, ld), dx)
        elif target is not None:
            torch.mm(dy_rows(dy), wm, out=target(dx))
        else:
            scatter(torch.mm(dy_rows(dy), wm), dx)
        return dx

    return backward_data


def _backward_weights(solver, p: ConvProblem, ld: int, t: ConvTensors, result: ResultBuffer, views):
    dy_rows, dy3, through_rows = views
    order = column_layout(p)
    columns = solver.columns.prepared_gather(t.input, p, ld)
    product = _weight_gradient_product(p, ld)
    k = p.gemm_k
    # A channels-first dY off the rows path is copied to rows by torch.
    dy_as_rows = dy_rows or rows
    in_place = through_rows and rows_path.in_place(p)

    def backward_weights(t: ConvTensors) -> torch.Tensor:
        dy, x = t.grad_output, t.input
        if through_rows:
            dw = result(x)
            dw_rows = rows_path.weight_gradient_rows(solver.columns, p, x, dy3(dy), ld, p.n,
                                                     fused=in_place)  # fmt: skip
            store_weight_rows(dw, dw_rows[:, :k].to(dw.dtype), order)
            return dw
        return product(dy_as_rows(dy).t(), columns(x))

    return backward_weights


__all__ = ["ColumnKeepingForward", "prepare"]
