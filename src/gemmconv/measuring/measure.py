"""The measuring engine: operands for a problem, verification of a solver's result, and
the two times of a call. Find (gemmconv.selection.find, behind the find and hybrid modes and
``gemmconv tune``), the driver (``gemmconv conv``), the benchmark suite (``gemmconv
bench``) and the scripts under bench/ and bench/probes/ all measure solvers here.

- Operands: seeded uniform(-1, 1) values, never zeros. x and the weight are dense in the
  problem's layout, the bias is there for a forward problem that has one, and dY is in
  the layout the backward ops receive it: the layout F.conv* gives the output, and
  autograd its gradient (``memory_format.output_layout``).
- Verification: a candidate writes into a NaN-filled result, so an element it leaves
  unwritten fails; the result is judged against a float64 reference and the vendor's
  result on the same operands (``verify.judge``). Without a reference only the NaN
  check runs.
- Timing (``TimingPolicy``), two numbers per candidate, each of the call the custom
  ops and the eager road make (the solver's prepared run, ``Solver.prepare``, the
  result allocated by the call):
  ``call_ms``, back-to-back calls with nothing queued ahead of them, as a user makes
  them (``timing.time_interleaved``) — what a call costs, and what find decides on;
  and ``device_ms``, the kernels' own time with the host hidden behind a head start
  (``timing.time_ms``) — a diagnostic. On the CPU the host does the work itself, so
  the two are one measurement.
- In the call users make (``InCall``): where the caller gives one, ``call_ms`` is of
  the public call itself with the candidate tried for the problem (the forward, the
  autograd node, the layout conversions around the solver, or torch's own road where
  the vendor's call takes it), on every device; ``device_ms`` stays the bare run's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Callable, Sequence

import torch

from gemmconv.core.memory_format import empty_in, output_layout
from gemmconv.core.problem import ConvProblem, Direction
from gemmconv.measuring.timing import Timing, time_interleaved, time_ms
from gemmconv.measuring.verify import Verdict, reference
from gemmconv.measuring.verify import judge as judge_result
from gemmconv.solvers.base import ConvTensors, Solver
from gemmconv.solvers.views import result_buffer

log = logging.getLogger("gemmconv.measure")

# On CUDA the calls rotate over operand sets that together overflow the L2 cache twice
# (at most this many sets), so a small problem is not timed from a warm cache.
MAX_OPERAND_SETS = 8


@dataclasses.dataclass(frozen=True)
class TimingPolicy:
    """How a candidate is timed: ``warmup`` and ``reps`` calls for its device time,
    then ``call_reps`` blocks of back-to-back calls of about ``block_ms`` each for its
    call time (CUDA only; on the CPU the first measurement is both)."""

    warmup: int = 5
    reps: int = 25
    call_reps: int = 5
    block_ms: float = 2.0

    def __post_init__(self) -> None:
        for name, least in (("warmup", 0), ("reps", 1), ("call_reps", 1)):
            if getattr(self, name) < least:
                raise ValueError(f"{name}={getattr(self, name)}: expected at least {least}")
        if not self.block_ms > 0:
            raise ValueError(f"block_ms={self.block_ms}: expected a positive time")


# GPU kernels here last microseconds, so many repetitions are cheap; on the CPU one
# call can take a second, so fewer.
DEFAULT_POLICY = {"cuda": TimingPolicy(5, 25), "cpu": TimingPolicy(1, 5)}


def default_policy(device_type: str) -> TimingPolicy:
    return DEFAULT_POLICY.get(device_type, DEFAULT_POLICY["cpu"])


Calls = Sequence[Callable[[], object]]


@dataclasses.dataclass(frozen=True)
class PublicCalls:
    """A candidate's public calls (one per operand set), and the context they run in
    again once another candidate's trial has been entered after theirs (its trial
    resumed): find times the candidates' blocks interleaved."""

    calls: Calls
    resumed: Callable[[], contextlib.AbstractContextManager[None]]


