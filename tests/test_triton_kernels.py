"""The Triton patch permutation kernels and the solver built on them.

On the CPU the kernels run in Triton's interpreter (gemmconv.kernels compiles a
kernel for CPU tensors through it, as TRITON_INTERPRET=1 would), in fp32 and fp16:
the gather and scatter are pure copies, so they must match torch's permuted views
exactly. On CUDA (marker gpu) the same checks run compiled, in bf16, fp16 and fp32,
and the patch_triton solver is checked against the float64 reference.
"""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch

from gemmconv import ConvProblem, Direction, Layout
from gemmconv.kernels.patch_gemm import patch_gemm_forward, patch_gemm_weight_grad
from gemmconv.kernels.patch_permute import (
    PatchGeometry,
    contiguous_run,
    gather_patches,
    scatter_patches,
)
from gemmconv.memory_format import empty_in
from gemmconv.solvers import get_solver
from gemmconv.solvers.padded_patch import padded_reduction
from gemmconv.solvers.patch import patches

from solver_cases import Geometry, case_id, check_case, problem_for

# (spatial, kernel): exact tiling, a remainder that no patch reads, point-output.
SHAPES = {
    1: [((12,), (4,)), ((11,), (3,))],
    2: [((8, 9), (4, 3)), ((9, 7), (4, 3)), ((5, 3), (5, 3))],
    3: [((4, 6, 4), (2, 3, 2)), ((5, 7, 5), (2, 3, 2))],
}
CASES = [
    (dims, spatial, kernel, layout)
    for dims, shapes in SHAPES.items()
    for (spatial, kernel), layout in itertools.product(shapes, list(Layout))
]


def _ids(case) -> str:
    dims, spatial, kernel, layout = case
    short = "cf" if layout is Layout.CHANNELS_FIRST else "cl"
    return f"{dims}d-s{'x'.join(map(str, spatial))}-r{'x'.join(map(str, kernel))}-{short}"


def _problem(spatial, kernel, layout, dtype, device_type, c=3, n=2) -> ConvProblem:
    return ConvProblem.from_sizes(
        n, c, 5, spatial, kernel, kernel, layout=layout, dtype=dtype, device_type=device_type
    )


def _random(shape, layout, dtype, device, seed) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    values = torch.rand(shape, generator=gen) * 2 - 1
    t = empty_in(shape, layout, dtype, device)
    return t.copy_(values.to(device=device, dtype=dtype))


