"""Operands torch's CPU convolution forward mishandles (solvers/cpu_conv_hazards.py):
gemmconv's calls that reach torch's convolution there, by the eager road, the vendor
solver and the op road, match float64 and keep torch's output strides."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import gemmconv
from gemmconv.core.memory_format import Layout, forward_output_layout
from gemmconv.core.problem import ConvProblem, Direction
from gemmconv.solvers import get_solver
from gemmconv.solvers.base import ConvTensors
from gemmconv.solvers.cpu_conv_hazards import (
    hazard_layout,
    unit_stride_reads,
    weight_gradient_arguments,
)

from random_conv import ConvCase, check_every_solver

# (input shape, weight shape, stride): geometries torch 2.13 and 2.14 computed wrongly.
DROPPED = [
    ((3, 1, 3, 3, 4), (2, 1, 1, 1, 3), (1, 1, 3)),
    ((2, 1, 3, 3, 5), (1, 1, 2, 2, 3), (2, 1, 3)),
    ((3, 1, 3, 3, 4), (1, 1, 1, 2, 3), (1, 1, 2)),
]


def _operands(input_shape, weight_shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(input_shape, generator=g)
    w = torch.randn(weight_shape, generator=g)
    x_cl = torch.empty(x.shape, memory_format=torch.channels_last_3d).copy_(x)
    return x, x_cl, w


def _max_error(y: torch.Tensor, reference: torch.Tensor) -> float:
    return (y.double() - reference).abs().max().item()


@pytest.mark.parametrize(("input_shape", "weight_shape", "stride"), DROPPED)
@pytest.mark.parametrize("solver", [None, "vendor"])
def test_forward_and_gradients_match_float64_with_torch_strides(
    input_shape, weight_shape, stride, solver, monkeypatch
):
    if solver is not None:
        monkeypatch.setenv("GEMMCONV_SOLVER", solver)
    x, x_cl, w = _operands(input_shape, weight_shape)
    x64 = x.double().requires_grad_()
    w64 = w.double().requires_grad_()
    reference = F.conv3d(x64, w64, stride=stride)
    dy = torch.randn(reference.shape, generator=torch.Generator().manual_seed(1))
    reference.backward(dy.double())
    xg, wg = x_cl.clone().requires_grad_(), w.clone().requires_grad_()
    y = gemmconv.conv3d(xg, wg, stride=stride)
    y.backward(dy)
    assert _max_error(y, reference) < 1e-5
    assert _max_error(xg.grad, x64.grad) < 1e-5
    assert _max_error(wg.grad, w64.grad) < 1e-5
    # torch's own output strides for these operands (its values are the ones dropped).
    assert y.stride() == F.conv3d(x_cl, w, stride=stride).stride()


@pytest.mark.parametrize(("input_shape", "weight_shape", "stride"), DROPPED)
def test_the_vendor_solver_writes_every_output(input_shape, weight_shape, stride):
    _, x_cl, w = _operands(input_shape, weight_shape)
    n, c, *spatial = input_shape
    case = ConvCase(dims=3, n=n, c=c, k=weight_shape[0], spatial=tuple(spatial),
                    kernel=tuple(weight_shape[2:]), stride=stride, padding=(0, 0, 0),
                    dilation=(1, 1, 1), groups=1, dtype=torch.float32, bias=False,
                    x_layout=Layout.CHANNELS_FIRST, w_layout=Layout.CHANNELS_FIRST,
                    x_view="dense", w_view="dense", dy_view="dense",
                    needs_grad=(True, True, True), seed=0)  # fmt: skip
    assert "vendor" in check_every_solver(case)
    problem = case.problem(Direction.FORWARD, Layout.CHANNELS_LAST, "cpu")
    assert get_solver("vendor").is_applicable(problem)


def test_only_the_hazardous_runs_are_rerouted():
    x, x_cl, w = _operands((3, 1, 3, 3, 4), (2, 1, 1, 1, 3))
    args = ((3, 2, 3, 3, 1), (1, 1, 3), (0, 0, 0), (1, 1, 1), 1)
    assert hazard_layout(x_cl, w, *args) is Layout.CHANNELS_LAST
    w_cl = torch.empty(w.shape, memory_format=torch.channels_last_3d).copy_(w)
    assert hazard_layout(x, w_cl, *args) is Layout.CHANNELS_LAST  # the weight's strides too
    assert hazard_layout(x, w, *args) is None  # channels-first: torch is right
    assert hazard_layout(x_cl.double(), w.double(), *args) is None
    assert hazard_layout(x_cl.bfloat16(), w.bfloat16(), *args) is None
    two = torch.randn(3, 2, 3, 3, 4).contiguous(memory_format=torch.channels_last_3d)
    assert hazard_layout(two, torch.randn(2, 2, 1, 1, 3), *args) is None
    seq = torch.randn(2, 1, 6).transpose(1, 2)  # [2, 6, 1], strides (6, 1, 6)
    one = ((2, 3, 2), (2,), (1,), (2,), 3)
    assert hazard_layout(seq.bfloat16(), torch.randn(3, 2, 1).bfloat16(), *one) is not None
    assert hazard_layout(seq, torch.randn(3, 2, 1), *one) is None  # fp32 ran
    dense = seq.bfloat16().clone(memory_format=torch.contiguous_format)  # strides (6, 1, 1)
    assert hazard_layout(dense, torch.randn(3, 2, 1).bfloat16(), *one) is None


# torch 2.14 segfaulted on this call; run in a child process, so that a crash fails the
# test instead of the test run.
_SEGFAULTING_CALL = """
import torch, torch.nn.functional as F, gemmconv
g = torch.Generator().manual_seed(0)
x = torch.randn(2, 1, 6, generator=g).transpose(1, 2)
w = torch.randn(3, 2, 1, generator=g)
ref = F.conv1d(x.double(), w.double(), stride=2, padding=1, dilation=2, groups=3)
for weight in (w, w.transpose(1, 2).contiguous().transpose(1, 2)):  # strides (2, 1, 1), (2, 1, 2)
    y = gemmconv.conv1d(x.bfloat16(), weight.bfloat16(), stride=2, padding=1, dilation=2,
                        groups=3)
    assert (y.double() - ref).abs().max().item() < 0.05, y
