"""Faults in the find path never stop a convolution, and never poison the database.

- A solver that raises, runs out of memory, leaves its output unwritten or (with
  GEMMCONV_FIND_VERIFY=1) returns a wrong result during find is skipped, logged and
  never stored; the convolution still gives torch's answer.
- A find database that is corrupt, locked past its timeout, on a read-only path, from
  another gemmconv version or schema, another application's sqlite file, or holding
  a bad row, degrades (a warning, a miss) and the convolution still gives torch's
  answer; a file that is not gemmconv's, or of another schema, is never written, and
  a read-only one is still read.
- Eight processes selecting and writing at once for STRESS_SECONDS all finish, and
  the file opens afterwards with every row each of them wrote, whole.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sqlite3
import time
import warnings

import pytest
import torch
import torch.nn.functional as F

import gemmconv
from gemmconv import solvers
from gemmconv.core.problem import DIRECTIONS, ConvProblem
from gemmconv.selection import dispatch, finddb
from gemmconv.selection.finddb import FindDb, FindDbWarning, Record
from gemmconv.solvers.base import Solver
from gemmconv.solvers.patch import PatchSolver

from conftest import find_db_warnings

# How long the stress test runs; CI uses the default.
STRESS_SECONDS = float(os.environ.get("GEMMCONV_STRESS_SECONDS", "20"))
STRESS_PROCESSES = 8


# ---- a convolution that exercises every direction ----------------------------------


def _conv_matches_torch(seed: int = 0) -> None:
    """A patch-embedding convolution and its gradients through gemmconv equal torch's."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(3, 3, 8, 8, generator=gen, dtype=torch.float64) * 2 - 1
    w = torch.rand(5, 3, 4, 4, generator=gen, dtype=torch.float64) * 2 - 1
    b = torch.rand(5, generator=gen, dtype=torch.float64) * 2 - 1
    dy = torch.rand(3, 5, 2, 2, generator=gen, dtype=torch.float64) * 2 - 1
    results = []
    for conv in (gemmconv.conv2d, F.conv2d):
        leaves = [t.clone().requires_grad_(True) for t in (x, w, b)]
        y = conv(*leaves, stride=4)
        y.backward(dy)
        results.append([y.detach(), *(t.grad for t in leaves)])
    for name, ours, theirs in zip(("y", "dx", "dw", "db"), *results, strict=True):
        torch.testing.assert_close(ours, theirs, msg=name)


def _patch_problems() -> list[ConvProblem]:
    """The three directions of the convolution in _conv_matches_torch."""
    return [
        ConvProblem.from_sizes(
            3, 3, 5, (8, 8), 4, stride=4, dtype=torch.float64, direction=d, has_bias=(i == 0)
        )
        for i, d in enumerate(DIRECTIONS)
    ]


def _stored_solvers(path: str | None = None) -> dict[str, str]:
    db = FindDb(path or os.environ["GEMMCONV_DB"])
    return {r.problem: r.solver for r in db.records()}


# ---- faulty solvers, registered only inside a test ----------------------------------


def _faulty_solver(fault: str) -> PatchSolver:
    """A patch solver (so it applies wherever patch does) that fails in one way, in
    every direction, and claims to cost nothing so nothing outranks it but a fault."""

    def failing(self, p, t, out):
        if fault == "raises":
            raise RuntimeError("simulated kernel failure")
        if fault == "cuda_out_of_memory":
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        if fault == "out_of_memory":
            raise torch.OutOfMemoryError("out of memory (simulated)")
        result = PatchSolver.run(PatchSolver(), p, t, out)
        if fault == "wrong":
            return result.mul_(1.5)  # right shape, finite, wrong
        if fault == "unwritten":
            return result.fill_(float("nan"))  # as if the kernel never stored its tile
        raise AssertionError(fault)

    cls = type(
        f"Faulty_{fault}",
        (PatchSolver,),
        {
            "id": f"faulty_{fault}",
            "run": failing,
            # Prepared runs would bypass the failing run: calls must run it too.
            "prepare": Solver.prepare,
            "estimate_ms": lambda self, problem, rates=None: 0.0,
        },
    )
    return cls()


