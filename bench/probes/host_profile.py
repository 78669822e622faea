"""Where a public call's time goes: one row, timed side by side and profiled.

For one suite case (or a case of the public-call table, ``gemmconv bench --api``), a
layout and a kind of call, it times torch's F.conv*, the reshape + F.linear rewrite and
gemmconv's public call as gemmconv.bench.call_timing builds them (back-to-back calls,
interleaved, median) and prints per call: the wall time, the host's time to issue the
calls (the loop without a synchronisation inside; a diagnostic, and a lower bound of
the wall time) and, on CUDA, the kernels' device time from torch.profiler (a
diagnostic), on one operand set and rotating over them as the wall does. Beside them,
for a call of one direction, the prepared run of the solver gemmconv chose (what
find's call time times), so the gap between the two shows; with ``--kernels``, the
kernels each launches per call. Then it profiles gemmconv's call with cProfile and
lists the functions with the most time of their own. Used to find host-path work; the
benchmarks, not this script, are where speed is reported.

    PYTHONPATH=src python bench/probes/host_profile.py point3d --layout cf --kind fwd_wgrad
    PYTHONPATH=src python bench/probes/host_profile.py point3d --n 4 --k 64 --device cpu --threads 1
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import itertools
import pstats
import time

import torch

from gemmconv.bench.call_timing import CALL_KINDS, DIRECTION_KINDS, public_calls, solvers_of
from gemmconv.bench.public_calls import API_CASES
from gemmconv.bench.suite import DTYPES, LAYOUT_NAMES, SUITE, make_problem
from gemmconv.core.problem import Direction
from gemmconv.measuring.measure import operand_sets
from gemmconv.measuring.timing import time_interleaved
from gemmconv.solvers import get_solver


def _shape(name: str, n: int | None, k: int | None):
    known = {case.name: case.full for case in (*SUITE, *API_CASES)}
    if name not in known:
        raise SystemExit(f"case={name!r}: expected one of {', '.join(known)}")
    shape = known[name]
    if n is not None:
        shape = dataclasses.replace(shape, n=n)
    return shape if k is None else dataclasses.replace(shape, k=k)


def issue_us(fn, calls: int, sync, passes: int = 3) -> float:
    """Microseconds per call the host takes to issue ``calls`` back-to-back calls, the
    least of ``passes`` passes: one pass read 20% over the wall of the same calls on
    the H200 (bench/probes/results/point2d_public_h200.txt, patch_padded's forward)."""
    best = float("inf")
    for _ in range(passes):
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, time.perf_counter() - start)
        sync()
    return best / calls * 1e6


