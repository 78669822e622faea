"""Solver choices and their readable text: what ``explain()`` and ``module.solvers()``
print. ``Choice`` and ``FindMode`` are defined here, beside the text that shows them, so
that gemmconv.selection.dispatch, which makes choices, imports this module and not the
other way round.

``Explanation`` is the dict they return (direction name -> Choice, so
``explain(...)["forward"].solver`` works as before) with a table for its repr: per
direction the solver chosen, where the decision came from, its estimate and measured
time, then every solver not chosen with its reasons. The reason a slower solver lost
shows enough digits for the two times to differ, and an exact tie says which rule
broke it.
"""

from __future__ import annotations

import dataclasses
import enum


class FindMode(str, enum.Enum):
    """How a solver is selected: immediate, database, find or hybrid (the docstring of
    gemmconv.selection.dispatch)."""

    IMMEDIATE = "immediate"
    DATABASE = "database"
    FIND = "find"
    HYBRID = "hybrid"


@dataclasses.dataclass(frozen=True)
class Choice:
    """The outcome of selection for one problem.

    ``source`` says where the decision came from: "estimate", "database", "find",
    "forced", or "rank N" for a choice adopted from rank N by ``sync_choices()``. A
    find fills ``times_ms`` with each measured candidate's call time, which decided,
    and ``device_times_ms`` with its device time (a diagnostic;
    gemmconv.measuring.measure says how each is taken). ``in_call``: those call times
    are of the public call with each candidate tried (the forward, gemmconv's autograd
    node or torch's own road, the layout conversions), not of its bare run. "trial" is
    the source of a candidate tried inside find."""

    solver: str
    rejected: dict[str, list[str]]
    estimates_ms: dict[str, float]
    reason: str
    mode: str = FindMode.IMMEDIATE.value
    source: str = "estimate"
    times_ms: dict[str, float] = dataclasses.field(default_factory=dict)
    device_times_ms: dict[str, float] = dataclasses.field(default_factory=dict)
    in_call: bool = False

    def __str__(self) -> str:
        return f"{self.solver} ({self.reason})"

    def __repr__(self) -> str:
        return choice_text(self)


def slower_than(kind: str, value_ms: float, best_ms: float, best_id: str) -> str:
    """Why a solver lost to ``best_id`` on ``kind`` ("estimate" or "measured")."""
    if value_ms == best_ms:
        return f"{kind} {value_ms:.4g} ms, a tie with {best_id}, which comes first in the registry"
    digits = 4
    # 17 significant digits tell any two distinct doubles apart.
    while digits < 17 and f"{value_ms:.{digits}g}" == f"{best_ms:.{digits}g}":
        digits += 1
    return f"{kind} {value_ms:.{digits}g} ms > {best_ms:.{digits}g} ms of {best_id}"


def _ms(value: float | None) -> str:
    return "" if value is None else f"{value:.4g} ms"


_HEADER = ("direction", "solver", "source", "estimate", "measured", "reason")


def _rows(direction: str, choice: Choice) -> list[tuple[str, ...]]:
    rows = [
        (
            direction,
            choice.solver,
            choice.source,
            _ms(choice.estimates_ms.get(choice.solver)),
            _ms(choice.times_ms.get(choice.solver)),
            choice.reason,
        )
    ]
    for solver_id, reasons in choice.rejected.items():
        rows.append(
            (
                "",
                solver_id,
                "not chosen",
                _ms(choice.estimates_ms.get(solver_id)),
                _ms(choice.times_ms.get(solver_id)),
                "; ".join(reasons),
            )
        )
    return rows


def table(rows: list[tuple[str, ...]]) -> str:
    """Left-aligned columns, two spaces apart; the last column is not padded."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lines = []
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row, widths)] + [row[-1]]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def choice_text(choice: Choice) -> str:
    """One choice as a table: the chosen solver, then each other one and why not."""
    return table([row[1:] for row in (_HEADER, *_rows("", choice))])


class Explanation(dict):
    """Direction name -> Choice, whose repr is a table of every direction's choice and
    then its ``notes``: where a call runs otherwise than the table says (eager calls
    that need gradients on torch's convolution, eager.training_road).

    For a problem off CUDA, ``on_cuda`` holds what the cost model would pick per
    direction for the same problem on CUDA (estimated with the cost table's entry
    named ``cuda_rates``, before any find), and the repr ends with it: what runs here
    and what would run on a GPU can differ (torch's convolution is as fast as a GEMM
    for some problems on the CPU, not on a GPU). None for a problem on CUDA."""

    def __init__(
        self,
        choices: dict[str, Choice],
        notes: list[str] | None = None,
        on_cuda: dict[str, Choice] | None = None,
        cuda_rates: str = "",
    ) -> None:
        super().__init__(choices)
        self.notes = notes or []
        self.on_cuda = on_cuda
        self.cuda_rates = cuda_rates

    def __repr__(self) -> str:
        rows = [_HEADER]
        for direction, choice in self.items():
            rows += _rows(direction, choice)
        modes = sorted({choice.mode for choice in self.values()})
        text = f"gemmconv solver choice (mode {', '.join(modes)})\n" + table(rows)
        return "\n".join([text, *self.notes, *self._cuda_lines()])

    def _cuda_lines(self) -> list[str]:
        if not self.on_cuda:
            return []
        solvers = ", ".join(f"{d} {c.solver}" for d, c in self.on_cuda.items())
        entry = f" (the cost table's {self.cuda_rates})" if self.cuda_rates else ""
        return [f"On CUDA the estimate{entry} would pick: {solvers}."]


__all__ = ["Choice", "Explanation", "FindMode", "choice_text", "slower_than", "table"]