@pytest.fixture
def register(monkeypatch):
    """register(solver) puts ``solver`` first in the registry for this test only."""

    def add(solver) -> None:
        monkeypatch.setattr(dispatch, "SOLVERS", (solver, *dispatch.SOLVERS))
        monkeypatch.setattr(solvers, "SOLVERS", (solver, *solvers.SOLVERS))
        monkeypatch.setitem(solvers._BY_ID, solver.id, solver)

    return add


@pytest.mark.parametrize("fault", ["raises", "cuda_out_of_memory", "out_of_memory"])
def test_a_failing_solver_is_skipped_logged_and_never_stored(fault, register, caplog):
    faulty = _faulty_solver(fault)
    register(faulty)
    with caplog.at_level(logging.WARNING, "gemmconv.dispatch"), gemmconv.find_mode("find"):
        _conv_matches_torch()
    skipped = [r for r in caplog.records if f"{faulty.id} skipped" in r.getMessage()]
    assert len(skipped) == 3, caplog.text  # once per direction
    stored = _stored_solvers()
    assert set(stored) == {p.key() for p in _patch_problems()}, stored
    assert faulty.id not in stored.values()


def test_a_wrong_result_is_dropped_when_find_verifies(register, monkeypatch, caplog):
    faulty = _faulty_solver("wrong")
    register(faulty)
    monkeypatch.setenv("GEMMCONV_FIND_VERIFY", "1")
    with caplog.at_level(logging.WARNING, "gemmconv.dispatch"), gemmconv.find_mode("find"):
        _conv_matches_torch()
    assert caplog.text.count(f"{faulty.id} dropped") == 3, caplog.text
    assert faulty.id not in _stored_solvers().values()


def test_an_unwritten_result_is_dropped_even_without_verification(register, caplog):
    """NaN left in the result on finite inputs is a fault find checks for always
    (it costs one pass): such a solver can be fast, and must not win."""
    faulty = _faulty_solver("unwritten")
    register(faulty)
    with caplog.at_level(logging.WARNING, "gemmconv.dispatch"), gemmconv.find_mode("find"):
        _conv_matches_torch()
    assert caplog.text.count(f"{faulty.id} skipped") == 3, caplog.text
    assert faulty.id not in _stored_solvers().values()


def test_a_stored_solver_that_no_longer_exists_is_ignored():
    identity = finddb.identity_for("cpu")
    db = finddb.get_db()
    for p in _patch_problems():
        db.store(Record(p.key(), identity, "solver_from_the_future", {}, 0.001, 0))
    with gemmconv.find_mode("database"):
        _conv_matches_torch()


# ---- a database that cannot be used ------------------------------------------------


@pytest.mark.parametrize("mode", ["database", "hybrid"])
def test_a_corrupt_file_is_moved_aside_and_the_convolution_runs(mode, tmp_path):
    path = tmp_path / "find.sqlite"
    path.write_bytes(b"this is not a sqlite database\n" * 64)
    with pytest.warns(FindDbWarning, match="unreadable"), gemmconv.find_mode(mode):
        _conv_matches_torch()
    assert list(tmp_path.glob("find.sqlite.corrupt-*")), "the bad file was not kept aside"
    if mode == "hybrid":
        assert set(_stored_solvers()) == {p.key() for p in _patch_problems()}


def test_a_file_truncated_mid_page_is_recovered(tmp_path):
    path = tmp_path / "find.sqlite"
    db = FindDb(path)
    for i in range(200):
        db.store(Record(f"filler-{i}", finddb.identity_for("cpu"), "vendor", {}, 1.0, 0))
    db.close()
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2 + 100])  # a torn copy: header fine, pages gone
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FindDbWarning)
        with gemmconv.find_mode("hybrid"):
            _conv_matches_torch()


