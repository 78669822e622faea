"""The patch solvers' column order follows the memory order of the tensor they gather
or scatter (x, or dx in backward-data), not the problem's layout.

A channels-first x with a channels-last weight is a channels-last problem (torch
gives it a channels-last output); its patches are still read in x's own
channels-first order, and the weight is flattened to match. Every patch solver is
checked on such mixed operands, and on the reverse, against float64 (the Triton
solvers through the interpreter, their device restriction lifted as in
test_triton_kernels).
"""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch

import gemmconv
from gemmconv import ConvProblem, ConvTensors, Direction, Layout, get_solver
from gemmconv.core.memory_format import output_layout
from gemmconv.kernels import patch_gemm, patch_permute
from gemmconv.kernels.launch import LaunchCache
from gemmconv.solvers.patch import column_layout
from gemmconv.solvers.patch.cost import gathered_run_bytes

from conftest import random_in
from solver_cases import check_run

CF, CL = Layout.CHANNELS_FIRST, Layout.CHANNELS_LAST
PATCH_SOLVERS = ("point_output", "patch", "patch_padded", "patch_triton", "patch_implicit")
# (spatial, kernel) per dims: a remainder no patch reads, C = 3 and odd kernels so the
# reduction is unaligned (patch_padded applies); and point-output with S == R.
SHAPES = {
    "remainder": {2: ((11, 7), (5, 3)), 3: ((11, 7, 8), (5, 3, 3))},
    "point": {2: ((5, 3), (5, 3)), 3: ((5, 3, 3), (5, 3, 3))},
}
# (x layout, weight layout): the mixed pair and its reverse.
PAIRS = [(CF, CL), (CL, CF)]


