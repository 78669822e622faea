"""Find decides on what the public call costs: each candidate is timed inside the call a
user makes (gemmconv.roads.in_call, dispatch.trial), and the eager road's training
rule sides with what find measured there."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

import gemmconv
from gemmconv.bench.suite import SUITE, make_problem
from gemmconv.core import device_rates
from gemmconv.core.memory_format import Layout
from gemmconv.core.problem import DIRECTIONS, ConvProblem, Direction
from gemmconv.measuring import measure
from gemmconv.measuring.timing import Timing
from gemmconv.roads import eager, in_call, ops
from gemmconv.selection import dispatch
from gemmconv.solvers import SOLVERS, get_solver

from find_counting import count_finds

CPU = torch.device("cpu")


def _problem(direction=Direction.FORWARD, **kw) -> ConvProblem:
    """A patch-class problem where patch, im2col and vendor apply on the CPU."""
    return ConvProblem.from_sizes(4, 3, 8, (8, 8), 4, stride=4, direction=direction, **kw)


def _fake_times(monkeypatch, bare: dict[str, float], public: dict[str, float]) -> list[str]:
    """Record timings: each candidate's bare run takes ``bare`` ms, its public call
    ``public`` ms. Returns the candidates whose public call was timed, in order."""
    timed: list[str] = []

    def time_solver(problem, solver, operand_sets, policy, *, setup=None):
        t = Timing.from_samples((bare[solver.id],))
        return t, t

    def bare_device_time(problem, solver, tensors, policy, *, setup=None):
        return Timing.from_samples((bare[solver.id],))

    def public_call_times(solvers, in_call_, device, policy):
        times = {}
        for solver in solvers:
            with in_call_(solver) as made:  # the real public call, made once
                assert made, f"{solver.id}: the public call did not reach the problem"
                made.calls[0]()
            timed.append(solver.id)
            times[solver.id] = Timing.from_samples((public[solver.id],))
        return times, {}

    monkeypatch.setattr(measure, "time_solver", time_solver)
    monkeypatch.setattr(measure, "bare_device_time", bare_device_time)
    monkeypatch.setattr(measure, "public_call_times", public_call_times)
    return timed


@pytest.mark.parametrize("direction", list(Direction))
def test_find_picks_by_the_public_call_not_the_bare_run(monkeypatch, direction):
    """Recorded timings where the bare runs and the public calls rank the candidates
    oppositely (issue 44: find's picks ran slower as public calls than immediate's):
    find follows the public call, keeps the bare time as device time, and says so."""
    bare = {"patch": 1.0, "im2col": 2.0, "vendor": 3.0}
    public = {"patch": 3.5, "im2col": 2.5, "vendor": 1.5}
    timed = _fake_times(monkeypatch, bare, public)
    problem = _problem(direction, has_bias=direction is Direction.FORWARD)
    with gemmconv.find_mode("find"):
        choice = dispatch.choose(problem)
    assert sorted(timed) == sorted(public)
    assert choice.solver == "vendor" and choice.in_call
    assert choice.times_ms == public and choice.device_times_ms == bare
    # Never slower in the public call than immediate's pick, which find measured too.
    immediate = dispatch.decide(problem).solver
    assert choice.times_ms[choice.solver] <= choice.times_ms[immediate]


def test_without_a_public_call_find_times_bare_runs(monkeypatch):
    monkeypatch.setattr(dispatch, "_public_calls", None)
    bare = {"patch": 1.0, "im2col": 2.0, "vendor": 3.0}
    timed = _fake_times(monkeypatch, bare, bare)
    with gemmconv.find_mode("find"):
        choice = dispatch.choose(_problem(Direction.BACKWARD_DATA))
    assert timed == [] and choice.solver == "patch" and not choice.in_call


def test_a_call_that_misses_the_problem_is_timed_bare_with_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(dispatch, "trial_hits", lambda number: 0)
    with caplog.at_level(logging.WARNING, "gemmconv.find"), gemmconv.find_mode("find"):
        choice = dispatch.choose(_problem(Direction.BACKWARD_WEIGHTS))
    assert not choice.in_call and set(choice.times_ms) == {"patch", "im2col", "vendor"}
    assert "did not reach the problem" in caplog.text


def test_a_trial_gives_its_solver_to_its_problem_only_and_leaves_nothing_behind():
    problem = _problem(has_bias=True)
    other = _problem(Direction.BACKWARD_DATA)
    outside = dispatch.selection_key()
    x, w, b = (torch.randn(4, 3, 8, 8), torch.randn(8, 3, 4, 4), torch.randn(8))
    calls_before, plans_before = len(eager._calls), len(ops._plans)
    with dispatch.trial(problem, "im2col") as number:
        assert dispatch.selection_key() != outside
        assert dispatch.choose(problem).solver == "im2col"
        assert dispatch.choose(problem).source == "trial"
        assert dispatch.choose(other).source == "estimate"  # decided as usual
        assert dispatch.trial_hits(number) == 2
        torch.testing.assert_close(
            gemmconv.conv2d(x, w, b, stride=4), torch.nn.functional.conv2d(x, w, b, stride=4)
        )
        assert len(eager._calls) > calls_before and len(ops._plans) > plans_before
    assert dispatch.selection_key() == outside
    assert (len(eager._calls), len(ops._plans)) == (calls_before, plans_before)
    assert dispatch.decided(problem) is None  # the trial's choice was never cached
    assert dispatch.choose(problem).source == "estimate"


def test_a_trial_inside_find_starts_no_other_find(monkeypatch):
    """A backward direction's public call builds a forward: undecided, it is decided
    as the database mode would, not found (one find never starts another)."""
    found = count_finds(monkeypatch)
    problem = _problem(Direction.BACKWARD_DATA)
    with gemmconv.find_mode("find"):
        choice = dispatch.choose(problem)
        assert dispatch.decided(problem.with_direction(Direction.FORWARD)) is None
    assert found == [problem] and choice.in_call


def _suite_problems() -> list:
    """Every suite case's tiny problem, both layouts, every direction (as the suite's
    rows and the eager road build them)."""
    cases = []
    for case in SUITE:
        for layout in Layout:
            for direction in DIRECTIONS:
                p = make_problem(case.tiny, layout, torch.float32, CPU, direction)
                cases.append(pytest.param(p, id=f"{case.name}-{layout.value}-{direction.value}"))
    return cases


@pytest.mark.parametrize("problem", _suite_problems())
def test_the_public_call_reaches_every_suite_problem(problem):
    """Each candidate's public call decides the problem find is timing (no call timed
    bare for want of a match) and computes what torch computes."""
    tried = in_call.public_calls(problem)
    assert tried is not None
    for solver in SOLVERS:
        if not solver.is_applicable(problem):
            continue
        with tried(solver) as made:
            assert made, f"{solver.id}: the public call missed {problem.key()}"
            result = made.calls[-1]()
        assert result is not None


@pytest.mark.parametrize("direction", list(Direction))
def test_find_times_the_candidates_interleaved_each_block_in_its_own_trial(monkeypatch, direction):
    """Every candidate's public calls are made, then timed block by block in one
    interleaved run (measure.time_interleaved), each block with its own candidate
    tried for the problem; at the end no trial is left open."""
    problem = _problem(direction)
    met = (
        dataclasses.replace(problem, has_bias=False) if direction != Direction.FORWARD else problem
    )
    solvers = [s for s in SOLVERS if s.is_applicable(problem)]
    outside = dispatch.selection_key()
    blocks: list[tuple[str, str]] = []  # (the block's candidate, the problem's choice in it)
    interleave = measure.time_interleaved

    def recording(calls, device, *, settings, **kwargs):
        assert set(calls) == set(settings) == {s.id for s in solvers}
        for name in reversed(list(calls)):  # another order than the trials were opened in
            with settings[name]():
                blocks.append((name, dispatch.choose(met).solver))
                calls[name][0]()
        return interleave(calls, device, settings=settings, **kwargs)

    monkeypatch.setattr(measure, "time_interleaved", recording)
    times, failed = measure.public_call_times(
        solvers, in_call.public_calls(problem), CPU, measure.default_policy("cpu")
    )
    assert set(times) == {s.id for s in solvers} and failed == {}
    assert blocks and all(owner == chosen for owner, chosen in blocks), blocks
    assert dispatch.selection_key() == outside
    assert dispatch.choose(met).source == "estimate"


def test_a_candidate_whose_public_call_raises_is_skipped_and_the_rest_timed(monkeypatch):
    problem = _problem(Direction.BACKWARD_WEIGHTS)
    solvers = [s for s in SOLVERS if s.is_applicable(problem)]
    failing = solvers[0]

    def broken(*args, **kwargs):
        raise RuntimeError("planted failure")

    monkeypatch.setattr(failing, "backward_weights", broken)
    monkeypatch.setattr(failing, "prepare", lambda p, t: broken)
    times, failed = measure.public_call_times(
        solvers, in_call.public_calls(problem), CPU, measure.default_policy("cpu")
    )
    assert "planted failure" in failed[failing.id]
    assert set(times) == {s.id for s in solvers[1:]}


def test_find_times_the_eager_road_the_user_call_takes():
    """In find mode a training call's directions are found in the public call, and
    its later calls run what find measured: a backward GEMM that beat the vendor in its
    call keeps gemmconv's node (the training rule does not send it to torch)."""
    x = torch.randn(16, 3, 32, 32, requires_grad=True)
    w = torch.randn(8, 3, 4, 4, requires_grad=True)
    b = torch.randn(8, requires_grad=True)
    with gemmconv.find_mode("find"):
        y = gemmconv.conv2d(x, w, b, stride=4)
        y.sum().backward()
        choices = gemmconv.explain(x, w, b, stride=4)
        forward = ConvProblem.from_tensors(x, w, b, (4, 4), (0, 0), (1, 1), 1)
        road = eager.training_road(forward, True, True)
    assert all(c.source == "find" and c.in_call for c in choices.values())
    backward_gemms = {d: c.solver for d, c in choices.items() if d != "forward"}
    if any(s != "vendor" for s in backward_gemms.values()):
        assert not road.on_torch, (backward_gemms, road)
    expected = torch.nn.grad.conv2d_input(x.shape, w, torch.ones_like(y), stride=4)
    torch.testing.assert_close(x.grad, expected)


def test_a_backward_gemm_found_in_the_call_keeps_the_node_whatever_its_saving():
    """The training rule's saving of a backward choice found in the public call: its
    call already paid the node and beat the vendor's call, so the node serves; a
    choice timed bare keeps the saving it measured, and a tried one none."""
    problem = _problem(Direction.BACKWARD_DATA)
    found = dispatch.Choice("patch", {}, {}, "found", "find", "find",
                            times_ms={"patch": 1.0, "vendor": 1.001}, in_call=True)  # fmt: skip
    rates = device_rates.rates_for(problem.device_type)
    assert eager._saving_over_vendor(found, problem, rates) == float("inf")
    bare = dataclasses.replace(found, in_call=False)
    assert eager._saving_over_vendor(bare, problem, rates) == pytest.approx(0.001)
    forward = eager._saving_over_vendor(found, problem.with_direction(Direction.FORWARD), rates)
    assert forward == pytest.approx(0.001)
    tried = dataclasses.replace(found, source="trial")
    assert eager._saving_over_vendor(tried, problem, rates) is None
    assert get_solver("patch").is_applicable(problem)
