"""The measuring engine (gemmconv.measuring.measure) and find's decision on what a call costs."""

from __future__ import annotations

import json
import math

import pytest
import torch

import gemmconv
from gemmconv.core.memory_format import Layout, has_strides_of
from gemmconv.core.problem import ConvProblem, Direction
from gemmconv.measuring import measure
from gemmconv.measuring.timing import Timing
from gemmconv.selection import dispatch, finddb
from gemmconv.solvers import get_solver
from gemmconv.solvers.im2col import Im2colSolver

CPU = torch.device("cpu")


def _problem(direction=Direction.FORWARD, **kw) -> ConvProblem:
    kw.setdefault("has_bias", direction is Direction.FORWARD)
    return ConvProblem.from_sizes(4, 3, 8, (8, 8), 4, stride=4, direction=direction, **kw)


# ---- operands -------------------------------------------------------------------


def test_operands_hold_the_bias_of_a_forward_problem_and_only_the_directions_tensors():
    forward = measure.operands(_problem(), CPU)
    assert forward.bias is not None and forward.bias.shape == (8,)
    assert forward.grad_output is None
    data = measure.operands(_problem(Direction.BACKWARD_DATA), CPU)
    assert data.input is None and data.bias is None and data.weight is not None
    every = measure.operands(_problem(Direction.BACKWARD_DATA, has_bias=True), CPU,
                             every_operand=True)  # fmt: skip
    assert None not in (every.input, every.weight, every.bias, every.grad_output)
    for t in (every.input, every.weight, every.bias, every.grad_output):
        assert t.abs().min() > 0 and t.abs().max() <= 1  # uniform(-1, 1), never zeros


@pytest.mark.parametrize(
    ("dims", "dtype", "grad_layout"),
    [
        (2, torch.float32, Layout.CHANNELS_LAST),
        (1, torch.float32, Layout.CHANNELS_FIRST),  # torch's 1-D outputs are contiguous
        (3, torch.float64, Layout.CHANNELS_FIRST),  # so are the CPU's 3-D fp64 ones
        # A 3-D fp16 one is contiguous on the CPU's own kernel and channels-last through
        # oneDNN, which takes fp16 on processors with AVX512-FP16: torch's is the answer.
        (3, torch.float16, None),
    ],
)
def test_grad_output_is_laid_out_as_the_backward_ops_receive_it(dims, dtype, grad_layout):
    p = ConvProblem.from_sizes(2, 3, 4, (4,) * dims, 2, stride=2, layout=Layout.CHANNELS_LAST,
                               dtype=dtype, direction=Direction.BACKWARD_WEIGHTS)  # fmt: skip
    t = measure.operands(p, CPU, seed=5)
    assert has_strides_of(t.input, Layout.CHANNELS_LAST)
    # the layout F.conv* gives its output, which autograd hands the backward
    x = t.input.detach().requires_grad_()
    w = torch.rand(p.weight_shape, dtype=dtype)
    y = {1: torch.nn.functional.conv1d, 2: torch.nn.functional.conv2d,
         3: torch.nn.functional.conv3d}[dims](x, w, stride=2)  # fmt: skip
    (torch_layout,) = [layout for layout in Layout if has_strides_of(y, layout)]
    assert grad_layout in (None, torch_layout)
    assert has_strides_of(t.grad_output, torch_layout)


def test_operand_sets_are_one_set_off_cuda_and_seeded():
    (first,) = measure.operand_sets(_problem(), CPU, seed=3)
    again = measure.operands(_problem(), CPU, seed=3)
    assert torch.equal(first.input, again.input) and torch.equal(first.bias, again.bias)
    assert measure.operand_bytes(first) == 4 * (4 * 3 * 64 + 8 * 3 * 16 + 8)


# ---- checking and timing a candidate --------------------------------------------


