"""The H200 suite run the cost table is fitted to, rebuilt as ConvProblems, for tests of
the cost model.

The tests read their own copy of the run (tests/data/h200_suite.json, the source the
H200 entry of gemmconv.core.device_rates names), never the benchmark's output folder, so a
new `gemmconv bench` run changes nothing here until the table is refitted with it."""

from __future__ import annotations

import json
from pathlib import Path

from gemmconv.bench.suite import DIRECTION_NAMES, DTYPES, LAYOUT_NAMES
from gemmconv.core.problem import ConvProblem

RESULTS = Path(__file__).resolve().parent / "data" / "h200_suite.json"

# Rows the fitted cost model still misses by more than 10% in call time (bench/NOTES.md):
# the target of 10% is not met there. The offline fit test marks them strict xfail, so
# the list cannot outlive the miss. Both are backward rows this run timed bare, where
# the solvers with more host work look faster than a user's backward finds them (it
# runs in gemmconv's autograd node): point 2D's channels-last weight gradient, whose
# patch_padded ran 68 us bare against point_output's 77 and, from the node, 124 against
# 78 in the H100 run at 462056e (bench/results/h100.json); DiT-XL/2's channels-last
# backward-data, patch_triton 45 us bare against patch_implicit's 51, where from the
# node on that H100 patch_implicit was the fastest. Find now times backward candidates
# from a node (measure.through_autograd).
STILL_OFF = {
    "point2d-cl-bwd_weights-bf16",
    "dit_xl2-cl-bwd_data-bf16",
}


def rows() -> list[dict]:
    return json.loads(RESULTS.read_text())["rows"]


def row_id(row: dict) -> str:
    return f"{row['case']}-{row['layout']}-{row['direction']}-{row['dtype']}"


def problem_of(row: dict) -> ConvProblem:
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


def measured(row: dict) -> dict[str, float]:
    """Each verified candidate's call time (back to back, what find decides on), ms."""
    return {
        sid: cand["call_ms"]
        for sid, cand in row["candidates"].items()
        if cand["ok"] and cand.get("call_ms") is not None
    }


def vendor_measured_competitive(problem: ConvProblem, tolerance: float) -> bool:
    """Whether the H200 measured the vendor within ``tolerance`` of every GEMM solver
    on this problem (False when the problem was not measured)."""
    for row in rows():
        if problem_of(row) != problem:
            continue
        times = measured(row)
        gemm = [ms for sid, ms in times.items() if sid not in ("vendor", "im2col")]
        return "vendor" in times and times["vendor"] <= (1 + tolerance) * min(gemm)
    return False
