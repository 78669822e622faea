"""The H200 suite runs the cost table is fitted to, rebuilt as ConvProblems, for tests of
the cost model.

The tests read their own copies of the runs (in tests/data, the sources the H200 entry
of gemmconv.device_rates names), never the benchmark's output folder, so a new
`gemmconv bench` run changes nothing here until the table is refitted with it."""

from __future__ import annotations

import json
from pathlib import Path

from gemmconv.bench import DIRECTION_NAMES, DTYPES, LAYOUT_NAMES
from gemmconv.problem import ConvProblem

DATA = Path(__file__).resolve().parent / "data"
# The run the vendor factors and the solvers' device-time constants are fitted to.
RESULTS = DATA / "h200_suite.json"
# The run the host costs are fitted to: per-solver call times with Triton's direct
# launch route (the run above timed its ordinary route, 55 us a launch), at b9cd4c7.
CALL_TIMES = DATA / "h200_calls_b9cd4c7.json"
# An H100 host's call times at 74f332e, whose reference launch (gemmconv.host_speed)
# took 17.7 us (bench/results/launch_cost_h100.txt, the same machine): the table's
# host costs scaled to it must rank that run as the fit run ranks its own. The run's
# own "host_costs" field is from a calibration by a torch op, since replaced.
H100_CALL_TIMES = DATA / "h100_calls_74f332e.json"
H100_REFERENCE_LAUNCH_US = 17.7

# Rows of CALL_TIMES where the fitted cost model's pick still runs more than 10% behind
# the fastest call: the point 2D backward-data rows pick patch_triton where
# patch_padded's call is 25-28% faster, its channels-last fp16 weight gradient
# patch_triton where point_output's is 40% faster, DiT-XL/2's channels-last
# backward-data patch_implicit (10.5% behind patch_triton). The offline fit test marks
# them strict xfail, so the list cannot outlive the miss.
STILL_OFF_H100 = {
    # point_output, 13% and 40% behind patch_triton / patch_padded on that host.
    "point2d-cl-fwd-bf16",
    "point2d-cl-bwd_data-bf16",
}
STILL_OFF = {
    "point2d-cf-bwd_data-bf16",
    "point2d-cl-bwd_data-bf16",
    "point2d-cf-bwd_data-fp16",
    "point2d-cl-bwd_data-fp16",
    "point2d-cl-bwd_weights-fp16",
    "dit_xl2-cl-bwd_data-bf16",
}


def rows(path: Path = RESULTS) -> list[dict]:
    return json.loads(path.read_text())["rows"]


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