def test_a_candidate_is_checked_into_a_nan_filled_result_and_judged():
    p = _problem()
    t = measure.operands(p, CPU)
    out = measure.result_like(p, t)
    result, verdict, refused = measure.run_checked(
        p, get_solver("patch"), t, out, measure.Judge(p, t)
    )
    assert result.data_ptr() == out.data_ptr() and verdict.ok and refused is None


def _unwritten(self, p, t, out):
    return torch.empty(p.output_shape, dtype=p.dtype) if out is None else out


def _wrong(self, p, t, out):
    ones = torch.ones(p.output_shape, dtype=p.dtype)
    return ones if out is None else out.copy_(ones)


def _raising(self, p, t, out):
    raise RuntimeError("kernel launch failed (simulated)")


@pytest.mark.parametrize(
    ("fault", "verify", "reason"),
    [
        (_unwritten, False, "left NaN in its result"),
        (_wrong, True, "verification FAILED"),
        (_raising, False, "RuntimeError: kernel launch failed (simulated)"),
    ],
)
def test_a_failing_candidate_is_skipped_with_its_reason(monkeypatch, fault, verify, reason):
    monkeypatch.setattr(Im2colSolver, "forward", fault)
    p = _problem()
    candidates = [get_solver("im2col"), get_solver("patch")]
    policy = measure.TimingPolicy(warmup=0, reps=1)
    measured = measure.measure_solvers(p, candidates, policy=policy, verify=verify)
    broken, good = measured
    assert not broken.ok and broken.skipped.startswith(reason) and broken.call is None
    assert good.ok and good.call_ms > 0
    assert good.workspace_bytes == get_solver("patch").workspace_bytes(p)
    assert measure.fastest(measured).solver == "patch"


def test_on_the_cpu_the_call_time_and_the_device_time_are_one_measurement():
    p = _problem()
    sets = measure.operand_sets(p, CPU)
    calls = []

    def counting_setup():
        calls.append(1)

    call, device = measure.time_solver(p, get_solver("patch"), sets,
                                       measure.TimingPolicy(warmup=2, reps=3),
                                       setup=counting_setup)  # fmt: skip
    assert call is device and device.reps == 3 and len(calls) == 2 + 3


def test_fastest_is_by_call_time_unless_asked_for_device_time():
    def timed(solver, call_ms, device_ms):
        return measure.Measurement(solver, Timing.from_samples((call_ms,)),
                                   Timing.from_samples((device_ms,)), 0)  # fmt: skip

    measured = [timed("a", 2.0, 1.0), timed("b", 1.0, 3.0),
                measure.Measurement("c", None, None, 0, skipped="raised")]  # fmt: skip
    assert measure.fastest(measured).solver == "b"
    assert measure.fastest(measured, by="device_ms").solver == "a"
    assert measure.fastest(measured[2:]) is None


@pytest.mark.parametrize(
    ("field", "value"), [("warmup", -1), ("reps", 0), ("call_reps", 0), ("block_ms", 0.0)]
)
def test_a_timing_policy_refuses_a_count_that_measures_nothing(field, value):
    with pytest.raises(ValueError, match=f"{field}="):
        measure.TimingPolicy(**{field: value})


