"""Which solver runs a problem: the selection modes, forced and disabled solvers.

Modes, after MIOpen's find modes:

- ``immediate``: the applicable solver with the lowest cost estimate; no benchmark,
  no database.
- ``database``: a find-database hit if there is one, else ``immediate``; never
  benchmarks. The default when no mode is set and ``torch.backends.cudnn.benchmark``
  is False.
- ``find``: benchmark every applicable solver (``gemmconv.selection.find``), store the winner.
- ``hybrid``: a database hit, else ``find``. The default when no mode is set and
  ``torch.backends.cudnn.benchmark`` is True.

Under ``torch.use_deterministic_algorithms(True)`` nothing is chosen by timing, which
differs from run to run: ``find`` and ``hybrid`` behave as ``database`` (a hit, else
the estimate), measure nothing and store nothing, and the choice's reason says so.

The mode comes from, first to last: ``find_mode(...)`` (a context manager),
``set_find_mode(...)``, ``$GEMMCONV_FIND_MODE``, the cudnn flag.
``$GEMMCONV_SOLVER=<id>`` (or ``solver=`` in ``choose``) forces one solver;
``$GEMMCONV_DISABLE=<id,...>`` removes solvers from consideration;
``$GEMMCONV_FIND_VERIFY=1`` verifies each find candidate and drops failing ones.

Under ``gemmconv.batch_invariant()`` (gemmconv.core.invariance) a forward is chosen
among the solvers whose forward is batch-invariant on the device
(``Solver.invariance_reasons``), in every mode; the others are listed as not chosen,
with why. Where none applies, the forward is chosen as without the switch, its
choice's reason says it is not batch-invariant and why, and a UserWarning says so
once per problem (whatever its batch size). Find-database rows found under the switch
are kept apart from the others (``database_key``).

Each problem is decided once per process for a given (mode, forced, disabled) and
cached, so steady-state calls pay no selection cost. Every decision is logged on the
``gemmconv.selection.dispatch`` logger (DEBUG; a fallback to the vendor path at INFO).

Under torch.distributed no convolution, ``explain()`` or ``module.solvers()`` ever
communicates: each rank decides from what it holds, so a rank may run a convolution,
or a shape, that the others do not (evaluation on rank 0 only, an uneven last batch).
Immediate mode decides from the cost table, which is the same on every rank, and
database mode from the find database, the same where the ranks read the same rows;
both are rank-consistent without communication. Find and hybrid modes measure, and
timings differ per rank: ``sync_choices()``, called where every rank gets to, gives
every rank the choices of the first rank that made each one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from gemmconv.core import device_rates, invariance
from gemmconv.core.device_rates import DeviceRates
from gemmconv.core.precision import convolutions_allow_tf32
from gemmconv.core.problem import DIRECTIONS, ConvProblem, Direction
from gemmconv.selection import calibrate
from gemmconv.selection.explanation import Choice, Explanation, FindMode, slower_than
from gemmconv.selection.finddb import DATABASE_ERRORS
from gemmconv.solvers import SOLVERS, Solver, get_solver
from gemmconv.solvers.base import determinism_state

if TYPE_CHECKING:  # types only: measuring (and find with it) loads when find first runs
    from gemmconv.measuring.measure import InCall
    from gemmconv.selection.find import FindResult

log = logging.getLogger("gemmconv.dispatch")


class SolverNotApplicable(RuntimeError):
    """A forced solver (``$GEMMCONV_SOLVER`` or ``solver=``) does not apply to the problem."""


# ---- the mode -----------------------------------------------------------------

# Process-wide, like torch.backends flags: the autograd engine runs CUDA backward
# passes on its own threads, which a per-thread (contextvar) setting would not reach.
_block_mode: FindMode | None = None
_process_mode: FindMode | None = None


# Other spellings of the database mode, as the design notes call it.
_MODE_ALIASES = {"immediate-with-database": "database", "immediate_with_database": "database"}


def _parse_mode(mode: FindMode | str, source: str) -> FindMode:
    try:
        if isinstance(mode, str):
            key = mode.strip().lower()
            return FindMode(_MODE_ALIASES.get(key, key))
        return FindMode(mode)
    except ValueError:
        names = ", ".join(m.value for m in FindMode)
        raise ValueError(f"{source}={mode!r}: unknown find mode; expected one of {names}") from None


def set_find_mode(mode: FindMode | str | None) -> None:
    """Set the process's find mode: "immediate", "database", "find", "hybrid" (or a
    FindMode); None returns to $GEMMCONV_FIND_MODE, else the cudnn.benchmark default.
    ValueError for any other name."""
    global _process_mode
    _process_mode = None if mode is None else _parse_mode(mode, "mode")


@contextlib.contextmanager
def find_mode(mode: FindMode | str) -> Iterator[FindMode]:
    """Use ``mode`` ("immediate", "database", "find", "hybrid") inside the block,
    process-wide (as ``torch.backends.cudnn.flags`` does), backward passes run by the
    autograd engine's threads included: ``with gemmconv.find_mode("find"): ...``."""
    global _block_mode
    saved, _block_mode = _block_mode, _parse_mode(mode, "mode")
    try:
        yield _block_mode
    finally:
        _block_mode = saved


