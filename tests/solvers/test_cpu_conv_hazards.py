"""Operands torch's CPU convolution forward mishandles (solvers/cpu_conv_hazards.py):
gemmconv's calls that reach torch's convolution there, by the eager road, the vendor
solver and the op road, match float64 and keep torch's output strides."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import gemmconv
from gemmconv.core.memory_format import Layout
from gemmconv.core.problem import ConvProblem, Direction
from gemmconv.solvers import get_solver
from gemmconv.solvers.base import ConvTensors
from gemmconv.solvers.cpu_conv_hazards import hazard_layout

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
    assert hazard_layout(_channels_last(volume), kernel, *three) is not None
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
