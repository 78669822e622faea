"""Find keeps the cost model's pick unless another candidate's call measured more than
PREFERENCE_MARGIN faster (selection/find.py), checked on made-up timings."""

from __future__ import annotations

import pytest

import gemmconv
from gemmconv.core.problem import ConvProblem, Direction
from gemmconv.measuring.measure import Measurement
from gemmconv.measuring.timing import Timing
from gemmconv.selection import dispatch, finddb
from gemmconv.selection import find as find_module
from gemmconv.selection.find import PREFERENCE_MARGIN, find_best
from gemmconv.solvers import get_solver


def _problem() -> ConvProblem:
    return ConvProblem.from_sizes(4, 3, 8, (8, 8), 4, stride=4, direction=Direction.BACKWARD_DATA)


def _timed(solver: str, ms: float) -> Measurement:
    timing = Timing.from_samples((ms,))
    return Measurement(solver, call=timing, device=timing, workspace_bytes=0)


def _skipped(solver: str) -> Measurement:
    return Measurement(solver, call=None, device=None, workspace_bytes=0, skipped="simulated")


def _measuring(monkeypatch, measured: list[Measurement]) -> None:
    monkeypatch.setattr(find_module, "measure_solvers", lambda *a, **k: measured)


def _solvers(measured: list[Measurement]):
    return [get_solver(m.solver) for m in measured]


@pytest.mark.parametrize(
    ("preferred_ms", "kept"),
    [(1.0, True), (1.0 + PREFERENCE_MARGIN * 0.8, True), (1.0 + PREFERENCE_MARGIN * 1.2, False)],
)
def test_the_preferred_pick_stays_within_the_margin(monkeypatch, preferred_ms, kept):
    measured = [_timed("vendor", 1.0), _timed("patch", preferred_ms), _timed("im2col", 3.0)]
    _measuring(monkeypatch, measured)
    result = find_best(_problem(), _solvers(measured), preferred="patch")
    assert result.best == ("patch" if kept else "vendor")
    assert result.best_ms == pytest.approx(preferred_ms if kept else 1.0)
    # On a tie the fastest is the earlier candidate: the preferred one is kept against it.
    assert result.kept_preferred == kept
    assert result.fastest == ("vendor" if kept else "")


def test_without_a_preference_or_with_it_skipped_the_fastest_wins(monkeypatch):
    measured = [_timed("vendor", 1.0), _timed("patch", 1.01)]
    _measuring(monkeypatch, measured)
    assert find_best(_problem(), _solvers(measured)).best == "vendor"
    skipped = [_timed("vendor", 1.0), _skipped("patch")]
    _measuring(monkeypatch, skipped)
    result = find_best(_problem(), _solvers(skipped), preferred="patch")
    assert result.best == "vendor" and not result.kept_preferred


def test_find_mode_keeps_and_stores_the_models_pick_and_says_why(monkeypatch):
    problem = _problem()
    model = dispatch.decide(problem).solver
    others = [sid for sid in dispatch.decide(problem).estimates_ms if sid != model]
    faster = others[0]
    measured = [_timed(model, 1.03), _timed(faster, 1.0)]
    measured += [_timed(sid, 2.0) for sid in others[1:]]
    _measuring(monkeypatch, measured)
    with gemmconv.find_mode("find"):
        choice = dispatch.choose(problem)
    assert choice.solver == model and choice.source == "find"
    assert "cost model's pick, kept" in choice.reason and faster in choice.reason
    assert f"not more than {PREFERENCE_MARGIN:.0%} under" in choice.rejected[faster][0]
    record = finddb.get_db().lookup(dispatch.database_key(problem), finddb.identity_for("cpu"))
    assert record is not None and record.solver == model
    assert record.time_ms == pytest.approx(1.03)


def test_find_mode_moves_off_the_models_pick_past_the_margin(monkeypatch):
    problem = _problem()
    model = dispatch.decide(problem).solver
    faster = next(sid for sid in dispatch.decide(problem).estimates_ms if sid != model)
    _measuring(monkeypatch, [_timed(model, 1.0 + 2 * PREFERENCE_MARGIN), _timed(faster, 1.0)])
    with gemmconv.find_mode("find"):
        choice = dispatch.choose(problem)
    assert choice.solver == faster and choice.reason.startswith("fastest in find")
