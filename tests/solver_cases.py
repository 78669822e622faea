"""The solver matrix: problems each registered solver must handle, generated from its
declared capabilities (directions, spatial dims, layouts, dtypes, devices).

Geometries are keyed by problem class, not by solver: a solver is tested on every
geometry it applies to. The first of them (in GEOMETRIES' order) runs the full product
of every declared dims x layout x dtype x direction; each further one runs every dims
x layout x direction once, the dtype rotating, so that each geometry meets every
dtype without the product growing with the geometries. The CPU suite
(test_solver_matrix.py) and the GPU suite (test_gpu_solvers.py) draw from the same
generator, and so do the tests that run every solver (numerics, determinism).

Solvers whose kernels are Triton declare CUDA only; on the CPU the matrix runs them in
Triton's interpreter (gemmconv.kernels compiles kernels for CPU tensors through it),
in fp32 and fp16 (the interpreter's tl.dot is wrong for bf16). On CUDA every kernel
variant they meet compiles for seconds, so there their first geometry is rotated like
the others: their full product runs on the CPU.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import torch

from gemmconv import ConvProblem, Direction, Layout
from gemmconv.solvers import SOLVERS, Solver


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


# By problem class, in the order a solver's first (full-product) geometry is looked
# for: general problems (the catch-all solvers), the patch class, then its special
# cases, one output pixel and 1x1 kernels (stride 1 is a patch too). Asymmetric
# kernels and odd sizes, so a transposed or mixed-up dimension shows; C = 4 keeps every
# reduction 16-byte aligned in every dtype, C = 3 with odd kernels keeps it unaligned
# in every dtype (the padded-reduction solvers need that).
GEOMETRIES: dict[str, list[Geometry]] = {
    "general": [
        Geometry(
            "general",
            spatial=(9, 7, 6),
            kernel=(3, 2, 2),
            stride=(2, 1, 2),
            padding=(1, 0, 1),
            dilation=(2, 1, 1),
            groups=2,
        ),
    ],
    "patch": [
        Geometry("exact", spatial=(8, 6, 4), kernel=(4, 3, 2), stride=(4, 3, 2)),
        Geometry("remainder_unaligned", spatial=(11, 7, 8), kernel=(5, 3, 3),
                 stride=(5, 3, 3), c=3),
    ],
    "point_output": [
        Geometry("s_eq_r", spatial=(4, 3, 2), kernel=(4, 3, 2), stride=(4, 3, 2)),
        Geometry("s_eq_r_unaligned", spatial=(5, 3, 3), kernel=(5, 3, 3), stride=(5, 3, 3),
                 c=3),
        Geometry("s_gt_r_unaligned", spatial=(7, 4, 5), kernel=(5, 3, 3), stride=(5, 3, 3),
                 c=3),
    ],
    "strided_pointwise": [
        Geometry("odd_s2", spatial=(7, 5, 3), kernel=(1,), stride=(2,)),
        Geometry("mixed", spatial=(7, 6, 5), kernel=(1,), stride=(3, 1, 2)),
    ],
    "pointwise": [Geometry("odd", spatial=(5, 7, 3), kernel=(1,), stride=(1,))],
}  # fmt: skip

# Solvers whose kernels are Triton: on the CPU they run interpreted, in these dtypes.
TRITON_SOLVERS = frozenset({"patch_triton", "patch_implicit"})
INTERPRETER_DTYPES = frozenset({torch.float32, torch.float16})


def _ordered_geometries() -> list[tuple[str, Geometry]]:
    return [(cls, g) for cls, geometries in GEOMETRIES.items() for g in geometries]


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


def runs_on(solver: Solver, device_type: str) -> bool:
    """Whether the matrix runs ``solver`` on ``device_type``: a device it declares, or
    the CPU through Triton's interpreter."""
    return device_type in solver.devices or (device_type == "cpu" and interpreted(solver))


def interpreted(solver: Solver) -> bool:
    """Whether the solver runs on the CPU only through Triton's interpreter."""
    return solver.id in TRITON_SOLVERS and "cpu" not in solver.devices


def matrix_dtypes(solver: Solver, device_type: str) -> list[torch.dtype]:
    dtypes = solver.dtypes
    if device_type == "cpu" and interpreted(solver):
        dtypes = dtypes & INTERPRETER_DTYPES
    return sorted(dtypes, key=str)


def applies(solver: Solver, problem: ConvProblem) -> bool:
    """The solver's verdict on ``problem``, as on a device it declares: an interpreted
    solver is asked about the problem on CUDA."""
    if problem.device_type not in solver.devices:
        problem = dataclasses.replace(problem, device_type=next(iter(solver.devices)))
    return solver.is_applicable(problem)


def full_product_first(solver: Solver, device_type: str) -> bool:
    """Whether the solver's first geometry runs the full product on ``device_type``."""
    return not (device_type == "cuda" and solver.id in TRITON_SOLVERS)