print("ran")
"""


@pytest.mark.parametrize("solver", [None, "vendor"])
def test_the_bf16_call_torch_crashed_on_runs(solver):
    env = dict(os.environ)
    env.pop("GEMMCONV_SOLVER", None)
    if solver is not None:
        env["GEMMCONV_SOLVER"] = solver
    done = subprocess.run([sys.executable, "-c", _SEGFAULTING_CALL], env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ran"


def test_the_compiled_call_matches_float64_with_torch_strides():
    """Under torch.compile the call runs gemmconv's op, whose vendor run is rerouted too
    (torch's own compiled convolution drops the same outputs)."""
    x, x_cl, w = _operands((3, 1, 3, 3, 4), (2, 1, 1, 1, 3))
    compiled = torch.compile(lambda a, b: gemmconv.conv3d(a, b, stride=(1, 1, 3)))
    y = compiled(x_cl, w)
    assert _max_error(y, F.conv3d(x.double(), w.double(), stride=(1, 1, 3))) < 1e-5
    assert y.stride() == F.conv3d(x_cl, w, stride=(1, 1, 3)).stride()


# bf16 weight gradients torch 2.14 computed wrongly: a padded dimension of at most two
# input elements, computed channels-last. (input shape, weight shape, stride, padding,
# groups, which operands are channels-last.) In 1-D and 2-D a tap that reads only
# padding is left unwritten (each run fills the memory with NaN first, so that it
# shows); the 3-D ones came back wrong on every run.
SMALL_PADDED = [
    ((1, 4, 1), (2, 4, 3), (2,), (1,), 1, "weight"),
    ((1, 4, 1, 1), (2, 4, 3, 3), (2, 2), (1, 1), 1, "weight"),
    ((1, 4, 2, 2, 2), (2, 2, 3, 3, 3), (1, 1, 1), (1, 1, 1), 2, "weight"),
    ((2, 4, 2, 2, 2), (4, 2, 3, 3, 3), (1, 1, 1), (1, 1, 1), 2, "input"),
]
_CONVS = {3: F.conv1d, 4: F.conv2d, 5: F.conv3d}
_GEMMCONV_CONVS = {3: gemmconv.conv1d, 4: gemmconv.conv2d, 5: gemmconv.conv3d}


def _channels_last(t: torch.Tensor) -> torch.Tensor:
    """``t`` with channels-last strides (for 1-D, a transposed [N, L, C] copy)."""
    order = (0, *range(2, t.dim()), 1)
    return t.permute(order).contiguous().permute(0, t.dim() - 1, *range(1, t.dim() - 1))


def _small_padded_operands(case, seed):
    input_shape, weight_shape, stride, padding, groups, last = case
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(input_shape, generator=g).bfloat16()
    w = torch.randn(weight_shape, generator=g).bfloat16()
    if last == "weight":
        w = _channels_last(w)
    else:
        x = _channels_last(x)
    x64, w64 = (t.double().contiguous().requires_grad_() for t in (x, w))
    reference = _CONVS[x.dim()](x64, w64, stride=stride, padding=padding, groups=groups)
    dy = torch.randn(reference.shape, generator=g, dtype=torch.float64)
    reference.backward(dy)
    return x, w, dy, w64.grad


def _garbage_in_freed_memory() -> None:
    """Leave NaN in memory the allocator hands out next, where an unwritten result
    would read it."""
    junk = torch.full((1 << 14,), float("nan"), dtype=torch.bfloat16)
    del junk


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("case", SMALL_PADDED, ids=lambda c: f"{len(c[0]) - 2}d-{c[5]}")
@pytest.mark.parametrize("solver", [None, "vendor"])
def test_bf16_weight_gradient_of_small_padded_inputs_matches_float64(case, solver, monkeypatch):
    if solver is not None:
        monkeypatch.setenv("GEMMCONV_SOLVER", solver)
    _, _, stride, padding, groups, _ = case
    for seed in range(8):
        x, w, dy, want = _small_padded_operands(case, seed)
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = _GEMMCONV_CONVS[x.dim()](xg, wg, stride=stride, padding=padding, groups=groups)
        assert y.stride() == _CONVS[x.dim()](x, w, stride=stride, padding=padding,
                                             groups=groups).stride()  # fmt: skip
        _garbage_in_freed_memory()
        y.backward(dy.bfloat16())
        assert _relative_error(wg.grad, want) < 0.02, (seed, wg.grad)
        assert wg.grad.stride() == w.stride()


@pytest.mark.parametrize("case", SMALL_PADDED, ids=lambda c: f"{len(c[0]) - 2}d-{c[5]}")
def test_the_vendor_solvers_weight_gradient_of_small_padded_inputs_matches_float64(case):
    """The vendor's weight gradient as gemmconv's own backward calls it (a GEMM solver
    forward, dW on the vendor)."""
    _, _, stride, padding, groups, _ = case
    for seed in range(8):
        x, w, dy, want = _small_padded_operands(case, seed)
        dilation = (1,) * len(stride)
        problem = ConvProblem.from_tensors(x, w, None, stride, padding, dilation, groups)
        problem = problem.with_direction(Direction.BACKWARD_WEIGHTS)
        tensors = ConvTensors(input=x, weight=w, bias=None, grad_output=dy.bfloat16())
        _garbage_in_freed_memory()
        dw = get_solver("vendor").run(problem, tensors)
        assert _relative_error(dw, want) < 0.02, (seed, dw)


def test_small_padded_bf16_runs_are_rerouted_only_where_channels_last():
    x = torch.randn(1, 4, 1).bfloat16()
    w = torch.randn(2, 4, 3).bfloat16()
    args = ((1, 2, 1), (2,), (1,), (1,), 1)
    assert hazard_layout(x, _channels_last(w), *args) is not None
    volume = torch.randn(2, 4, 2, 2, 2).bfloat16()
    kernel = torch.randn(4, 2, 3, 3, 3).bfloat16()
    three = ((2, 4, 2, 2, 2), (1, 1, 1), (1, 1, 1), (1, 1, 1), 2)
    # Rerouted where torch computes the volume channels-last: on a CPU whose oneDNN
    # takes bf16 (AVX512 or AVX-NE-CONVERT); elsewhere its result is channels-first.
    cl_volume = _channels_last(volume)
    torch_layout = forward_output_layout(cl_volume, kernel, None, *three)
    rerouted = hazard_layout(cl_volume, kernel, *three)
    assert (rerouted is not None) == (torch_layout is Layout.CHANNELS_LAST)
    assert hazard_layout(volume, kernel, *three) is None
    assert hazard_layout(x, w, *args) is None  # channels-first: torch is right
    assert hazard_layout(x.float(), _channels_last(w.float()), *args) is None
    unpadded = ((1, 2, 1), (2,), (0,), (1,), 1)
    assert hazard_layout(x, _channels_last(w), *unpadded) is None
    longer = torch.randn(1, 4, 3).bfloat16()
    assert hazard_layout(longer, _channels_last(w), (1, 2, 2), (2,), (1,), (1,), 1) is None


@pytest.mark.parametrize("case", SMALL_PADDED, ids=lambda c: f"{len(c[0]) - 2}d-{c[5]}")
def test_batched_bf16_weight_gradients_of_small_padded_inputs_match_float64(case, monkeypatch):
    """Batched gradients through gemmconv's own node (im2col forced) run torch's
    convolution_backward (roads/autograd.py), given channels-first operands here."""
    monkeypatch.setenv("GEMMCONV_SOLVER", "im2col")
    _, _, stride, padding, groups, _ = case
    for seed in range(4):
        x, w, dy, want = _small_padded_operands(case, seed)
        wg = w.clone().requires_grad_()
        y = _GEMMCONV_CONVS[x.dim()](x, wg, stride=stride, padding=padding, groups=groups)
        assert type(y.grad_fn).__name__ != "ConvolutionBackward0"
        batch = torch.stack([dy, 2 * dy]).bfloat16()
        _garbage_in_freed_memory()
        (dw,) = torch.autograd.grad(y, wg, batch, is_grads_batched=True)
        assert _relative_error(dw[0], want) < 0.02, (seed, dw[0])
        assert _relative_error(dw[1], 2 * want) < 0.02, (seed, dw[1])


# Strided 1x1s whose channels-last weight gradient torch 2.13 to 2.15 computed by writing past
# the end of a buffer, with two threads (tests/native/guard_allocator.c faults at the
# write): (dtype, samples, in channels, out channels, size, stride).
OVERFLOWING = [
    ("bf16", 1, 3, 2, (6, 7), (2, 1)),
    ("fp32", 3, 3, 1, (6, 6), (2, 1)),
    ("fp32", 3, 5, 2, (6, 10), (3, 1)),
    ("fp32", 3, 6, 6, (7, 8), (1, 2)),
]
# The same reads in 1-D and 3-D, which no sweep saw fault but which are routed alike.
STRIDED_POINTWISE = [
    *OVERFLOWING,
    ("fp32", 2, 4, 3, (9,), (2,)),
    ("bf16", 2, 4, 3, (5, 6, 7), (1, 2, 3)),
]
_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _strided_pointwise_operands(case, seed):
    """x and W of ``case`` (x channels-last, W contiguous), dY, and the float64
    reference's y, dx and dW."""
    dtype, n, c, k, size, stride = case
    g = torch.Generator().manual_seed(seed)
    x = _channels_last(torch.randn(n, c, *size, generator=g).to(_DTYPES[dtype]))
    w = torch.randn(k, c, *(1,) * len(size), generator=g).to(_DTYPES[dtype])
    x64, w64 = (t.double().contiguous().requires_grad_() for t in (x, w))
    reference = _CONVS[x.dim()](x64, w64, stride=stride)
    dy = torch.randn(reference.shape, generator=g, dtype=torch.float64)
    reference.backward(dy)
    return x, w, dy.to(x.dtype), (reference.detach(), x64.grad, w64.grad)


def _bound(dtype: torch.dtype) -> float:
    return 0.02 if dtype == torch.bfloat16 else 1e-5


@pytest.mark.parametrize("case", STRIDED_POINTWISE, ids=lambda c: f"{c[0]}-{len(c[4])}d-{c[5]}")
@pytest.mark.parametrize("solver", [None, "vendor"])
def test_strided_pointwise_gradients_match_float64_with_torch_strides(case, solver, monkeypatch):
    if solver is not None:
        monkeypatch.setenv("GEMMCONV_SOLVER", solver)
    stride = case[5]
    for seed in range(3):
        x, w, dy, (y64, dx64, dw64) = _strided_pointwise_operands(case, seed)
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = _GEMMCONV_CONVS[x.dim()](xg, wg, stride=stride)
        assert y.stride() == _CONVS[x.dim()](x, w, stride=stride).stride()
        y.backward(dy)
        bound = _bound(x.dtype)
        assert _relative_error(y, y64) < bound
        assert _relative_error(xg.grad, dx64) < bound
        assert _relative_error(wg.grad, dw64) < bound, (seed, wg.grad)


@pytest.mark.parametrize("case", STRIDED_POINTWISE, ids=lambda c: f"{c[0]}-{len(c[4])}d-{c[5]}")
def test_the_vendor_solvers_strided_pointwise_weight_gradient_matches_float64(case):
    stride = case[5]
    x, w, dy, (_, _, dw64) = _strided_pointwise_operands(case, 0)
    ones = (1,) * len(stride)
    problem = ConvProblem.from_tensors(x, w, None, stride, (0,) * len(stride), ones, 1)
    problem = problem.with_direction(Direction.BACKWARD_WEIGHTS)
    tensors = ConvTensors(input=x, weight=w, bias=None, grad_output=dy)
    dw = get_solver("vendor").run(problem, tensors)
    assert _relative_error(dw, dw64) < _bound(x.dtype)


def test_strided_pointwise_runs_go_to_unit_stride_only_where_channels_last():
    x = _channels_last(torch.randn(3, 5, 6, 10))
    w = torch.randn(2, 5, 1, 1)
    stride, none, ones = [3, 1], [0, 0], [1, 1]
    reads = unit_stride_reads(x, w, stride, none, ones, 1)
    assert reads is not None
    # The elements the strided 1x1 reads, copied dense channels-last.
    assert torch.equal(x[reads], x[:, :, ::3])
    seen, weight, unit_stride, unit_dilation = weight_gradient_arguments(
        x, w, stride, none, ones, 1
    )
    assert torch.equal(seen, x[:, :, ::3])
    assert seen.is_contiguous(memory_format=torch.channels_last)
    assert (weight is w, unit_stride, unit_dilation) == (True, [1, 1], [1, 1])
    assert unit_stride_reads(x.contiguous(), w, stride, none, ones, 1) is None  # channels-first
    assert unit_stride_reads(x.double(), w.double(), stride, none, ones, 1) is None
    assert unit_stride_reads(x, w, ones, none, ones, 1) is None
    assert unit_stride_reads(x, w, stride, [1, 0], ones, 1) is None
    kernel = torch.randn(2, 5, 3, 1)
    assert unit_stride_reads(x, kernel, stride, none, ones, 1) is None
    # Unchanged arguments come back as they were given.
    same = weight_gradient_arguments(x.contiguous(), w, stride, none, ones, 1)
    assert same[2] is stride and same[3] is ones


def test_torch_records_the_unit_stride_convolution_where_it_serves_training(monkeypatch):
    """Where the eager road hands a training call to torch's own convolution, torch
    records the unit-stride one, whose backward never runs the strided kernel."""
    monkeypatch.setenv("GEMMCONV_SOLVER", "vendor")
    x, w, dy, (_, dx64, dw64) = _strided_pointwise_operands(OVERFLOWING[1], 0)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = gemmconv.conv2d(xg, wg, stride=OVERFLOWING[1][5])
    assert type(y.grad_fn).__name__ == "ConvolutionBackward0"
    assert tuple(y.grad_fn._saved_stride) == (1, 1)
    assert y.stride() == F.conv2d(x, w, stride=OVERFLOWING[1][5]).stride()
    with torch.no_grad():  # a forward alone runs torch's strided call itself
        alone = gemmconv.conv2d(x, w, stride=OVERFLOWING[1][5])
    assert torch.equal(alone, F.conv2d(x, w, stride=OVERFLOWING[1][5]))
    y.backward(dy)
    assert _relative_error(xg.grad, dx64) < 1e-5
    assert _relative_error(wg.grad, dw64) < 1e-5


@pytest.mark.parametrize("case", OVERFLOWING[:2], ids=lambda c: f"{c[0]}-{c[5]}")
def test_batched_strided_pointwise_gradients_match_float64(case, monkeypatch):
    """Batched gradients through gemmconv's own node run torch's convolution_backward
    (roads/autograd.py): dW at unit stride, dx from the strided operands."""
    monkeypatch.setenv("GEMMCONV_SOLVER", "im2col")
    x, w, dy, (_, dx64, dw64) = _strided_pointwise_operands(case, 0)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = gemmconv.conv2d(xg, wg, stride=case[5])
    assert type(y.grad_fn).__name__ != "ConvolutionBackward0"
    dx, dw = torch.autograd.grad(y, (xg, wg), torch.stack([dy, 2 * dy]), is_grads_batched=True)
    bound = _bound(x.dtype)
    for i, scale in enumerate((1, 2)):
        assert _relative_error(dx[i], scale * dx64) < bound
        assert _relative_error(dw[i], scale * dw64) < bound


_OVERFLOW_RUN = """
import sys, torch
torch.set_num_threads(2)
import gemmconv
from gemmconv.core.problem import ConvProblem, Direction
from gemmconv.solvers import get_solver
from gemmconv.solvers.base import ConvTensors
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
caller = sys.argv[1]
for dtype, n, c, k, size, stride in %r:
    x = torch.rand(n, c, *size, dtype=DTYPES[dtype]).contiguous(memory_format=torch.channels_last)
    w = torch.rand(k, c, 1, 1, dtype=x.dtype)
    if caller == "torch":
        dy = torch.rand(n, k, *((s - 1) // t + 1 for s, t in zip(size, stride)), dtype=x.dtype)
        dy = dy.contiguous(memory_format=torch.channels_last)
        torch.ops.aten.convolution_backward.default(
            dy, x, w, None, list(stride), [0, 0], [1, 1], False, [0, 0], 1, [False, True, False])
        continue
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = gemmconv.conv2d(xg, wg, stride=stride)
    dy = torch.rand_like(y)
    y.backward(dy)
    torch.autograd.grad(gemmconv.conv2d(xg, wg, stride=stride), (xg, wg),
                        torch.stack([dy, dy]), is_grads_batched=True)
    problem = ConvProblem.from_tensors(x, w, None, stride, (0, 0), (1, 1), 1)
    problem = problem.with_direction(Direction.BACKWARD_WEIGHTS)
    get_solver("vendor").run(problem, ConvTensors(input=x, weight=w, bias=None, grad_output=dy))
print("ran")
"""


@pytest.fixture(scope="module")
def guard_allocator(tmp_path_factory) -> str:
    """tests/native/guard_allocator.c built into a library to preload."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler (cc or gcc) to build tests/native/guard_allocator.c")
    library = tmp_path_factory.mktemp("guard") / "guard_allocator.so"
    source = Path(__file__).resolve().parents[1] / "native" / "guard_allocator.c"
    subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", str(library), str(source),
                    "-lpthread"], check=True)  # fmt: skip
    return str(library)


def _under_guard(library: str, caller: str, solver: str | None):
    env = {k: v for k, v in os.environ.items() if k != "GEMMCONV_SOLVER"}
    env.update(LD_PRELOAD=library, GUARD_READ="1", OMP_NUM_THREADS="2")
    if solver is not None:
        env["GEMMCONV_SOLVER"] = solver
    return subprocess.run([sys.executable, "-c", _OVERFLOW_RUN % (OVERFLOWING,), caller],
                          env=env, capture_output=True, text=True, timeout=300)  # fmt: skip


@pytest.mark.parametrize("solver", [None, "vendor", "im2col"])
def test_no_strided_pointwise_call_writes_past_a_buffer(guard_allocator, solver):
    """Under an allocator that faults at a write past a buffer's end, torch's own calls
    fault on these problems and gemmconv's run (public calls, batched gradients, the
    vendor solver's weight gradient)."""
    torch_run = _under_guard(guard_allocator, "torch", None)
    if torch_run.returncode == 0:
        pytest.skip(f"torch {torch.__version__}'s own weight gradients wrote no byte past a "
                    "buffer here: nothing to avoid")  # fmt: skip
    done = _under_guard(guard_allocator, "gemmconv", solver)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ran"