def current_find_mode() -> FindMode:
    mode = _block_mode or _process_mode
    if mode is not None:
        return mode
    env = os.environ.get("GEMMCONV_FIND_MODE")
    if env:
        return _parse_mode(env, "GEMMCONV_FIND_MODE")
    return FindMode.HYBRID if torch.backends.cudnn.benchmark else FindMode.DATABASE


def forced_solver(solver: str | None = None) -> str | None:
    """The solver id forced by the argument, else by ``$GEMMCONV_SOLVER``."""
    forced = solver or os.environ.get("GEMMCONV_SOLVER") or None
    if forced is not None:
        get_solver(forced)  # an unknown id is an error naming every known one
    return forced


def disabled_solvers() -> frozenset[str]:
    raw = os.environ.get("GEMMCONV_DISABLE", "")
    ids = frozenset(s.strip() for s in raw.split(",") if s.strip())
    known = {s.id for s in SOLVERS}
    unknown = sorted(ids - known)
    if unknown:
        raise ValueError(
            f"GEMMCONV_DISABLE={raw!r}: unknown solver id(s) {', '.join(unknown)}; "
            f"expected ids from {', '.join(sorted(known))}"
        )
    return ids


def find_verify_enabled() -> bool:
    return os.environ.get("GEMMCONV_FIND_VERIFY", "0").strip().lower() in ("1", "true", "yes")


# ---- deciding -----------------------------------------------------------------


def decide(
    problem: ConvProblem,
    solvers: Sequence[Solver] = SOLVERS,
    rates: DeviceRates | None = None,
    rejected: dict[str, list[str]] | None = None,
) -> Choice:
    """Immediate selection: the applicable solver with the lowest estimate of what a
    call costs (``Solver.call_ms``: device time, and host time where it shows)."""
    rejected = dict(rejected or {})
    estimates: dict[str, float] = {}
    for solver in solvers:
        reasons = solver.not_supported_reasons(problem)
        if reasons:
            rejected[solver.id] = reasons
        else:
            estimates[solver.id] = solver.call_ms(problem, rates)
    if not estimates:
        raise RuntimeError(f"no solver applies to {problem.key()}: {_listing(rejected)}")
    best = min(estimates, key=estimates.__getitem__)  # min keeps the first of equals
    reason = f"lowest estimate, {estimates[best]:.4g} ms"
    host_tie = _host_bound_tie(problem, solvers, estimates, best, rates)
    if host_tie is not None:
        best, reason = host_tie
    tie = _forward_tie(problem, solvers, estimates, best, rates)
    if tie is not None:
        rejected[best] = [tie]
        reason = f"the vendor's single call: {tie}"
        best = "vendor"
    for sid, est in estimates.items():
        if sid != best and sid not in rejected:
            rejected[sid] = [slower_than("estimate", est, estimates[best], best)]
    return Choice(solver=best, rejected=rejected, estimates_ms=estimates, reason=reason)


# Where the lowest estimate is a call priced at its host time, the estimates within
# this fraction of it differ by host prices alone, which hide the device times behind
# them and were fitted less closely than those.
HOST_TIE_MARGIN = 0.10


def _host_bound_tie(
    problem: ConvProblem,
    solvers: Sequence[Solver],
    estimates: dict[str, float],
    best: str,
    rates: DeviceRates | None,
) -> tuple[str, str] | None:
    """The tie rule for host-bound calls: on a device whose host runs ahead of it (a
    GPU), where ``best``'s estimate is its host time, the solver of least device time
    among those estimated within HOST_TIE_MARGIN of it, and why; None where ``best``
    stays. Qwen2-VL's backward-data on an H100 (bench/results/h100.json at 3dd28ca):
    patch_implicit priced at 80 us of host time against point_output's 85, for 74 us
    of device time against 36, ran 87 us a call from the node against 66."""
    rates = rates or device_rates.rates_for(problem.device_type)
    if not rates.host_overlaps_device:
        return None  # host time adds to every CPU estimate: no tie hides behind it
    by_id = {s.id: s for s in solvers}
    device = {sid: by_id[sid].estimate_ms(problem, rates) for sid in estimates}
    if estimates[best] <= device[best]:
        return None
    close = [
        sid for sid, est in estimates.items() if est <= estimates[best] * (1 + HOST_TIE_MARGIN)
    ]
    pick = min(close, key=lambda sid: (device[sid], estimates[sid]))
    if pick == best:
        return None
    return pick, (
        f"least device time ({device[pick]:.4g} ms) among the estimates within "
        f"{HOST_TIE_MARGIN:.0%} of the lowest, {estimates[best]:.4g} ms of {best}'s host time"
    )