@pytest.fixture
def short_busy_timeout(monkeypatch):
    monkeypatch.setattr(finddb, "BUSY_TIMEOUT_MS", 200)


def _database_with_rows(path) -> None:
    db = FindDb(path)
    db.store(Record("unrelated", finddb.identity_for("cpu"), "vendor", {}, 1.0, 0))
    db.close()


def _hold_lock(path, kind: str) -> sqlite3.Connection:
    """Another process's connection holding ``kind`` of lock on ``path`` until closed."""
    holder = sqlite3.connect(path, isolation_level=None)
    if kind == "exclusive":
        # No readers either: sqlite's exclusive locking mode, with a write in flight.
        holder.execute("PRAGMA locking_mode = EXCLUSIVE")
        holder.execute("BEGIN EXCLUSIVE")
        holder.execute("INSERT OR REPLACE INTO meta VALUES ('held', '1')")
    else:
        holder.execute("BEGIN IMMEDIATE")  # the write lock; WAL readers carry on
    return holder


# An exclusive lock cannot be taken while this process has the WAL file open, so that
# one is taken before gemmconv opens the database.
@pytest.mark.parametrize(
    "kind, when",
    [("write", "before_opening"), ("write", "after_opening"), ("exclusive", "before_opening")],
)
def test_a_database_locked_past_the_timeout(kind, when, tmp_path, short_busy_timeout):
    """Another process holds a lock throughout: lookups and stores that time out are a
    miss and a dropped result (or the process falls back to memory), and the
    convolution runs, without waiting much beyond the busy timeout."""
    path = tmp_path / "find.sqlite"
    _database_with_rows(path)
    if when == "after_opening":
        assert finddb.get_db().lookup("unrelated", finddb.identity_for("cpu")) is not None
    holder = _hold_lock(path, kind)
    try:
        started = time.monotonic()
        with warnings.catch_warnings(record=True), gemmconv.find_mode("hybrid"):
            warnings.simplefilter("always")
            _conv_matches_torch()
        assert time.monotonic() - started < 30, "waited far past the busy timeout"
    finally:
        holder.rollback()
        holder.close()


@pytest.mark.parametrize("where", ["unwritable_directory", "a_directory"])
def test_a_path_that_cannot_hold_a_database_degrades_to_memory(where, tmp_path, monkeypatch):
    # /proc refuses new directories even to root, so this works in any CI container.
    path = "/proc/gemmconv-test/find.sqlite" if where == "unwritable_directory" else tmp_path
    monkeypatch.setenv("GEMMCONV_DB", str(path))
    finddb.reset_db()
    with pytest.warns(FindDbWarning, match="in-memory"), gemmconv.find_mode("hybrid"):
        _conv_matches_torch()
    assert finddb.get_db().in_memory


def test_a_read_only_database_is_used_and_never_written(tmp_path, monkeypatch):
    """A file sqlite may read but not write (a shared, read-only cache): simulated with
    sqlite's own read-only open, since root ignores file permissions (test_finddb has
    real file modes). Its rows decide, nothing is stored, one warning."""
    path = tmp_path / "find.sqlite"
    forward = _patch_problems()[0]
    db = FindDb(path)
    db.store(Record(forward.key(), finddb.identity_for("cpu"), "im2col", {}, 1.0, 0))
    db.close()
    before = path.read_bytes()
    real_connect = sqlite3.connect

    def read_only(database, *args, **kwargs):
        if str(database) == str(path):
            database, kwargs["uri"] = f"file:{path}?mode=ro", True
        return real_connect(database, *args, **kwargs)

    monkeypatch.setattr(finddb.sqlite3, "connect", read_only)
    finddb.reset_db()
    with warnings.catch_warnings(record=True) as seen, gemmconv.find_mode("hybrid"):
        warnings.simplefilter("always")
        _conv_matches_torch()
        assert dispatch.choose(forward).source == "database"
        assert dispatch.choose(forward).solver == "im2col"
    found = [str(w.message) for w in seen if issubclass(w.category, FindDbWarning)]
    assert len(found) == 1 and "read-only" in found[0], found
    assert path.read_bytes() == before
    assert [r.problem for r in FindDb(path).records()] == [forward.key()]


