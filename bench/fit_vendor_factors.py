"""Refit the cost table's vendor factors (gemmconv.core.device_rates.FACTORS) to the
recorded suite runs (two on H100s, one on the H200).

A factor prices cuDNN's device time as a fraction of the GEMM floor; each row of a run
implies one, the row's floor over cuDNN's measured device time. The floor is the
card's (its measured rates): the H100, costed with the H200's entry, runs every
byte-bound solver slower by the same bandwidth, so that counts against none of them.
Device time, not the call's: a call's host time and the autograd node are priced
apart (Solver.call_ms).

This prints each class's implied factor per direction and card (what says a class
needs a factor per direction); then for each factor of the table the rows it prices,
the median implied factor per run, and the value chosen: the geometric mean of the
runs' medians, moved to the nearest value at which immediate mode's pick on those
rows runs within 10% of the fastest recorded call on as many rows of every run as any
value does, and a tenth either side of it does too (so no pick sits on its edge; where
no value is that steady, the middle of those that do best).

The runs are the tests' copies (tests/data), which tests/selection/test_cost_model_fit.py
replays, so a new `gemmconv bench` run changes nothing until it is copied there, named
here and the table refitted.

    PYTHONPATH=src python bench/fit_vendor_factors.py
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path

from gemmconv.bench.suite import DIRECTION_NAMES, DTYPES, LAYOUT_NAMES
from gemmconv.core.device_rates import FACTORS, H200, DeviceRates
from gemmconv.core.problem import ConvProblem
from gemmconv.selection import dispatch
from gemmconv.solvers import get_solver
from gemmconv.solvers.vendor import vendor_class, vendor_factor

DATA = Path(__file__).resolve().parents[1] / "tests" / "data"
RUNS = {
    "H100 f0db2a3": DATA / "h100_suite.json",  # bench/results/h100.json at c3062b9
    "H100 3dd28ca": DATA / "h100_suite_3dd28ca.json",  # bench/results/h100.json at 07d2002
    "H200 22a735c": DATA / "h200_suite.json",
}
# A pick within this fraction of the fastest recorded call counts as right.
TOLERANCE = 0.10
# A direction needs its own factor where on every card its median implied factor is
# more than this ratio from the class's forward one.
DIRECTION_APART = 1.25
# The values tried: two significant digits from 0.010 to 1.0.
GRID = [m * 10.0**e for e in (-3, -2) for m in range(10, 100)] + [1.0]


@dataclasses.dataclass
class Row:
    card: str
    label: str
    problem: ConvProblem
    calls: dict[str, float]  # each verified candidate's recorded call time, ms
    implied: float  # the card's floor over cuDNN's device time


def load(card: str, path: Path) -> list[Row]:
    rows = []
    for r in json.loads(path.read_text())["rows"]:
        shape = r["shape"]
        problem = ConvProblem.from_sizes(
            n=shape["n"], c=shape["c"], k=shape["k"], spatial=tuple(shape["spatial"]),
            kernel=tuple(shape["kernel"]), stride=tuple(shape["kernel"]),
            layout=LAYOUT_NAMES[r["layout"]], dtype=DTYPES[r["dtype"]], device_type="cuda",
            direction=DIRECTION_NAMES[r["direction"]],
        )  # fmt: skip
        calls = {
            sid: c["call_ms"]
            for sid, c in r["candidates"].items()
            if c["ok"] and c.get("call_ms") is not None
        }
        label = f"{r['case']}-{r['layout']}-{r['direction']}-{r['dtype']}"
        rows.append(Row(card, label, problem, calls, r["floor_ms"] / r["vendor_ms"]))
    return rows


def misses(rows: list[Row], rates: DeviceRates) -> list[str]:
    """The rows whose immediate pick runs over TOLERANCE behind the fastest call."""
    off = []
    for row in rows:
        pick = dispatch.decide(row.problem, [get_solver(s) for s in row.calls], rates).solver
        if row.calls[pick] > (1 + TOLERANCE) * min(row.calls.values()):
            off.append(f"{row.card} {row.label} ({pick})")
    return off


def with_factor(name: str, value: float) -> DeviceRates:
    return dataclasses.replace(H200, factors={**H200.factors, name: value})


def fit(name: str, rows: list[Row]) -> float:
    """The value chosen for factor ``name`` from the rows it prices (table: H200)."""
    by_card = defaultdict(list)
    for row in rows:
        by_card[row.card].append(row.implied)
    medians = {card: statistics.median(v) for card, v in by_card.items()}
    target = math.exp(statistics.fmean(math.log(m) for m in medians.values()))
    count = {v: len(misses(rows, with_factor(name, v))) for v in GRID}
    best = [v for v in GRID if count[v] == min(count.values())]
    steady = [v for v in best if all(u in best for u in GRID if v / 1.1 <= u <= v * 1.1)]
    if steady:
        chosen = min(steady, key=lambda v: abs(math.log(v / target)))
    else:  # every value that does best is near a flip: the middle of their range
        middle = math.sqrt(best[0] * best[-1])
        chosen = min(best, key=lambda v: abs(math.log(v / middle)))
    cards = ", ".join(f"{card} {m:.3f} ({len(by_card[card])} rows)" for card, m in medians.items())
    print(f"{name}: implied {cards}; geometric mean {target:.3f}")
    print(f"    picks right on all but {count[chosen]} rows for {best[0]:.3g}-{best[-1]:.3g}; "
          f"table {H200.factors[name]:.3g}, chosen {chosen:.2g}")  # fmt: skip
    for miss in misses(rows, with_factor(name, chosen)):
        print(f"    off: {miss}")
    return chosen


def directions(rows: list[Row]) -> set[str]:
    """Prints each class's median implied factor per direction and card, against its
    forward; returns the factors the table needs for directions apart from the class."""
    table: dict[str, dict[str, dict[str, list[float]]]] = defaultdict(
        lambda: defaultdict(lambda: defaultdict(list))
    )
    for row in rows:
        table[vendor_class(row.problem)][row.problem.direction.value][row.card].append(row.implied)
    own = set()
    print("implied factor by class, direction and card (median; ratio to the forward):")
    for cls, by_direction in table.items():
        forward = {card: statistics.median(v) for card, v in by_direction["forward"].items()}
        for direction, by_card in by_direction.items():
            ratios = {card: statistics.median(v) / forward[card] for card, v in by_card.items()}
            apart = len(ratios) == len(RUNS) and all(
                not 1 / DIRECTION_APART <= r <= DIRECTION_APART for r in ratios.values()
            )
            if apart:
                own.add(f"{cls}_{direction}")
            cells = "; ".join(
                f"{card} {statistics.median(by_card[card]):.3f} ({r:.3g}x)"
                for card, r in ratios.items()
            )
            print(f"  {cls} {direction}: {cells}{'  <- its own factor' if apart else ''}")
    return own


def chosen_factors(rows: list[Row]) -> dict[str, float]:
    """The value chosen for every factor some row prices."""
    by_factor = defaultdict(list)
    for row in rows:
        by_factor[vendor_factor(row.problem)].append(row)
    return {name: fit(name, by_factor[name]) for name in FACTORS if by_factor[name]}


def main() -> None:
    rows = [row for card, path in RUNS.items() for row in load(card, path)]
    missing = directions(rows) - set(FACTORS)
    print(f"directions apart without a factor of their own: {', '.join(missing) or 'none'}")
    chosen = chosen_factors(rows)
    print(f"no rows (kept as they are): {', '.join(set(FACTORS) - set(chosen)) or 'none'}")
    print("with every chosen value at once, off by more than 10%:")
    refit = dataclasses.replace(H200, factors={**H200.factors, **chosen})
    for miss in misses(rows, refit) or ["none"]:
        print(f"    {miss}")


if __name__ == "__main__":
    main()
