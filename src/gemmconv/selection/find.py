"""Find: measure every candidate solver on a problem and name the fastest.

The candidates are measured by gemmconv.measuring.measure on the same fresh seeded random
operands of the problem's shapes, layout, dtype and device. The winner is the fastest
by what a call costs as a user makes it (back-to-back calls, ``call_ms``): with
``in_call`` (gemmconv.selection.dispatch gives it where the eager road can make the call),
the public call itself with the candidate tried, its forward, autograd node and layout
conversions included; the device time of each (``device_ms``) is kept beside it as a
diagnostic. A candidate
that raises, runs out of memory, leaves an element unwritten or — when verification is
asked for — fails it, is logged and skipped; it can never win.

Find keeps the cost model's pick (``preferred``) unless another candidate's call measured
more than PREFERENCE_MARGIN faster: closer than that, the order of two candidates is
within what one timing of a call can tell. On an H100 (commit 5202680) find moved
point 3D's channels-last backward-data from ``point_output`` to ``patch_implicit``, 3%
faster in its timing, and the public call then ran 1.18x immediate mode's.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from gemmconv.core.problem import ConvProblem
from gemmconv.measuring.measure import (
    InCall,
    Measurement,
    TimingPolicy,
    fastest,
    measure_solvers,
)
from gemmconv.solvers import Solver

log = logging.getLogger("gemmconv.find")

# The bound on find against immediate mode: find's pick may cost at most this
# much more than the model's, by find's own timing.
PREFERENCE_MARGIN = 0.05


@dataclasses.dataclass(frozen=True)
class FindResult:
    problem: ConvProblem
    best: str
    best_ms: float  # the winner's call time
    best_device_ms: float
    workspace_bytes: int
    candidates: tuple[Measurement, ...]
    fastest: str = ""  # the fastest measured candidate, where ``best`` is the preferred one

    @property
    def kept_preferred(self) -> bool:
        """Whether ``best`` is the preferred candidate, kept though not the fastest."""
        return bool(self.fastest) and self.fastest != self.best

    @property
    def in_call(self) -> bool:
        """Whether every timed candidate was timed in the public call (InCall)."""
        timed = [c for c in self.candidates if c.ok]
        return bool(timed) and all(c.in_call for c in timed)

    def times_ms(self) -> dict[str, float]:
        """Call time per measured candidate."""
        return {c.solver: c.call_ms for c in self.candidates if c.ok}

    def device_times_ms(self) -> dict[str, float]:
        """Device time per measured candidate (a diagnostic)."""
        return {c.solver: c.device_ms for c in self.candidates if c.ok}


def find_best(
    problem: ConvProblem,
    solvers: Sequence[Solver],
    *,
    verify: bool = False,
    policy: TimingPolicy | None = None,
    progress: object | None = None,
    in_call: InCall | None = None,
    preferred: str | None = None,
) -> FindResult:
    """Measure every solver of ``solvers`` (all must apply to ``problem``) and return
    the fastest by call time, or ``preferred`` where its call measured within
    PREFERENCE_MARGIN of the fastest. ``policy`` defaults to measure.default_policy of
    the problem's device; ``progress`` is an object with ``update(n)`` (a tqdm bar),
    advanced once per candidate; ``in_call`` times each in the public call."""
    if not solvers:
        raise ValueError(f"solvers=[]: find on {problem.key()} needs at least one candidate")
    measured = measure_solvers(
        problem, solvers, policy=policy, verify=verify, progress=progress, in_call=in_call
    )
    for m in measured:
        if not m.ok:
            failed_check = m.verdict is not None and not m.verdict.ok
            what = "dropped" if failed_check else "skipped"
            log.warning("find %s: %s %s, %s", problem.key(), m.solver, what, m.skipped)
        else:
            log.debug("find %s: %s call %s, device %s", problem.key(), m.solver, m.call, m.device)
    best = fastest(measured)
    if best is None:
        listing = "; ".join(f"{m.solver}: {m.skipped}" for m in measured)
        raise RuntimeError(f"find on {problem.key()}: every candidate failed: {listing}")
    fastest_id = ""
    kept = next((m for m in measured if m.ok and m.solver == preferred), None)
    if kept is not None and kept is not best:
        if kept.call_ms <= best.call_ms * (1 + PREFERENCE_MARGIN):
            fastest_id, best = best.solver, kept
    return FindResult(
        problem, best.solver, best.call_ms, best.device_ms, best.workspace_bytes,
        tuple(measured), fastest_id,
    )  # fmt: skip


__all__ = ["PREFERENCE_MARGIN", "FindResult", "find_best"]
