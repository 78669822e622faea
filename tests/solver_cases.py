"""Problems each solver must handle, generated from the solvers' declared capabilities.

For every solver, direction, spatial dimension, layout and dtype it declares, there
is an eligible problem here; the CPU and GPU suites run the same list.
"""

from __future__ import annotations

import dataclasses

import torch

from gemmconv import ConvProblem, Direction, Layout
from gemmconv.solvers import SOLVERS


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Sizes per spatial dimension (cycled for 2-D/3-D) of one eligible problem."""

    label: str
    spatial: tuple[int, ...]
    kernel: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...] = (0,)
    dilation: tuple[int, ...] = (1,)
    groups: int = 1
    n: int = 3
    c: int = 4
    k: int = 6


# Asymmetric kernels and odd sizes, so a transposed or mixed-up dimension shows.
GEOMETRIES: dict[str, list[Geometry]] = {
    "point_output": [
        Geometry("s_eq_r", spatial=(4, 3, 2), kernel=(4, 3, 2), stride=(4, 3, 2)),
        Geometry("s_gt_r", spatial=(7, 5, 3), kernel=(4, 3, 2), stride=(4, 3, 2)),
    ],
    "patch": [
        Geometry("exact", spatial=(8, 6, 4), kernel=(4, 3, 2), stride=(4, 3, 2)),
        Geometry("remainder", spatial=(11, 7, 5), kernel=(4, 3, 2), stride=(4, 3, 2)),
    ],
    "pointwise": [Geometry("odd", spatial=(5, 7, 3), kernel=(1,), stride=(1,))],
    "strided_pointwise": [
        Geometry("odd_s2", spatial=(7, 5, 3), kernel=(1,), stride=(2,)),
        Geometry("mixed", spatial=(7, 6, 5), kernel=(1,), stride=(3, 1, 2)),
    ],
    "im2col": [
        Geometry(
            "general",
            spatial=(9, 7, 6),
            kernel=(3, 2, 2),
            stride=(2, 1, 2),
            padding=(1, 0, 1),
            dilation=(2, 1, 1),
            groups=2,
        ),
        Geometry("patch_like", spatial=(8, 6, 4), kernel=(4, 3, 2), stride=(4, 3, 2)),
    ],
    "vendor": [
        Geometry(
            "general",
            spatial=(9, 7, 6),
            kernel=(3, 2, 2),
            stride=(2, 1, 2),
            padding=(1, 0, 1),
            dilation=(2, 1, 1),
            groups=2,
        )
    ],
}


def _cycle(values: tuple[int, ...], dims: int) -> tuple[int, ...]:
    return tuple(values[i % len(values)] for i in range(dims))


def problem_for(
    geometry: Geometry,
    dims: int,
    layout: Layout,
    dtype: torch.dtype,
    device_type: str,
    direction: Direction,
    has_bias: bool = True,
) -> ConvProblem:
    return ConvProblem.from_sizes(
        n=geometry.n,
        c=geometry.c,
        k=geometry.k,
        spatial=geometry.spatial[:dims],
        kernel=_cycle(geometry.kernel, dims),
        stride=_cycle(geometry.stride, dims),
        padding=_cycle(geometry.padding, dims),
        dilation=_cycle(geometry.dilation, dims),
        groups=geometry.groups,
        layout=layout,
        dtype=dtype,
        device_type=device_type,
        direction=direction,
        has_bias=has_bias and direction is Direction.FORWARD,
    )


def solver_matrix(device_type: str, dtypes=None):
    """(solver, geometry, dims, layout, dtype, direction) for everything each solver claims."""
    cases = []
    for solver in SOLVERS:
        if device_type not in solver.devices:
            continue
        for geometry in GEOMETRIES.get(solver.id, []):
            for dims in sorted(solver.spatial_dims):
                for layout in sorted(solver.layouts, key=lambda v: v.value):
                    for dtype in sorted(solver.dtypes, key=str):
                        if dtypes is not None and dtype not in dtypes:
                            continue
                        for direction in sorted(solver.directions, key=lambda v: v.value):
                            cases.append((solver, geometry, dims, layout, dtype, direction))
    return cases


def case_id(case) -> str:
    solver, geometry, dims, layout, dtype, direction = case
    short = {Layout.CHANNELS_FIRST: "cf", Layout.CHANNELS_LAST: "cl"}[layout]
    return (
        f"{solver.id}-{geometry.label}-{dims}d-{short}-{str(dtype).replace('torch.', '')}"
        f"-{direction.value}"
    )


def operands(problem: ConvProblem, device, seed: int):
    """Fresh seeded random operands of the problem's direction, dense in its layout."""
    from gemmconv import ConvTensors

    from conftest import random_in

    gen = torch.Generator().manual_seed(seed)
    layout, dtype = problem.layout, problem.dtype

    def rand(shape, lay=layout):
        return random_in(shape, lay, dtype, device, gen)

    x_shape, x_layout = problem.input_shape, problem.input_layout
    if problem.direction is Direction.FORWARD:
        bias = rand((problem.k,), Layout.CHANNELS_FIRST) if problem.has_bias else None
        return ConvTensors(
            input=rand(x_shape, x_layout), weight=rand(problem.weight_shape), bias=bias
        )
    grad_output = rand(problem.output_shape)
    if problem.direction is Direction.BACKWARD_DATA:
        return ConvTensors(grad_output=grad_output, weight=rand(problem.weight_shape))
    return ConvTensors(grad_output=grad_output, input=rand(x_shape, x_layout))


