"""The ``gemmconv`` command: a MIOpenDriver-style convolution driver and its helpers.

- ``gemmconv conv``: run one problem in the chosen directions: solver and why, time,
  TFLOP/s, GB/s, the vendor's time and the speed-up, verification.
- ``gemmconv demo``: ``conv`` preset to the headline case (9500x3x14x14 -> 1280, 14/14).
- ``gemmconv solvers``: every solver's verdict on a problem, workspace and estimate.
- ``gemmconv tune FILE``: find over many problems (one ``conv`` flag line each), stored.
- ``gemmconv db show|clear|export FILE|import FILE``: the find database.
- ``gemmconv profile MODEL``: gemmconv.profile on a timm, Hugging Face or factory-file
  model (gemmconv.cli.model_specs): per convolution, then the whole model.
- ``gemmconv bench ...``: the benchmark suite (gemmconv.bench.suite), arguments passed on;
  ``--api`` the public-call table (gemmconv.bench.public_calls), ``--models`` the end-to-end
  model benchmark (gemmconv.bench.models).

A bad flag or an inconsistent problem is one line on stderr, ``gemmconv <command>:
error: ...``, and exit status 2 (gemmconv.terminal.usage); a failed verification is exit status
1. Progress bars go to stderr when it is a terminal; a run foreseen to be long on the
CPU is announced with a warning first (gemmconv.terminal.long_run). ``conv`` and ``demo``
end with a one-line summary (the speed-up over the vendor per direction, verified or
FAILED). Ctrl-C stops ``conv``, ``demo`` and ``tune`` at once, even inside one long
convolution: one line, exit status 130 (gemmconv.terminal.interrupt).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import math
import os
import shlex
import sqlite3
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

from gemmconv.core.memory_format import Layout
from gemmconv.core.problem import DIRECTIONS, ConvProblem, Direction, dtype_name
from gemmconv.terminal.interrupt import INTERRUPTED_EXIT_STATUS, run_interruptibly
from gemmconv.terminal.long_run import Calls, cpu_seconds, long_run_warning
from gemmconv.terminal.progress import Bar, CallCounter, progress_bar
from gemmconv.terminal.usage import (
    INT64_MAX,
    Parser,
    UsageError,
    int64,
    report_usage_error,
)

# ---- problem flags -----------------------------------------------------------------

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_LAYOUTS = {
    "NCW": (1, Layout.CHANNELS_FIRST),
    "NWC": (1, Layout.CHANNELS_LAST),
    "NCHW": (2, Layout.CHANNELS_FIRST),
    "NHWC": (2, Layout.CHANNELS_LAST),
    "NCDHW": (3, Layout.CHANNELS_FIRST),
    "NDHWC": (3, Layout.CHANNELS_LAST),
}
_DIRECTION_BITS = {
    1: Direction.FORWARD,
    2: Direction.BACKWARD_DATA,
    4: Direction.BACKWARD_WEIGHTS,
}
_DIRECTION_TITLES = {
    Direction.FORWARD: "Forward",
    Direction.BACKWARD_DATA: "Backward-data",
    Direction.BACKWARD_WEIGHTS: "Backward-weights",
}

# MIOpenDriver's defaults, except timing on.
CONV_DEFAULTS = {
    "batch": 100, "in_channels": 3, "in_h": 32, "in_w": 32, "out_channels": 32,
    "fil_h": 3, "fil_w": 3, "iterations": 10,
}  # fmt: skip
# The headline case: a point-output patch embedding (the suite's point2d case).
DEMO_DEFAULTS = {
    "batch": 9500, "in_channels": 3, "in_h": 14, "in_w": 14, "out_channels": 1280,
    "fil_h": 14, "fil_w": 14, "stride_h": 14, "stride_w": 14, "iterations": 100,
}  # fmt: skip
# The CPU runs the demo's vendor backward-data in about 10 s a call at N=9500 (and the
# float64 reference slower still), so on the CPU the demo uses a tenth of the batch.
DEMO_CPU_BATCH = 950
DEMO_CPU_ITERATIONS = 3


# Per-dimension flags: MIOpenDriver's short flag, where it has one; the long flag of
# (kind, dim) is --{kind}-{dim} and its attribute {kind}_{dim}.
_SHORT_FLAGS = {
    ("in", "h"): "-H", ("in", "w"): "-W", ("fil", "h"): "-y", ("fil", "w"): "-x",
    ("pad", "h"): "-p", ("pad", "w"): "-q", ("stride", "h"): "-u", ("stride", "w"): "-v",
    ("dil", "h"): "-l", ("dil", "w"): "-j",
}  # fmt: skip
_KIND_TEXT = {
    "in": "input", "fil": "filter", "pad": "padding", "stride": "stride", "dil": "dilation",
}  # fmt: skip
_DIM_TEXT = {"d": "depth (3-D only)", "h": "height (2-D, 3-D)", "w": "width"}
# (d, h, w) defaults where a subcommand sets none.
_PER_DIM_FALLBACKS = {
    "in": (8, 32, 32), "fil": (3, 3, 3), "pad": (0, 0, 0), "stride": (1, 1, 1), "dil": (1, 1, 1),
}  # fmt: skip


def _dim_flag(kind: str, dim: str) -> str:
    """The flag of one dimension as help and errors name it: '-u/--stride-h'."""
    short = _SHORT_FLAGS.get((kind, dim))
    return f"{short}/--{kind}-{dim}" if short else f"--{kind}-{dim}"


def _add_problem_flags(p: argparse.ArgumentParser, defaults: dict) -> None:
    def d(name: str, fallback):
        return defaults.get(name, fallback)

    g = p.add_argument_group("problem (MIOpenDriver flags)")
    g.add_argument("-n", "--batch", type=int64, default=d("batch", 100), help="batch size N")
    g.add_argument(
        "-c", "--in-channels", type=int64, default=d("in_channels", 3), help="input channels C"
    )
    g.add_argument(
        "-k", "--out-channels", type=int64, default=d("out_channels", 32), help="output channels K"
    )
    for kind, fallbacks in _PER_DIM_FALLBACKS.items():
        for dim, fallback in zip("dhw", fallbacks):
            name = f"{kind}_{dim}"
            g.add_argument(
                *_dim_flag(kind, dim).split("/"),
                dest=name,
                type=int64,
                default=d(name, fallback),
                help=f"{_KIND_TEXT[kind]} {_DIM_TEXT[dim]}",
            )
    g.add_argument("-g", "--groups", type=int64, default=d("groups", 1), help="groups")
    g.add_argument(
        "--spatial-dim",
        type=int64,
        choices=(1, 2, 3),
        default=None,
        help="1, 2 or 3 (default: from --layout, else 2); 1-D uses W, 3-D adds D",
    )
    g.add_argument("-b", type=int64, choices=(0, 1), dest="bias", default=0, help="bias 0/1")
    g.add_argument("--bias", action="store_const", const=1, dest="bias", help="with bias")
    g.add_argument(
        "--dtype",
        choices=(*_DTYPES, "auto"),
        default="auto",
        help="auto: what the device runs fast: bf16 on a CUDA GPU with native bf16, fp16 on "
        "an older one, fp32 on the CPU",
    )
    g.add_argument(
        "--layout",
        type=str.upper,
        choices=tuple(_LAYOUTS),
        default=None,
        help="default: channels-first of the spatial dim",
    )
    g.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: CUDA if present"
    )
    g.add_argument(
        "-F",
        "--forw",
        type=int64,
        default=0,
        help="directions: 0 all, 1 fwd, 2 bwd-data, 4 bwd-weights (sums combine)",
    )


def _device(args) -> torch.device:
    if args.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available")
    return torch.device(args.device)


def _directions(forw: int) -> list[Direction]:
    if not 0 <= forw <= 7:
        raise UsageError(f"-F/--forw {forw}: expected 0 (all) or a sum of 1, 2 and 4")
    if forw == 0:
        return list(DIRECTIONS)
    return [d for bit, d in _DIRECTION_BITS.items() if forw & bit]


def auto_dtype(device: torch.device) -> torch.dtype:
    """``--dtype auto``: the precision ``device`` runs fast. The CPU gets fp32: torch's
    half-precision CPU convolutions fall to kernels up to two orders of magnitude
    slower on CPUs without bf16/fp16 instructions (gemmconv.terminal.long_run). A GPU
    gets bf16 where torch says it runs bf16 natively, else fp16, which older GPUs run on
    their tensor cores while their bf16 is emulated."""
    if device.type != "cuda":
        return torch.float32
    if torch.cuda.is_available():
        with torch.cuda.device(device):
            if not torch.cuda.is_bf16_supported(including_emulation=False):
                return torch.float16
    return torch.bfloat16


def problem_from_args(args, device: torch.device) -> ConvProblem:
    """The forward problem the flags describe, checked for consistency."""
    dims, layout = _LAYOUTS[args.layout] if args.layout else (None, None)
    if args.spatial_dim is not None and dims is not None and args.spatial_dim != dims:
        raise UsageError(
            f"--layout {args.layout} is {dims}-D but --spatial-dim is {args.spatial_dim}"
        )
    dims = args.spatial_dim or dims or 2
    layout = layout or Layout.CHANNELS_FIRST
    names = "dhw"[3 - dims :]
    for flag, value in (
        ("-n/--batch", args.batch),
        ("-c/--in-channels", args.in_channels),
        ("-k/--out-channels", args.out_channels),
        ("-g/--groups", args.groups),
    ):
        if value < 1:
            raise UsageError(f"{flag} {value}: expected a value >= 1")
    for kind, least in (("in", 1), ("fil", 1), ("stride", 1), ("dil", 1), ("pad", 0)):
        for n in names:
            value = getattr(args, f"{kind}_{n}")
            if value < least:
                raise UsageError(f"{_dim_flag(kind, n)} {value}: expected a value >= {least}")
    for flag, channels in (
        ("-c/--in-channels", args.in_channels),
        ("-k/--out-channels", args.out_channels),
    ):
        if channels % args.groups:
            raise UsageError(f"{flag} {channels} is not divisible by -g/--groups {args.groups}")

    def per_dim(kind: str) -> tuple[int, ...]:
        return tuple(getattr(args, f"{kind}_{n}") for n in names)

    spatial, kernel = per_dim("in"), per_dim("fil")
    pad, stride, dil = per_dim("pad"), per_dim("stride"), per_dim("dil")
    for n, s, r, p, d in zip(names, spatial, kernel, pad, dil):
        if s + 2 * p > INT64_MAX:  # torch indexes the padded input in 64-bit integers
            raise UsageError(
                f"the padded input {n.upper()}={s}+2*{p} ({_dim_flag('in', n)}, "
                f"{_dim_flag('pad', n)}) is more than {INT64_MAX}"
            )
        if s + 2 * p < d * (r - 1) + 1:
            raise UsageError(
                f"filter {n.upper()}={r} ({_dim_flag('fil', n)}, dilation {d}) is larger than "
                f"the padded input {n.upper()}={s}+2*{p} ({_dim_flag('in', n)}, "
                f"{_dim_flag('pad', n)})"
            )
    dtype = _DTYPES.get(args.dtype) or auto_dtype(device)
    problem = ConvProblem.from_sizes(
        args.batch, args.in_channels, args.out_channels, spatial, kernel,
        stride=stride, padding=pad, dilation=dil, groups=args.groups, layout=layout,
        dtype=dtype, device_type=device.type, has_bias=bool(args.bias),
    )  # fmt: skip
    _check_sizable(problem, names)
    return problem


def _check_sizable(problem: ConvProblem, names: str) -> None:
    """A UsageError when torch cannot size one of the problem's tensors (its bytes
    overflow a 64-bit integer), asked of torch on the meta device, which allocates
    nothing; a tensor that torch can size but memory cannot hold fails when it runs."""

    def flags(*kinds: str) -> str:
        return ", ".join(_dim_flag(kind, n) for kind in kinds for n in names)

    tensors = (
        ("input", problem.input_shape, f"-n/--batch, -c/--in-channels, {flags('in')}"),
        ("weight", problem.weight_shape, f"-k/--out-channels, -c/--in-channels, -g/--groups, "
         f"{flags('fil')}"),
        ("output", problem.output_shape, f"-n/--batch, -k/--out-channels, "
         f"{flags('in', 'fil', 'pad', 'stride', 'dil')}"),
    )  # fmt: skip
    for name, shape, named in tensors:
        try:
            torch.empty(shape, dtype=problem.dtype, device="meta")
        except (RuntimeError, ValueError, TypeError, OverflowError) as e:
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise UsageError(
                f"the {name} tensor {_dims_text(shape)} ({dtype_name(problem.dtype)}, from "
                f"{named}) is too large for torch to size ({reason})"
            ) from None


def _dims_text(values: Sequence[int]) -> str:
    return "x".join(str(v) for v in values)


def _layout_name(p: ConvProblem) -> str:
    return next(n for n, (d, lay) in _LAYOUTS.items() if d == p.dims and lay is p.layout)


def describe(p: ConvProblem) -> str:
    spatial = "x".join(str(s) for s in p.spatial)
    return (
        f"N={p.n} C={p.c} {spatial} -> K={p.k}, filter {_dims_text(p.kernel)}, stride "
        f"{_dims_text(p.stride)}, pad {_dims_text(p.padding)}, dilation "
        f"{_dims_text(p.dilation)}, groups {p.groups}, {_layout_name(p)}, "
        f"{dtype_name(p.dtype)}{', bias' if p.has_bias else ''}"
    )


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} threads)"


# ---- gemmconv conv / demo ------------------------------------------------------------


def _add_json_flag(
    p: argparse.ArgumentParser | argparse._ArgumentGroup, help: str = "machine-readable output"
) -> None:
    """--json, which every command but bench takes."""
    p.add_argument("--json", action="store_true", help=help)


def _add_conv_flags(p: argparse.ArgumentParser, defaults: dict) -> None:
    """Every flag of conv, defaulting to ``defaults`` (demo takes them all too)."""
    _add_problem_flags(p, defaults)
    _add_run_flags(p, defaults["iterations"])


def _add_run_flags(p: argparse.ArgumentParser, iterations: int) -> None:
    g = p.add_argument_group("run")
    g.add_argument("-t", "--time", type=int64, choices=(0, 1), default=1, help="time 0/1")
    g.add_argument("-V", "--verify", type=int64, choices=(0, 1), default=1, help="verify 0/1")
    g.add_argument("-i", "--iterations", type=int64, default=iterations, help="timed repetitions")
    g.add_argument(
        "--warmup", type=int64, default=None, help="untimed calls (default 5 GPU, 1 CPU)"
    )
    g.add_argument("-S", "--solver", default=None, help="force this solver id")
    g.add_argument(
        "-N", "--nan", type=int64, choices=(0, 1), default=1, help="NaN-fill outputs 0/1"
    )
    g.add_argument("-s", "--search", type=int64, choices=(0, 1), default=0, help="find 0/1")
    g.add_argument("--seed", type=int64, default=0, help="seed of the random operands")
    _add_json_flag(g)


@dataclasses.dataclass
class DirectionReport:
    direction: str
    problem: str
    solver: str
    reason: str
    source: str
    time_ms: float | None = None  # per call, back to back: what a caller pays
    min_ms: float | None = None
    reps: int | None = None
    device_ms: float | None = None  # the kernels' time alone, a diagnostic
    tflops: float | None = None
    gbs: float | None = None
    vendor_ms: float | None = None
    vendor_device_ms: float | None = None
    speedup: float | None = None
    verified: bool = False
    ok: bool | None = None
    rms: float | None = None
    tol: float | None = None
    vendor_rms: float | None = None
    verdict: str | None = None


def _selection(args, problem: ConvProblem):
    from gemmconv.selection import dispatch
    from gemmconv.solvers import get_solver

    if args.solver is not None:
        # Checked here so that the error names the flag, not the environment variable.
        reasons = get_solver(args.solver).not_supported_reasons(problem)
        if reasons:
            raise UsageError(
                f"-S/--solver {args.solver}: does not apply to the {problem.direction.value} "
                f"problem {problem.key()}: {', '.join(reasons)}"
            )
    mode = contextlib.nullcontext() if not args.search else dispatch.find_mode("find")
    try:
        with mode:
            return dispatch.choose(problem, solver=args.solver)
    except (ValueError, dispatch.SolverNotApplicable) as e:
        # A forced solver that does not apply, an unknown id, a bad GEMMCONV_* variable.
        raise UsageError(str(e)) from None


def _warmup(args, device: torch.device) -> int:
    return args.warmup if args.warmup is not None else (5 if device.type == "cuda" else 1)


def _calls(args, vendor_chosen: bool, warmup: int) -> Calls:
    """The convolutions run_direction makes for one direction, by who computes them."""
    timed = warmup + args.iterations if args.time else 0
    checks = 1 if args.verify else 0  # verification runs the vendor and the reference once
    if vendor_chosen:
        return Calls(vendor=1 + timed + checks, reference=checks)
    return Calls(gemm=1 + timed, vendor=checks + timed, reference=checks)


def _foreseen_seconds(args, problems: list[ConvProblem], warmup: int) -> float:
    """The run's CPU time, foreseen before any solver is chosen (a find included): a
    gemmconv solver is assumed unless the vendor is forced, which, when the vendor is
    chosen after all, leaves out one vendor call per direction."""
    calls = _calls(args, args.solver == "vendor", warmup)
    seconds = sum(cpu_seconds(p, calls) for p in problems)
    if args.search:
        seconds += sum(cpu_seconds(p, _find_calls(p)) for p in problems)
    return seconds


def run_direction(
    args, problem: ConvProblem, device: torch.device, choice, bar: Bar
) -> DirectionReport:
    """Run, verify and time one direction with ``choice``'s solver and the vendor's
    (gemmconv.measuring.measure), advancing ``bar`` by one per convolution (as counted by
    ``_calls``)."""
    from gemmconv.measuring import measure
    from gemmconv.solvers import get_solver

    solver = get_solver(choice.solver)
    if args.time:  # on CUDA several sets, so the timed calls do not run from the L2 cache
        sets = measure.operand_sets(problem, device, seed=args.seed)
    else:
        sets = [measure.operands(problem, device, seed=args.seed)]
    tensors = sets[0]
    report = DirectionReport(
        problem.direction.value, problem.key(), choice.solver, choice.reason, choice.source
    )
    judge = measure.Judge(problem, tensors) if args.verify else None
    out = measure.result_like(problem, tensors)
    _, verdict, _ = measure.run_checked(
        problem, solver, tensors, out, judge, nan_fill=bool(args.nan)
    )
    bar.update(1)
    if verdict is not None:
        bar.update(2)
        report.verified, report.ok = True, verdict.ok
        report.rms, report.tol, report.vendor_rms = (
            verdict.error,
            verdict.tolerance,
            verdict.vendor_error,
        )
        report.verdict = str(verdict)
    if args.time:
        policy = measure.TimingPolicy(warmup=_warmup(args, device), reps=args.iterations)
        counter = CallCounter(bar)
        call, device_time = measure.time_solver(problem, solver, sets, policy, setup=counter)
        counter.finish()
        report.time_ms, report.min_ms, report.reps = call.median_ms, call.min_ms, call.reps
        report.device_ms = device_time.median_ms
        report.tflops = problem.flops() / call.median_ms / 1e9
        report.gbs = problem.min_bytes() / call.median_ms / 1e6
        if choice.solver == "vendor":
            report.vendor_ms, report.vendor_device_ms = report.time_ms, report.device_ms
        else:
            vendor = get_solver("vendor")
            vendor_call, vendor_device = measure.time_solver(
                problem, vendor, sets, policy, setup=counter
            )
            counter.finish()
            report.vendor_ms, report.vendor_device_ms = (
                vendor_call.median_ms,
                vendor_device.median_ms,
            )
        report.speedup = report.vendor_ms / report.time_ms
    return report


def _direction_lines(r: DirectionReport, device: torch.device) -> list[str]:
    title = _DIRECTION_TITLES[Direction(r.direction)]
    lines = [f"{title}: solver {r.solver} ({r.reason})"]
    if r.time_ms is not None:
        lines.append(
            f"  time {r.time_ms:.4f} ms a call (median of {r.reps}, min {r.min_ms:.4f})  "
            f"{r.tflops:.3g} TFLOP/s  {r.gbs:.3g} GB/s"
        )
        if device.type == "cuda":  # on the CPU the two times are one measurement
            lines.append(
                f"  device time {r.device_ms:.4f} ms, vendor {r.vendor_device_ms:.4f} ms "
                "(diagnostic: the kernels alone, host hidden)"
            )
        lines.append(f"  vendor {r.vendor_ms:.4f} ms a call  speed-up {r.speedup:.2f}x")
    if r.verified:
        lines.append(f"  {r.verdict}")
    return lines


def summary_line(reports: Sequence[DirectionReport]) -> str:
    """The run in one line: the speed-up over the vendor per direction (where timed) and
    the verification's outcome, ``verified`` or ``FAILED`` with the directions that
    failed."""
    timed = [
        f"{_DIRECTION_TITLES[Direction(r.direction)].lower()} {r.speedup:.2f}x"
        + (" (the vendor ran)" if r.solver == "vendor" else "")
        for r in reports
        if r.speedup is not None
    ]
    speed = f"speed-up over the vendor: {', '.join(timed)}" if timed else "not timed"
    failed = [_DIRECTION_TITLES[Direction(r.direction)].lower() for r in reports if r.ok is False]
    if failed:
        outcome = f"FAILED ({', '.join(failed)})"
    elif reports and all(r.verified for r in reports):
        outcome = "verified"
    else:
        outcome = "not verified"
    return f"summary: {speed}; {outcome}"


def _how_to_shorten_conv(problem: ConvProblem) -> str:
    ways = "-i 1, -F 1 (one direction), a smaller -n/--batch, or -V 0 (no verification)"
    if problem.dtype != torch.float32:
        ways = "--dtype fp32, " + ways
    return f"shorten it with {ways}"


def _warn_if_long(command: str, seconds: float, how_to_shorten: str) -> None:
    warning = long_run_warning(seconds, how_to_shorten)
    if warning is not None:
        print(f"gemmconv {command}: {warning}", file=sys.stderr)


def cmd_conv(args) -> int:
    device = _device(args)
    base = problem_from_args(args, device)
    directions = _directions(args.forw)
    if args.iterations < 1:
        raise UsageError(f"-i/--iterations {args.iterations}: expected a value >= 1")
    if args.warmup is not None and args.warmup < 0:
        raise UsageError(f"--warmup {args.warmup}: expected a value >= 0")
    if args.solver is not None:
        _check_solver_id(args.solver)
    problems = [base.with_direction(d) for d in directions]
    warmup = _warmup(args, device)
    _warn_if_long(
        args.command, _foreseen_seconds(args, problems, warmup), _how_to_shorten_conv(base)
    )
    choices = [_selection(args, p) for p in problems]
    calls = [_calls(args, c.solver == "vendor", warmup) for c in choices]
    if not args.json:
        print(f"gemmconv {args.command}: {describe(base)}")
        print(f"device: {device_name(device)}")
        for note in getattr(args, "notes", []):
            print(f"note: {note}")
    reports = []
    total = sum(n.gemm + n.vendor + n.reference for n in calls)
    with progress_bar(total, desc=args.command, unit="conv") as bar:
        for problem, choice in zip(problems, choices):
            report = run_direction(args, problem, device, choice, bar)
            reports.append(report)
            if not args.json:
                for line in _direction_lines(report, device):
                    bar.write(line)
    ok = all(r.ok is not False for r in reports)
    if not args.json:
        print(summary_line(reports))
    if args.json:
        payload = {
            "problem": describe(base),
            "device": device_name(device),
            "dtype": dtype_name(base.dtype),
            "layout": _layout_name(base),
            "iterations": args.iterations,
            "notes": getattr(args, "notes", []),
            "directions": [dataclasses.asdict(r) for r in reports],
            "ok": ok,
        }
        print(json.dumps(payload, indent=1))
    return 0 if ok else 1


def cmd_demo(args) -> int:
    device = _device(args)
    args.notes = []
    if device.type == "cpu":
        if args.batch == DEMO_DEFAULTS["batch"] and not args.batch_given:
            args.batch = DEMO_CPU_BATCH
            args.notes.append(
                f"on the CPU the demo runs N={DEMO_CPU_BATCH} (the vendor's backward-data "
                "alone takes about 10 s a call at N=9500); pass -n 9500 for the full case"
            )
        if not args.iterations_given:
            args.iterations = DEMO_CPU_ITERATIONS
    return cmd_conv(args)


def _check_solver_id(solver_id: str) -> None:
    from gemmconv.solvers import solver_ids

    if solver_id not in solver_ids():
        raise UsageError(
            f"-S/--solver {solver_id}: unknown solver id; expected one of {', '.join(solver_ids())}"
        )


# ---- gemmconv solvers -------------------------------------------------------------------


def cmd_solvers(args) -> int:
    from gemmconv.selection import calibrate, dispatch
    from gemmconv.solvers import SOLVERS

    device = _device(args)
    base = problem_from_args(args, device)
    calibrate.prepare(device.type)
    rows = []
    for direction in _directions(args.forw):
        problem = base.with_direction(direction)
        applicable = [s for s in SOLVERS if s.is_applicable(problem)]
        best = dispatch.decide(problem, applicable).solver if applicable else None
        for s in SOLVERS:
            reasons = s.not_supported_reasons(problem)
            rows.append(
                {
                    "direction": direction.value,
                    "solver": s.id,
                    "applicable": not reasons,
                    "immediate_choice": s.id == best,
                    "workspace_bytes": None if reasons else s.workspace_bytes(problem),
                    "estimate_ms": None if reasons else s.estimate_ms(problem),
                    "why_not": reasons,
                }
            )
    if args.json:
        print(json.dumps({"problem": describe(base), "solvers": rows}, indent=1))
        return 0
    print(f"gemmconv solvers: {describe(base)} on {device_name(device)}")
    print(
        f"{'direction':<17} {'solver':<18} {'applies':<8} {'workspace':>12} "
        f"{'estimate ms':>12}  why not"
    )
    for r in rows:
        ws = "" if r["workspace_bytes"] is None else _bytes_text(r["workspace_bytes"])
        est = "" if r["estimate_ms"] is None else f"{r['estimate_ms']:.4g}"
        mark = "yes *" if r["immediate_choice"] else ("yes" if r["applicable"] else "no")
        why = "; ".join(r["why_not"])
        print(f"{r['direction']:<17} {r['solver']:<18} {mark:<8} {ws:>12} {est:>12}  {why}")
    print("* the immediate-mode choice (lowest estimate)")
    return 0


def _bytes_text(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


# ---- gemmconv tune ----------------------------------------------------------------------


def _find_calls(problem: ConvProblem) -> Calls:
    """The convolutions a find on the CPU makes: each applicable solver once to check
    its result is written, then its warm-up and timed repetitions."""
    from gemmconv.measuring.measure import default_policy
    from gemmconv.solvers import SOLVERS

    policy = default_policy("cpu")
    each = 1 + policy.warmup + policy.reps
    applicable = [s.id for s in SOLVERS if s.is_applicable(problem)]
    vendor = "vendor" in applicable
    return Calls(gemm=each * (len(applicable) - vendor), vendor=each * vendor)


def cmd_tune(args) -> int:
    from gemmconv.selection import dispatch

    jobs = []
    for number, line in _problem_lines(args.file):
        sub = Parser(prog="gemmconv tune", add_help=False)
        _add_problem_flags(sub, CONV_DEFAULTS)
        try:
            line_args = sub.parse_args(shlex.split(line))
            base = problem_from_args(line_args, _device(line_args))
            jobs += [base.with_direction(d) for d in _directions(line_args.forw)]
        except UsageError as e:
            raise UsageError(f"{args.file}:{number}: {e}") from None
    if not jobs:
        raise UsageError(f"{args.file}: no problems (one line of conv flags each)")
    _warn_if_long(
        "tune",
        sum(cpu_seconds(p, _find_calls(p)) for p in jobs),
        "shorten it with fewer or smaller problems in the file",
    )
    results = []
    with progress_bar(len(jobs), "find", "problem", enabled=not args.no_progress) as bar:
        for problem in jobs:
            with dispatch.find_mode("find"):
                choice = dispatch.choose(problem)
            results.append(_tune_result(problem, choice))
            bar.set_postfix_str(choice.solver)
            bar.update(1)
    summary = _agreement(results)
    if args.json:
        print(json.dumps({"results": results, "summary": summary}, indent=1))
        return 0
    for r in results:
        time_text = "" if r["time_ms"] is None else f"  {r['time_ms']:.4g} ms"
        note = (
            "" if r["agrees"] else f"  (immediate: {r['immediate']}, {r['immediate_ratio']:.2f}x)"
        )
        print(f"{r['problem']}  ->  {r['solver']}{time_text}{note}")
    print(
        f"immediate mode agrees with find on {summary['agree']} of {summary['problems']} "
        f"problems; its picks run at most {summary['worst_ratio']:.2f}x find's best "
        f"(geometric mean {summary['geomean_ratio']:.3f}x)"
    )
    return 0


def _tune_result(problem: ConvProblem, choice) -> dict:
    """The find winner beside what immediate mode would have run among the same
    candidates and how much slower that is (the immediate pick's measured call time
    over the winner's)."""
    from gemmconv.selection import dispatch
    from gemmconv.solvers import get_solver

    candidates = [get_solver(sid) for sid in choice.estimates_ms]
    immediate = dispatch.decide(problem, candidates).solver
    best_ms = choice.times_ms[choice.solver]
    immediate_ms = choice.times_ms.get(immediate)
    return {
        "problem": problem.key(),
        "solver": choice.solver,
        "time_ms": best_ms,
        "times_ms": choice.times_ms,
        "device_times_ms": choice.device_times_ms,
        "immediate": immediate,
        "agrees": immediate == choice.solver,
        # A pick that failed in find counts as infinitely slow.
        "immediate_ratio": math.inf if immediate_ms is None else immediate_ms / best_ms,
    }


def _agreement(results: list[dict]) -> dict:
    ratios = [r["immediate_ratio"] for r in results]
    return {
        "problems": len(results),
        "agree": sum(r["agrees"] for r in results),
        "within_10_percent": sum(q <= 1.10 for q in ratios),
        "worst_ratio": max(ratios),
        "geomean_ratio": math.exp(sum(math.log(q) for q in ratios) / len(ratios)),
    }


def _problem_lines(path: str) -> Iterator[tuple[int, str]]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise UsageError(f"cannot read {path!r} ({e.strerror})") from None
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if line:
            yield number, line


# ---- gemmconv db ------------------------------------------------------------------------


def _current_identities():
    from gemmconv.selection import finddb

    ids = {finddb.identity_for("cpu")}
    if torch.cuda.is_available():
        ids.add(finddb.identity_for("cuda"))
    return ids


def cmd_db(args) -> int:
    from gemmconv.selection import finddb

    if args.action in ("export", "import") and args.file is None:
        raise UsageError(f"db {args.action}: expected a FILE argument")
    # Strict: a file that is not a usable gemmconv database is an error here (one
    # line, exit status 1), never an in-memory stand-in to report on or import into.
    db = finddb.FindDb(strict=True)
    try:
        with warnings.catch_warnings():
            # A row skipped (one that does not parse), a file reopened: one line each.
            warnings.showwarning = _one_line_warning
            return _db_action(db, args)
    except (sqlite3.Error, OSError) as e:
        raise finddb.FindDbError(f"{db.path}: {e}") from None
    finally:
        db.close()


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"gemmconv db: warning: {message}", file=sys.stderr)


