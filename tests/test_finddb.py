"""The find database: hits, misses, identity isolation, recovery, degradation, concurrency."""

from __future__ import annotations

import json
import multiprocessing
import sqlite3
import warnings

import pytest

from gemmconv import finddb
from gemmconv.finddb import FindDb, FindDbWarning, Identity, Record

HERE = Identity("NVIDIA H200", "9.0", "2.11.0", "0.1.0")
OTHER_DEVICE = Identity("NVIDIA A100-SXM4-80GB", "8.0", "2.11.0", "0.1.0")
OTHER_RELEASE = Identity("NVIDIA H200", "9.0", "2.11.0", "0.0.9")


def _record(problem: str, identity: Identity = HERE, solver: str = "patch", ms: float = 0.5):
    return Record(problem, identity, solver, {"pad_to": 16}, ms, 4096)


def test_hit_returns_what_was_stored(tmp_path):
    db = FindDb(tmp_path / "find.sqlite")
    db.store(_record("2d-a", ms=0.25))
    hit = db.lookup("2d-a", HERE)
    assert hit == _record("2d-a", ms=0.25)
    # A second handle on the same file (another process's view) sees it too.
    assert FindDb(tmp_path / "find.sqlite").lookup("2d-a", HERE) == hit


def test_miss_is_none(tmp_path):
    db = FindDb(tmp_path / "find.sqlite")
    db.store(_record("2d-a"))
    assert db.lookup("2d-b", HERE) is None


def test_rows_of_another_device_or_release_are_ignored(tmp_path):
    db = FindDb(tmp_path / "find.sqlite")
    db.store(_record("2d-a", OTHER_DEVICE, solver="vendor"))
    db.store(_record("2d-a", OTHER_RELEASE, solver="im2col"))
    assert db.lookup("2d-a", HERE) is None
    db.store(_record("2d-a", HERE, solver="patch"))
    assert db.lookup("2d-a", HERE).solver == "patch"
    assert db.lookup("2d-a", OTHER_DEVICE).solver == "vendor"
    assert [r.solver for r in db.records(HERE)] == ["patch"]
    assert len(db.records()) == 3


def test_store_replaces_the_previous_result(tmp_path):
    db = FindDb(tmp_path / "find.sqlite")
    db.store(_record("2d-a", solver="im2col", ms=2.0))
    db.store(_record("2d-a", solver="patch", ms=1.0))
    assert db.lookup("2d-a", HERE).solver == "patch"
    assert len(db.records()) == 1