def test_rows_of_another_gemmconv_version_are_ignored():
    """A database written by another release, naming a solver that would fail here:
    never consulted, and this release's results are stored beside it."""
    here = finddb.identity_for("cpu")
    other = finddb.Identity(here.device, here.capability, here.torch_version, "0.0.1")
    db = finddb.get_db()
    for p in _patch_problems():
        db.store(Record(p.key(), other, "solver_from_the_past", {}, 0.001, 0))
    with gemmconv.find_mode("hybrid"):
        _conv_matches_torch()
    records = FindDb(os.environ["GEMMCONV_DB"]).records()
    assert {r.identity.gemmconv_version for r in records} == {"0.0.1", here.gemmconv_version}
    assert all(r.solver != "solver_from_the_past" for r in records if r.identity == here)


NOT_OURS = {
    "newer_schema": (
        [
            "CREATE TABLE meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)",
            f"INSERT INTO meta VALUES ('{finddb.MARKER[0]}', '{finddb.MARKER[1]}')",
            "INSERT INTO meta VALUES ('schema', '999')",
        ],
        "schema version '999'",
    ),
    "another_application": (
        [
            "CREATE TABLE bookmarks (url TEXT, title TEXT)",
            "INSERT INTO bookmarks VALUES ('https://pytorch.org', 'PyTorch')",
        ],
        "not a gemmconv find database",
    ),
}


@pytest.mark.parametrize("kind", sorted(NOT_OURS))
def test_a_file_that_is_not_a_database_of_this_release_is_left_untouched(kind, tmp_path):
    """Neither read, nor written, nor moved aside: one warning, and the convolution runs."""
    statements, message = NOT_OURS[kind]
    path = tmp_path / "find.sqlite"
    conn = sqlite3.connect(path)
    for statement in statements:
        conn.execute(statement)
    conn.commit()
    conn.close()
    before = path.read_bytes()
    with pytest.warns(FindDbWarning, match=message) as caught, gemmconv.find_mode("hybrid"):
        _conv_matches_torch()
    assert find_db_warnings(caught) == 1, [str(w.message) for w in caught]
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["find.sqlite"]


@pytest.mark.parametrize(
    "column, value", [("time_ms", "fast"), ("config", "{not json"), ("workspace_bytes", -1)]
)
def test_a_row_that_does_not_parse_is_a_miss_with_one_warning(column, value):
    """Rows written by hand, or by a broken tool, for every direction of the problem."""
    identity = finddb.identity_for("cpu")
    db = finddb.get_db()
    db.store(Record("unrelated", identity, "vendor", {}, 1.0, 0))
    conn = sqlite3.connect(os.environ["GEMMCONV_DB"])
    for p in _patch_problems():
        row = {"solver": "im2col", "config": "{}", "time_ms": 0.1, "workspace_bytes": 0}
        row[column] = value
        conn.execute(
            "INSERT OR REPLACE INTO find VALUES (?,?,?,?,?,?,?,?,?,?)",
            (p.key(), *identity.values(), *row.values(), time.time()),
        )
    conn.commit()
    conn.close()
    with warnings.catch_warnings(record=True) as seen, gemmconv.find_mode("database"):
        warnings.simplefilter("always")
        _conv_matches_torch()
        for p in _patch_problems():
            assert dispatch.choose(p).source == "estimate"
    found = [str(w.message) for w in seen if issubclass(w.category, FindDbWarning)]
    assert len(found) == 3 and all("does not parse" in m for m in found), found


# ---- eight processes at once ---------------------------------------------------------

SHARED_KEYS = 5