def _forward_tie(
    problem: ConvProblem,
    solvers: Sequence[Solver],
    estimates: dict[str, float],
    best: str,
    rates: DeviceRates | None,
) -> str | None:
    """The tie rule for forwards, as the training road's for calls with gradients: on a
    device whose host runs ahead of it (a GPU), a GEMM solver whose estimated saving
    over the vendor is less than its own call's host time (Solver.host_ms, the measured
    launch costs of the cost table) leaves the forward to the vendor's single call.
    There a call is priced at the larger of device and host time, so the GEMM's host
    work goes unpriced behind its device time, and a saving under it is a tie the
    estimate cannot tell apart (ResNet's 1x1 forwards: estimated 4 us, measured -1 to
    0 us a call on the H200, tests/data/h200_suite.json). On the CPU host time adds to
    every estimate already. Returns why, or None where the GEMM keeps the forward."""
    if problem.direction is not Direction.FORWARD or best == "vendor" or "vendor" not in estimates:
        return None
    rates = rates or device_rates.rates_for(problem.device_type)
    if not rates.host_overlaps_device:
        return None
    solver = next(s for s in solvers if s.id == best)
    saving_ms = estimates["vendor"] - estimates[best]
    host_ms = solver.host_ms(problem, rates)
    if saving_ms >= host_ms:
        return None
    return (
        f"saves {saving_ms * 1000:.1f} us over the vendor by estimate, less than its "
        f"call's host time ({host_ms * 1000:.1f} us)"
    )


def _listing(rejected: dict[str, list[str]]) -> str:
    return "; ".join(f"{sid}: {', '.join(r)}" for sid, r in rejected.items())


def _decide_forced(problem: ConvProblem, forced: str, mode: FindMode) -> Choice:
    reasons = get_solver(forced).not_supported_reasons(problem)
    if reasons:
        raise SolverNotApplicable(
            f"solver {forced!r} was forced (GEMMCONV_SOLVER or solver=) but does not apply "
            f"to {problem.key()}: {', '.join(reasons)}"
        )
    return Choice(forced, {}, {}, "forced", mode.value, "forced")


def _decide_in_mode(
    problem: ConvProblem,
    mode: FindMode,
    forced: str | None,
    disabled: frozenset[str],
    rates: DeviceRates | None = None,
    invariant: bool = False,
    warn: bool = True,
) -> Choice:
    invariant = invariant and problem.direction is Direction.FORWARD
    if forced is not None:
        choice = _decide_forced(problem, forced, mode)
        if invariant:
            reasons = get_solver(forced).invariance_reasons(problem)
            if reasons:
                why = f"{forced} is forced and {'; '.join(reasons)}"
                return _not_invariant(problem, choice, why, warn)
        return choice
    candidates = [s for s in SOLVERS if s.id not in disabled]
    off = {sid: ["disabled by GEMMCONV_DISABLE"] for sid in sorted(disabled)}
    variant: str | None = None
    if invariant:
        candidates, off, variant = _invariant_candidates(problem, candidates, off)
    estimated = decide(problem, candidates, rates, rejected=off)
    if variant is not None:
        estimated = _not_invariant(problem, estimated, variant, warn)
    estimated = dataclasses.replace(estimated, mode=mode.value)
    if mode is FindMode.IMMEDIATE:
        return estimated
    if 0 in (problem.n, problem.c, problem.k):
        # An empty problem multiplies nothing: only the vendor path applies (it gives
        # torch's zeros), and there is nothing to time or to store.
        return dataclasses.replace(estimated, reason=f"{estimated.reason}; empty problem, no find")
    # Under torch.use_deterministic_algorithms timing noise must not pick the solver
    # (two processes would compute different bits): find and hybrid read the database
    # and otherwise keep the estimate, measuring and storing nothing.
    untimed = mode is not FindMode.DATABASE and torch.are_deterministic_algorithms_enabled()
    note = "; not timed: torch.use_deterministic_algorithms is on" if untimed else ""
    if mode is not FindMode.FIND or untimed:
        hit = _database_hit(problem, estimated)
        if hit is not None:
            return dataclasses.replace(
                estimated,
                solver=hit.solver,
                reason=f"find database, {hit.time_ms:.4g} ms measured{note}",
                source="database",
            )
        if mode is FindMode.DATABASE or untimed:
            return dataclasses.replace(estimated, reason=estimated.reason + note)
    if _capturing(problem):
        # Timing synchronises the device, which a CUDA graph capture forbids; the
        # estimate decides, and the graph replays what it captured.
        log.info("%s: inside a CUDA graph capture, no find; the estimate decides", problem.key())
        return dataclasses.replace(estimated, reason=f"{estimated.reason}; no find while capturing")
    # A find restricted by GEMMCONV_DISABLE is not the true best: it is not stored.
    return _decide_by_find(problem, estimated, store=not disabled)