def _db_action(db, args) -> int:
    from gemmconv.selection import finddb

    if args.action == "show":
        _db_show(db, args.json)
    elif args.action == "clear":
        if not (args.yes or _clear_confirmed(db.path)):
            print("nothing cleared")
            return 1
        print(f"cleared {db.clear()} results from {db.path}")
    elif args.action == "export":
        try:
            count = db.export_json(args.file)
        except ValueError as e:  # the database's own file: refused before any write
            raise UsageError(str(e)) from None
        print(f"exported {count} results to {args.file}")
    else:
        # All or nothing: a bad record (a refused value, a number out of range) is one
        # line naming it, exit status 2, and the database as it was.
        try:
            records = finddb.read_json(args.file)
        except ValueError as e:
            raise UsageError(str(e)) from None
        stored = db.store_many(records)
        replaced = len(records) - len({r.key for r in records})
        note = (
            f" ({replaced} of the file's {len(records)} records replaced by a later record "
            "of the same problem and identity)"
            if replaced
            else ""
        )
        print(f"imported {stored} results into {db.path}{note}")
    return 0


def _clear_confirmed(path: str) -> bool:
    """Ask on the terminal before deleting every result; with no terminal, refuse."""
    if not sys.stdin.isatty():
        raise UsageError(
            f"clear deletes every stored result in {path}: pass --yes to confirm "
            "(there is no terminal to ask on)"
        )
    return input(f"delete every stored result in {path}? [y/N] ").strip().lower() in ("y", "yes")


