"""Determinism: under torch.use_deterministic_algorithms(True) gemmconv runs only solvers
whose results are bitwise reproducible run to run, and two runs are bitwise equal; no
solver is chosen by timing, so two processes compute the same bits.

Each solver declares ``deterministic`` (False for split reductions with atomics) and
``uses_cublas`` (cuBLAS is reproducible only with CUBLAS_WORKSPACE_CONFIG=:4096:8 or
:16:8); the base class turns both into rejection reasons while the flag is on.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zlib

import pytest
import torch

import gemmconv
from gemmconv import ConvProblem, Direction, get_solver, solvers
from gemmconv.selection import dispatch
from gemmconv.solvers import SOLVERS
from gemmconv.solvers.base import cublas_is_reproducible
from gemmconv.solvers.patch import PatchSolver

from solver_cases import case_id, operands, problem_for, solver_matrix

DIRECTIONS = (Direction.FORWARD, Direction.BACKWARD_DATA, Direction.BACKWARD_WEIGHTS)


@pytest.fixture
def deterministic():
    """torch.use_deterministic_algorithms(True) for the test, then as it was."""
    was, warn_only = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    torch.use_deterministic_algorithms(True)
    dispatch.clear_cache()
    yield
    torch.use_deterministic_algorithms(was, warn_only=warn_only)
    dispatch.clear_cache()


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.shape == b.shape
        and a.stride() == b.stride()
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def _cases(device_type: str):
    """The solver matrix's cases on ``device_type`` that run natively there (fp32; bf16
    too on CUDA) and that its solver still takes under the flag."""
    dtypes = {torch.float32, torch.bfloat16} if device_type == "cuda" else {torch.float32}
    cases = []
    for case in solver_matrix(device_type, dtypes=dtypes):
        solver, _, geometry, dims, layout, dtype, direction = case
        p = problem_for(geometry, dims, layout, dtype, device_type, direction)
        if device_type in solver.devices and solver.is_applicable(p):
            cases.append(case)
    return cases


def _run_twice_bitwise_equal(case, device_type: str) -> None:
    solver, _, geometry, dims, layout, dtype, direction = case
    problem = problem_for(geometry, dims, layout, dtype, device_type, direction)
    assert solver.not_supported_reasons(problem) == [], "refused under the flag"
    seed = zlib.crc32(case_id(case).encode())
    # Fresh operands (fresh allocations, so alignment may differ) with the same values.
    first = solver.run(problem, operands(problem, device_type, seed))
    second = solver.run(problem, operands(problem, device_type, seed))
    assert _bitwise_equal(first, second), f"{case_id(case)}: two runs differ"


CPU_CASES = _cases("cpu")


@pytest.mark.parametrize("case", CPU_CASES, ids=[case_id(c) for c in CPU_CASES])
def test_every_cpu_solver_is_bitwise_reproducible(case, deterministic):
    _run_twice_bitwise_equal(case, "cpu")


@pytest.mark.gpu
def test_every_cuda_solver_is_bitwise_reproducible(deterministic, monkeypatch):
    # torch refuses cuBLAS under the flag without this; set it before CUDA starts (the
    # GPU command exports it) for cuBLAS to honour it for its own handles as well.
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    dispatch.clear_cache()
    cases = _cases("cuda")
    assert {c[0].id for c in cases} == {s.id for s in SOLVERS if "cuda" in s.devices}
    for case in cases:
        _run_twice_bitwise_equal(case, "cuda")


@pytest.mark.parametrize("dims", (1, 2, 3))
@pytest.mark.parametrize("layout", ("cf", "cl"))
@pytest.mark.parametrize(
    "kind, kernel, stride, padding",
    [("patch", 4, 4, 0), ("pointwise", 1, 1, 0), ("strided", 1, 2, 0), ("general", 3, 1, 1)],
)
def test_conv_and_its_gradients_are_bitwise_reproducible(
    kind, kernel, stride, padding, layout, dims, deterministic
):
    conv = {1: gemmconv.conv1d, 2: gemmconv.conv2d, 3: gemmconv.conv3d}[dims]
    gen = torch.Generator().manual_seed(zlib.crc32(f"{kind}{layout}{dims}".encode()))
    x = torch.rand(3, 5, *(8,) * dims, generator=gen) * 2 - 1
    if layout == "cl":
        x = x.movedim(1, -1).contiguous().movedim(-1, 1)
    w = torch.rand(6, 5, *(kernel,) * dims, generator=gen) * 2 - 1
    b = torch.rand(6, generator=gen) * 2 - 1
    runs = []
    for _ in range(2):
        dispatch.clear_cache()
        leaves = [t.clone().requires_grad_(True) for t in (x, w, b)]
        y = conv(*leaves, stride=stride, padding=padding)
        y.backward(torch.rand(y.shape, generator=torch.Generator().manual_seed(3)) - 0.5)
        runs.append([y.detach(), *(t.grad for t in leaves)])
    for name, first, second in zip(("y", "dx", "dw", "db"), *runs, strict=True):
        assert _bitwise_equal(first, second), name


# ---- the declared capability and its rules ---------------------------------------


class _NondeterministicPatch(PatchSolver):
    """A stand-in for a split-reduction solver with atomics, cheaper than all others."""

    id = "nondeterministic_patch"
    deterministic = False

    def estimate_ms(self, problem, rates=None) -> float:
        return 0.0


@pytest.fixture
def nondeterministic(monkeypatch):
    solver = _NondeterministicPatch()
    monkeypatch.setattr(dispatch, "SOLVERS", (solver, *dispatch.SOLVERS))
    monkeypatch.setitem(solvers._BY_ID, solver.id, solver)
    return solver


def _patch_problem(device_type: str = "cpu") -> ConvProblem:
    return ConvProblem.from_sizes(2, 3, 4, (8, 8), 4, stride=4, device_type=device_type)


def test_every_solver_declares_whether_it_is_deterministic():
    for solver in SOLVERS:
        assert isinstance(solver.deterministic, bool), solver.id
        assert isinstance(solver.uses_cublas, bool), solver.id


def test_a_nondeterministic_solver_is_refused_only_under_the_flag(nondeterministic):
    problem = _patch_problem()
    assert nondeterministic.not_supported_reasons(problem) == []
    assert dispatch.choose(problem).solver == nondeterministic.id
    torch.use_deterministic_algorithms(True)
    try:
        reasons = nondeterministic.not_supported_reasons(problem)
        assert reasons and "use_deterministic_algorithms" in reasons[0]
        # The cached choice made without the flag is not reused under it.
        choice = dispatch.choose(problem)
        assert choice.solver != nondeterministic.id
        assert "not bitwise reproducible" in choice.rejected[nondeterministic.id][0]
        with pytest.raises(dispatch.SolverNotApplicable, match="not bitwise reproducible"):
            dispatch.choose(problem, solver=nondeterministic.id)
    finally:
        torch.use_deterministic_algorithms(False)
    assert dispatch.choose(problem).solver == nondeterministic.id


@pytest.mark.parametrize("mode", ["find", "hybrid"])
def test_under_the_flag_find_measures_and_stores_nothing(mode, deterministic):
    """Timing noise must not choose: the estimate decides, and says why."""
    from gemmconv.selection import finddb

    problem = _patch_problem()
    with gemmconv.find_mode(mode):
        choice = dispatch.choose(problem)
    assert choice.source == "estimate" and choice.times_ms == {}
    assert choice.solver == dispatch.decide(problem).solver
    assert "not timed: torch.use_deterministic_algorithms is on" in choice.reason
    assert finddb.get_db().lookup(problem.key(), finddb.identity_for("cpu")) is None


@pytest.mark.parametrize("mode", ["find", "hybrid"])
def test_under_the_flag_find_uses_a_stored_result(mode, deterministic):
    from gemmconv.selection import finddb

    problem = _patch_problem()
    identity = finddb.identity_for("cpu")
    finddb.get_db().store(finddb.Record(problem.key(), identity, "im2col", {}, 2.0, 0))
    with gemmconv.find_mode(mode):
        choice = dispatch.choose(problem)
    assert (choice.solver, choice.source) == ("im2col", "database")
    assert "not timed" in choice.reason


def test_under_the_flag_a_stored_solver_refused_by_it_is_not_used(nondeterministic, deterministic):
    from gemmconv.selection import finddb

    problem = _patch_problem()
    identity = finddb.identity_for("cpu")
    finddb.get_db().store(finddb.Record(problem.key(), identity, nondeterministic.id, {}, 0.1, 0))
    with gemmconv.find_mode("find"):
        choice = dispatch.choose(problem)
    assert choice.solver != nondeterministic.id and choice.source == "estimate"


# ---- two processes ----------------------------------------------------------------

# Each child: a fresh, empty find database, find mode, the flag on; every problem's
# forward and gradients on seeded operands, saved for the parent to compare.
_CHILD = """
import sys, torch, gemmconv
torch.use_deterministic_algorithms(True)
gemmconv.set_find_mode("find")
problems = {problems!r}
results = []
for i, (dims, c, k, size, kernel, stride, padding, channels_last) in enumerate(problems):
    gen = torch.Generator().manual_seed(1000 + i)
    x = torch.rand(2, c, *(size,) * dims, generator=gen) * 2 - 1
    if channels_last:
        x = x.movedim(1, -1).contiguous().movedim(-1, 1)
    w = torch.rand(k, c, *(kernel,) * dims, generator=gen) * 2 - 1
    b = torch.rand(k, generator=gen) * 2 - 1
    leaves = [t.requires_grad_(True) for t in (x, w, b)]
    conv = (gemmconv.conv1d, gemmconv.conv2d, gemmconv.conv3d)[dims - 1]
    y = conv(*leaves, stride=stride, padding=padding)
    y.backward(torch.rand(y.shape, generator=gen) * 2 - 1)
    results.append([y.detach(), *(t.grad for t in leaves)])