# A candidate's calls as users make them: given a solver, a context inside which the
# public call runs with that solver tried for the problem; it yields its PublicCalls,
# or None where the problem's call cannot be made so (a road closed), and the candidate
# is then timed bare. gemmconv.selection.dispatch builds one per find.
InCall = Callable[[Solver], contextlib.AbstractContextManager[PublicCalls | None]]


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One candidate's outcome: its two times, or why it was skipped. ``in_call``: its
    call time is of the public call (InCall), not of its bare run."""

    solver: str
    call: Timing | None
    device: Timing | None
    workspace_bytes: int
    verdict: Verdict | None = None
    extra_bytes: int | None = None
    skipped: str | None = None
    in_call: bool = False

    @property
    def ok(self) -> bool:
        return self.skipped is None

    @property
    def call_ms(self) -> float | None:
        return None if self.call is None else self.call.median_ms

    @property
    def device_ms(self) -> float | None:
        return None if self.device is None else self.device.median_ms


# ---- operands ---------------------------------------------------------------------


def problem_device(problem: ConvProblem) -> torch.device:
    """The device a problem's operands live on (the current CUDA device for "cuda")."""
    if problem.device_type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"problem {problem.key()} is on cuda, but no CUDA device is available"
            )
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(problem.device_type)


def operands(
    problem: ConvProblem, device: torch.device, seed: int = 0, *, every_operand: bool = False
) -> ConvTensors:
    """Seeded uniform(-1, 1) operands of the problem's direction (with
    ``every_operand``: x, the weight, the bias and dY whatever the direction, for calls
    through autograd), laid out as the module docstring says."""
    generator = torch.Generator(device=device).manual_seed(seed)
    grad_layout = output_layout(problem.layout, problem.dims, problem.dtype, device.type)

    def uniform(shape: tuple[int, ...], layout=problem.layout) -> torch.Tensor:
        t = empty_in(shape, layout, problem.dtype, device)
        return t.uniform_(-1.0, 1.0, generator=generator)

    d = problem.direction
    tensors = ConvTensors()
    if every_operand or d is not Direction.BACKWARD_DATA:
        tensors.input = uniform(problem.input_shape, problem.input_layout)
    if every_operand or d is not Direction.BACKWARD_WEIGHTS:
        tensors.weight = uniform(problem.weight_shape)
    if problem.has_bias and (every_operand or d is Direction.FORWARD):
        bias = torch.empty(problem.k, dtype=problem.dtype, device=device)
        tensors.bias = bias.uniform_(-1.0, 1.0, generator=generator)
    if every_operand or d is not Direction.FORWARD:
        tensors.grad_output = uniform(problem.output_shape, grad_layout)
    return tensors


def operand_bytes(tensors: ConvTensors) -> int:
    held = (tensors.input, tensors.weight, tensors.bias, tensors.grad_output)
    return sum(t.numel() * t.element_size() for t in held if t is not None)


def operand_sets(
    problem: ConvProblem, device: torch.device, seed: int = 0, *, every_operand: bool = False
) -> list[ConvTensors]:
    """Operand sets (seeds ``seed``, ``seed + 1``, ..) that together overflow the L2
    cache twice, at most MAX_OPERAND_SETS, on CUDA; the one set of ``seed`` elsewhere."""
    first = operands(problem, device, seed, every_operand=every_operand)
    if device.type != "cuda":
        return [first]
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
    count = min(MAX_OPERAND_SETS, max(1, math.ceil(2 * l2 / max(operand_bytes(first), 1))))
    return [first] + [operands(problem, device, seed + i, every_operand=every_operand)
                      for i in range(1, count)]  # fmt: skip


def result_like(problem: ConvProblem, tensors: ConvTensors) -> torch.Tensor:
    """An uninitialised result buffer in the layout the direction returns."""
    return result_buffer(problem, _first_operand(tensors), None)


