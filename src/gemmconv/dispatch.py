"""Which solver runs a problem.

Every registered solver is asked for its rejection reasons; among those that apply,
the lowest cost estimate wins (ties go to the earlier solver in the registry). The
decision is made once per problem per process and cached, so steady-state calls pay
no selection cost. Each decision is logged on the ``gemmconv.dispatch`` logger, a
fallback to the vendor path included.
"""

from __future__ import annotations

import dataclasses
import logging
import threading

from gemmconv.problem import DIRECTIONS, ConvProblem
from gemmconv.solvers import SOLVERS, Solver

log = logging.getLogger("gemmconv.dispatch")


@dataclasses.dataclass(frozen=True)
class Choice:
    """The outcome of selection for one problem."""

    solver: str
    rejected: dict[str, list[str]]
    estimates_ms: dict[str, float]
    reason: str

    def __str__(self) -> str:
        return f"{self.solver} ({self.reason})"


_cache: dict[ConvProblem, Choice] = {}
_lock = threading.Lock()


def decide(problem: ConvProblem, solvers: tuple[Solver, ...] = SOLVERS) -> Choice:
    """Immediate selection: the applicable solver with the lowest estimate."""
    rejected: dict[str, list[str]] = {}
    estimates: dict[str, float] = {}
    for solver in solvers:
        reasons = solver.not_supported_reasons(problem)
        if reasons:
            rejected[solver.id] = reasons
        else:
            estimates[solver.id] = solver.estimate_ms(problem)
    if not estimates:
        listing = "; ".join(f"{sid}: {', '.join(r)}" for sid, r in rejected.items())
        raise RuntimeError(f"no solver applies to {problem.key()}: {listing}")
    best = min(estimates, key=estimates.__getitem__)  # min keeps the first of equals
    for sid, est in estimates.items():
        if sid != best:
            rejected[sid] = [f"estimate {est:.4g} ms > {estimates[best]:.4g} ms of {best}"]
    return Choice(
        solver=best,
        rejected=rejected,
        estimates_ms=estimates,
        reason=f"lowest estimate, {estimates[best]:.4g} ms",
    )


def choose(problem: ConvProblem) -> Choice:
    """The cached choice for ``problem``."""
    choice = _cache.get(problem)
    if choice is None:
        choice = decide(problem)
        with _lock:
            _cache[problem] = choice
        level = logging.INFO if choice.solver == "vendor" else logging.DEBUG
        log.log(level, "%s -> %s", problem.key(), choice)
    return choice


def solver_for(problem: ConvProblem) -> Solver:
    from gemmconv.solvers import get_solver

    return get_solver(choose(problem).solver)


def clear_cache() -> None:
    with _lock:
        _cache.clear()


def explain_problem(problem: ConvProblem) -> dict[str, Choice]:
    """The choice in every direction, keyed by direction name, without running anything."""
    return {d.value: choose(problem.with_direction(d)) for d in DIRECTIONS}
