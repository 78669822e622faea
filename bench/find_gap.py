"""Where a solver's call time and its device time part, on a few suite problems.

Find decides on what a call costs back to back; the suite's device time hides the host
behind a head start. For one solver (default patch_triton, whose channels-first rows
path is host-heavy) this measures both the way find does (gemmconv.measuring.measure), the host
time of one call on its own, and lists the kernels of a call with the profiler, so a
gap between the two times can be traced to launches or to kernels. It once served to
find why `gemmconv tune` and the suite timed patch_triton differently
(bench/probes/results/h200_find_gap_before_run*.json).

    PYTHONPATH=src python3 bench/find_gap.py --out DIR [--solver ID]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from gemmconv.core.memory_format import Layout
from gemmconv.core.problem import ConvProblem, Direction
from gemmconv.measuring import measure
from gemmconv.solvers import get_solver

CASES = {
    "vit_b16-cf-bwd_weights": ((256, 3, 768, (224, 224), (16, 16)), Direction.BACKWARD_WEIGHTS),
    "vit_b16-cf-bwd_data": ((256, 3, 768, (224, 224), (16, 16)), Direction.BACKWARD_DATA),
    "point2d-cf-bwd_data": ((9500, 3, 1280, (14, 14), (14, 14)), Direction.BACKWARD_DATA),
    "vit_b16-cf-fwd": ((256, 3, 768, (224, 224), (16, 16)), Direction.FORWARD),
}


def _kernels(fn) -> list[tuple[str, float, int]]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us:
            rows.append((e.key[:90], round(us / 3, 1), e.count))
    return sorted(rows, key=lambda r: -r[1])[:8]


def _host_ms(fn, calls: int = 40) -> float:
    """Host time per call: the wall time of queueing ``calls`` calls, without waiting
    for the device (40 calls of a dozen launches stay below the launch-queue depth)."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed * 1000.0 / calls


def _case(p: ConvProblem, solver) -> dict:
    (m,) = measure.measure_solvers(p, [solver], verify=True)
    if not m.ok:
        return {"skipped": m.skipped}
    tensors = measure.operands(p, measure.problem_device(p))
    call = lambda: solver.run(p, tensors)  # noqa: E731 - the call the custom ops make
    return {
        "call_ms": m.call_ms,
        "device_ms": m.device_ms,
        "verdict": str(m.verdict),
        "host_ms_per_call": _host_ms(call),
        "kernels": _kernels(call),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--solver", default="patch_triton")
    args = ap.parse_args()
    solver = get_solver(args.solver)
    report = {"device": torch.cuda.get_device_name(), "solver": args.solver, "cases": {}}
    for name, ((n, c, k, spatial, kernel), direction) in CASES.items():
        p = ConvProblem.from_sizes(
            n, c, k, spatial, kernel, stride=kernel, layout=Layout.CHANNELS_FIRST,
            dtype=torch.bfloat16, device_type="cuda", direction=direction,
        )  # fmt: skip
        row = _case(p, solver)
        report["cases"][name] = row
        print(name, {k: v for k, v in row.items() if k.endswith("_ms") or k == "skipped"})
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "find_gap.json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