# ---- verification -----------------------------------------------------------------


class Judge:
    """Judges results of one problem on one operand set against a float64 reference
    and the vendor's result (``verify.judge``). The reference is computed on the
    operands' device (the host would take minutes at benchmark sizes), on the host
    where the device refuses a float64 convolution."""

    def __init__(self, problem: ConvProblem, tensors: ConvTensors) -> None:
        from gemmconv.solvers.vendor import VendorSolver

        self.problem = problem
        self.reference = _reference(problem, tensors)
        self.vendor_result = VendorSolver().run(problem, tensors)

    def __call__(self, result: torch.Tensor) -> Verdict:
        return judge_result(self.problem, result, self.reference, self.vendor_result)


def _reference(problem: ConvProblem, tensors: ConvTensors) -> torch.Tensor:
    device = _first_operand(tensors).device
    try:
        return reference(problem, tensors, device=device)
    except RuntimeError as exc:
        if device.type == "cpu":
            raise
        log.info("float64 reference on %s failed (%s); computing it on the CPU", device, exc)
        return reference(problem, tensors, device="cpu").to(device)


def run_checked(
    problem: ConvProblem,
    solver: Solver,
    tensors: ConvTensors,
    out: torch.Tensor,
    judge: Judge | None = None,
    *,
    nan_fill: bool = True,
) -> tuple[torch.Tensor, Verdict | None, str | None]:
    """Run ``solver`` once into ``out`` (NaN-filled first unless ``nan_fill`` is off);
    returns the result, the verdict (None without a judge) and why the result is
    refused (None when it passes: judged OK, or without a judge, no NaN left)."""
    if nan_fill:
        out.fill_(math.nan)  # an element the solver does not write fails the check
    result = solver.run(problem, tensors, out=out)
    if judge is not None:
        verdict = judge(result)
        return result, verdict, None if verdict.ok else f"verification {verdict}"
    # Without verification one cheap check still runs: the operands are finite, so a
    # NaN left in the NaN-filled result is an element the solver never wrote (or
    # garbage), and such a solver must not win however fast it is.
    if nan_fill and torch.isnan(result).any():
        return result, None, "left NaN in its result"
    return result, None, None


# ---- timing -----------------------------------------------------------------------


def time_solver(
    problem: ConvProblem,
    solver: Solver,
    operand_sets: Sequence[ConvTensors],
    policy: TimingPolicy,
    *,
    setup: Callable[[], object] | None = None,
) -> tuple[Timing, Timing]:
    """(call time, device time) of the solver's prepared run (``solver.prepare``, what
    an eager call runs): the device time on the first operand set (``setup`` runs
    before each of those calls), the call time rotating over every set. On the CPU
    one measurement is both."""
    first = operand_sets[0]
    device = _first_operand(first).device
    device_time = bare_device_time(problem, solver, first, policy, setup=setup)
    if device.type != "cuda":
        return device_time, device_time
    run = solver.prepare(problem, first)
    calls = [lambda t=t: run(t) for t in operand_sets]
    if problem.direction is not Direction.FORWARD:
        calls = [through_autograd(call, device) for call in calls]
    call_time = time_interleaved(
        {solver.id: calls}, device, reps=policy.call_reps, warmup=1, block_ms=policy.block_ms
    )[solver.id]
    return call_time, device_time


def bare_device_time(
    problem: ConvProblem,
    solver: Solver,
    tensors: ConvTensors,
    policy: TimingPolicy,
    *,
    setup: Callable[[], object] | None = None,
) -> Timing:
    """The device time of the solver's prepared run on ``tensors`` (the host hidden
    behind a head start on CUDA; the wall clock on the CPU)."""
    run = solver.prepare(problem, tensors)
    device = _first_operand(tensors).device
    return time_ms(
        lambda: run(tensors), device=device, warmup=policy.warmup, reps=policy.reps, setup=setup
    )