def _invariant_candidates(
    problem: ConvProblem, candidates: list[Solver], off: dict[str, list[str]]
) -> tuple[list[Solver], dict[str, list[str]], str | None]:
    """Under gemmconv.batch_invariant(): the candidates whose forward of ``problem`` is
    batch-invariant, and the others added to ``off`` with why; where no such candidate
    applies, every candidate as without the switch, and why none is invariant."""
    invariant, variant_off = [], dict(off)
    for solver in candidates:
        reasons = solver.invariance_reasons(problem)
        if not reasons:
            invariant.append(solver)
        elif solver.is_applicable(problem):
            variant_off[solver.id] = [f"not batch-invariant: {r}" for r in reasons]
        else:
            invariant.append(solver)  # refused for its own reasons, which decide() lists
    if any(not s.invariance_reasons(problem) and s.is_applicable(problem) for s in invariant):
        return invariant, variant_off, None
    named = [s.id for s in candidates if not s.invariance_reasons(problem)]
    # Solvers invariant on this device in general, but not for this problem: by reason.
    refusals: dict[str, list[str]] = {}
    for solver in candidates:
        if problem.device_type in solver.batch_invariant_devices and solver.is_applicable(problem):
            for reason in solver.invariance_reasons(problem):
                refusals.setdefault(reason, []).append(solver.id)
    details = [f"{', '.join(ids)}: {reason}" for reason, ids in refusals.items()]
    if named:
        details.append(f"{', '.join(named)} do not take it")
    why = "no batch-invariant solver applies" + (f" ({'; '.join(details)})" if details else "")
    return candidates, off, why


# Problems (as keyed without their batch size) already warned about as not
# batch-invariant: each is warned about once a process.
_warned_variant: set[str] = set()


def _not_invariant(problem: ConvProblem, choice: Choice, why: str, warn: bool = True) -> Choice:
    """``choice`` for a forward that gemmconv.batch_invariant() cannot make invariant:
    its reason says so and why, and (``warn``) a UserWarning says it once per problem."""
    chosen = get_solver(choice.solver).invariance_reasons(problem)
    detail = why
    if chosen and not why.startswith(f"{choice.solver} "):
        detail = f"{why}; {choice.solver}: {'; '.join(chosen)}"
    text = f"NOT batch-invariant: {detail}"
    geometry = dataclasses.replace(problem, n=1).key()
    if warn and geometry not in _warned_variant:
        _warned_variant.add(geometry)
        warnings.warn(
            f"gemmconv.batch_invariant is on but the forward of {problem.key()} cannot be "
            f"made batch-invariant: {detail}; it runs {choice.solver}, whose output for a "
            "sample may depend on the batch",
            UserWarning,
            stacklevel=2,
        )
    return dataclasses.replace(choice, reason=f"{choice.reason}; {text}")


def _capturing(problem: ConvProblem) -> bool:
    return (
        problem.device_type == "cuda"
        and torch.cuda.is_available()
        and torch.cuda.is_current_stream_capturing()
    )


def _database_hit(problem: ConvProblem, estimated: Choice):
    from gemmconv.selection import finddb

    identity = finddb.identity_for(problem.device_type)
    try:
        hit = finddb.get_db().lookup(database_key(problem), identity)
    except DATABASE_ERRORS as e:
        # The database must never be why a convolution fails: a file locked past its
        # timeout, a full disk or a malformed row is a miss.
        log.warning(
            "%s: find database lookup failed (%s: %s); treated as a miss",
            problem.key(),
            type(e).__name__,
            e,
        )
        return None
    if hit is not None and hit.solver not in estimated.estimates_ms:
        # Stored by a run where it applied, but now disabled or no longer applicable.
        log.debug("%s: database names %s, which is not a candidate now", problem.key(), hit.solver)
        return None
    return hit


def _decide_by_find(problem: ConvProblem, estimated: Choice, store: bool) -> Choice:
    from gemmconv.selection import finddb
    from gemmconv.selection.find import PREFERENCE_MARGIN, find_best

    applicable = [get_solver(sid) for sid in estimated.estimates_ms]
    in_call = None if _public_calls is None else _public_calls(problem)
    result = find_best(
        problem, applicable, verify=find_verify_enabled(), in_call=in_call,
        preferred=estimated.solver,
    )  # fmt: skip
    rejected = {k: v for k, v in estimated.rejected.items() if k not in estimated.estimates_ms}
    for cand in result.candidates:
        if cand.solver == result.best:
            continue
        if not cand.ok:
            rejected[cand.solver] = [f"skipped in find: {cand.skipped}"]
        elif cand.solver == result.fastest:
            rejected[cand.solver] = [
                f"measured {cand.call_ms:.4g} ms a call, not more than "
                f"{PREFERENCE_MARGIN:.0%} under the cost model's pick"
            ]
        else:
            rejected[cand.solver] = [
                slower_than("measured", cand.call_ms, result.best_ms, result.best)
            ]
    if store:
        record = finddb.Record(
            database_key(problem),
            finddb.identity_for(problem.device_type),
            result.best,
            {},
            result.best_ms,
            result.workspace_bytes,
        )
        try:
            finddb.get_db().store(record)
        except DATABASE_ERRORS as e:
            log.warning("%s: find result not stored (%s: %s)", problem.key(), type(e).__name__, e)
    return dataclasses.replace(
        estimated,
        solver=result.best,
        rejected=rejected,
        reason=_find_reason(result),
        source="find",
        times_ms=result.times_ms(),
        device_times_ms=result.device_times_ms(),
        in_call=result.in_call,
    )


