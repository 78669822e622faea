"""What the chunk budget of CUDA's batch-invariant GEMM costs, row by row of the suite.

gemmconv.batch_invariant() runs CUDA forwards as cuBLAS products of one fixed shape
(solvers/invariant.py): ``cuda_rows_chunk`` rows, or ``cuda_samples_chunk`` samples,
chosen from the widths and dtype so that the chunk's multiply-adds stay within
CUDA_CHUNK_MACS. A bigger budget launches fewer products (host time) but pads or
overlaps more rows; this probe times, for each candidate budget, every forward row of
the suite (gemmconv.bench.suite's cases at their full size, both layouts, each case's
dtypes) as the suite's invariance column does (gemmconv.bench.invariance_cost: the
public call with the switch on against the default call, interleaved in one run, on
the api columns' operands and math mode), and prints one line per row and budget:

    budget case layout dtype  default_ms invariant_ms cost  solver  [small-batch columns]

then, per budget, how many rows exceed the 1.10 target, the largest cost and the
geometric mean. ``--small-batch N`` adds the same two calls at batch N (a serving
request of a few samples, where a big chunk is mostly padding). Each line is printed
as it is measured and, with ``--out FILE``, appended to FILE as a JSON line.

    PYTHONPATH=src python3 bench/probes/invariant_chunk_cost.py [--budgets 31,32,33,34]
        [--cases vit_b16,...] [--layouts cf,cl] [--reps 15] [--small-batch 1] [--out FILE]

On the CPU (``--device cpu --tiny``) the switch runs the CPU's own policy: that only
checks the probe runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time

import torch

from gemmconv.bench.invariance_cost import INVARIANCE_TARGET, invariance_times
from gemmconv.bench.suite import DTYPES, LAYOUT_NAMES, make_problem, math_mode, suite_cases
from gemmconv.core.problem import Direction
from gemmconv.roads import eager
from gemmconv.selection import dispatch
from gemmconv.solvers import invariant


def _rows(case_names, layout_names):
    for case in suite_cases(case_names):
        for dtype_key in case.dtypes:
            for layout_name in layout_names:
                yield case, dtype_key, layout_name


def _fresh_selection() -> None:
    """Forget every choice and plan: the next call decides and prepares anew."""
    dispatch.clear_cache()
    eager.clear()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budgets", default="31,32,33,34",
                    help="comma list of log2 of CUDA_CHUNK_MACS candidates")  # fmt: skip
    ap.add_argument("--cases", default="", help="comma list of suite case names (default all)")
    ap.add_argument("--layouts", default="cf,cl", help="comma list of cf, cl")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--block-ms", type=float, default=2.0)
    ap.add_argument("--small-batch", type=int, default=0,
                    help="also time each row at this batch size (0: no)")  # fmt: skip
    ap.add_argument("--out", default="", help="append each result as a JSON line to this file")
    ap.add_argument("--device", default="cuda",
                    help="cuda; cpu with --tiny only checks that the probe runs")  # fmt: skip
    ap.add_argument("--tiny", action="store_true", help="the cases' tiny shapes (a smoke run)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("invariant_chunk_cost: --device cuda, but torch sees no CUDA device", file=sys.stderr)
        return 2
    budgets = [int(b) for b in args.budgets.split(",") if b]
    case_names = [c for c in args.cases.split(",") if c] or None
    layouts = [name for name in args.layouts.split(",") if name]
    out = open(args.out, "a") if args.out else None  # noqa: SIM115 (appended line by line)
    saved = invariant.CUDA_CHUNK_MACS
    summary: dict[int, list[float]] = {b: [] for b in budgets}
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    print(f"# {name}, torch {torch.__version__}, "
          f"current CUDA_CHUNK_MACS = 2^{saved.bit_length() - 1}", flush=True)  # fmt: skip
    header = "budget case layout dtype default_ms invariant_ms cost solver"
    if args.small_batch:
        header += f" default_ms@{args.small_batch} invariant_ms@{args.small_batch} cost@small"
    print(header, flush=True)
    try:
        for case, dtype_key, layout_name in _rows(case_names, layouts):
            dtype = DTYPES[dtype_key]
            full = case.tiny if args.tiny else case.full
            shapes = [full]
            if args.small_batch:
                shapes.append(dataclasses.replace(full, n=args.small_batch))
            for budget in budgets:
                invariant.CUDA_CHUNK_MACS = 1 << budget
                line = {"budget_log2": budget, "case": case.name, "layout": layout_name,
                        "dtype": dtype_key}  # fmt: skip
                for i, shape in enumerate(shapes):
                    _fresh_selection()
                    p = make_problem(shape, LAYOUT_NAMES[layout_name], dtype, device,
                                     Direction.FORWARD)  # fmt: skip
                    start = time.perf_counter()
                    with math_mode(dtype, device.type):
                        times = invariance_times(p, device, reps=args.reps, block_ms=args.block_ms)
                    suffix = "" if i == 0 else "_small"
                    line[f"default_ms{suffix}"] = times["invariant_default_api_ms"]
                    line[f"invariant_ms{suffix}"] = times["invariant_api_ms"]
                    line[f"cost{suffix}"] = times["invariance_cost"]
                    line[f"solver{suffix}"] = times["invariant_solver"]
                    line[f"invariant{suffix}"] = times["invariant"]
                    line[f"seconds{suffix}"] = round(time.perf_counter() - start, 2)
                summary[budget].append(line["cost"])
                text = (f"2^{budget} {case.name} {layout_name} {dtype_key} "
                        f"{line['default_ms']:.4f} {line['invariant_ms']:.4f} "
                        f"{line['cost']:.2f} {line['solver']}"
                        + ("" if line["invariant"] else " NOT-INVARIANT"))  # fmt: skip
                if args.small_batch:
                    text += (f" {line['default_ms_small']:.4f} {line['invariant_ms_small']:.4f}"
                             f" {line['cost_small']:.2f}")  # fmt: skip
                print(text, flush=True)
                if out is not None:
                    out.write(json.dumps(line) + "\n")
                    out.flush()
    finally:
        invariant.CUDA_CHUNK_MACS = saved
        _fresh_selection()
        if out is not None:
            out.close()
    print("# per budget: rows over target, largest cost, geometric mean", flush=True)
    for budget, costs in summary.items():
        if not costs:
            continue
        over = sum(c > INVARIANCE_TARGET for c in costs)
        geomean = math.exp(sum(math.log(c) for c in costs) / len(costs))
        print(f"2^{budget}: {over}/{len(costs)} over {INVARIANCE_TARGET}, "
              f"max {max(costs):.2f}, geomean {geomean:.3f}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