def public_call_times(
    solvers: Sequence[Solver], in_call: InCall, device: torch.device, policy: TimingPolicy
) -> tuple[dict[str, Timing], dict[str, str]]:
    """Each candidate's public call, back to back as a user makes it, the candidates'
    blocks interleaved in a fresh order each repetition, as the suite times its columns
    (CUDA: ``policy.call_reps`` blocks rotating over the operand sets; the CPU:
    ``policy.reps`` single calls after ``policy.warmup``). Timed one after another,
    each in its own few milliseconds, two candidates of one solver's speed read up to
    1.12x apart on an H100 host, and find took SAM's channels-first backward-data to
    ``patch`` at 0.200 ms a call against ``patch_triton``'s 0.148 (f1867b6). Returns
    the times, and per candidate whose call raised, why; a candidate whose call
    cannot be made is in neither."""
    failed: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        made: dict[str, PublicCalls] = {}
        for solver in solvers:
            try:
                public = stack.enter_context(in_call(solver))
            except Exception as e:  # a candidate's failure must not end the search
                failed[solver.id] = _failure(e)
                continue
            if public is not None:
                made[solver.id] = public
        try:
            return _interleaved(made, device, policy), failed
        except Exception:  # one candidate failed among the others: each timed alone
            times = {}
            for solver_id, public in made.items():
                try:
                    times.update(_interleaved({solver_id: public}, device, policy))
                except Exception as e:
                    failed[solver_id] = _failure(e)
            return times, failed


def _interleaved(
    made: dict[str, PublicCalls], device: torch.device, policy: TimingPolicy
) -> dict[str, Timing]:
    if not made:
        return {}
    calls = {solver_id: public.calls for solver_id, public in made.items()}
    settings = {solver_id: public.resumed for solver_id, public in made.items()}
    if device.type != "cuda":
        return time_interleaved(calls, device, reps=policy.reps, warmup=policy.warmup,
                                calls_per_rep=1, settings=settings)  # fmt: skip
    return time_interleaved(calls, device, reps=policy.call_reps, warmup=1,
                            block_ms=policy.block_ms, settings=settings)  # fmt: skip


def _failure(error: Exception) -> str:
    if isinstance(error, torch.cuda.OutOfMemoryError):
        torch.cuda.empty_cache()
        return f"out of memory: {error}"
    return f"{type(error).__name__}: {error}"


class _BackwardRunning(torch.autograd.Function):
    """An autograd node whose backward makes one call: a backward direction as the
    eager road's node runs it."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, call: Callable[[], object]) -> torch.Tensor:  # type: ignore[override]
        ctx.call = call
        return anchor.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        ctx.call()
        return grad, None


def through_autograd(call: Callable[[], object], device: torch.device) -> Callable[[], object]:
    """``call`` made from inside an autograd node, as a user's backward reaches a
    backward direction: each call is one ``torch.autograd.grad`` of a graph built
    once. A public backward call cost about 60 us of host beyond its solver's bare
    call (autograd, the hand-off to the engine's worker thread on CUDA, the node;
    bench/results/node_gap_h100.txt), so timed bare, the backward solvers with the
    most host work looked fastest and ran slowest for users (up to 2.6x their bare
    call, bench/results/point2d_public_h200.txt)."""
    with torch.inference_mode(False), torch.enable_grad():
        anchor = torch.zeros((), device=device, requires_grad=True)
        out = _BackwardRunning.apply(anchor, call)
    seed = torch.ones_like(out)

    def from_a_node() -> object:
        return torch.autograd.grad(out, anchor, seed, retain_graph=True)

    return from_a_node


def _first_operand(tensors: ConvTensors) -> torch.Tensor:
    """x, else dY, else the weight: the tensor a result buffer is laid out like."""
    return next(t for t in (tensors.input, tensors.grad_output, tensors.weight) if t is not None)


def peak_extra_bytes(fn: Callable[[], torch.Tensor], device: torch.device) -> int | None:
    """Device memory a call allocates beyond its result, at its peak (CUDA only)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    result = fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    held = result.untyped_storage().nbytes()
    del result
    return max(0, peak - before - held)


