"""Immediate mode against the H200 suite run the cost table is fitted to (the tests' copy,
tests/data/h200_suite.json): on every measured row the cost model's pick must run
within 10% of the fastest measured solver, in the call time that run recorded (what
find decides on).

Runs offline: each row's ConvProblem is rebuilt for device_type "cuda" and ranked with
the H200 entry of the cost table passed explicitly, so the CPU-only CI machine ranks exactly as the
H200 did, through the same dispatch.decide the benchmark records as immediate_solver.
"""

from __future__ import annotations

import pytest

from gemmconv.core.device_rates import H200
from gemmconv.roads import eager
from gemmconv.selection import dispatch
from gemmconv.solvers import get_solver

from h200_measurements import RESULTS, STILL_OFF, measured, problem_of, row_id, rows

TOLERANCE = 0.10


def test_benchmark_has_rows() -> None:
    all_rows = rows()
    assert len(all_rows) >= 60, f"{RESULTS} holds {len(all_rows)} rows, expected the full suite"
    assert all(measured(r) for r in all_rows)


def _param(row: dict):
    marks = ()
    if row_id(row) in STILL_OFF:
        marks = pytest.mark.xfail(strict=True, reason="cost model still >10% off find here")
    return pytest.param(row, id=row_id(row), marks=marks)


@pytest.mark.parametrize("row", [_param(r) for r in rows()])
def test_immediate_within_tolerance_of_find(row: dict) -> None:
    times = measured(row)
    problem = problem_of(row)
    solvers = [get_solver(sid) for sid in times]
    choice = dispatch.decide(problem, solvers, rates=H200)
    best = min(times.values())
    gap = times[choice.solver] / best - 1.0
    assert gap <= TOLERANCE, (
        f"{row_id(row)}: immediate picks {choice.solver} ({times[choice.solver]:.4g} ms), "
        f"{gap:.0%} behind the fastest measured {min(times, key=times.get)} "
        f"({best:.4g} ms); estimates {choice.estimates_ms}"
    )


def _cases() -> dict[tuple[str, str, str], list[dict]]:
    """The suite's rows by case, layout and dtype: one list of three directions each."""
    cases: dict[tuple[str, str, str], list[dict]] = {}
    for row in rows():
        cases.setdefault((row["case"], row["layout"], row["dtype"]), []).append(row)
    return cases


# Cases where the estimated saving falls on the other side: ConvNeXt's channels-first
# downsample, whose patch solvers the model prices 25-35% under their calls, a near tie
# with cuDNN by call time (36 us over three directions). Its public calls favoured
# gemmconv's node all the same (0.97-1.17x cuDNN, bench/results/h200.json).
RULE_STILL_OFF = {("convnext_down", "cf", "bf16")}


def _case_param(case: tuple[str, str, str]):
    marks = ()
    if case in RULE_STILL_OFF:
        marks = pytest.mark.xfail(strict=True, reason="estimated saving on the node's other side")
    return pytest.param(case, id="-".join(case), marks=marks)


@pytest.mark.parametrize("case", [_case_param(c) for c in sorted(_cases())])
def test_the_training_call_rule_sides_with_the_measured_saving(case) -> None:
    """eager's rule sends a training call to torch's convolution where the GEMM solvers
    of its three directions save less than the autograd node: the saving it estimates
    must fall on the node's side the measured one does. A vendor priced too cheap sent
    DiT-XL/2's channels-last training calls to torch though the GEMMs save 208 us."""
    node_ms = H200.autograd_node_us / 1000
    estimated = measured_saving = 0.0
    for row in _cases()[case]:
        times = measured(row)
        choice = dispatch.decide(problem_of(row), [get_solver(s) for s in times], rates=H200)
        estimated += eager._saving_over_vendor(choice, problem_of(row).direction)
        measured_saving += times["vendor"] - times[choice.solver]
    assert (estimated < node_ms) == (measured_saving < node_ms), (
        f"{case}: estimated saving {estimated * 1000:.0f} us, measured "
        f"{measured_saving * 1000:.0f} us, node {node_ms * 1000:.0f} us"
    )


# A tie within this fraction of a call is no loss (run-to-run spread of one call).
TIE = 0.01


def _forward_rows() -> list[dict]:
    return [r for r in rows() if r["direction"] == "fwd"]


@pytest.mark.parametrize("row", [pytest.param(r, id=row_id(r)) for r in _forward_rows()])
def test_the_forward_tie_rule_sides_with_the_measured_call(row: dict) -> None:
    """dispatch's tie rule sends a forward whose GEMM saves less than its own call's host
    time to the vendor: on the H200 run, the option it picks (the vendor, or the GEMM
    the estimate ranks first) runs no slower a call than the other, within a tie."""
    times = measured(row)
    problem = problem_of(row)
    choice = dispatch.decide(problem, [get_solver(s) for s in times], rates=H200)
    gemm = min(
        (s for s in choice.estimates_ms if s != "vendor"), key=choice.estimates_ms.__getitem__
    )
    other = gemm if choice.solver == "vendor" else "vendor"
    assert times[choice.solver] <= (1 + TIE) * times[other], (
        f"{row_id(row)}: the rule picks {choice.solver} ({times[choice.solver]:.4g} ms a "
        f"call), {other} ran {times[other]:.4g}; {choice.reason}"
    )
    if row["immediate_solver"] == gemm:
        # The run's public call ran this GEMM: the public calls agree with the pick too.
        public = {gemm: row["api_ms"], "vendor": row["vendor_api_ms"]}
        assert public[choice.solver] <= (1 + TIE) * public[other], (row_id(row), public)


def test_the_forward_tie_rule_changes_some_picks_and_only_forwards() -> None:
    """The rule moves forwards from a GEMM to the vendor only (the recorded run's ResNet
    1x1 forwards, both layouts, where the estimate saw a 6 us saving and the calls
    measured a tie); a backward direction's pick is never the rule's."""
    changed = []
    for row in rows():
        times = measured(row)
        choice = dispatch.decide(problem_of(row), [get_solver(s) for s in times], rates=H200)
        lowest = min(choice.estimates_ms, key=choice.estimates_ms.__getitem__)
        if choice.solver != lowest:
            assert row["direction"] == "fwd" and choice.solver == "vendor", row_id(row)
            assert "host time" in choice.reason and "host time" in choice.rejected[lowest][0]
            changed.append(row_id(row))
    assert changed, "the rule changes no pick on the recorded run"