def solver_cases(solver: Solver, device_type: str) -> list[tuple]:
    """(solver, problem class, geometry, dims, layout, dtype, direction) cases of one
    solver, by the rule in the module docstring."""
    if not runs_on(solver, device_type):
        return []
    dims_list = sorted(solver.spatial_dims)
    layouts = sorted(solver.layouts, key=lambda v: v.value)
    dtypes = matrix_dtypes(solver, device_type)
    directions = sorted(solver.directions, key=lambda v: v.value)
    cases = []
    first = full_product_first(solver, device_type)
    for cls, geometry in _ordered_geometries():
        found = []
        combos = itertools.product(dims_list, layouts, directions)
        for index, (dims, layout, direction) in enumerate(combos):
            chosen = dtypes if first else [dtypes[(len(cases) + index) % len(dtypes)]]
            for dtype in chosen:
                problem = problem_for(geometry, dims, layout, dtype, device_type, direction)
                if applies(solver, problem):
                    found.append((solver, cls, geometry, dims, layout, dtype, direction))
        if found:
            first = False
            cases += found
    return cases


def solver_matrix(device_type: str, dtypes=None) -> list[tuple]:
    """Every registered solver's cases on ``device_type`` (``dtypes`` filters them)."""
    return [
        case
        for solver in SOLVERS
        for case in solver_cases(solver, device_type)
        if dtypes is None or case[5] in dtypes
    ]


def case_id(case) -> str:
    solver, cls, geometry, dims, layout, dtype, direction = case
    short = {Layout.CHANNELS_FIRST: "cf", Layout.CHANNELS_LAST: "cl"}[layout]
    return (
        f"{solver.id}-{cls}.{geometry.label}-{dims}d-{short}-"
        f"{str(dtype).replace('torch.', '')}-{direction.value}"
    )


def operands(problem: ConvProblem, device, seed: int):
    """Fresh seeded random operands of the problem's direction, dense in its layout,
    but for the bias of every other seed, which is every other element of a longer
    vector (a bias is taken with any stride)."""
    from gemmconv import ConvTensors

    from conftest import random_in

    gen = torch.Generator().manual_seed(seed)
    layout, dtype = problem.layout, problem.dtype

    def rand(shape, lay=layout):
        return random_in(shape, lay, dtype, device, gen)

    x_shape, x_layout = problem.input_shape, problem.input_layout
    if problem.direction is Direction.FORWARD:
        bias = None
        if problem.has_bias:
            step = 1 + seed % 2
            bias = rand((problem.k * step,), Layout.CHANNELS_FIRST)[::step]
        return ConvTensors(
            input=rand(x_shape, x_layout), weight=rand(problem.weight_shape), bias=bias
        )
    grad_output = rand(problem.output_shape)
    if problem.direction is Direction.BACKWARD_DATA:
        return ConvTensors(grad_output=grad_output, weight=rand(problem.weight_shape))
    return ConvTensors(grad_output=grad_output, input=rand(x_shape, x_layout))


def nan_output(problem: ConvProblem, device) -> torch.Tensor:
    """The direction's result buffer, NaN everywhere, in the layout the result takes."""
    from gemmconv.solvers.views import result_shape_and_layout

    from conftest import nan_in

    shape, layout = result_shape_and_layout(problem)
    return nan_in(shape, layout, problem.dtype, device)


def check_case(case, device_type: str, seed: int) -> None:
    """Run one solver case into a NaN-filled output and judge it against float64 and
    vendor (an interpreted solver must be let onto the CPU by the caller)."""
    solver, _, geometry, dims, layout, dtype, direction = case
    problem = problem_for(geometry, dims, layout, dtype, device_type, direction)
    check_run(solver, problem, operands(problem, device_type, seed), case_id(case))


def check_run(solver, problem: ConvProblem, tensors, label: str) -> None:
    """Run ``solver`` on ``tensors`` into a NaN-filled output and judge the result
    against float64 and the vendor path."""
    from gemmconv.measuring.verify import judge, reference
    from gemmconv.solvers.vendor import VendorSolver

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
    check_prepared(solver, problem, tensors, result, label)


def check_prepared(solver, problem: ConvProblem, tensors, result, label: str) -> None:
    """The solver's prepared run (what eager calls run) gives ``result`` (its own run's,
    into a NaN-filled output) bit for bit, on its first call and on a second one
    (Triton launches are prepared by the first). Its memory layout may
    differ where the solver's own allocation does (ops re-lays it out either way)."""
    runner = solver.prepare(problem, tensors)
    if isinstance(runner, functools.partial) and runner.func == solver.run:
        return  # not prepared: the run itself, judged above (and maybe not bitwise repeatable)
    # A run that states its results' strides (ops then skips checking them) keeps to them.
    stated = getattr(runner, "result_strides", None)
    for call in ("first", "second"):
        prepared = runner(tensors)
        assert prepared.shape == result.shape, f"{label}: {call} prepared call's shape"
        assert torch.equal(prepared, result), f"{label}: {call} prepared call differs from run"
        assert stated in (None, prepared.stride()), f"{label}: {call} prepared call's strides"


def _shape_attr(direction: Direction) -> str:
    return {
        Direction.FORWARD: "output_shape",
        Direction.BACKWARD_DATA: "input_shape",
        Direction.BACKWARD_WEIGHTS: "weight_shape",
    }[direction]