def test_file_runs_in_wal_mode(tmp_path):
    path = tmp_path / "find.sqlite"
    FindDb(path).store(_record("2d-a"))
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_corrupt_file_is_moved_aside_with_one_warning_and_rebuilt(tmp_path):
    path = tmp_path / "find.sqlite"
    garbage = b"this is not an sqlite database\x00" * 200
    path.write_bytes(garbage)
    db = FindDb(path)
    with pytest.warns(FindDbWarning, match="unreadable") as caught:
        assert db.lookup("2d-a", HERE) is None
        db.store(_record("2d-a"))
        assert db.lookup("2d-a", HERE).solver == "patch"
    assert len(caught) == 1
    aside = list(tmp_path.glob("find.sqlite.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_bytes() == garbage
    assert not db.in_memory
    assert FindDb(path).lookup("2d-a", HERE).solver == "patch"  # the rebuilt file persists


def test_unwritable_location_degrades_to_memory_with_one_warning(tmp_path):
    # Tests run as root, which ignores permission bits; a path below a regular file
    # is a location no user can create, so it stands in for a read-only directory.
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    db = FindDb(blocker / "gemmconv" / "find.sqlite")
    with pytest.warns(FindDbWarning, match="in-memory") as caught:
        db.store(_record("2d-a"))
        assert db.lookup("2d-a", HERE).solver == "patch"
        db.store(_record("2d-b"))
    assert len(caught) == 1
    assert db.in_memory


def test_file_refusing_writes_degrades_to_memory(tmp_path, monkeypatch):
    # Root can write any file, so the read-only refusal sqlite would give an ordinary
    # user is simulated: the file opens, but every write fails as it would then.
    path = tmp_path / "find.sqlite"
    FindDb(path).store(_record("2d-a"))
    db = FindDb(path)
    assert db.lookup("2d-a", HERE).solver == "patch"
    real_connection = db._connection

    class ReadOnlyConnection:
        def __init__(self, conn):
            self._conn = conn

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def execute(self, sql, *args):
            if sql.lstrip().upper().startswith(("INSERT", "DELETE")):
                raise sqlite3.OperationalError("attempt to write a readonly database")
            return self._conn.execute(sql, *args)

        executemany = execute

        def close(self):
            self._conn.close()

    monkeypatch.setattr(db, "_connection", lambda: ReadOnlyConnection(real_connection()))
    with pytest.warns(FindDbWarning, match="read-only") as caught:
        db.store(_record("2d-b"))
    assert len(caught) == 1 and db.in_memory
    assert db.lookup("2d-b", HERE).solver == "patch"


def test_export_and_import_round_trip(tmp_path):
    src = FindDb(tmp_path / "a.sqlite")
    src.store(_record("2d-a"))
    src.store(_record("2d-b", OTHER_DEVICE, solver="vendor"))
    out = tmp_path / "dump.json"
    assert src.export_json(out) == 2
    assert len(json.loads(out.read_text())["records"]) == 2
    dst = FindDb(tmp_path / "b.sqlite")
    assert dst.import_json(out) == 2
    assert dst.records() == src.records()


def test_import_of_a_bad_file_names_it(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json"):
        FindDb(tmp_path / "x.sqlite").import_json(bad)
    bad.write_text(json.dumps({"records": [{"problem": "p"}]}))
    with pytest.raises(ValueError, match="missing or bad field"):
        FindDb(tmp_path / "x.sqlite").import_json(bad)


def test_clear_removes_results_and_rates(tmp_path):
    db = FindDb(tmp_path / "find.sqlite")
    db.store(_record("2d-a"))
    db.store_rates(HERE, {"bandwidth_gbs": 1.0})
    assert db.clear() == 1
    assert db.records() == [] and db.lookup_rates(HERE) is None


def test_default_path_follows_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("GEMMCONV_DB", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert finddb.default_path() == tmp_path / "cache" / "gemmconv" / "find.sqlite"
    monkeypatch.setenv("GEMMCONV_DB", str(tmp_path / "mine.sqlite"))
    assert finddb.default_path() == tmp_path / "mine.sqlite"
    finddb.reset_db()
    assert finddb.get_db().requested_path == str(tmp_path / "mine.sqlite")
    finddb.reset_db()


def _write_many(path: str, worker: int, count: int) -> None:
    db = FindDb(path)
    for i in range(count):
        db.store(_record(f"2d-w{worker}-p{i}", ms=float(i)))
        # Interleave reads with the writes, as a real process would.
        assert db.lookup(f"2d-w{worker}-p{i}", HERE) is not None


def test_four_processes_writing_at_once_lose_nothing(tmp_path):
    path = str(tmp_path / "find.sqlite")
    ctx = multiprocessing.get_context("spawn")
    count = 40
    procs = [ctx.Process(target=_write_many, args=(path, w, count)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the shared file must still be healthy
        stored = {r.problem for r in FindDb(path).records()}
    assert stored == {f"2d-w{w}-p{i}" for w in range(4) for i in range(count)}


def test_reading_a_database_that_does_not_exist_creates_nothing(tmp_path):
    path = tmp_path / "cache" / "gemmconv" / "find.sqlite"
    db = FindDb(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert db.lookup("2d-a", HERE) is None
        assert db.records() == [] and db.lookup_rates(HERE) is None
    assert not (tmp_path / "cache").exists()
    db.store(_record("2d-a"))
    assert path.exists() and db.lookup("2d-a", HERE).solver == "patch"
