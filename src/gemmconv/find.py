"""Find: benchmark every candidate solver on a problem and name the fastest.

Each candidate runs on the same fresh seeded random operands of the problem's shapes,
layout, dtype and device, writing into the same preallocated result, and is timed
with ``gemmconv.timing.time_ms`` (CUDA events with the L2 flushed between repetitions
on a GPU, perf_counter on the CPU). A candidate that raises, runs out of memory, or —
when verification is asked for — fails it, is logged and skipped; it can never win.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence

import torch

from gemmconv.memory_format import Layout, empty_in, output_layout
from gemmconv.problem import ConvProblem, Direction
from gemmconv.solvers import ConvTensors, Solver
from gemmconv.solvers.views import result_buffer
from gemmconv.timing import time_ms

log = logging.getLogger("gemmconv.dispatch")

# Repetitions per candidate. GPU kernels here last microseconds, so many repetitions
# are cheap; on the CPU one call can take a second, so fewer.
REPS = {"cuda": (5, 25), "cpu": (1, 5)}


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One solver's outcome in a find: a time, or why it was skipped."""

    solver: str
    time_ms: float | None
    workspace_bytes: int
    skipped: str | None = None
    verdict: str | None = None


@dataclasses.dataclass(frozen=True)
class FindResult:
    problem: ConvProblem
    best: str
    best_ms: float
    workspace_bytes: int
    candidates: tuple[Candidate, ...]

    def times_ms(self) -> dict[str, float]:
        return {c.solver: c.time_ms for c in self.candidates if c.time_ms is not None}


def problem_device(problem: ConvProblem) -> torch.device:
    if problem.device_type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"problem {problem.key()} is on cuda, but no CUDA device is available"
            )
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(problem.device_type)


def random_operands(problem: ConvProblem, device: torch.device, seed: int = 0) -> ConvTensors:
    """Seeded uniform(-1, 1) operands of the direction, dense in the problem's layout
    (x in its input_layout; the bias, which has no channel dimension to move, is a plain
    1-D tensor)."""
    generator = torch.Generator(device=device).manual_seed(seed)

    def uniform(shape: tuple[int, ...], layout: Layout | None) -> torch.Tensor:
        if layout is None:
            t = torch.empty(shape, dtype=problem.dtype, device=device)
        else:
            t = empty_in(shape, layout, problem.dtype, device)
        return t.uniform_(-1.0, 1.0, generator=generator)

    layout = problem.layout
    grad_layout = output_layout(layout, problem.dims, problem.dtype, problem.device_type)
    d = problem.direction
    tensors = ConvTensors()
    if d is not Direction.BACKWARD_DATA:
        tensors.input = uniform(problem.input_shape, problem.input_layout)
    if d is not Direction.BACKWARD_WEIGHTS:
        tensors.weight = uniform(problem.weight_shape, layout)
    if d is Direction.FORWARD and problem.has_bias:
        tensors.bias = uniform((problem.k,), None)
    if d is not Direction.FORWARD:
        tensors.grad_output = uniform(problem.output_shape, grad_layout)
    return tensors


def result_like(problem: ConvProblem, tensors: ConvTensors) -> torch.Tensor:
    """An uninitialised result buffer in the layout the direction returns."""
    like = next(t for t in (tensors.input, tensors.grad_output, tensors.weight) if t is not None)
    return result_buffer(problem, like, None)


def find_best(
    problem: ConvProblem,
    solvers: Sequence[Solver],
    *,
    verify: bool = False,
    warmup: int | None = None,
    reps: int | None = None,
    progress: object | None = None,
) -> FindResult:
    """Time every solver of ``solvers`` (all must apply to ``problem``) and return the
    fastest. ``progress`` is an object with ``update(n)`` (a tqdm bar), advanced once
    per candidate."""
    if not solvers:
        raise ValueError(f"solvers=[]: find on {problem.key()} needs at least one candidate")
    device = problem_device(problem)
    default_warmup, default_reps = REPS.get(device.type, REPS["cpu"])
    warmup = default_warmup if warmup is None else warmup
    reps = default_reps if reps is None else reps
    tensors = random_operands(problem, device)
    out = result_like(problem, tensors)
    judge_candidate = _verifier(problem, tensors) if verify else None

    candidates = []
    for solver in solvers:
        candidates.append(_measure(problem, solver, tensors, out, warmup, reps, judge_candidate))
        if progress is not None:
            progress.update(1)
    timed = [c for c in candidates if c.time_ms is not None]
    if not timed:
        listing = "; ".join(f"{c.solver}: {c.skipped}" for c in candidates)
        raise RuntimeError(f"find on {problem.key()}: every candidate failed: {listing}")
    best = min(timed, key=lambda c: c.time_ms)  # min keeps the earlier of equal times
    return FindResult(problem, best.solver, best.time_ms, best.workspace_bytes, tuple(candidates))


def _measure(problem, solver, tensors, out, warmup, reps, judge_candidate) -> Candidate:
    workspace = solver.workspace_bytes(problem)
    try:
        verdict = None
        if judge_candidate is not None:
            out.fill_(math.nan)  # an element the solver does not write fails the check
            solver.run(problem, tensors, out=out)
            verdict = judge_candidate(out)
            if not verdict.ok:
                log.warning("find %s: %s dropped, %s", problem.key(), solver.id, verdict)
                return Candidate(
                    solver.id, None, workspace, f"verification {verdict}", str(verdict)
                )
        else:
            # Without verification, one cheap check still runs: the operands are finite,
            # so a NaN left in the NaN-filled result is an element the solver never
            # wrote (or garbage), and such a solver must not win however fast it is.
            out.fill_(math.nan)
            solver.run(problem, tensors, out=out)
            if torch.isnan(out).any():
                log.warning("find %s: %s skipped, left NaN in its result", problem.key(), solver.id)
                return Candidate(solver.id, None, workspace, "left NaN in its result")
        timing = time_ms(
            lambda: solver.run(problem, tensors, out=out),
            device=out.device,
            warmup=warmup,
            reps=reps,
        )
    except torch.cuda.OutOfMemoryError as e:
        torch.cuda.empty_cache()
        log.warning("find %s: %s skipped, out of memory (%s)", problem.key(), solver.id, e)
        return Candidate(solver.id, None, workspace, f"out of memory: {e}")
    except Exception as e:  # a candidate's failure must not end the search
        log.warning(
            "find %s: %s skipped, raised %s: %s", problem.key(), solver.id, type(e).__name__, e
        )
        return Candidate(solver.id, None, workspace, f"{type(e).__name__}: {e}")
    log.debug("find %s: %s %s", problem.key(), solver.id, timing)
    return Candidate(
        solver.id, timing.median_ms, workspace, None, None if verdict is None else str(verdict)
    )


def _verifier(problem: ConvProblem, tensors: ConvTensors):
    """A judge of candidate results against one float64 reference and one vendor result."""
    from gemmconv.solvers.vendor import VendorSolver
    from gemmconv.verify import judge, reference

    ref = reference(problem, tensors)
    vendor_result = VendorSolver().run(problem, tensors)
    return lambda result: judge(problem, result, ref, vendor_result)


__all__ = ["Candidate", "FindResult", "find_best", "random_operands", "result_like"]