# ---- peak rates -------------------------------------------------------------------

# Math modes a peak matrix rate is measured in: the operand dtype and, for fp32, whether
# TF32 is on ("fp32" is full fp32).
MATH_MODES = {
    "bf16": (torch.bfloat16, False),
    "fp16": (torch.float16, False),
    "tf32": (torch.float32, True),
    "fp32": (torch.float32, False),
}
# Square matmul sizes: large enough to reach the peak; full fp32 is slow, so smaller.
_PEAK_SIZES = {"fp32": 4096}
_PEAK_SIZE = 8192
_COPY_BYTES = 256 << 20  # several times any L2 cache
_QUICK_SIZE, _QUICK_COPY_BYTES = 256, 16 << 20


def peak_rates(
    device: torch.device, modes: Sequence[str], policy: TimingPolicy, *, quick: bool = False
) -> tuple[dict[str, float], float]:
    """The device's peak rates: TFLOP/s of a large square matmul on random data in each
    math mode of ``modes`` (MATH_MODES), with the accumulation rules of a
    convolution's GEMM (fp16/bf16 reduce in fp32), and GB/s of a large device copy,
    counting bytes read plus written. Device time: these are rates of the hardware.
    ``quick`` uses tiny sizes (a check of the plumbing, not a measurement)."""
    from gemmconv.core.precision import _fp32_matmul_mode, conv_gemm_precision

    generator = torch.Generator(device=device).manual_seed(0)
    tflops = {}
    for mode in modes:
        dtype, tf32 = MATH_MODES[mode]
        size = _QUICK_SIZE if quick else _PEAK_SIZES.get(mode, _PEAK_SIZE)
        a = torch.empty(size, size, dtype=dtype, device=device).uniform_(-1, 1, generator=generator)
        out = torch.empty_like(a)
        if dtype == torch.float32:
            precision = _fp32_matmul_mode(tf32)
        else:
            precision = conv_gemm_precision(dtype, "cuda")
        with precision:
            t = time_ms(
                lambda a=a, out=out: torch.mm(a, a, out=out),
                device=device,
                warmup=policy.warmup,
                reps=policy.reps,
            )
        tflops[mode] = 2 * size**3 / (t.median_ms * 1e9)
        del a, out
    copy_bytes = _QUICK_COPY_BYTES if quick else _COPY_BYTES
    src = torch.empty(copy_bytes, dtype=torch.uint8, device=device).random_(generator=generator)
    dst = torch.empty_like(src)
    copy = time_ms(lambda: dst.copy_(src), device=device, warmup=policy.warmup, reps=policy.reps)
    return tflops, 2 * copy_bytes / (copy.median_ms * 1e6)


# ---- candidates -------------------------------------------------------------------


def measure_solver(
    problem: ConvProblem,
    solver: Solver,
    operand_sets: Sequence[ConvTensors],
    out: torch.Tensor,
    policy: TimingPolicy,
    *,
    judge: Judge | None = None,
    peak_memory: bool = False,
    call_time: bool = True,
) -> Measurement:
    """Check ``solver`` on the first operand set (``run_checked``), then time it
    (``time_solver``; without ``call_time``, its device time alone, the call left for
    measure_solvers to time in the public call); with ``peak_memory``, also its extra
    memory at peak. A candidate that raises, runs out of memory or fails the check is
    returned with the reason in ``skipped``: it can never win, and it never ends the
    search."""
    workspace = solver.workspace_bytes(problem)
    verdict = None
    try:
        _, verdict, refused = run_checked(problem, solver, operand_sets[0], out, judge)
        if refused is not None:
            return Measurement(solver.id, None, None, workspace, verdict, skipped=refused)
        extra = None
        if peak_memory:
            extra = peak_extra_bytes(lambda: solver.run(problem, operand_sets[0]), out.device)
        if call_time:
            call, device = time_solver(problem, solver, operand_sets, policy)
        else:
            call, device = None, bare_device_time(problem, solver, operand_sets[0], policy)
    except Exception as e:  # a candidate's failure must not end the search
        return Measurement(solver.id, None, None, workspace, verdict, skipped=_failure(e))
    return Measurement(solver.id, call, device, workspace, verdict, extra)


