"""A record of the problems find times, for tests that check when find runs."""

from __future__ import annotations

import pytest

from gemmconv.core.problem import ConvProblem
from gemmconv.selection import find as find_module


def count_finds(monkeypatch: pytest.MonkeyPatch) -> list[ConvProblem]:
    """The list every later find_best call appends its problem to (the find still runs)."""
    calls: list[ConvProblem] = []
    real = find_module.find_best

    def counting(problem, solvers, **kw):
        calls.append(problem)
        return real(problem, solvers, **kw)

    monkeypatch.setattr(find_module, "find_best", counting)
    return calls
