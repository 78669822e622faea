"""Numerical edge cases behave as torch's convolution does.

- NaN and +-Inf in any operand give non-finite results at exactly the positions
  torch's convolution gives them, for every solver forced through the solver
  interface and through the public functions.
- Empty batches and empty channel sets give torch's shapes and gradients.
- Problems with an operand of more than 2^31 - 1 elements never reach a GEMM solver
  (32-bit GEMM indexing); they are decided on descriptors, with no allocation.
"""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch
import torch.nn.functional as F

import gemmconv
from gemmconv import ConvProblem, ConvTensors, Direction, Layout, get_solver
from gemmconv.core.device_rates import CPU, H200
from gemmconv.core.memory_format import empty_in
from gemmconv.core.precision import reduction_mm, reduction_mm_of
from gemmconv.measuring.verify import reference, rms_range, tolerance
from gemmconv.selection.dispatch import decide
from gemmconv.solvers import SOLVERS
from gemmconv.solvers.base import INT32_MAX
from gemmconv.solvers.views import bias_grad

from conftest import random_in
from solver_cases import nan_output, operands, problem_for, solver_matrix

TORCH_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
GEMMCONV_CONV = {1: gemmconv.conv1d, 2: gemmconv.conv2d, 3: gemmconv.conv3d}
DIRECTIONS = (Direction.FORWARD, Direction.BACKWARD_DATA, Direction.BACKWARD_WEIGHTS)
GEMM_SOLVERS = [s for s in SOLVERS if s.id != "vendor"]


# ---- NaN and Inf -----------------------------------------------------------------


def _poison(t: torch.Tensor, gen: torch.Generator, count: int = 3) -> torch.Tensor:
    """A copy of ``t`` (same strides) with ``count`` each of NaN, +Inf and -Inf at random
    places."""
    t = t.clone()
    positions = torch.randperm(t.numel(), generator=gen)[: 3 * count]
    values = (float("nan"), float("inf"), float("-inf"))
    for i, index in enumerate(zip(*torch.unravel_index(positions, t.shape), strict=True)):
        t[tuple(int(v) for v in index)] = values[i % 3]
    return t