def _stress_worker(path: str, worker: int, seconds: float, barrier, report: str) -> None:
    """Select (hybrid dispatch: lookups, finds, stores) and write (own and shared rows),
    interleaved, for ``seconds``; then report how many own rows were written."""
    os.environ["GEMMCONV_DB"] = path
    warnings.simplefilter("error", FindDbWarning)  # degrading would lose rows: fail instead
    from gemmconv.selection import dispatch, finddb
    from gemmconv.selection.finddb import Record

    dispatch.set_find_mode("hybrid")
    # A lookup or store the database refused would be logged and skipped: count them.
    refused = _WarningCount()
    logging.getLogger("gemmconv.dispatch").addHandler(refused)
    identity = finddb.identity_for("cpu")
    db = finddb.get_db()
    problems = [
        ConvProblem.from_sizes(2, 3, 4, (4 * s, 4), 4, stride=4, direction=d)
        for s in (1, 2, 3)
        for d in DIRECTIONS
    ]
    barrier.wait(timeout=120)
    deadline = time.monotonic() + seconds
    written = 0
    while time.monotonic() < deadline:
        dispatch.clear_cache()  # so each select goes to the database again
        choice = dispatch.choose(problems[written % len(problems)])
        assert choice.solver in solvers._BY_ID
        key = f"stress-w{worker}-{written}"
        db.store(Record(key, identity, "vendor", _payload(worker, written), written, worker))
        assert db.lookup(key, identity) is not None
        shared = f"stress-shared-{written % SHARED_KEYS}"
        db.store(Record(shared, identity, "patch", _payload(worker, written), written, worker))
        written += 1
    assert refused.count == 0, f"worker {worker}: {refused.count} database calls refused"
    with open(report, "w") as f:
        f.write(str(written))


class _WarningCount(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1


def _payload(worker: int, i: int) -> dict:
    # Redundant on purpose: a torn row would not agree with itself.
    return {"worker": worker, "i": i, "check": f"{worker}:{i}:{worker * 7919 + i}"}


def _row_is_whole(record: Record) -> bool:
    c = record.config
    if set(c) != {"worker", "i", "check"}:
        return False
    return (
        c == _payload(c["worker"], c["i"])
        and record.time_ms == c["i"]
        and record.workspace_bytes == c["worker"]
    )


def test_eight_processes_selecting_and_writing_at_once(tmp_path):
    path = str(tmp_path / "find.sqlite")
    # A fork server imports torch and gemmconv once, before any thread starts, and
    # forks every worker from that clean state (spawn would import torch 8 times).
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "gemmconv", "test_faults"])
    barrier = ctx.Barrier(STRESS_PROCESSES)
    reports = [str(tmp_path / f"worker-{w}.count") for w in range(STRESS_PROCESSES)]
    procs = [
        ctx.Process(target=_stress_worker, args=(path, w, STRESS_SECONDS, barrier, reports[w]))
        for w in range(STRESS_PROCESSES)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=STRESS_SECONDS + 180)
    assert [p.exitcode for p in procs] == [0] * STRESS_PROCESSES, "a process failed or hung"

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the shared file must open cleanly
        records = {r.problem: r for r in FindDb(path).records()}
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    conn.close()
    counts = [int(open(report).read()) for report in reports]
    print(f"rows written per process in {STRESS_SECONDS} s: {counts}")
    for w, written in enumerate(counts):
        assert written > 0, f"worker {w} wrote nothing in {STRESS_SECONDS} s"
        for i in range(written):
            record = records.get(f"stress-w{w}-{i}")
            assert record is not None, f"row {i} of worker {w} was lost"
            assert _row_is_whole(record) and record.config["worker"] == w, record
    for k in range(SHARED_KEYS):
        assert _row_is_whole(records[f"stress-shared-{k}"]), records[f"stress-shared-{k}"]
    selected = [r for r in records.values() if not r.problem.startswith("stress-")]
    assert len(selected) == 9, sorted(records)  # one find result per problem
    assert all(r.solver in solvers._BY_ID for r in selected)
