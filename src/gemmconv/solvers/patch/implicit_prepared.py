"""Prepared runs of the implicit GEMMs: each direction's launch bound once.

``ImplicitGemmSolver``'s own directions find the weight's rows, build the launch's key
from every operand's sizes and strides and look it up on every call: about 20 us of
Python a call on the H200's host, where the prepared runs of the column GEMMs spend
half that (bench/results/point2d_public_h200.txt: 40 us of host issue for its
backward-data run against 20 for ``point_output``'s). An eager call with the same
metadata makes the same launch, so the plan binds it here, found on meta tensors:
a call then allocates its result, takes the weight's rows (a view replayed, or the
permuted copy where they are one) and launches the kernel. The solver's own
directions stay the reference; the solver matrix compares the two bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gemmconv.core.precision import convolutions_allow_tf32
from gemmconv.core.problem import ConvProblem, Direction
from gemmconv.kernels import split_programs
from gemmconv.solvers.base import ConvTensors
from gemmconv.solvers.patch.mapping import channels_last_columns, column_layout, covered_extent
from gemmconv.solvers.prepared_run import ResultBuffer, Runner, meta_operands
from gemmconv.solvers.views import (
    ViewRecipe,
    store_weight_rows,
    weight_rows,
    weight_rows_target,
    zero_outside,
)


def prepare(solver, p: ConvProblem, t: ConvTensors) -> Runner:
    """The prepared run of ``solver`` (an ImplicitGemmSolver) for operands like ``t``."""
    from gemmconv.kernels import patch_gemm

    meta = meta_operands(t)
    device = next(v for v in (t.input, t.grad_output) if v is not None).device
    allow_tf32 = convolutions_allow_tf32()
    columns_last = channels_last_columns(p)
    if p.direction is Direction.FORWARD:
        result = ResultBuffer(p, meta.input)
        rows_of = _weight_rows_of(p, meta.weight)
        launch = patch_gemm.forward_launch(
            meta.input, rows_of(meta.weight), meta.bias, p.kernel, columns_last, result.meta,
            allow_tf32, device,
        )  # fmt: skip

        def run(t: ConvTensors) -> torch.Tensor:
            y = result(t.input)
            if launch is not None:
                launch(t.input, rows_of(t.weight), t.bias, y)
            return y

    elif p.direction is Direction.BACKWARD_DATA:
        result = ResultBuffer(p, meta.grad_output)
        rows_of = _weight_rows_of(p, meta.weight)
        launch = patch_gemm.backward_data_launch(
            meta.grad_output, rows_of(meta.weight), p.kernel, columns_last, result.meta,
            allow_tf32, device,
        )  # fmt: skip
        covered = covered_extent(p)
        uncovered = any(keep < size for size, keep in zip(p.spatial, covered))

        def run(t: ConvTensors) -> torch.Tensor:
            dx = result(t.grad_output)
            if uncovered:
                zero_outside(dx, covered)
            if launch is not None:
                launch(t.grad_output, rows_of(t.weight), dx)
            return dx

    else:
        result = ResultBuffer(p, meta.input)
        splits = patch_gemm.wgrad_splits(p.gemm_m, p.k, p.gemm_k, p.dtype, split_programs(device))
        gradient = patch_gemm.weight_grad_launch(
            meta.grad_output, meta.input, p.kernel, columns_last, splits, allow_tf32, device
        )
        store = _weight_store(p, result)

        def run(t: ConvTensors) -> torch.Tensor:
            return store(gradient.run(t.grad_output, t.input), t.input)

    if p.dtype == torch.float32:
        # The flag decides the fp32 dot's precision, a constant of the launch: a call
        # under the other setting takes the solver's own run.
        prepared_run = run

        def run(t: ConvTensors) -> torch.Tensor:
            if convolutions_allow_tf32() != allow_tf32:
                return solver.run(p, t)
            return prepared_run(t)

    run.result_strides = result.stride  # type: ignore[attr-defined]
    return run


def _weight_rows_of(p: ConvProblem, weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """The weight as dense [K, Kred] rows in the column order, as the solver's own
    directions take them: a view replayed where the weight's memory is those rows,
    else its permuted copy, made afresh each call (a kept copy could be stale after an
    update through ``weight.data``)."""
    layout = column_layout(p)
    view = weight_rows_target(weight, layout)
    if view is not None and view.is_contiguous():
        return ViewRecipe(view, weight).apply
    return lambda w: weight_rows(w, layout).contiguous()


def _weight_store(
    p: ConvProblem, result: ResultBuffer
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """How the fp32 rows [K, Kred] become dW: rounded once to dW's dtype, then where
    that copy's memory is dW's own order its view, else copied into a new dW."""
    layout = column_layout(p)
    view = weight_rows_target(result.meta, layout)
    if view is not None and view.is_contiguous() and result.meta.storage_offset() == 0:
        # dW's memory is its rows in order: the rounded rows, viewed as dW, are it.
        dtype, over = p.dtype, result.over

        def as_result(rows32: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
            return over(rows32.to(dtype))

        return as_result

    def copied(rows32: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        dw = result(like)
        store_weight_rows(dw, rows32, layout)
        return dw

    return copied


__all__ = ["prepare"]