def _find_reason(result: FindResult) -> str:
    from gemmconv.selection.find import PREFERENCE_MARGIN

    times = f"{result.best_ms:.4g} ms a call ({result.best_device_ms:.4g} ms device time)"
    if result.kept_preferred:
        fastest_ms = result.times_ms()[result.fastest]
        return (
            f"the cost model's pick, kept: {times}, within {PREFERENCE_MARGIN:.0%} of "
            f"find's fastest, {result.fastest} at {fastest_ms:.4g} ms"
        )
    return f"fastest in find, {times}"


# ---- trials: a candidate inside the call users make -----------------------------

# Per problem on trial, the solver it runs; set only inside find (trial()). Process-wide
# like the mode: a backward runs on the autograd engine's threads.
_trials: dict[ConvProblem, str] = {}
# The innermost trial's number, part of selection_key(), so that what the roads memoise
# while a candidate is tried is that trial's own; None outside any trial.
_trial_token: int | None = None
_trial_numbers = itertools.count(1)
# How many times choose() gave each trial's solver, by trial number.
_trial_hits: dict[int, int] = {}


@contextlib.contextmanager
def trial(problem: ConvProblem, solver_id: str) -> Iterator[int]:
    """Inside the block, ``choose(problem)`` gives ``solver_id`` (source "trial", nothing
    cached, found or stored) and every other problem is decided as usual: find times a
    candidate in the public call this way. Yields the trial's number (``trial_hits``
    says whether the call reached the problem; ``resume_trial`` makes the trial the
    active one again inside a later trial's block). What the roads memoised inside is
    forgotten at the end (its keys hold the trial's number), so the trial leaves
    nothing behind but the choices of other problems it decided."""
    number = next(_trial_numbers)
    with _lock:
        _trial_hits[number] = 0
    try:
        with _trying(problem, solver_id, number):
            yield number
    finally:
        with _lock:
            del _trial_hits[number]
            for memo in _dependent_caches:
                for key in [k for k in memo if _made_in_trial(k, number)]:
                    del memo[key]


@contextlib.contextmanager
def resume_trial(problem: ConvProblem, solver_id: str, number: int) -> Iterator[None]:
    """Trial ``number`` of ``solver_id`` on ``problem``, still open, made the active one
    for the block, its memos kept: find times the candidates' public calls
    interleaved, each block inside its own trial."""
    if number not in _trial_hits:
        raise ValueError(f"number={number}: expected an open trial")
    with _trying(problem, solver_id, number):
        yield


@contextlib.contextmanager
def _trying(problem: ConvProblem, solver_id: str, number: int) -> Iterator[None]:
    global _trial_token
    with _lock:
        saved_solver, saved_token = _trials.get(problem), _trial_token
        _trials[problem] = solver_id
        _trial_token = number
    try:
        yield
    finally:
        with _lock:
            if saved_solver is None:
                del _trials[problem]
            else:
                _trials[problem] = saved_solver
            _trial_token = saved_token


def trial_hits(number: int) -> int:
    """How many decisions trial ``number`` has made so far (0: the call never reached its
    problem)."""
    return _trial_hits.get(number, 0)


def _made_in_trial(key: object, number: int) -> bool:
    """Whether a memo's key ends with the selection_key() of trial ``number``."""
    if not isinstance(key, tuple) or not key:
        return False
    last = key[-1]
    return isinstance(last, tuple) and len(last) == _SELECTION_KEY_LENGTH and last[-1] == number


def _trial_choice(problem: ConvProblem, solver_id: str) -> Choice:
    if _trial_token is not None:
        _trial_hits[_trial_token] = _trial_hits.get(_trial_token, 0) + 1
    mode = current_find_mode().value
    return Choice(solver_id, {}, {}, "tried in find's call", mode, "trial")


# Where set, a function of a problem giving find its candidates' public calls
# (measure.InCall), or None where the call cannot be made; the eager road sets it when
# it is imported (gemmconv.roads.in_call), being the layer that makes the public call.
_public_calls: Callable[[ConvProblem], InCall | None] | None = None