def _kernel_times(fn, calls: int) -> list[tuple[str, float, float]]:
    """(kernel, launches per call, device microseconds per call) of ``fn`` on CUDA,
    from torch.profiler, most time first."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = [
        (e.key, e.count / calls, e.device_time_total / calls)
        for e in prof.key_averages()
        if e.device_time_total > 0
    ]
    return sorted(kernels, key=lambda k: -k[2])


def _print_host_ops(fn, calls: int, top: int) -> None:
    """The ops and runtime calls with the most host time of their own per call of
    ``fn``, from torch.profiler (what cProfile cannot see inside torch's C++)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]
    for e in events:
        per_call = e.self_cpu_time_total / calls
        print(f"      {per_call:8.1f} us self  x{e.count / calls:5.2f}  {e.key[:100]}")


def _rotating(fns):
    """One call of ``fns`` after another, in turn, as the timed blocks make them."""
    turn = itertools.cycle(fns)

    def call():
        return next(turn)()

    return call


def _on_calling_thread(fn):
    """``fn`` with autograd's backward kept on the calling thread: on CUDA the engine
    hands a backward to the device's worker thread, where gemmconv's Python node runs."""

    def call():
        with torch.autograd.set_multithreading_enabled(False):
            return fn()

    return call


def _solver_run(case_problem, kind: str, device: torch.device, t0):
    """The prepared run of the solver gemmconv picks for a one-direction ``kind``, on
    that direction's operand sets, named by the solver; None for other kinds."""
    direction = next((d for d, k in DIRECTION_KINDS.items() if k == kind), None)
    if direction is None:
        return None
    p = dataclasses.replace(case_problem, direction=direction)
    sets = operand_sets(p, device, 0)
    solver_id = solvers_of(case_problem, t0)[direction.value]
    run = get_solver(solver_id).prepare(p, sets[0])
    return f"solver {solver_id}", [lambda t=t: run(t) for t in sets]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case", help="a suite case or a public-call-table case")
    parser.add_argument("--layout", default="cf", choices=sorted(LAYOUT_NAMES))
    parser.add_argument("--kind", default="fwd", choices=CALL_KINDS)
    parser.add_argument("--dtype", default=None, choices=sorted(DTYPES))
    parser.add_argument("--n", type=int, default=None, help="batch (patches) instead of the case's")
    parser.add_argument("--k", type=int, default=None, help="output channels instead of the case's")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--calls", type=int, default=200, help="calls issued and profiled")
    parser.add_argument("--top", type=int, default=25, help="cProfile rows")
    parser.add_argument("--kernels", action="store_true", help="list each call's kernels")
    parser.add_argument(
        "--host-ops", type=int, default=0, help="list this many ops by their host time per call"
    )
    parser.add_argument(
        "--rotated",
        action="store_true",
        help="interleave in a rotating order, as the timings before the shuffle did",
    )
    parser.add_argument(
        "--calling-thread",
        action="store_true",
        help="time the rewrite's and gemmconv's calls with the backward on the calling thread too",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype_key = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    shape = _shape(args.case, args.n, args.k)
    p = make_problem(shape, LAYOUT_NAMES[args.layout], DTYPES[dtype_key], device, Direction.FORWARD)
    sets = operand_sets(p, device, 0, every_operand=True)
    calls = public_calls(p, args.kind, sets)
    solver = _solver_run(p, args.kind, device, sets[0])
    if solver is not None:
        calls[solver[0]] = solver[1]
    if args.calling_thread and args.kind != "fwd":
        for name in ("linear", "gemmconv"):
            if name in calls:
                calls[f"{name} on the calling thread"] = [
                    _on_calling_thread(f) for f in calls[name]
                ]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = time_interleaved(calls, device, reps=args.reps, shuffled=not args.rotated)
    order = "rotated" if args.rotated else "shuffled"
    row = f"{args.case} {args.layout} {args.kind} {dtype_key} n={shape.n} k={shape.k} {order}"
    print(f"{row} on {device}, torch {torch.__version__}; us per call")
    for name, fns in calls.items():
        line = f"  {name:9s} wall {times[name].median_ms * 1e3:9.1f}"
        line += f"  host issue {issue_us(fns[0], args.calls, sync):9.1f}"
        if len(fns) > 1:
            # The wall rotates over the operand sets; issued the same way, a gap between
            # this and the single set's issue is host work a rotation brings.
            line += f"  rotating {issue_us(_rotating(fns), args.calls, sync):9.1f}"
        kernels = _kernel_times(fns[0], args.calls) if device.type == "cuda" else None
        if kernels is not None:
            line += f"  device {sum(k[2] for k in kernels):9.1f}"
            if len(fns) > 1:
                # Over the rotating operand sets, as the wall is timed: one set's
                # operands may stay in L2 from call to call, the rotation's do not.
                rotated = _kernel_times(_rotating(fns), args.calls)
                line += f"  rotating {sum(k[2] for k in rotated):9.1f}"
        print(line, flush=True)
        for kernel, launches, us in kernels if args.kernels and kernels else ():
            print(f"      {us:8.1f} us  x{launches:4.2f}  {kernel[:110]}")
        if args.host_ops:
            _print_host_ops(fns[0], args.calls, args.host_ops)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.calls):
        calls["gemmconv"][0]()
    sync()
    profiler.disable()
    report = io.StringIO()
    pstats.Stats(profiler, stream=report).sort_stats("tottime").print_stats(args.top)
    print(f"gemmconv's call under cProfile, {args.calls} calls (its overhead included):")
    print(report.getvalue())


if __name__ == "__main__":
    main()
