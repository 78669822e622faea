"""Immediate mode against the committed H200 benchmark: on every measured row the
cost model's pick must run within 10% of the fastest measured solver (find's pick).

Runs offline: each row's ConvProblem is rebuilt for device_type "cuda" and ranked with
the H200 rates table passed explicitly, so the CPU-only CI machine ranks exactly as the
H200 did, through the same dispatch.decide the benchmark records as immediate_solver.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gemmconv import dispatch
from gemmconv.bench import DIRECTION_NAMES, DTYPES, LAYOUT_NAMES
from gemmconv.device_rates import H200
from gemmconv.problem import ConvProblem
from gemmconv.solvers import get_solver

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results" / "h200.json"
TOLERANCE = 0.10


def _rows() -> list[dict]:
    return json.loads(RESULTS.read_text())["rows"]


def _problem(row: dict) -> ConvProblem:
    shape = row["shape"]
    return ConvProblem.from_sizes(
        n=shape["n"],
        c=shape["c"],
        k=shape["k"],
        spatial=tuple(shape["spatial"]),
        kernel=tuple(shape["kernel"]),
        stride=tuple(shape["kernel"]),  # every suite case is stride == kernel (bench.Shape)
        layout=LAYOUT_NAMES[row["layout"]],
        dtype=DTYPES[row["dtype"]],
        device_type="cuda",
        direction=DIRECTION_NAMES[row["direction"]],
    )


def _measured(row: dict) -> dict[str, float]:
    return {
        sid: cand["ms"]
        for sid, cand in row["candidates"].items()
        if cand["ok"] and cand["ms"] is not None
    }


def _row_id(row: dict) -> str:
    return f"{row['case']}-{row['layout']}-{row['direction']}-{row['dtype']}"


def test_benchmark_has_rows() -> None:
    rows = _rows()
    assert len(rows) >= 60, f"{RESULTS} holds {len(rows)} rows, expected the full suite"
    assert all(_measured(r) for r in rows)


@pytest.mark.parametrize("row", _rows(), ids=_row_id)
def test_immediate_within_tolerance_of_find(row: dict) -> None:
    measured = _measured(row)
    problem = _problem(row)
    solvers = [get_solver(sid) for sid in measured]
    choice = dispatch.decide(problem, solvers, rates=H200)
    best = min(measured.values())
    gap = measured[choice.solver] / best - 1.0
    assert gap <= TOLERANCE, (
        f"{_row_id(row)}: immediate picks {choice.solver} ({measured[choice.solver]:.4g} ms), "
        f"{gap:.0%} behind the fastest measured {min(measured, key=measured.get)} "
        f"({best:.4g} ms); estimates {choice.estimates_ms}"
    )
