"""Find in tests: a record of the problems it times, and the rule its pick follows."""

from __future__ import annotations

import pytest

from gemmconv.core.problem import ConvProblem
from gemmconv.selection import find as find_module
from gemmconv.selection.find import PREFERENCE_MARGIN


def count_finds(monkeypatch: pytest.MonkeyPatch) -> list[ConvProblem]:
    """The list every later find_best call appends its problem to (the find still runs)."""
    calls: list[ConvProblem] = []
    real = find_module.find_best

    def counting(problem, solvers, **kw):
        calls.append(problem)
        return real(problem, solvers, **kw)

    monkeypatch.setattr(find_module, "find_best", counting)
    return calls


def is_finds_pick(solver: str, times_ms: dict[str, float], preferred: str | None) -> bool:
    """Whether ``solver`` is what find picks from ``times_ms`` (call time per candidate):
    the fastest, or ``preferred`` (the cost model's pick) within PREFERENCE_MARGIN."""
    fastest = min(times_ms, key=times_ms.__getitem__)
    if solver == fastest:
        return True
    return solver == preferred and times_ms[solver] <= times_ms[fastest] * (1 + PREFERENCE_MARGIN)
