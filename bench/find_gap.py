"""Why `gemmconv tune` timed patch_triton 2-4x slower than the suite did on some rows:
times one solver on one problem the ways the two paths do (find's operands and result
buffer, the suite's operands), lists the kernels of each with the profiler, and
measures the host time per call.

    PYTHONPATH=src python3 bench/find_gap.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from gemmconv import find
from gemmconv.bench import make_operands
from gemmconv.memory_format import Layout
from gemmconv.problem import ConvProblem, Direction
from gemmconv.solvers import get_solver
from gemmconv.timing import time_ms

CASES = {
    "vit_b16-cf-bwd_weights": ((256, 3, 768, (224, 224), (16, 16)), Direction.BACKWARD_WEIGHTS),
    "vit_b16-cf-bwd_data": ((256, 3, 768, (224, 224), (16, 16)), Direction.BACKWARD_DATA),
    "point2d-cf-bwd_data": ((9500, 3, 1280, (14, 14), (14, 14)), Direction.BACKWARD_DATA),
    "vit_b16-cf-fwd": ((256, 3, 768, (224, 224), (16, 16)), Direction.FORWARD),
}


def _kernels(fn) -> list[tuple[str, float]]:
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


def _case(p: ConvProblem, solver, device: torch.device) -> dict:
    find_ops = find.random_operands(p, device)
    out = find.result_like(p, find_ops)
    bench_ops = make_operands(p, device, seed=0)
    variants = {
        "find_operands_with_out": lambda: solver.run(p, find_ops, out=out),
        "find_operands_no_out": lambda: solver.run(p, find_ops),
        "bench_operands_no_out": lambda: solver.run(p, bench_ops),
        "bench_operands_with_out": lambda: solver.run(p, bench_ops, out=out),
    }
    row = {
        "dy_strides": None if find_ops.grad_output is None else find_ops.grad_output.stride(),
        "bench_dy_strides": None
        if bench_ops.grad_output is None
        else bench_ops.grad_output.stride(),
        "out_strides": out.stride(),
    }
    for label, fn in variants.items():
        row[label + "_ms"] = time_ms(fn, device=device, warmup=5, reps=25).median_ms
    row["find_best_ms"] = find.find_best(p, [solver]).best_ms
    row["host_ms_per_call"] = _host_ms(variants["bench_operands_no_out"])
    row["kernels_find_with_out"] = _kernels(variants["find_operands_with_out"])
    row["kernels_bench_no_out"] = _kernels(variants["bench_operands_no_out"])
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--solver", default="patch_triton")
    args = ap.parse_args()
    device = torch.device("cuda")
    solver = get_solver(args.solver)
    report = {"device": torch.cuda.get_device_name(), "solver": args.solver, "cases": {}}
    for name, ((n, c, k, spatial, kernel), direction) in CASES.items():
        p = ConvProblem.from_sizes(
            n, c, k, spatial, kernel, stride=kernel, layout=Layout.CHANNELS_FIRST,
            dtype=torch.bfloat16, device_type="cuda", direction=direction,
        )  # fmt: skip
        row = _case(p, solver, device)
        report["cases"][name] = row
        print(name, {k: v for k, v in row.items() if k.endswith("_ms")}, flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "find_gap.json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