def _finiteness(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    t = t.detach().cpu()
    return torch.isnan(t), torch.isposinf(t), torch.isneginf(t)


def _non_finite_difference(ours: torch.Tensor, theirs: torch.Tensor) -> str | None:
    """None when NaN, +Inf and -Inf sit at the same positions and the finite values
    agree; else what differs."""
    if ours.shape != theirs.shape:
        return f"shape {tuple(ours.shape)} vs {tuple(theirs.shape)}"
    for name, mine, ref in zip(("NaN", "+Inf", "-Inf"), _finiteness(ours), _finiteness(theirs)):
        differ = (mine != ref).nonzero().tolist()
        if differ:
            return f"{name} positions differ at {differ[:5]}"
    finite = torch.isfinite(theirs.detach().cpu())
    a, b = ours.detach().cpu()[finite].double(), theirs.detach().cpu()[finite].double()
    # The finite values are judged like any result (verify.tolerance of the dtype and
    # device: on CUDA fp32 that is TF32's while convolutions allow TF32).
    if a.numel() and rms_range(a, b) > tolerance(ours.dtype, ours.device.type):
        return "finite values differ"
    return None


def _assert_same_non_finite(what: str, ours: torch.Tensor, *torch_results: torch.Tensor) -> None:
    """``ours`` has torch's non-finite positions: those of the first of ``torch_results``,
    or of one of the others where torch's backends disagree among themselves."""
    differences = [_non_finite_difference(ours, theirs) for theirs in torch_results]
    assert None in differences, f"{what}: {differences[0]}"


def _torch_results(problem: ConvProblem, tensors: ConvTensors) -> list[torch.Tensor]:
    """torch's answers on the same data: float64, which on the CPU is its direct
    GEMM path on the zero-padded input, and, where the problem pads, leaves input
    elements no window reaches, or computes a strided backward-data, also the problem's
    own dtype and device (oneDNN or cuDNN). The two differ only where a non-finite
    weight (or output gradient) meets padding, such an element, or the zeros a strided
    backward-data inserts between output-gradient elements (cuDNN does, on the H200):
    one skips those taps, the other multiplies them, and IEEE makes 0 * Inf a NaN."""
    results = [reference(problem, tensors)]
    strided_backward_data = problem.direction is Direction.BACKWARD_DATA and any(
        s > 1 for s in problem.stride
    )
    if any(problem.padding) or _uncovered_input(problem) or strided_backward_data:
        results.append(_torch_on_device(problem, tensors))
    return results


def _torch_on_device(p: ConvProblem, t: ConvTensors) -> torch.Tensor:
    """torch's own answer in the problem's dtype, device and layout, through F.conv*
    and its autograd (not through gemmconv's vendor solver, which is among the solvers
    checked against it)."""
    conv = TORCH_CONV[p.dims]
    args = dict(stride=p.stride, padding=p.padding, dilation=p.dilation, groups=p.groups)
    if p.direction is Direction.FORWARD:
        return conv(t.input, t.weight, t.bias, **args)
    device, by_input = t.grad_output.device, p.direction is Direction.BACKWARD_DATA
    x = t.input if t.input is not None else empty_in(p.input_shape, p.layout, p.dtype, device)
    w = t.weight if t.weight is not None else empty_in(p.weight_shape, p.layout, p.dtype, device)
    x, w = x.detach().requires_grad_(by_input), w.detach().requires_grad_(not by_input)
    (grad,) = torch.autograd.grad(conv(x, w, None, **args), x if by_input else w, t.grad_output)
    return grad


def _uncovered_input(p: ConvProblem) -> bool:
    """Whether the last window ends before the input does in some dimension."""
    return any(
        (o - 1) * u + d * (r - 1) + 1 < s
        for s, o, u, d, r in zip(p.spatial, p.output_spatial, p.stride, p.dilation, p.kernel)
    )


def _poisoned_cases(device_type: str):
    """(solver id, problem class, geometry, dims, layout, direction): the fp32 cases of
    the solver matrix on ``device_type`` that run natively there."""
    return [
        (solver.id, cls, geometry, dims, layout, direction)
        for solver, cls, geometry, dims, layout, _, direction in solver_matrix(
            device_type, dtypes={torch.float32}
        )
        if device_type in solver.devices
    ]


def _operands_of(direction: Direction) -> tuple[str, ...]:
    return {
        Direction.FORWARD: ("input", "weight"),
        Direction.BACKWARD_DATA: ("grad_output", "weight"),
        Direction.BACKWARD_WEIGHTS: ("grad_output", "input"),
    }[direction]


def _case_id(case) -> str:
    solver_id, cls, geometry, dims, layout, direction = case
    return f"{solver_id}-{cls}.{geometry.label}-{dims}d-{layout.value}-{direction.value}"


CPU_POISONED = _poisoned_cases("cpu")
GPU_POISONED = _poisoned_cases("cuda")


def _check_poisoned(case, device_type: str) -> None:
    solver_id, _, geometry, dims, layout, direction = case
    solver = get_solver(solver_id)
    problem = problem_for(geometry, dims, layout, torch.float32, device_type, direction)
    seed = zlib.crc32(_case_id(case).encode())
    tensors = operands(problem, device_type, seed)
    gen = torch.Generator().manual_seed(seed)
    # Both operands of the direction: the first three of each non-finite value, the
    # second one of each, so that many outputs stay finite and positions matter.
    large, small = _operands_of(direction)
    setattr(tensors, large, _poison(getattr(tensors, large).cpu(), gen).to(device_type))
    setattr(tensors, small, _poison(getattr(tensors, small).cpu(), gen, 1).to(device_type))
    ours = solver.run(problem, tensors)
    _assert_same_non_finite(
        f"{solver_id} {direction.value}", ours, *_torch_results(problem, tensors)
    )


@pytest.mark.parametrize("case", CPU_POISONED, ids=[_case_id(c) for c in CPU_POISONED])
def test_solver_propagates_nan_and_inf_like_torch(case):
    """Each solver, forced, on an operand holding NaN, +Inf and -Inf: non-finite results
    exactly where torch's convolution (float64, the same data) has them."""
    _check_poisoned(case, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_POISONED, ids=[_case_id(c) for c in GPU_POISONED])
def test_solver_propagates_nan_and_inf_like_torch_on_cuda(case):
    _check_poisoned(case, "cuda")


def test_every_solver_is_checked_with_non_finite_operands():
    checked = {case[0] for case in CPU_POISONED} | {case[0] for case in GPU_POISONED}
    assert checked == {s.id for s in SOLVERS}


@pytest.mark.parametrize("dims", (1, 2, 3))
@pytest.mark.parametrize(
    "kind, kernel, stride, padding",
    [
        ("patch", 2, 2, 0),
        ("point_output", 5, 5, 0),
        ("pointwise", 1, 1, 0),
        ("strided_pointwise", 1, 2, 0),
        ("general", 3, 1, 1),
    ],
)
@pytest.mark.parametrize("poisoned", ("input", "weight", "grad_output"))
def test_conv_propagates_nan_and_inf_like_torch(dims, kind, kernel, stride, padding, poisoned):
    """Through gemmconv.conv{d}d and autograd: forward and every gradient."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{dims}{kind}{poisoned}".encode()))
    spatial = (5,) * dims if kind != "patch" else (6,) * dims
    x = torch.rand(2, 3, *spatial, generator=gen) * 2 - 1
    w = torch.rand(4, 3, *(kernel,) * dims, generator=gen) * 2 - 1
    b = torch.rand(4, generator=gen) * 2 - 1
    if poisoned == "input":
        x = _poison(x, gen)
    if poisoned == "weight":
        w = _poison(w, gen, count=1)
    runs = [(GEMMCONV_CONV[dims], torch.float32), (TORCH_CONV[dims], torch.float64)]
    if padding:  # see _torch_results: torch's backends differ where NaN meets padding
        runs.append((TORCH_CONV[dims], torch.float32))
    results = []
    for conv, dtype in runs:
        leaves = [t.detach().to(dtype).requires_grad_(True) for t in (x, w, b)]
        y = conv(*leaves, stride=stride, padding=padding)
        dy = torch.rand(y.shape, generator=torch.Generator().manual_seed(7)) * 2 - 1
        if poisoned == "grad_output":
            dy = _poison(dy, torch.Generator().manual_seed(8))
        y.backward(dy.to(dtype))
        results.append((y, *(t.grad for t in leaves)))
    names = ("forward", "input grad", "weight grad", "bias grad")
    for i, name in enumerate(names):
        ours, *theirs = (result[i] for result in results)
        _assert_same_non_finite(f"{kind} {name}", ours, *theirs)


# ---- empty tensors -----------------------------------------------------------------


EMPTY_CASES = {
    # label: (n, c, spatial, kernel, stride, padding)
    "zero_batch_patch": (0, 3, 6, 2, 2, 0),
    "zero_batch_point_output": (0, 3, 4, 4, 4, 0),
    "zero_batch_pointwise": (0, 3, 5, 1, 1, 0),
    "zero_batch_strided_pointwise": (0, 3, 5, 1, 2, 0),
    "zero_batch_general": (0, 3, 5, 3, 1, 1),
    "zero_batch_empty_spatial_padded": (0, 3, 0, 3, 1, 2),
    "zero_channels_general": (2, 0, 5, 3, 1, 1),
    "zero_channels_pointwise": (2, 0, 5, 1, 1, 0),
}


@pytest.mark.parametrize("layout", ("cf", "cl"))
@pytest.mark.parametrize("dims", (1, 2, 3))
@pytest.mark.parametrize("label", list(EMPTY_CASES))
def test_empty_tensors_give_torchs_shapes_and_gradients(label, dims, layout):
    n, c, s, r, u, p = EMPTY_CASES[label]
    gen = torch.Generator().manual_seed(zlib.crc32(label.encode()))
    x = torch.rand(n, c, *(s,) * dims, generator=gen)
    if layout == "cl" and dims > 1:
        x = x.to(memory_format=torch.channels_last if dims == 2 else torch.channels_last_3d)
    if layout == "cl" and dims == 1:
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    w = torch.rand(4, c, *(r,) * dims, generator=gen) * 2 - 1
    b = torch.rand(4, generator=gen) * 2 - 1
    results = []
    for conv in (GEMMCONV_CONV[dims], TORCH_CONV[dims]):
        leaves = [t.clone().requires_grad_(True) for t in (x, w, b)]
        y = conv(*leaves, stride=u, padding=p)
        y.backward(torch.ones_like(y))
        results.append((y, *(t.grad for t in leaves)))
    for name, ours, theirs in zip(("forward", "input grad", "weight grad", "bias grad"), *results):
        assert ours.shape == theirs.shape, f"{name}: {ours.shape} vs torch's {theirs.shape}"
        assert ours.dtype == theirs.dtype, name
        torch.testing.assert_close(ours, theirs, msg=name)


def _strides_that_address(t: torch.Tensor) -> tuple:
    """The strides of the dimensions longer than 1 (the others address nothing)."""
    return tuple(st if n != 1 else None for st, n in zip(t.stride(), t.shape))


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64), ids=str)
@pytest.mark.parametrize("dims", (1, 2, 3))
def test_empty_batch_output_has_torchs_strides(dims, dtype):
    """torch computes an empty batch apart from its convolution backends, and its
    output is contiguous unless the output has the input's shape (then it keeps the
    input's layout), whatever the weight's layout or the dtype."""
    gen = torch.Generator().manual_seed(dims)
    # (channels, output channels, kernel, stride): a patch, and a pointwise as wide as its input.
    for c, k, r, u in ((3, 4, 2, 2), (3, 3, 1, 1)):
        for x_layout, w_layout in itertools.product(Layout, Layout):
            x = empty_in((0, c, *(6,) * dims), x_layout, dtype, "cpu")
            w = random_in((k, c, *(r,) * dims), w_layout, dtype, "cpu", gen)
            ours = GEMMCONV_CONV[dims](x, w, stride=u)
            theirs = TORCH_CONV[dims](x, w, stride=u)
            assert ours.shape == theirs.shape
            assert _strides_that_address(ours) == _strides_that_address(theirs), (
                f"c={c} k={k} kernel={r} input {x_layout.value}, weight {w_layout.value}: "
                f"{ours.stride()} vs torch's {theirs.stride()}"
            )


@pytest.mark.parametrize("direction", DIRECTIONS, ids=lambda d: d.value)
def test_empty_batch_goes_to_the_vendor_path(direction):
    problem = ConvProblem.from_sizes(0, 3, 8, (224, 224), 16, stride=16, direction=direction)
    for solver in GEMM_SOLVERS:
        reasons = solver.not_supported_reasons(problem)
        assert any("empty problem" in r for r in reasons), (solver.id, reasons)
    assert decide(problem, rates=CPU).solver == "vendor"


def test_empty_batch_runs_on_every_direction_through_the_vendor():
    problem = ConvProblem.from_sizes(0, 3, 8, (6, 6), 2, stride=2)
    for direction in DIRECTIONS:
        p = problem.with_direction(direction)
        tensors = operands(p, "cpu", 0)
        result = get_solver("vendor").run(p, tensors)
        expected = {
            Direction.FORWARD: p.output_shape,
            Direction.BACKWARD_DATA: p.input_shape,
            Direction.BACKWARD_WEIGHTS: p.weight_shape,
        }[direction]
        assert tuple(result.shape) == expected
        if direction is Direction.BACKWARD_WEIGHTS:
            assert torch.equal(result, torch.zeros(expected)), "a sum over no samples is zero"


# ---- strides near 64 bits -------------------------------------------------------------


@pytest.mark.parametrize("stride", (2**62, 2**63 - 1), ids=("2^62", "2^63-1"))
@pytest.mark.parametrize("kernel", (1, 3))
@pytest.mark.parametrize("dims", (1, 2, 3))
def test_a_stride_near_64_bits_runs_in_every_solver(dims, kernel, stride):
    """torch takes any stride that fits in 64 bits. With one output position per
    dimension the stride is never taken, so no solver may build a view whose strides
    are that stride times an element stride (which overflows)."""
    base = ConvProblem.from_sizes(2, 4, 6, (6,) * dims, kernel, stride=stride, dtype=torch.float64)
    ran = set()
    for direction in DIRECTIONS:
        problem = base.with_direction(direction)
        tensors = operands(problem, "cpu", seed=dims * 10 + kernel)
        expected = reference(problem, tensors)
        for solver in SOLVERS:
            if solver.not_supported_reasons(problem):
                continue
            result = solver.run(problem, tensors, out=nan_output(problem, "cpu"))
            torch.testing.assert_close(result, expected, msg=f"{solver.id} {direction.value}")
            ran.add(solver.id)
    assert "im2col" in ran and (kernel != 1 or "strided_pointwise" in ran), ran


# ---- operands past 32-bit indexing --------------------------------------------------


def _huge_problems():
    """(label, problem, the operand that is too large) with every other operand small
    where the geometry allows; sizes only, nothing is allocated."""
    half = torch.bfloat16
    return [
        # ViT-B/16 on 50 000 images: 7.5e9 input elements.
        (
            "vit_patch_embedding",
            ConvProblem.from_sizes(50_000, 3, 768, (224, 224), 16, stride=16, dtype=half),
            "input",
        ),
        # 1x1 with a huge output: 65536 pixels x 32769 output channels.
        ("pointwise_output", ConvProblem.from_sizes(1, 1, 2**15 + 1, (2**16,), 1), "output"),
        # A pointwise weight of 2^16 x (2^15 + 1).
        ("pointwise_weight", ConvProblem.from_sizes(1, 2**15 + 1, 2**16, (1,), 1), "weight"),
        # 3x3, padding 1: x and y have 2.7e8 elements, the column matrix 2.4e9.
        (
            "im2col_columns",
            ConvProblem.from_sizes(1, 64, 64, (2048, 2048), 3, padding=1),
            "column matrix",
        ),
        # A point-output problem whose M = N is huge: 3x14x14 patches of 2^22 images.
        (
            "point_output_batch",
            ConvProblem.from_sizes(2**22, 3, 1280, (14, 14), 14, stride=14, dtype=half),
            "input",
        ),
    ]


HUGE = _huge_problems()


@pytest.mark.parametrize("device_type", ("cpu", "cuda"))
@pytest.mark.parametrize("direction", DIRECTIONS, ids=lambda d: d.value)
@pytest.mark.parametrize("label, problem, operand", HUGE, ids=[h[0] for h in HUGE])
def test_huge_operands_are_routed_to_the_vendor(label, problem, operand, direction, device_type):
    problem = problem.with_direction(direction)
    problem = ConvProblem.from_sizes(
        problem.n, problem.c, problem.k, problem.spatial, problem.kernel, problem.stride,
        problem.padding, problem.dilation, problem.groups, problem.layout, problem.dtype,
        device_type, direction,
    )  # fmt: skip
    for solver in GEMM_SOLVERS:
        reasons = solver.not_supported_reasons(problem)
        assert any(f"{operand} has" in r and str(INT32_MAX) in r for r in reasons), (
            solver.id,
            reasons,
        )
    assert get_solver("vendor").not_supported_reasons(problem) == []
    rates = H200 if device_type == "cuda" else CPU
    assert decide(problem, rates=rates).solver == "vendor"


@pytest.mark.parametrize("layout", (Layout.CHANNELS_FIRST, Layout.CHANNELS_LAST))
def test_operand_of_exactly_int32_max_elements_still_runs_as_a_gemm(layout):
    """The limit is inclusive: 2^31 - 1 elements (a prime, so one long row) pass, one more
    does not."""
    at_limit = ConvProblem.from_sizes(1, 1, 1, (INT32_MAX,), 1, layout=layout)
    assert get_solver("pointwise").not_supported_reasons(at_limit) == []
    over = ConvProblem.from_sizes(1, 1, 1, (INT32_MAX + 1,), 1, layout=layout)
    assert get_solver("pointwise").not_supported_reasons(over)


def test_problem_arithmetic_does_not_overflow_on_huge_sizes():
    """Sizes, flops and bytes are Python integers: exact however large."""
    _, problem, _ = HUGE[0]
    assert problem.gemm_m == 50_000 * 14 * 14
    assert problem.flops() == 2 * 50_000 * 196 * 768 * 768
    assert problem.min_bytes() > 2**33


@pytest.mark.parametrize("memory_format", [torch.channels_last, torch.contiguous_format],
                         ids=["cl", "cf"])  # fmt: skip
@pytest.mark.parametrize(
    ("channels", "out_channels"), [(147, 64), (16, 16), (5, 3)], ids=["wide", "edge", "skinny"]
)
def test_cpu_fp32_weight_gradient_within_twice_the_vendors_error(
    channels, out_channels, memory_format, monkeypatch
):
    # 32768 rows of reduction through pointwise's one GEMM (channels-first operands
    # are copied to rows for it on the CPU): wide enough results run it in fp32, the
    # skinny one (which an fp32 GEMM sums almost sequentially: about 4x the vendor's
    # error at this length) in fp64 (precision.py).
    monkeypatch.setenv("GEMMCONV_SOLVER", "pointwise")
    gen = torch.Generator().manual_seed(channels)
    x = (torch.rand(2, channels, 128, 128, generator=gen) * 2 - 1).to(memory_format=memory_format)
    w = torch.rand(out_channels, channels, 1, 1, generator=gen) * 2 - 1
    dy = torch.rand(2, out_channels, 128, 128, generator=gen) * 2 - 1
    w.requires_grad_()
    (ours,) = torch.autograd.grad(gemmconv.conv2d(x, w), w, dy)
    (vendor,) = torch.autograd.grad(F.conv2d(x, w), w, dy)
    x64, w64 = x.double(), w.detach().double().requires_grad_()
    (ref,) = torch.autograd.grad(F.conv2d(x64, w64), w64, dy.double())
    ours_error, vendor_error = rms_range(ours, ref), rms_range(vendor, ref)
    assert torch.isfinite(ours).all()
    assert ours_error <= max(2 * vendor_error, 2.0**-24), (ours_error, vendor_error)


@pytest.mark.parametrize(
    ("rows", "out_rows", "out_cols", "widens"),
    [
        (4096, 64, 64, False),
        (4096, 3, 64, True),
        (4096, 64, 5, True),
        ((1 << 17) + 1, 64, 64, True),
    ],
    ids=["within", "skinny-rows", "skinny-cols", "long"],
)
def test_reduction_mm_of_decides_once_as_reduction_mm_does(rows, out_rows, out_cols, widens):
    chosen = reduction_mm_of(torch.float32, "cpu", rows, out_rows, out_cols)
    assert chosen is (reduction_mm if widens else torch.mm)
    # Only the CPU's fp32 ever widens.
    assert reduction_mm_of(torch.bfloat16, "cpu", rows, out_rows, out_cols) is torch.mm
    assert reduction_mm_of(torch.float32, "cuda", rows, out_rows, out_cols) is torch.mm


def test_cpu_fp32_weight_gradient_from_kept_columns_rounds_once_on_a_skinny_result(
    monkeypatch,
):
    # The forward keeps its columns and dW multiplies them (ColumnKeepingForward): a
    # skinny 3 x 4 result over 32768 rows is reduced in fp64 there, as reduction_mm
    # would, and rounded once. An fp32 GEMM measured 1.2-1.7e-6 here, the fp64 one
    # about 1.5e-8.
    monkeypatch.setenv("GEMMCONV_SOLVER", "patch")
    from gemmconv.solvers.patch.prepared import ColumnKeepingForward

    from_columns = []
    original = ColumnKeepingForward.weight_gradient

    def spied(self, dy, col):
        from_columns.append(col.shape[0])
        return original(self, dy, col)

    monkeypatch.setattr(ColumnKeepingForward, "weight_gradient", spied)
    gen = torch.Generator().manual_seed(5)
    x = torch.rand(2, 1, 256, 256, generator=gen) * 2 - 1
    w = (torch.rand(3, 1, 2, 2, generator=gen) * 2 - 1).requires_grad_()
    dy = torch.rand(2, 3, 128, 128, generator=gen) * 2 - 1
    (ours,) = torch.autograd.grad(gemmconv.conv2d(x, w, stride=2), w, dy)
    assert from_columns == [2 * 128 * 128]
    x64, w64 = x.double(), w.detach().double().requires_grad_()
    (ref,) = torch.autograd.grad(F.conv2d(x64, w64, stride=2), w64, dy.double())
    assert rms_range(ours, ref) <= 2.0**-24


def _check_half_bias_gradient(device: str, dtype: torch.dtype) -> None:
    # 262144 terms of about 0.125 per channel: summed in the half type itself the
    # total would stall far below the 32768 it should reach (and fit fp16's range);
    # accumulated in fp32 and rounded once it is within one unit of the half type's
    # last place of the exact sum.
    gen = torch.Generator().manual_seed(11)
    dy = (torch.rand(16, 4, 128, 128, generator=gen) / 4).to(device=device, dtype=dtype)
    got = bias_grad(dy)
    exact = dy.double().sum((0, 2, 3))
    assert got.dtype == dtype
    relative = ((got.double() - exact).abs() / exact).max().item()
    assert relative <= torch.finfo(dtype).eps, relative


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_bias_gradient_accumulates_in_fp32(dtype):
    _check_half_bias_gradient("cpu", dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_bias_gradient_accumulates_in_fp32_on_cuda(dtype):
    _check_half_bias_gradient("cuda", dtype)