def nan_output(problem: ConvProblem, device) -> torch.Tensor:
    """The direction's result buffer, NaN everywhere, in the layout the result takes."""
    from gemmconv.memory_format import output_layout

    from conftest import nan_in

    if problem.direction is Direction.FORWARD:
        shape, layout = (
            problem.output_shape,
            output_layout(problem.layout, problem.dims, problem.dtype, problem.device_type),
        )
    elif problem.direction is Direction.BACKWARD_DATA:
        shape, layout = (
            problem.input_shape,
            output_layout(problem.layout, problem.dims, problem.dtype, problem.device_type),
        )
    else:
        shape, layout = problem.weight_shape, problem.layout
    return nan_in(shape, layout, problem.dtype, device)


def check_case(case, device_type: str, seed: int) -> None:
    """Run one solver case into a NaN-filled output and judge it against float64 and vendor."""
    solver, geometry, dims, layout, dtype, direction = case
    problem = problem_for(geometry, dims, layout, dtype, device_type, direction)
    check_run(solver, problem, operands(problem, device_type, seed), case_id(case))


def check_run(solver, problem: ConvProblem, tensors, label: str) -> None:
    """Run ``solver`` on ``tensors`` into a NaN-filled output and judge the result
    against float64 and the vendor path."""
    from gemmconv.solvers.vendor import VendorSolver
    from gemmconv.verify import judge, reference

    assert solver.not_supported_reasons(problem) == [], solver.not_supported_reasons(problem)
    device = next(t for t in (tensors.input, tensors.grad_output) if t is not None).device
    out = nan_output(problem, device)
    result = solver.run(problem, tensors, out=out)
    assert result.data_ptr() == out.data_ptr(), "the solver did not write into the given output"
    assert tuple(result.shape) == tuple(getattr(problem, _shape_attr(problem.direction)))
    assert not torch.isnan(result).any(), "an output element was left unwritten (NaN)"
    vendor = VendorSolver().run(problem, tensors)
    verdict = judge(problem, result, reference(problem, tensors), vendor)
    assert verdict.ok, f"{label}: {verdict}"


def _shape_attr(direction: Direction) -> str:
    return {
        Direction.FORWARD: "output_shape",
        Direction.BACKWARD_DATA: "input_shape",
        Direction.BACKWARD_WEIGHTS: "weight_shape",
    }[direction]
