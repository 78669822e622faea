"""Immediate mode on the CPU against the call times the CPU entry's small-patch vendor
factors are fitted to (tests/data/cpu_small_patch_calls.jsonl, written by
bench/probes/cpu_vendor_fit.py on the 2-core EPYC, torch 2.14.1): on every row the
cost model's pick must run within 10% of the fastest call find measured. Offline: each
row is rebuilt as a CPU problem and ranked by dispatch.decide with the CPU entry."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gemmconv.bench.suite import DIRECTION_NAMES, LAYOUT_NAMES, Shape, make_problem
from gemmconv.core.device_rates import CPU
from gemmconv.core.problem import ConvProblem

from recorded_runs import immediate_gap

CALLS = Path(__file__).resolve().parents[1] / "data" / "cpu_small_patch_calls.jsonl"
TOLERANCE = 0.10
# Rows where the pick still runs over 10% behind the fastest call, and why: the two
# solvers trade places within the class one factor prices. Strict xfail, so an entry
# cannot outlive its miss.
STILL_OFF = {
    "sd3_512-cl-bwd_data": "oneDNN ran SD3's 16-channel backward-data in 0.61 ms against "
    "the GEMM's 1.10, DiT-XL/2's 4 channels in 1.01 against 0.56 and Wan 2.1's "
    "channels-last-3d in 7.8 against 2.0: one few-channel factor orders two of three",
    "dit_xl2_b8-cf-bwd_data": "oneDNN's channels-first backward-data of 4 channels ran "
    "1.23 ms against the GEMM's 0.77; the factor sends the class's other eleven rows to "
    "their fastest call",
    "wan21_1_3b-cl-bwd_weights": "oneDNN's channels-last-3d weight gradient ran 6.6 ms "
    "against the GEMM's 2.5, where SD3's 2-D one ran 0.5x the GEMM's and ConvNeXt's level "
    "with it",
}


def _rows() -> list[dict]:
    return [json.loads(line) for line in CALLS.read_text().splitlines() if line.strip()]


def _row_id(row: dict) -> str:
    return f"{row['problem']}-{row['layout']}-{row['direction']}"


def _problem(row: dict) -> ConvProblem:
    s = row["shape"]
    shape = Shape(s["n"], s["c"], s["k"], tuple(s["spatial"]), tuple(s["kernel"]))
    direction = DIRECTION_NAMES[row["direction"]]
    return make_problem(shape, LAYOUT_NAMES[row["layout"]], torch.float32, torch.device("cpu"),
                        direction)  # fmt: skip


def _param(row: dict):
    reason = STILL_OFF.get(_row_id(row))
    marks = pytest.mark.xfail(strict=True, reason=reason) if reason else ()
    return pytest.param(row, id=_row_id(row), marks=marks)


def test_rows_cover_every_problem_layout_and_direction() -> None:
    rows = _rows()
    assert len(rows) == 24 and len({_row_id(r) for r in rows}) == 24
    assert all({"patch", "vendor"} <= set(r["calls_ms"]) for r in rows)
    assert set(STILL_OFF) <= {_row_id(r) for r in rows}


@pytest.mark.parametrize("row", [_param(r) for r in _rows()])
def test_immediate_within_tolerance_of_the_fastest_call(row: dict) -> None:
    gap, line = immediate_gap(_problem(row), row["calls_ms"], CPU)
    assert gap <= TOLERANCE, f"{_row_id(row)}: {line}"