def _db_show(db, as_json: bool) -> None:
    current = _current_identities()
    rows = db.rows()
    if as_json:
        shown = [
            {**r.record.as_json(), "current": r.record.identity in current}
            if r.record is not None
            else {**r.values, "error": r.error}
            for r in rows
        ]
        print(json.dumps({"path": db.path, "records": shown}, indent=1, default=repr))
        return
    print(f"find database: {db.path} ({len(rows)} results)")
    for row in rows:
        r = row.record
        if r is None:  # !: a row that does not parse
            print(f"! {row.values}  ({row.error})")
            continue
        mark = " " if r.identity in current else "x"  # x: another device or version
        print(
            f"{mark} {r.problem}  ->  {r.solver}  {r.time_ms:.4g} ms  "
            f"ws {_bytes_text(r.workspace_bytes)}  [{r.identity.device}, "
            f"torch {r.identity.torch_version}, gemmconv {r.identity.gemmconv_version}]"
        )
    if any(row.record is not None and row.record.identity not in current for row in rows):
        print("x: measured on another device or version; ignored here")
    if any(row.record is None for row in rows):
        print("!: does not parse; ignored (a miss) by every lookup")


# ---- gemmconv profile --------------------------------------------------------------------

PROFILE_BATCH = 8


def _shape(text: str) -> tuple[int, ...]:
    """An argparse ``type`` for --input: sizes joined by x, each >= 1 (1x3x224x224)."""
    parts = text.lower().split("x")
    if not all(p.strip().isdigit() and int(p) >= 1 for p in parts):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected sizes >= 1 joined by x, such as 1x3x224x224"
        )
    return tuple(int(p) for p in parts)