torch.save(results, sys.argv[1])
"""

# Problems where several solvers apply with close times and different summation
# orders: without the rule, timing noise alone picks which one runs.
TWO_PROCESS_PROBLEMS = [
    (dims, c, k, size, kernel, stride, padding, channels_last)
    for dims, size in ((1, 24), (2, 8), (3, 4))
    for c, k in ((24, 16),)
    for kernel, stride, padding in ((2, 2, 0), (1, 1, 0), (1, 2, 0), (3, 1, 1))
    for channels_last in (False, True)
    if not (dims == 1 and channels_last)
]


def test_two_processes_in_find_mode_compute_the_same_bits(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    code = _CHILD.format(problems=TWO_PROCESS_PROBLEMS)
    children = []
    for name in ("first", "second"):
        env_child = {**env, "GEMMCONV_DB": str(tmp_path / f"{name}.sqlite")}
        out = tmp_path / f"{name}.pt"
        command = [sys.executable, "-c", code, str(out)]
        children.append((out, subprocess.Popen(command, env=env_child, stderr=subprocess.PIPE)))
    for _, child in children:
        _, err = child.communicate(timeout=300)
        assert child.returncode == 0, err.decode()
    first, second = (torch.load(out) for out, _ in children)
    differ = [
        (problem, name)
        for problem, a, b in zip(TWO_PROCESS_PROBLEMS, first, second, strict=True)
        for name, x, y in zip(("y", "dx", "dw", "db"), a, b, strict=True)
        if not _bitwise_equal(x, y)
    ]
    assert not differ, f"{len(differ)} results differ between the processes: {differ[:5]}"


@pytest.mark.parametrize("config", ["", ":0:0", ":4096:8", ":16:8"])
def test_cublas_solvers_need_a_reproducible_workspace_config(config, monkeypatch, deterministic):
    """Decided on descriptors: no GPU needed. Without a reproducible config torch itself
    would refuse the GEMM; gemmconv routes the problem to cuDNN instead."""
    if config:
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", config)
    else:
        monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    reproducible = config in (":4096:8", ":16:8") or bool(torch.version.hip)
    assert cublas_is_reproducible() == reproducible
    problem = _patch_problem("cuda")
    for solver in SOLVERS:
        reasons = solver.determinism_reasons(problem)
        refused = any("CUBLAS_WORKSPACE_CONFIG" in r for r in reasons)
        assert refused == (solver.uses_cublas and not reproducible), (solver.id, reasons)
    for solver_id in ("vendor", "patch_implicit"):
        if solver_id in solvers._BY_ID:
            assert get_solver(solver_id).determinism_reasons(problem) == []


def test_without_the_flag_nothing_is_refused_for_determinism(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert not torch.are_deterministic_algorithms_enabled()
    for solver in SOLVERS:
        assert solver.determinism_reasons(_patch_problem("cuda")) == []