def measure_solvers(
    problem: ConvProblem,
    solvers: Sequence[Solver],
    *,
    policy: TimingPolicy | None = None,
    verify: bool = False,
    seed: int = 0,
    peak_memory: bool = False,
    progress: object | None = None,
    in_call: InCall | None = None,
) -> list[Measurement]:
    """Measure every solver of ``solvers`` (all must apply to ``problem``) on the same
    operands, in order. ``verify`` judges each result against float64 and the vendor;
    ``progress`` is an object with ``update(n)`` (a tqdm bar), advanced per candidate;
    ``in_call`` times the candidates that pass in the public call, interleaved
    (public_call_times), and a candidate whose call cannot be made by its bare run."""
    device = problem_device(problem)
    policy = policy or default_policy(device.type)
    sets = operand_sets(problem, device, seed)
    out = result_like(problem, sets[0])
    judge = Judge(problem, sets[0]) if verify else None
    measured = []
    call_time = in_call is None  # else timed in the public call, after every check
    for solver in solvers:
        m = measure_solver(problem, solver, sets, out, policy, judge=judge,
                           peak_memory=peak_memory, call_time=call_time)  # fmt: skip
        measured.append(m)
        if progress is not None:
            progress.update(1)
    if in_call is None:
        return measured
    passed = [s for s, m in zip(solvers, measured) if m.ok]
    public, failed = public_call_times(passed, in_call, device, policy)
    return [_with_call_time(m, solver, problem, sets, policy, public, failed)
            for solver, m in zip(solvers, measured)]  # fmt: skip


def _with_call_time(
    m: Measurement,
    solver: Solver,
    problem: ConvProblem,
    sets: Sequence[ConvTensors],
    policy: TimingPolicy,
    public: dict[str, Timing],
    failed: dict[str, str],
) -> Measurement:
    """``m`` (measured without its call time) with its public call's time, or where
    that call could not be made its bare run's, or the reason its call failed."""
    if not m.ok:
        return m
    if m.solver in failed:
        return dataclasses.replace(m, device=None, skipped=failed[m.solver])
    if m.solver in public:
        return dataclasses.replace(m, call=public[m.solver], in_call=True)
    try:
        call, _ = time_solver(problem, solver, sets, policy)
    except Exception as e:
        return dataclasses.replace(m, device=None, skipped=_failure(e))
    return dataclasses.replace(m, call=call)


def fastest(measured: Sequence[Measurement], by: str = "call_ms") -> Measurement | None:
    """The measured candidate with the lowest ``by`` ("call_ms" or "device_ms"); the
    earlier of equal times; None when every one was skipped."""
    timed = [m for m in measured if m.ok]
    return min(timed, key=lambda m: getattr(m, by), default=None)


__all__ = [
    "DEFAULT_POLICY",
    "bare_device_time",
    "InCall",
    "Judge",
    "Measurement",
    "PublicCalls",
    "TimingPolicy",
    "default_policy",
    "fastest",
    "measure_solver",
    "measure_solvers",
    "operand_bytes",
    "operand_sets",
    "operands",
    "peak_extra_bytes",
    "peak_rates",
    "problem_device",
    "public_call_times",
    "result_like",
    "run_checked",
    "time_solver",
]