def test_a_call_through_autograd_runs_inside_a_node_in_any_grad_mode():
    """through_autograd makes each call from a backward node of a graph built once,
    whether the caller is under no_grad, inference_mode or inside a backward itself
    (find decides a backward plan on its first backward call)."""
    made = []
    call = measure.through_autograd(lambda: made.append(torch.is_grad_enabled()), CPU)
    call()
    with torch.no_grad():
        call()
    with torch.inference_mode():
        measure.through_autograd(lambda: made.append("inference"), CPU)()

    class Outer(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            measure.through_autograd(lambda: made.append("reentrant"), CPU)()
            return grad * 2

    x = torch.ones(3, requires_grad=True)
    Outer.apply(x).sum().backward()
    # The node's backward runs without grad mode, as autograd runs every backward.
    assert made == [False, False, "inference", "reentrant"]
    assert torch.equal(x.grad, torch.full((3,), 2.0))


# ---- find decides on the call time ----------------------------------------------


def test_find_stores_the_fastest_call_and_keeps_device_times_beside_it(monkeypatch):
    """Where the candidate fastest on the device is slower as a call (host time), find
    picks by the call, stores that time, and reports the device times too (bare runs:
    no public call for find to time)."""
    fake = {"patch": (2.0, 0.5), "im2col": (1.0, 3.0), "vendor": (4.0, 4.0)}
    monkeypatch.setattr(dispatch, "_public_calls", None)

    def time_solver(problem, solver, operand_sets, policy, *, setup=None):
        call_ms, device_ms = fake[solver.id]
        return Timing.from_samples((call_ms,)), Timing.from_samples((device_ms,))

    monkeypatch.setattr(measure, "time_solver", time_solver)
    problem = _problem(has_bias=False)
    with gemmconv.find_mode("find"):
        choice = dispatch.choose(problem)
    assert choice.solver == "im2col" and choice.source == "find"
    assert choice.times_ms == {sid: c for sid, (c, _) in fake.items()}
    assert choice.device_times_ms == {sid: d for sid, (_, d) in fake.items()}
    assert "1 ms a call (3 ms device time)" in choice.reason
    record = finddb.get_db().lookup(problem.key(), finddb.identity_for("cpu"))
    assert record.solver == "im2col" and math.isclose(record.time_ms, 1.0)


# ---- on the GPU -----------------------------------------------------------------


@pytest.mark.gpu
def test_on_cuda_a_candidate_has_a_call_time_and_a_device_time():
    cuda = torch.device("cuda")
    p = ConvProblem.from_sizes(64, 3, 64, (32, 32), 4, stride=4, dtype=torch.bfloat16,
                               device_type="cuda")  # fmt: skip
    assert len(measure.operand_sets(p, cuda)) == measure.MAX_OPERAND_SETS  # a small problem
    (m,) = measure.measure_solvers(p, [get_solver("patch")], verify=True)
    assert m.ok and m.verdict.ok
    assert m.call is not m.device and m.call_ms > 0 and m.device_ms > 0


@pytest.mark.gpu
def test_on_cuda_a_backward_candidate_is_timed_from_an_autograd_node(monkeypatch):
    """A backward direction's call time is of calls made from an autograd node (what a
    user's backward pays); a forward's is of bare calls."""
    cuda = torch.device("cuda")
    wrapped = []
    real = measure.through_autograd

    def counted(call, device):
        wrapped.append(device)
        return real(call, device)

    monkeypatch.setattr(measure, "through_autograd", counted)
    for direction in Direction:
        p = ConvProblem.from_sizes(64, 3, 64, (32, 32), 4, stride=4, dtype=torch.bfloat16,
                                   device_type="cuda", direction=direction)  # fmt: skip
        before = len(wrapped)
        (m,) = measure.measure_solvers(p, [get_solver("patch")])
        assert m.ok and m.call_ms > 0
        sets = len(measure.operand_sets(p, cuda))
        assert len(wrapped) - before == (0 if direction is Direction.FORWARD else sets)


@pytest.mark.gpu
def test_the_suite_on_cuda_has_what_users_pay_beside_device_time(tmp_path):
    from gemmconv.bench.suite import main

    argv = ["--device", "cuda", "--quick", "--cases", "point2d,vit_b16", "--dtypes", "bf16",
            "--out", str(tmp_path), "--name", "gpu", "--no-plot"]  # fmt: skip
    assert main(argv) == 0
    rows = json.loads((tmp_path / "gpu.json").read_text())["rows"]
    assert len(rows) == 2 * 2 * 3
    for r in rows:
        assert min(r["api_ms"], r["vendor_api_ms"], r["linear_api_ms"], r["gemmconv_ms"]) > 0
        assert all(c["call_ms"] > 0 for c in r["candidates"].values() if c["ok"])