def set_public_calls(builder: Callable[[ConvProblem], InCall | None] | None) -> None:
    """Give find the public call of a problem with a candidate tried (None: find times
    each candidate's bare run, from an autograd node for a backward direction)."""
    global _public_calls
    _public_calls = builder


# ---- the cached entry points ----------------------------------------------------


class SelectionState(NamedTuple):
    """Everything besides the problem that a choice depends on, parsed: the mode,
    forced and disabled solvers, the TF32 flag convolutions follow (it changes fp32
    estimates and fp32 winners) and the determinism state (it changes which solvers
    may run). Choices are cached per (problem, state); ``selection_key()`` is its
    cheap raw form for caches on the per-call path."""

    mode: FindMode
    forced: str | None
    disabled: frozenset[str]
    allow_tf32: bool
    determinism: tuple[bool, bool]
    batch_invariant: bool = False


def selection_state(solver: str | None = None) -> SelectionState:
    """The current selection state; ``solver`` forces one solver. Raises for a bad
    setting (an unknown mode or solver id) on every call that sees it."""
    mode = current_find_mode()
    forced = forced_solver(solver)
    disabled = disabled_solvers()
    if forced is not None and forced in disabled:
        raise ValueError(
            f"solver {forced!r} is forced and also listed in GEMMCONV_DISABLE; "
            "expected one or the other"
        )
    return SelectionState(
        mode,
        forced,
        disabled,
        convolutions_allow_tf32(),
        determinism_state(),
        invariance.batch_invariant_enabled(),
    )


_cache: dict[tuple[ConvProblem, SelectionState], Choice] = {}
_lock = threading.Lock()


def choose(problem: ConvProblem, solver: str | None = None) -> Choice:
    """The cached choice for ``problem`` in the current selection state; ``solver``
    forces one."""
    if _trials and solver is None:
        tried = _trials.get(problem)
        if tried is not None:
            return _trial_choice(problem, tried)
    state = selection_state(solver)
    key = (problem, state)
    choice = _cache.get(key)
    if choice is None and _trials and state.mode in (FindMode.FIND, FindMode.HYBRID):
        # Another problem a tried call meets, undecided (the forward of a backward
        # direction's graph): decided as the database mode would, measuring nothing and
        # caching nothing, so one find never starts another, and the problem, if the
        # user's calls meet it, is found then.
        return _decide_in_mode(
            problem, FindMode.DATABASE, state.forced, state.disabled, None, state.batch_invariant
        )
    if choice is None:
        # A device the cost table does not know is calibrated here, before selection,
        # so that estimating stays pure.
        calibrate.prepare(problem.device_type)
        choice = _decide_in_mode(
            problem, state.mode, state.forced, state.disabled, None, state.batch_invariant
        )
        with _lock:
            _cache[key] = choice
        level = logging.INFO if choice.solver == "vendor" else logging.DEBUG
        log.log(level, "%s [%s] -> %s", problem.key(), state.mode.value, choice)
    return choice


def decided(problem: ConvProblem) -> Choice | None:
    """The cached choice for ``problem`` in the current selection state, without deciding
    one (None where none is cached)."""
    return _cache.get((problem, selection_state()))


def database_key(problem: ConvProblem) -> str:
    """The find-database key of ``problem``: its own key, and for an fp32 problem on
    CUDA the math mode its convolutions run in (TF32 or full fp32), which changes the
    winner and so must not share a row; a forward found under gemmconv.batch_invariant()
    ends in "-invariant" (its winner is among the invariant solvers only)."""
    key = problem.key()
    if problem.dtype == torch.float32 and problem.device_type == "cuda":
        key = f"{key}-{'tf32' if convolutions_allow_tf32() else 'ieee'}"
    if problem.direction is Direction.FORWARD and invariance.batch_invariant_enabled():
        key = f"{key}-invariant"
    return key


def solver_for(problem: ConvProblem, solver: str | None = None) -> Solver:
    return get_solver(choose(problem, solver).solver)


# CPython keeps the environment as a dict of encoded names; reading it directly costs
# a tenth of os.environ.get, which matters on a path taken by every eager call.
_ENVIRON = getattr(os.environ, "_data", None)
_ENCODE = getattr(os.environ, "encodekey", None)
_SETTINGS = (
    "GEMMCONV_FIND_MODE",
    "GEMMCONV_SOLVER",
    "GEMMCONV_DISABLE",
    "CUBLAS_WORKSPACE_CONFIG",
    invariance.ENV,
)
if _ENVIRON is None or _ENCODE is None:
    _read_setting, _RAW_SETTINGS = os.environ.get, _SETTINGS
else:
    _read_setting, _RAW_SETTINGS = _ENVIRON.get, tuple(map(_ENCODE, _SETTINGS))