def _profile_inputs(args, loaded, device: torch.device) -> tuple:
    """The example inputs: --input's random tensors, else the factory's, else one
    batch of the model's own input size."""
    if args.input:
        if args.batch is not None:
            raise UsageError("--batch: give the batch inside --input instead (its first size)")
        generator = torch.Generator().manual_seed(args.seed)
        return tuple(torch.randn(shape, generator=generator) for shape in args.input)
    if loaded.inputs is not None:
        if args.batch is not None:
            raise UsageError(f"--batch {args.batch}: the factory of {args.model} gave its inputs")
        return loaded.inputs
    if loaded.sample_shape is None:
        raise UsageError(
            f"{args.model}: its input shape is not known; give --input, such as "
            "--input 1x3x224x224, or a factory file returning (model, example_inputs)"
        )
    batch = PROFILE_BATCH if args.batch is None else args.batch
    if batch < 1:
        raise UsageError(f"--batch {batch}: expected a value >= 1")
    generator = torch.Generator().manual_seed(args.seed)
    return (torch.randn((batch, *loaded.sample_shape), generator=generator),)


def cmd_profile(args) -> int:
    from gemmconv.cli.model_specs import load, parse_overrides
    from gemmconv.profiling import profile

    if args.steps < 1:
        raise UsageError(f"--steps {args.steps}: expected a value >= 1")
    if args.warmup < 0:
        raise UsageError(f"--warmup {args.warmup}: expected a value >= 0")
    device = _device(args)
    overrides = parse_overrides(args.override)
    torch.manual_seed(args.seed)
    loaded = load(args.model, overrides)
    inputs = _profile_inputs(args, loaded, device)
    with contextlib.ExitStack() as stack:
        bar: Bar | None = None
        shown = 0

        def progress(done: int, total: int, what: str) -> None:
            nonlocal bar, shown
            if bar is None:  # the total is known once the forward has been recorded
                bar = stack.enter_context(
                    progress_bar(total, "profile", "step", enabled=not args.no_progress)
                )
            bar.update(done - shown)
            bar.set_postfix_str(what)
            shown = done

        result = profile(
            loaded.model,
            *inputs,
            device=device,
            dtype=args.dtype,
            train=not args.no_train,
            steps=args.steps,
            warmup=args.warmup,
            conv_times=not args.no_conv_times,
            progress=progress,
        )
    shapes = [_dims_text(x.shape) for x in inputs if isinstance(x, torch.Tensor)]
    if args.json is not None:
        data = {"model": args.model, "overrides": overrides, "inputs": shapes}
        data.update(result.to_dict())
        text = json.dumps(data, indent=2, default=str)
        if args.json == "-":
            print(text)
            return 0
        try:
            Path(args.json).write_text(text + "\n")
        except OSError as e:
            raise UsageError(f"--json {args.json}: cannot write it ({e.strerror})") from None
    if result.has_convolutions:
        print(f"{args.model}, input {', '.join(shapes)}")
    print(result)
    return 0


