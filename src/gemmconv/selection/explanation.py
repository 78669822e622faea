"""Readable text for solver choices: what ``explain()`` and ``module.solvers()`` print.

``Explanation`` is the dict they return (direction name -> Choice, so
``explain(...)["forward"].solver`` works as before) with a table for its repr: per
direction the solver chosen, where the decision came from, its estimate and measured
time, then every solver not chosen with its reasons. The reason a slower solver lost
shows enough digits for the two times to differ, and an exact tie says which rule
broke it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gemmconv.dispatch import Choice


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
    that need gradients on torch's convolution, eager.training_road)."""

    def __init__(self, choices: dict[str, Choice], notes: list[str] | None = None) -> None:
        super().__init__(choices)
        self.notes = notes or []

    def __repr__(self) -> str:
        rows = [_HEADER]
        for direction, choice in self.items():
            rows += _rows(direction, choice)
        modes = sorted({choice.mode for choice in self.values()})
        text = f"gemmconv solver choice (mode {', '.join(modes)})\n" + table(rows)
        return "\n".join([text, *self.notes])


__all__ = ["Explanation", "choice_text", "slower_than", "table"]