_FIND_MODE_RAW, _SOLVER_RAW, _DISABLE_RAW, _WORKSPACE_RAW, _INVARIANT_RAW = _RAW_SETTINGS
_cudnn_benchmark = torch._C._get_cudnn_benchmark
_cudnn_allow_tf32 = torch._C._get_cudnn_allow_tf32
_deterministic = torch._C._get_deterministic_algorithms


def selection_key() -> tuple:
    """Everything besides the problem that ``choose(problem)`` and the solvers decide
    from, read raw: the block and process modes, the cudnn benchmark and TF32 flags,
    the determinism flag, the batch-invariance switch (gemmconv.core.invariance: its
    block and process settings) and the environment settings
    (``$GEMMCONV_FIND_MODE``, ``$GEMMCONV_SOLVER``, ``$GEMMCONV_DISABLE``,
    ``$CUBLAS_WORKSPACE_CONFIG``, ``$GEMMCONV_BATCH_INVARIANT``) and the number of the
    trial find is making (``trial``), None outside one.

    Equal keys give equal choices for a problem until ``clear_cache()``, so a caller
    may memoise per (problem metadata, key) what it derives from a choice (see
    ``dependent_cache``). Nothing is parsed or validated here, which keeps it cheap:
    a bad setting is reported by ``choose`` on the first call that sees it, and a
    key that made ``choose`` raise is never memoised. One flat tuple of reads bound
    at import: every eager call builds it, and nesting and mapping cost 0.4 us of its
    0.6 on the CPU machine."""
    return (
        _block_mode,
        _process_mode,
        _cudnn_benchmark(),
        _cudnn_allow_tf32(),
        _deterministic(),
        _read_setting(_FIND_MODE_RAW),
        _read_setting(_SOLVER_RAW),
        _read_setting(_DISABLE_RAW),
        _read_setting(_WORKSPACE_RAW),
        invariance.setting,
        _read_setting(_INVARIANT_RAW),
        _trial_token,
    )


_SELECTION_KEY_LENGTH = len(selection_key())


# Memos of other modules built from choices; emptied with the choice cache.
_dependent_caches: list[dict] = []


def dependent_cache() -> dict:
    """A new dict that ``clear_cache()`` empties along with the choices themselves."""
    memo: dict = {}
    _dependent_caches.append(memo)
    return memo


def clear_cache() -> None:
    with _lock:
        _cache.clear()
        for memo in _dependent_caches:
            memo.clear()


def explain_problem(problem: ConvProblem) -> Explanation:
    """The choice in every direction, keyed by direction name (a dict whose repr is a
    table).

    Runs nothing in immediate and database modes; in find and hybrid modes a problem
    not yet decided is benchmarked, as the convolution itself would be."""
    explanation = Explanation({d.value: choose(problem.with_direction(d)) for d in DIRECTIONS})
    if invariance.batch_invariant_enabled():
        explanation.notes.append(invariance_note(explanation[Direction.FORWARD.value]))
    if problem.device_type != "cuda":
        explanation.on_cuda = estimate_on_cuda(problem)
        explanation.cuda_rates = cuda_rates().name
    return explanation


def invariance_note(forward: Choice) -> str:
    """The sentence explain() ends with under gemmconv.batch_invariant(): whether the
    forward's output is batch-invariant, and if not, why."""
    marker = "; NOT batch-invariant: "
    if marker in forward.reason:
        return (f"batch_invariant is on: the forward ({forward.solver}) is NOT batch-invariant: "
                f"{forward.reason.split(marker, 1)[1]}")  # fmt: skip
    return (f"batch_invariant is on: the forward ({forward.solver}) is batch-invariant: a "
            "sample's output is the same bits in any batch")  # fmt: skip


def estimate(problem: ConvProblem) -> Choice:
    """The choice immediate mode makes for ``problem`` in the current selection state
    (forced and disabled solvers included): what the cost model says, whatever the
    mode. Pure: reads no find database, measures nothing, caches nothing."""
    state = selection_state()
    return _decide_in_mode(
        problem, FindMode.IMMEDIATE, state.forced, state.disabled, None, state.batch_invariant
    )


def cuda_rates() -> DeviceRates:
    """The rates a CUDA problem is estimated with from any machine: this process's
    CUDA device's where it has one (the table's entry, or its calibration), else the
    table's nearest GPU entry. Pure: never calibrates."""
    if torch.cuda.is_available():
        return device_rates.rates_for("cuda")
    return device_rates.NEAREST_GPU


def estimate_on_cuda(problem: ConvProblem) -> dict[str, Choice]:
    """What the cost model picks for ``problem`` moved to CUDA, per direction (the
    solver ids of ``explain`` on a GPU, before any find): for a model on the CPU,
    what it would run on a GPU. Ignores GEMMCONV_SOLVER and GEMMCONV_DISABLE, which
    speak of the device this process runs on. Pure, as ``estimate``."""
    on_cuda = dataclasses.replace(problem, device_type="cuda")
    rates = cuda_rates()
    invariant = invariance.batch_invariant_enabled()
    return {
        d.value: _decide_in_mode(
            on_cuda.with_direction(d),
            FindMode.IMMEDIATE,
            None,
            frozenset(),
            rates,
            invariant,
            warn=False,
        )
        for d in DIRECTIONS
    }