def _add_profile_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model", metavar="MODEL", help="timm:NAME, hf:CONFIG_OR_CLASS or FILE.py:FACTORY"
    )
    p.add_argument(
        "-o",
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="timm: a create_model keyword (img_size=64); hf: a config attribute "
        "(hidden_size=32); FILE.py: a factory keyword. Repeatable; default: none",
    )
    p.add_argument(
        "--input",
        action="append",
        type=_shape,
        default=[],
        metavar="SHAPE",
        help="a random input of this shape, such as 1x3x224x224 (repeat for more "
        "arguments); default: the model's input size (timm, hf) or the factory's inputs",
    )
    p.add_argument(
        "--batch",
        type=int64,
        default=None,
        help=f"batch of the derived input (default {PROFILE_BATCH})",
    )
    p.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: CUDA if present"
    )
    p.add_argument(
        "--dtype",
        choices=("auto", *_DTYPES),
        default="auto",
        help="bf16/fp16 run under torch.autocast; auto: bf16 on CUDA, else fp32",
    )
    p.add_argument("--steps", type=int64, default=10, help="timed steps (the median is shown)")
    p.add_argument("--warmup", type=int64, default=2, help="untimed steps first")
    p.add_argument("--no-train", action="store_true", help="forward only, no training step")
    p.add_argument(
        "--no-conv-times", action="store_true", help="time the whole model only, not each conv"
    )
    p.add_argument("--seed", type=int64, default=0, help="seed of the weights and inputs")
    p.add_argument(
        "--json",
        nargs="?",
        const="-",
        default=None,
        metavar="PATH",
        help="machine-readable output: on stdout, or written to PATH (the table on stdout)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


# ---- gemmconv bench -----------------------------------------------------------------------


# `gemmconv bench --models` and `--api` run their own benchmarks; the rest is the suite.
# Each is imported when the command runs and by nothing else of the library, so that
# importing gemmconv or running a convolution loads no benchmark module.
_BENCH_MODULES = {"--models": "gemmconv.bench.models", "--api": "gemmconv.bench.public_calls"}
_BENCH_SUITE = "gemmconv.bench.suite"


def cmd_bench(argv: list[str]) -> int:
    name = next((_BENCH_MODULES[a] for a in argv if a in _BENCH_MODULES), _BENCH_SUITE)
    try:
        bench = importlib.import_module(name)
    except ModuleNotFoundError as e:
        # Only the benchmark itself missing is a usage error; a module it imports is not.
        if e.name is None or not name.startswith(e.name):
            raise
        raise UsageError(f"the benchmark ({name}) is not part of this installation") from None
    return int(bench.main(argv) or 0)


# ---- entry point -------------------------------------------------------------------------

_DEMO_DESCRIPTION = (
    "conv preset to the headline case: a point-output patch embedding, "
    "N=9500 C=3 14x14 -> K=1280, filter = stride = 14x14, all three directions, "
    f"{DEMO_DEFAULTS['iterations']} timed repetitions. On the CPU it runs "
    f"N={DEMO_CPU_BATCH} and {DEMO_CPU_ITERATIONS} repetitions unless -n or -i is given. "
    "Every conv flag works here too."
)


def _add_command(
    sub: argparse._SubParsersAction,
    name: str,
    handler: Callable[[argparse.Namespace], int],
    help: str,
    description: str,
) -> argparse.ArgumentParser:
    """A subcommand whose parsed arguments main() hands to ``handler``."""
    command = sub.add_parser(name, help=help, description=description)
    command.set_defaults(handler=handler)
    return command


def build_parser() -> argparse.ArgumentParser:
    from gemmconv.core.version import __version__

    parser = Parser(
        prog="gemmconv", description="Run, time and verify GEMM convolutions (MIOpenDriver style)."
    )
    parser.add_argument("--version", action="version", version=f"gemmconv {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    conv = _add_command(
        sub,
        "conv",
        cmd_conv,
        help="run, time and verify one convolution problem",
        description="Run, time and verify one convolution problem in the chosen directions.",
    )
    _add_conv_flags(conv, CONV_DEFAULTS)

    demo = _add_command(
        sub,
        "demo",
        cmd_demo,
        help="conv preset to the headline case (9500x3x14x14->1280)",
        description=_DEMO_DESCRIPTION,
    )
    _add_conv_flags(demo, DEMO_DEFAULTS)

    solvers = _add_command(
        sub,
        "solvers",
        cmd_solvers,
        help="every solver's verdict on a problem",
        description="Every solver's verdict on a problem: applies or why not, workspace, "
        "cost estimate, and the immediate-mode choice. Runs nothing.",
    )
    _add_problem_flags(solvers, CONV_DEFAULTS)
    _add_json_flag(solvers)

    tune = _add_command(
        sub,
        "tune",
        cmd_tune,
        help="find over many problems (a file of conv flag lines)",
        description="Find (time every applicable solver) for each problem of a file and "
        "store the winners in the find database.",
    )
    tune.add_argument("file", help="one problem per line, as conv flags; # starts a comment")
    _add_json_flag(tune)
    tune.add_argument("--no-progress", action="store_true", help="no progress bar")

    db = _add_command(
        sub,
        "db",
        cmd_db,
        help="the find database: show, clear, export, import",
        description="The find database ($GEMMCONV_DB, else the user's cache directory). "
        "clear asks first; --yes skips the question (needed when there is no terminal).",
    )
    db.add_argument("action", choices=("show", "clear", "export", "import"), help="what to do")
    db.add_argument("file", nargs="?", default=None, help="JSON file for export/import")
    _add_json_flag(db, help="machine-readable output (show)")
    db.add_argument("--yes", action="store_true", help="clear without asking")

    profile = _add_command(
        sub,
        "profile",
        cmd_profile,
        help="what gemmconv does for a model: per conv, then whole-model steps",
        description="Profile a model: per convolution its shape, whether convert() swaps "
        "it, the solver per direction on this device and torch's and gemmconv's time per "
        "call; then the whole model's forward and training step, torch's and converted, "
        "interleaved. Weights are random: nothing is downloaded.",
    )
    _add_profile_flags(profile)

    sub.add_parser(
        "bench",
        help="the benchmark suite (gemmconv bench --help for its flags)",
        add_help=False,
    )
    return parser


# The commands that run convolutions, one call of which can take a minute on the CPU:
# their work runs where Ctrl-C cannot be held up by it (gemmconv.terminal.interrupt).
_LONG_COMMANDS = frozenset({"conv", "demo", "tune"})


def _given(argv: Sequence[str], *flags: str) -> bool:
    return any(a in flags or any(a.startswith(f + "=") for f in flags) for a in argv)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = "gemmconv"
    try:
        parser = build_parser()
        if not argv:
            # No command: the command list, as --help prints it (a request, not an error).
            parser.print_help()
            return 0
        if argv[0] == "bench":
            prog = "gemmconv bench"
            return cmd_bench(argv[1:])
        args, unknown = parser.parse_known_args(argv)
        prog = f"gemmconv {args.command}"
        if unknown:
            raise UsageError(f"unrecognized arguments: {' '.join(unknown)}")
        args.batch_given = _given(argv, "-n", "--batch")
        args.iterations_given = _given(argv, "-i", "--iterations")
        if args.command in _LONG_COMMANDS:
            return run_interruptibly(lambda: args.handler(args), f"{prog}: interrupted")
        return args.handler(args)
    except UsageError as e:
        return report_usage_error(e, prog)
    except (ValueError, RuntimeError) as e:
        # A failure while running (out of memory, every find candidate failing): one
        # line, exit status 1; GEMMCONV_TRACEBACK=1 shows the stack.
        if os.environ.get("GEMMCONV_TRACEBACK") == "1":
            raise
        print(f"{prog}: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return INTERRUPTED_EXIT_STATUS


if __name__ == "__main__":
    sys.exit(main())
