"""Whether pricing a slower host's launches higher would move immediate mode's picks
closer to the fastest recorded call (offline, no device).

Scales every host price of the H200 entry (a torch op, a Triton launch, an allocation
and the autograd node) by one factor and counts, for each recorded suite run, the rows
whose immediate pick runs over 10% behind the fastest recorded call, with the mean gap.
A host calibrated per process would set that factor from the host's measured launch
cost; if no factor leaves fewer rows off on a slow host's run than 1.0 does, the
calibration cannot help there. It also prints how far apart two solvers that run the
same work (point_output and patch on one-pixel outputs) read in each run: the spread a
pick cannot be judged finer than.

    PYTHONPATH=src python bench/probes/host_price_scale.py [RUN.json ...]

With no arguments it reads the tests' recorded runs and bench/results/h100.json.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fit_vendor_factors import RUNS, TOLERANCE, load  # noqa: E402

from gemmconv.core.device_rates import H200, DeviceRates  # noqa: E402
from gemmconv.selection import dispatch  # noqa: E402
from gemmconv.solvers import get_solver  # noqa: E402

SCALES = (0.6, 0.8, 1.0, 1.2, 1.4, 1.6, 1.8, 2.0, 2.4)
RESULTS = Path(__file__).resolve().parents[1] / "results" / "h100.json"


def scaled(scale: float) -> DeviceRates:
    return dataclasses.replace(
        H200,
        host_launch_us=H200.host_launch_us * scale,
        host_triton_launch_us=H200.host_triton_launch_us * scale,
        host_allocation_us=H200.host_allocation_us * scale,
        autograd_node_us=H200.autograd_node_us * scale,
    )


def gaps(rows, rates: DeviceRates) -> list[float]:
    out = []
    for row in rows:
        pick = dispatch.decide(row.problem, [get_solver(s) for s in row.calls], rates).solver
        out.append(row.calls[pick] / min(row.calls.values()) - 1.0)
    return out


def same_work_spread(path: Path) -> list[float]:
    """patch's call over point_output's on every row that ran both (the same GEMM)."""
    ratios = []
    for r in json.loads(path.read_text())["rows"]:
        c = r["candidates"]
        if all(s in c and c[s]["ok"] for s in ("patch", "point_output")):
            ratios.append(c["patch"]["call_ms"] / c["point_output"]["call_ms"])
    return ratios


def main() -> None:
    paths = {Path(p).name: Path(p) for p in sys.argv[1:]}
    paths = paths or {**RUNS, "bench/results/h100.json": RESULTS}
    for name, path in paths.items():
        handoff = json.loads(path.read_text()).get("backward_handoff_us") or {}
        rows = load(name, path)
        print(f"{name}: {len(rows)} rows, torch's backward hand-off "
              f"{handoff.get('device_thread', float('nan')):.1f} us")  # fmt: skip
        for scale in SCALES:
            g = gaps(rows, scaled(scale))
            off, mean = sum(x > TOLERANCE for x in g), statistics.fmean(g)
            print(f"    host prices x{scale:<4} {off:3d} rows off, mean gap {mean:.3f}")
        spread = same_work_spread(path)
        if spread:
            print(f"    patch / point_output on the same GEMM: {min(spread):.2f}-{max(spread):.2f} "
                  f"over {len(spread)} rows")  # fmt: skip


if __name__ == "__main__":
    main()
