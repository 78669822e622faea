"""Why the vendor's measured time and its public call disagree (a diagnostic).

For one suite row, times the vendor's result of the row's direction several ways, back
to back and interleaved: gemmconv's VendorSolver into a result buffer of the problem's
layout (as the check before find's timing runs it) and returning its own result (what
find, the suite and an eager call time and run), aten.convolution_backward with the
real operand, and torch's gradient through autograd as a user calls it
(gemmconv.bench.call_timing's vendor call). Prints us per call and each result's strides.

    PYTHONPATH=src python bench/probes/vendor_probe.py convnext_down --layout cl --kind bwd_data
"""

from __future__ import annotations

import argparse

import torch

from gemmconv.bench.call_timing import public_calls
from gemmconv.bench.suite import DTYPES, LAYOUT_NAMES, SUITE, make_problem
from gemmconv.core.problem import Direction
from gemmconv.measuring.measure import operand_sets, result_like
from gemmconv.measuring.timing import time_interleaved
from gemmconv.solvers.vendor import VendorSolver

DIRECTIONS = {"bwd_data": Direction.BACKWARD_DATA, "bwd_weights": Direction.BACKWARD_WEIGHTS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case")
    parser.add_argument("--layout", default="cl", choices=sorted(LAYOUT_NAMES))
    parser.add_argument("--kind", default="bwd_data", choices=sorted(DIRECTIONS))
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--tiny", action="store_true", help="the case's tiny shape")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    case = next(c for c in SUITE if c.name == args.case)
    shape = case.tiny if args.tiny else case.full
    layout, dtype = LAYOUT_NAMES[args.layout], DTYPES[args.dtype]
    p = make_problem(shape, layout, dtype, device, DIRECTIONS[args.kind])
    t = operand_sets(p, device, 0, every_operand=True)[0]
    data = args.kind == "bwd_data"
    solver = VendorSolver()
    out = result_like(p, t)
    only = type(t)(
        input=None if data else t.input,
        weight=t.weight if data else None,
        grad_output=t.grad_output,
    )
    args6 = solver._args(p)
    mask = [data, not data, False]

    def real_operand():
        return torch.ops.aten.convolution_backward(
            t.grad_output, t.input, t.weight, None, *args6, mask
        )[0 if data else 1]

    fp = make_problem(shape, layout, dtype, device, Direction.FORWARD)
    api = public_calls(fp, args.kind, [t])["torch"][0]
    calls = {
        "solver into out": [lambda: solver.run(p, only, out)],
        "solver, own result": [lambda: solver.run(p, only, None)],
        "real operand": [real_operand],
        "through autograd": [api],
    }
    for name, fns in calls.items():
        r = fns[0]()
        if isinstance(r, torch.Tensor):
            print(f"  {name:20s} result strides {r.stride()}")
    print(f"operands: x {t.input.stride()}, w {t.weight.stride()}, dY {t.grad_output.stride()}")
    times = time_interleaved(calls, device, reps=args.reps)
    print(f"{args.case} {args.layout} {args.kind} {args.dtype} on {device}: us per call")
    for name in calls:
        print(f"  {name:20s} {times[name].median_ms * 1e3:9.1f}")


if __name__ == "__main__":
    main()