def _check_gather_scatter(dims, spatial, kernel, layout, dtype, device, extra_pad: int) -> None:
    p = _problem(spatial, kernel, layout, dtype, device.type)
    seed = zlib.crc32(repr((spatial, kernel, layout, dtype, extra_pad)).encode())
    x = _random(p.input_shape, layout, dtype, device, seed)
    channels_last = layout is Layout.CHANNELS_LAST
    expected = patches(x, p).reshape(p.gemm_m, p.gemm_k)
    ld = padded_reduction(p) + extra_pad

    col = torch.full((p.gemm_m, ld), float("nan"), dtype=dtype, device=device)
    gather_patches(x, p.output_spatial, p.kernel, channels_last, out=col)
    assert torch.equal(col[:, : p.gemm_k], expected)
    assert torch.equal(col[:, p.gemm_k :], torch.zeros_like(col[:, p.gemm_k :]))

    # Scatter back into a NaN-filled dx: every covered element written, the rest untouched.
    dx = torch.full_like(x, float("nan"))
    scatter_patches(col, p.output_spatial, p.kernel, channels_last, dx)
    covered = (
        slice(None),
        slice(None),
        *(slice(0, o * r) for o, r in zip(p.output_spatial, p.kernel)),
    )
    assert torch.equal(dx[covered], x[covered])
    outside = torch.ones_like(dx, dtype=torch.bool)
    outside[covered] = False
    assert torch.isnan(dx[outside]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_gather_and_scatter_match_torch_views_interpreted(case, dtype):
    _check_gather_scatter(*case, dtype, torch.device("cpu"), extra_pad=0)


def test_gather_pads_to_a_wider_leading_dimension_interpreted():
    _check_gather_scatter(2, (9, 7), (4, 3), Layout.CHANNELS_LAST, torch.float32,
                          torch.device("cpu"), extra_pad=24)  # fmt: skip


def test_gather_reads_through_arbitrary_strides_interpreted():
    p = _problem((8, 6), (4, 3), Layout.CHANNELS_FIRST, torch.float32, "cpu")
    wide = _random((2, 3, 8, 12), Layout.CHANNELS_FIRST, torch.float32, torch.device("cpu"), 7)
    x = wide[..., ::2]  # a strided, non-dense view
    col = torch.full((p.gemm_m, p.gemm_k), float("nan"))
    gather_patches(x, p.output_spatial, p.kernel, False, out=col)
    assert torch.equal(col, patches(x, p).reshape(p.gemm_m, p.gemm_k))


@pytest.mark.parametrize("memory", list(Layout))
@pytest.mark.parametrize("columns", list(Layout))
def test_column_order_independent_of_memory_order_interpreted(memory, columns):
    # Mismatched pairs take the general index map (no contiguous run to exploit).
    p = _problem((8, 6, 4), (2, 3, 2), columns, torch.float32, "cpu")
    x = _random(p.input_shape, memory, torch.float32, torch.device("cpu"), 17)
    channels_last = columns is Layout.CHANNELS_LAST
    g = PatchGeometry.of(x, p.output_spatial, p.kernel, channels_last)
    assert (contiguous_run(g) == 0) == (channels_last and memory is Layout.CHANNELS_FIRST)
    col = torch.full((p.gemm_m, p.gemm_k), float("nan"))
    gather_patches(x, p.output_spatial, p.kernel, channels_last, out=col)
    assert torch.equal(col, patches(x, p).reshape(p.gemm_m, p.gemm_k))
    dx = torch.full_like(x, float("nan"))
    scatter_patches(col, p.output_spatial, p.kernel, channels_last, dx)
    assert torch.equal(dx, x)


def test_bad_buffers_are_refused_with_their_shapes():
    x = torch.rand(2, 3, 8, 6)
    with pytest.raises(ValueError, match=r"out of shape \(8, 35\)"):
        gather_patches(x, (2, 2), (4, 3), False, out=torch.empty(8, 35))
    with pytest.raises(ValueError, match="expected dense rows"):
        gather_patches(x, (2, 2), (4, 3), False, out=torch.empty(8, 80)[:, :40])
    with pytest.raises(ValueError, match="exceeds spatial"):
        gather_patches(x, (3, 2), (4, 3), False, out=torch.empty(12, 36))
    with pytest.raises(ValueError, match="expected torch.float32"):
        gather_patches(x, (2, 2), (4, 3), False, out=torch.empty(8, 36, dtype=torch.float16))


# ---- the solver built on the kernels -----------------------------------------

SOLVER_GEOMETRIES = [
    # C = 3 and odd kernels: an unaligned reduction in every dtype, so padding is used.
    Geometry("remainder", spatial=(11, 7, 8), kernel=(5, 3, 3), stride=(5, 3, 3), c=3),
    Geometry("point", spatial=(5, 3, 3), kernel=(5, 3, 3), stride=(5, 3, 3), c=3),
    # An aligned reduction (C = 4, kernel 4x2x2 in fp32: 64 bytes): no padding.
    Geometry("aligned", spatial=(8, 4, 4), kernel=(4, 2, 2), stride=(4, 2, 2), c=4),
]


def _solver_cases(solver_id: str, dtypes):
    """Every geometry x dims x layout x dtype x direction the solver applies to on CUDA."""
    solver = get_solver(solver_id)
    cases = []
    for g, dims, layout, dtype, direction in itertools.product(
        SOLVER_GEOMETRIES, (1, 2, 3), list(Layout), dtypes, list(Direction)
    ):
        if solver.is_applicable(problem_for(g, dims, layout, dtype, "cuda", direction)):
            cases.append((solver, g, dims, layout, dtype, direction))
    return cases


CPU_DTYPES = (torch.float32, torch.float16)  # the interpreter's tl.dot is wrong for bf16
CPU_SOLVER_CASES = _solver_cases("patch_triton", CPU_DTYPES) + _solver_cases(
    "patch_implicit", CPU_DTYPES
)


@pytest.mark.parametrize("case", CPU_SOLVER_CASES, ids=[case_id(c) for c in CPU_SOLVER_CASES])
def test_triton_solvers_match_float64_interpreted(case, monkeypatch):
    # The solver declares CUDA only; on the CPU its kernels run interpreted, so the
    # mapping is checked here by lifting the device restriction for the test.
    solver = case[0]
    monkeypatch.setattr(type(solver), "devices", frozenset({"cpu", "cuda"}))
    check_case(case, "cpu", seed=zlib.crc32(case_id(case).encode()))


def test_triton_patch_solver_declares_cuda_only():
    p = _problem((8, 6), (4, 3), Layout.CHANNELS_FIRST, torch.float32, "cpu")
    assert "device cpu not supported" in get_solver("patch_triton").not_supported_reasons(p)
    assert get_solver("patch_triton").not_supported_reasons(p.__class__.from_sizes(
        2, 3, 5, (8, 6), (4, 3), (4, 3), device_type="cuda")) == []  # fmt: skip


@pytest.mark.parametrize("layout", list(Layout))
def test_split_weight_gradient_sums_its_partials_interpreted(layout):
    # M = 4 * 5 * 4 = 80 rows cut into three fp32 partials (32 + 32 + 16 rows).
    p = _problem((10, 12), (2, 3), layout, torch.float32, "cpu", c=3, n=4)
    dev = torch.device("cpu")
    x = _random(p.input_shape, layout, torch.float32, dev, 11)
    dy = _random(p.output_shape, layout, torch.float32, dev, 12)
    channels_last = layout is Layout.CHANNELS_LAST
    rows = patch_gemm_weight_grad(dy, x, p.kernel, channels_last, splits=3)
    col = patches(x, p).reshape(p.gemm_m, p.gemm_k).double()
    expected = dy.movedim(1, -1).reshape(-1, p.k).double().t() @ col
    assert rows.dtype == torch.float32
    assert torch.allclose(rows.double(), expected, rtol=1e-5, atol=1e-5)


def test_implicit_forward_writes_through_any_output_strides_interpreted():
    p = _problem((8, 9), (4, 3), Layout.CHANNELS_FIRST, torch.float32, "cpu")
    dev = torch.device("cpu")
    x = _random(p.input_shape, Layout.CHANNELS_FIRST, torch.float32, dev, 5)
    w = _random(p.weight_shape, Layout.CHANNELS_FIRST, torch.float32, dev, 6)
    bias = torch.rand(p.k) + 0.5
    expected = torch.nn.functional.conv2d(x.double(), w.double(), bias.double(), stride=(4, 3))
    wide = torch.full((p.n, p.k, 2, 3 * 2), float("nan"))
    y = wide[..., ::2]  # an output view with a stride-2 innermost dimension
    patch_gemm_forward(x, w.reshape(p.k, -1), bias, p.kernel, False, out=y)
    assert torch.allclose(y.double(), expected, rtol=1e-5, atol=1e-5)
    assert torch.isnan(wide[..., 1::2]).all()


# ---- on the GPU --------------------------------------------------------------

GPU_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# Every new problem geometry compiles new kernel variants (the contiguous run and the
# strides are specialised), a few seconds each, so the GPU matrix keeps one problem
# per kind: 1-D with a remainder, 2-D exact, 3-D with a remainder, point-output.
GPU_PERMUTE_CASES = [
    c for c in CASES if (c[0], c[1]) in {(1, (11,)), (2, (8, 9)), (3, (5, 7, 5)), (2, (5, 3))}
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("case", GPU_PERMUTE_CASES, ids=[_ids(c) for c in GPU_PERMUTE_CASES])
def test_gather_and_scatter_match_torch_views_on_cuda(case, dtype):
    _check_gather_scatter(*case, dtype, torch.device("cuda"), extra_pad=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=["bf16", "fp16", "fp32"])
def test_gather_large_rows_on_cuda(dtype):
    # Enough rows that the grid has many programs in both dimensions (and int64 offsets).
    _check_gather_scatter(2, (14 * 40, 14 * 3), (14, 14), Layout.CHANNELS_FIRST, dtype,
                          torch.device("cuda"), extra_pad=0)  # fmt: skip


# 3-D with a remainder (cropping, an unaligned reduction, all three index levels) for
# every solver x layout x dtype x direction; 2-D point-output and aligned for the
# solvers whose kernels compile fast (the implicit GEMMs meet those shapes in the
# bench, which verifies every candidate against float64 too).
_GPU_SHAPES = {
    "patch_triton": {("remainder", 3), ("point", 2), ("aligned", 2)},
    "patch_padded": {("remainder", 3), ("point", 2)},
    "patch_implicit": {("remainder", 3)},
}
GPU_SOLVER_CASES = [
    case
    for solver_id, shapes in _GPU_SHAPES.items()
    for case in _solver_cases(solver_id, GPU_DTYPES)
    if (case[1].label, case[2]) in shapes
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_SOLVER_CASES, ids=[case_id(c) for c in GPU_SOLVER_CASES])
def test_patch_solvers_match_float64_on_cuda(case):
    check_case(case, "cuda", seed=zlib.crc32(case_id(case).encode()))
