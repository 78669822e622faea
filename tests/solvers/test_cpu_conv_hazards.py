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
from gemmconv.core.problem import Direction
from gemmconv.solvers import get_solver
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