def _tensors(x_layout, w_layout, spatial, kernel, dtype, seed, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    x = random_in((2, 3, *spatial), x_layout, dtype, device, gen)
    w = random_in((5, 3, *kernel), w_layout, dtype, device, gen)
    bias = random_in((5,), CF, dtype, device, gen)
    return x, w, bias


def _problem(x, w, bias, kernel, direction) -> ConvProblem:
    """The problem the custom ops build: from the forward's operands, and for the weight
    gradient with x's own layout (backward-data has no x)."""
    forward_bias = bias if direction is Direction.FORWARD else None
    return ConvProblem.from_tensors(x, w, forward_bias, stride=kernel, direction=direction)


def _direction_tensors(p: ConvProblem, x, w, bias, seed) -> ConvTensors:
    if p.direction is Direction.FORWARD:
        return ConvTensors(input=x, weight=w, bias=bias)
    gen = torch.Generator().manual_seed(seed + 1)
    # dY in the layout the forward returned y in, as autograd hands it over.
    dy_layout = output_layout(p.layout, p.dims, p.dtype, p.device_type)
    dy = random_in(p.output_shape, dy_layout, p.dtype, x.device, gen)
    if p.direction is Direction.BACKWARD_DATA:
        return ConvTensors(grad_output=dy, weight=w)
    return ConvTensors(grad_output=dy, input=x)


CASES = [
    (solver_id, shape, dims, pair, direction)
    for solver_id, shape, dims, pair, direction in itertools.product(
        PATCH_SOLVERS, SHAPES, (2, 3), PAIRS, list(Direction)
    )
    if not (solver_id == "point_output" and shape == "remainder")
    # With S == R and C = 3 the reduction is unaligned, so patch_padded applies to both.
]


def _case_id(case) -> str:
    solver_id, shape, dims, (x_layout, w_layout), direction = case
    short = {CF: "cf", CL: "cl"}
    return f"{solver_id}-{shape}-{dims}d-x{short[x_layout]}-w{short[w_layout]}-{direction.value}"


def _check_mixed(case, dtype: torch.dtype, device: str) -> None:
    solver_id, shape, dims, (x_layout, w_layout), direction = case
    spatial, kernel = SHAPES[shape][dims]
    seed = zlib.crc32(_case_id(case).encode())
    x, w, bias = _tensors(x_layout, w_layout, spatial, kernel, dtype, seed, device)
    p = _problem(x, w, bias, kernel, direction)
    assert p.layout is CL  # one channels-last operand makes the problem channels-last
    if direction is not Direction.BACKWARD_DATA:
        assert p.input_layout is x_layout and column_layout(p) is x_layout
    tensors = _direction_tensors(p, x, w, bias, seed)
    check_run(get_solver(solver_id), p, tensors, f"{_case_id(case)}-{dtype}")


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_mixed_layouts_match_float64(case, monkeypatch):
    monkeypatch.setattr(type(get_solver(case[0])), "devices", frozenset({"cpu", "cuda"}))
    _check_mixed(case, torch.float32, "cpu")


# One 3-D problem with a remainder and one 2-D point-output problem per solver: each
# new geometry compiles new kernel variants on the GPU.
GPU_CASES = [c for c in CASES if (c[1], c[2]) in {("remainder", 3), ("point", 2)}]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", GPU_CASES, ids=[_case_id(c) for c in GPU_CASES])
def test_mixed_layouts_match_float64_on_cuda(case, dtype):
    _check_mixed(case, dtype, "cuda")


def test_problem_records_the_inputs_own_layout():
    x, w, _ = _tensors(CF, CL, (8, 6), (4, 3), torch.float32, 1)
    mixed = ConvProblem.from_tensors(x, w, stride=(4, 3))
    assert (mixed.layout, mixed.input_layout) == (CL, CF)
    assert mixed.key().endswith("-channels_last-input_channels_first-fp32-cpu-forward-b0")
    # Operands of one layout keep the key they had before input_layout existed.
    same = ConvProblem.from_tensors(x.to(memory_format=torch.channels_last), w, stride=(4, 3))
    assert same.input_layout is CL and "input_" not in same.key()
    assert same == ConvProblem.from_sizes(2, 3, 5, (8, 6), (4, 3), (4, 3), layout=CL)
    # Backward-data reads no x: its problem is the same whatever x's layout was.
    data = mixed.with_direction(Direction.BACKWARD_DATA)
    assert data.input_layout is CL
    assert data == same.with_direction(Direction.BACKWARD_DATA)
    weights = mixed.with_direction(Direction.BACKWARD_WEIGHTS)
    assert weights.input_layout is CF and weights.key() != same.key()


def _record_runs(monkeypatch, module) -> list[int]:
    """The contiguous runs every new launch of ``module`` is prepared with."""
    runs: list[int] = []
    original = module.contiguous_run

    def recording(g):
        runs.append(original(g))
        return runs[-1]

    monkeypatch.setattr(module, "contiguous_run", recording)
    monkeypatch.setattr(module, "_launches", LaunchCache())
    return runs


@pytest.mark.parametrize(
    ("solver_id", "module"), [("patch_triton", patch_permute), ("patch_implicit", patch_gemm)]
)
@pytest.mark.parametrize("direction", list(Direction), ids=lambda d: d.value)
def test_channels_first_x_with_channels_last_weight_takes_the_contiguous_run(
    solver_id, module, direction, monkeypatch
):
    # Read in the channels-last column order, a channels-first x would have no
    # contiguous run (contiguous_run 0: the kernels' general index path).
    solver = get_solver(solver_id)
    monkeypatch.setattr(type(solver), "devices", frozenset({"cpu", "cuda"}))
    runs = _record_runs(monkeypatch, module)
    x, w, bias = _tensors(CF, CL, (8, 6), (4, 3), torch.float32, 3)
    p = _problem(x, w, bias, (4, 3), direction)
    solver.run(p, _direction_tensors(p, x, w, bias, 3))
    assert runs and all(run > 0 for run in runs), runs


def test_the_cost_follows_the_column_order():
    x, w, _ = _tensors(CF, CL, (8, 6), (4, 3), torch.float32, 1)
    mixed = ConvProblem.from_tensors(x, w, stride=(4, 3))
    same = ConvProblem.from_tensors(x.to(memory_format=torch.channels_last), w, stride=(4, 3))
    # Runs of one kernel row in x's channels-first order, of a row of all channels in
    # the channels-last one.
    assert gathered_run_bytes(mixed) == 3 * 4
    assert gathered_run_bytes(same) == 3 * 3 * 4
    implicit = get_solver("patch_implicit")
    assert implicit.efficiency(mixed) < implicit.efficiency(same)
    # Point-output with S == R: the column matrix is x's own memory in either order.
    point_x = x[:, :, :4, :3].contiguous()
    point = ConvProblem.from_tensors(point_x, w, stride=(4, 3))
    assert point.input_layout is CF
    assert get_solver("patch").workspace_bytes(point) == 0


@pytest.mark.parametrize("sliced", [False, True], ids=["dense", "sliced"])
def test_ops_build_the_problems_from_the_inputs_layout(sliced, monkeypatch):
    seen: dict[Direction, tuple[ConvProblem, ConvTensors]] = {}
    patch_cls = type(get_solver("patch"))
    original = patch_cls.prepare

    def recording(self, problem, tensors):
        seen[problem.direction] = (problem, tensors)
        return original(self, problem, tensors)

    monkeypatch.setattr(patch_cls, "prepare", recording)
    monkeypatch.setenv("GEMMCONV_SOLVER", "patch")
    wide, w, bias = _tensors(CF, CL, (8, 12), (4, 3), torch.float64, 5)
    # A strided x is dense in no layout: the op copies it, into its own order.
    x = wide[..., ::2] if sliced else wide[..., :6].contiguous()
    x.requires_grad_(True)
    w.requires_grad_(True)
    y = gemmconv.conv2d(x, w, bias, stride=(4, 3))
    dy = torch.rand_like(y)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    # The eager road's dW multiplies the forward's columns (its plan is decided, never
    # prepared); the op builds and runs its own problem.
    assert Direction.BACKWARD_WEIGHTS not in seen
    dw_op = torch.ops.gemmconv.conv_backward_weights(
        dy, x.detach(), list(w.shape), [4, 3], [0, 0], [1, 1], 1, True
    )
    for direction in (Direction.FORWARD, Direction.BACKWARD_WEIGHTS):
        problem, tensors = seen[direction]
        assert problem.input_layout is CF
        assert tensors.input.is_contiguous()
    assert seen[Direction.BACKWARD_DATA][0].input_layout is CL
    x_ref, w_ref = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
    y_ref = torch.nn.functional.conv2d(x_ref, w_ref, bias, stride=(4, 3))
    dx_ref, dw_ref = torch.autograd.grad(y_ref, (x_ref, w_ref), dy)
    for got, want in ((y, y_ref), (dx, dx_ref), (dw, dw_ref), (dw_op, dw_ref)):
        torch.testing.assert_close(got, want)