# ---- agreeing across ranks ----------------------------------------------------


def sync_choices(group: torch.distributed.ProcessGroup | None = None) -> int:
    """Give every rank of ``group`` (default: the whole world) the same solver choices.

    A collective: call it where every rank of the group gets to, as any collective,
    e.g. after the first training step, never from code some ranks skip. No
    convolution calls it, nor anything else in gemmconv. Each rank contributes the
    choices it has made so far (one ``all_gather_object``; under NCCL the current
    CUDA device must be set, as torch requires). For each problem and selection
    state, the choice of the lowest group rank that made it is adopted by every rank,
    ranks that have not met the problem yet included: a shape only some ranks have
    seen (an uneven last batch) then runs the same solver when the others meet it.
    A choice whose solver does not apply on this rank (other hardware) is not
    adopted; the rank keeps its own, with a warning. The peak rates of a CUDA device
    the cost table does not know are measured on the group's first rank and shared
    likewise, so later estimates agree too.

    What holds under torch.distributed: immediate and database modes are
    rank-consistent with no communication (the database where every rank reads the
    same rows). Find and hybrid modes measure on each rank, so before this call ranks
    may run different solvers for one problem, each giving torch's results within the
    dtype's tolerance; after it, every problem decided before the call runs the same
    solver on every rank; a problem first met after it is decided on its own until the
    next call. Changing the selection state (mode, GEMMCONV_SOLVER or GEMMCONV_DISABLE,
    TF32, determinism) starts new choices, shared only among ranks with the same state.

    Returns how many choices this rank adopted. Without an initialised process group,
    or in a group of one rank, does nothing and returns 0."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    if group is not None and dist.get_rank(group) < 0:
        return 0  # not a member: the group's collective is not this process's
    size = dist.get_world_size(group)
    if size == 1:
        return 0
    if dist.get_rank(group) == 0:
        # Measured on one rank only, so every rank's later estimates use the same rates.
        calibrate.calibrate_unknown_device()
    with _lock:
        mine = list(_cache.items())
    gathered: list = [None] * size
    dist.all_gather_object(gathered, (mine, device_rates.calibrated()), group=group)
    # Every rank computes the same winners from the same gathered list.
    winners: dict[tuple[ConvProblem, SelectionState], tuple[int, Choice]] = {}
    rates: dict[int, DeviceRates] = {}
    for rank, (choices, calibrated) in enumerate(gathered):
        for key, choice in choices:
            winners.setdefault(key, (rank, choice))
        for index, entry in calibrated.items():
            rates.setdefault(index, entry)
    device_rates.adopt_calibrated(rates)
    me = dist.get_rank(group)
    adopted, changed = 0, False
    for key, (rank, theirs) in winners.items():
        if rank == me:
            continue
        with _lock:
            ours = _cache.get(key)
        if ours is not None and ours.solver == theirs.solver:
            continue
        problem, state = key
        reasons = get_solver(theirs.solver).not_supported_reasons(problem)
        if reasons:
            log.warning(
                "%s: rank %d chose %s, which does not apply on rank %d (%s); this rank "
                "keeps deciding on its own",
                problem.key(), rank, theirs.solver, me, ", ".join(reasons),
            )  # fmt: skip
            continue
        if not theirs.source.startswith("rank "):
            source = f"rank {rank if group is None else dist.get_global_rank(group, rank)}"
            theirs = dataclasses.replace(theirs, reason=f"{source}: {theirs.reason}", source=source)
        with _lock:
            _cache[key] = theirs
        adopted += 1
        changed = changed or ours is not None
        level = logging.INFO if theirs.solver == "vendor" else logging.DEBUG
        log.log(level, "%s [%s] -> %s", problem.key(), state.mode.value, theirs)
    if changed:
        # Eager calls and op plans memoise what they derived from the replaced choices.
        with _lock:
            for memo in _dependent_caches:
                memo.clear()
    return adopted


__all__ = [
    "Choice",
    "FindMode",
    "SelectionState",
    "SolverNotApplicable",
    "choose",
    "clear_cache",
    "current_find_mode",
    "database_key",
    "decide",
    "decided",
    "dependent_cache",
    "cuda_rates",
    "estimate",
    "estimate_on_cuda",
    "explain_problem",
    "find_mode",
    "selection_key",
    "selection_state",
    "set_find_mode",
    "resume_trial",
    "set_public_calls",
    "solver_for",
    "sync_choices",
    "trial",
    "trial_hits",
]
