"""The find database: hits, misses, identity isolation, recovery, degradation, concurrency,
rows and imports that are not what a find writes, other applications' files, read-only
files and directories (real file modes, in a child process that is not root)."""

from __future__ import annotations

import json
import math
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings
from pathlib import Path

import pytest

from gemmconv.selection import finddb
from gemmconv.selection.finddb import SCHEMA_VERSION, FindDb, FindDbWarning, Identity, Record

from conftest import find_db_warnings

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
    assert find_db_warnings(caught) == 1
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
    assert find_db_warnings(caught) == 1
    assert db.in_memory


def test_file_refusing_writes_is_used_read_only(tmp_path, monkeypatch):
    # Root can write any file, so the read-only refusal sqlite would give an ordinary
    # user is simulated: the file opens, but every write fails as it would then.
    # (test_a_read_only_file_or_directory_is_read_and_never_written uses real modes.)
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
        db.store(_record("2d-c"))
    assert find_db_warnings(caught) == 1 and db.read_only and not db.in_memory
    assert db.lookup("2d-a", HERE).solver == "patch"  # its rows are still used
    assert {r.problem for r in FindDb(path).records()} == {"2d-a"}  # nothing was written


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
    with pytest.raises(ValueError, match="missing field"):
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


# ---- rows and records that are not what a find writes ------------------------------


def _insert_raw(path, problem: str, identity: Identity = HERE, **columns) -> None:
    """A find row written by hand (or a broken tool), bypassing every check."""
    values = {"solver": "patch", "config": "{}", "time_ms": 0.5, "workspace_bytes": 0}
    values.update(columns)
    conn = sqlite3.connect(path)
    conn.execute(
        "INSERT OR REPLACE INTO find VALUES (?,?,?,?,?,?,?,?,?,?)",
        (problem, *identity.values(), *values.values(), 0.0),
    )
    conn.commit()
    conn.close()


BAD_ROWS = {
    "time_is_text": {"time_ms": "fast"},
    "time_is_negative": {"time_ms": -1.0},
    "config_is_not_json": {"config": "{not json"},
    "config_is_not_an_object": {"config": "[1, 2]"},
    "workspace_is_negative": {"workspace_bytes": -4},
    "workspace_is_text": {"workspace_bytes": "4 KiB"},
    "solver_is_empty": {"solver": ""},
}


@pytest.mark.parametrize("bad", sorted(BAD_ROWS))
def test_a_row_that_does_not_parse_is_a_miss_with_one_warning(bad, tmp_path):
    path = tmp_path / "find.sqlite"
    db = FindDb(path)
    db.store(_record("2d-good"))
    _insert_raw(path, "2d-bad", **BAD_ROWS[bad])
    with pytest.warns(FindDbWarning, match="does not parse") as caught:
        assert db.lookup("2d-bad", HERE) is None
        assert db.lookup("2d-bad", HERE) is None
        assert [r.problem for r in db.records()] == ["2d-good"]
    assert find_db_warnings(caught) == 1, [str(w.message) for w in caught]
    rows = {row.values["problem"]: row for row in db.rows()}
    assert rows["2d-bad"].record is None and rows["2d-bad"].error
    assert rows["2d-good"].record == _record("2d-good")


def _insert_not_utf8(path, problem: str, column: str) -> None:
    """A find row whose ``column`` holds TEXT that is not UTF-8 (bytes sqlite stores as
    they come, from another tool or a damaged disk)."""
    values = {
        "problem": problem, **dict(zip(finddb._IDENTITY_COLUMNS, HERE.values())),
        "solver": "patch", "config": "{}", "time_ms": 0.5, "workspace_bytes": 0, "created": 0.0,
    }  # fmt: skip
    values[column] = b"\xff\xfe not UTF-8 \xc3"
    marks = ", ".join("CAST(? AS TEXT)" if name == column else "?" for name in values)
    conn = sqlite3.connect(path)
    conn.execute(f"INSERT INTO find ({', '.join(values)}) VALUES ({marks})", tuple(values.values()))
    conn.commit()
    conn.close()


@pytest.mark.parametrize("column", finddb._FIND_COLUMNS)
def test_text_that_is_not_utf8_in_any_column_is_a_row_that_does_not_parse(column, tmp_path):
    """sqlite3 fails the whole query on such a value; the other rows must still read."""
    path = tmp_path / "find.sqlite"
    db = FindDb(path)
    db.store(_record("2d-good"))
    _insert_not_utf8(path, "2d-bad", column)
    rows = db.rows()
    assert len(rows) == 2
    bad = next(row for row in rows if row.record is None)
    assert b"\xff\xfe not UTF-8 \xc3" in bad.values.values() and column in bad.error
    with pytest.warns(FindDbWarning, match="does not parse") as caught:
        assert db.records() == [_record("2d-good")]
        assert db.lookup("2d-bad", HERE) is None
    assert find_db_warnings(caught) == 1, [str(w.message) for w in caught]
    assert db.lookup("2d-good", HERE) == _record("2d-good")
    out = tmp_path / "dump.json"
    with pytest.warns(FindDbWarning, match="does not parse"):
        assert FindDb(path).export_json(out) == 1


def test_text_that_is_not_utf8_in_the_meta_or_rates_tables_is_ignored(tmp_path):
    path = tmp_path / "find.sqlite"
    FindDb(path).store(_record("2d-a"))
    conn = sqlite3.connect(path)
    conn.execute("INSERT INTO meta VALUES (CAST(? AS TEXT), CAST(? AS TEXT))", (b"\xff", b"\xfe"))
    conn.execute(
        "INSERT INTO rates VALUES (?, ?, ?, ?, CAST(? AS TEXT), 0)",
        (*HERE.values(), b'{"fp32": 1\xff}'),
    )
    conn.commit()
    conn.close()
    db = FindDb(path, strict=True)  # still a gemmconv database: its marker is intact
    assert db.lookup("2d-a", HERE) == _record("2d-a")
    with pytest.warns(FindDbWarning, match="unreadable rates"):
        assert db.lookup_rates(HERE) is None


def test_a_table_with_columns_it_does_not_know_still_reads_and_writes(tmp_path):
    path = tmp_path / "find.sqlite"
    FindDb(path).store(_record("2d-a"))
    conn = sqlite3.connect(path)
    conn.execute("ALTER TABLE find ADD COLUMN note TEXT DEFAULT 'added by a later tool'")
    conn.commit()
    conn.close()
    db = FindDb(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        db.store(_record("2d-b", solver="im2col"))
        assert db.lookup("2d-a", HERE).solver == "patch"
        assert db.lookup("2d-b", HERE).solver == "im2col"


def test_a_constraint_violation_is_an_error_not_corruption(tmp_path):
    """sqlite's IntegrityError (here from a trigger) says nothing about the file: the
    store fails, and the database and its rows stay where they are."""
    path = tmp_path / "find.sqlite"
    db = FindDb(path)
    db.store_many([_record(f"2d-{i}") for i in range(50)])
    conn = sqlite3.connect(path)
    conn.execute(
        "CREATE TRIGGER refuse BEFORE INSERT ON find WHEN NEW.problem = '2d-refused' "
        "BEGIN SELECT RAISE(ABORT, 'refused by a trigger'); END"
    )
    conn.commit()
    conn.close()
    with pytest.raises(sqlite3.IntegrityError, match="refused by a trigger"):
        db.store(_record("2d-refused"))
    assert not list(tmp_path.glob("find.sqlite.corrupt-*"))
    assert len(FindDb(path).records()) == 50


def _good_json_record(i: int) -> dict:
    return _record(f"2d-import-{i}").as_json()


BAD_RECORDS = {
    "time_nan": ({"time_ms": math.nan}, "time_ms=nan"),
    "time_inf": ({"time_ms": math.inf}, "time_ms=inf"),
    "time_negative": ({"time_ms": -0.5}, "time_ms=-0.5"),
    "time_text": ({"time_ms": "0.5"}, "time_ms='0.5'"),
    "time_bool": ({"time_ms": True}, "time_ms=True"),
    "workspace_negative": ({"workspace_bytes": -1}, "workspace_bytes=-1"),
    "workspace_float": ({"workspace_bytes": 4096.5}, "workspace_bytes=4096.5"),
    "workspace_null": ({"workspace_bytes": None}, "workspace_bytes=None"),
    "solver_unknown": ({"solver": "winograd"}, "solver='winograd': unknown solver id"),
    "problem_empty": ({"problem": ""}, "problem='': expected a non-empty string"),
    "problem_number": ({"problem": 7}, "problem=7"),
    "device_missing": ({"device": None}, "device=None"),
    "config_list": ({"config": [1]}, "config=[1]"),
    "field_unknown": ({"speedup": 2.0}, "unknown field(s) speedup"),
    # Numbers no float or sqlite INTEGER holds: refused like any bad value.
    "time_400_digits": ({"time_ms": int("9" * 400)}, "time_ms=<an integer of 400 digits>"),
    "workspace_2_to_64": ({"workspace_bytes": 2**64}, f"workspace_bytes={2**64}: expected"),
    "problem_lone_surrogate": ({"problem": "\ud800"}, "no lone surrogate"),
}


@pytest.mark.parametrize("bad", sorted(BAD_RECORDS))
def test_import_refuses_a_bad_record_and_writes_nothing(bad, tmp_path):
    path = tmp_path / "find.sqlite"
    db = FindDb(path)
    db.store_many([_record(f"2d-{i}") for i in range(50)])
    change, message = BAD_RECORDS[bad]
    records = [_good_json_record(i) for i in range(3)]
    records[2].update(change)
    dump = tmp_path / "dump.json"
    dump.write_text(json.dumps({"records": records}))
    with pytest.raises(ValueError, match="dump.json") as raised:
        db.import_json(dump)
    text = str(raised.value)
    assert "record 2" in text and message in text and "nothing imported" in text, text
    assert "\n" not in text
    assert not list(tmp_path.glob("find.sqlite.corrupt-*"))
    assert {r.problem for r in FindDb(path).records()} == {f"2d-{i}" for i in range(50)}


def test_import_refuses_a_record_missing_a_field(tmp_path):
    dump = tmp_path / "dump.json"
    record = _good_json_record(0)
    del record["time_ms"]
    dump.write_text(json.dumps({"records": [record, "not an object"]}))
    with pytest.raises(ValueError, match="record 0 .*missing field.*time_ms"):
        FindDb(tmp_path / "find.sqlite").import_json(dump)
    dump.write_text(json.dumps({"records": [_good_json_record(0), "not an object"]}))
    with pytest.raises(ValueError, match="record 1: 'not an object': expected a JSON object"):
        FindDb(tmp_path / "find.sqlite").import_json(dump)
    assert not (tmp_path / "find.sqlite").exists()


def test_import_of_records_with_one_key_stores_the_last_and_counts_it(tmp_path):
    dump = tmp_path / "dump.json"
    records = [_good_json_record(0), _good_json_record(1), _good_json_record(0)]
    records[2]["solver"] = "vendor"
    dump.write_text(json.dumps({"records": records}))
    db = FindDb(tmp_path / "find.sqlite")
    assert db.import_json(dump) == 2
    assert db.lookup("2d-import-0", HERE).solver == "vendor"
    assert len(db.records()) == 2


def _link(kind: str, live: Path, tmp_path: Path, monkeypatch) -> str:
    """A name of the database file ``live`` of the given kind."""
    if kind == "same":
        return str(live)
    if kind == "relative":
        monkeypatch.chdir(tmp_path)
        return os.path.join(".", "sub", "..", live.name)
    other = tmp_path / f"{kind}.sqlite"
    (os.symlink if kind == "symlink" else os.link)(live, other)
    return str(other)


@pytest.mark.parametrize("kind", ["same", "relative", "symlink", "hard_link", "wal"])
def test_export_into_the_database_itself_is_refused(kind, tmp_path, monkeypatch):
    path = tmp_path / "find.sqlite"
    (tmp_path / "sub").mkdir()
    db = FindDb(path)
    db.store(_record("2d-a"))
    if kind == "wal":
        target = str(path) + "-wal"
        assert os.path.exists(target)  # the connection is open: the WAL holds the row
    else:
        target = _link(kind, path, tmp_path, monkeypatch)
    before = Path(target).read_bytes()
    with pytest.raises(ValueError, match="find database's own file.*nothing exported"):
        db.export_json(target)
    assert Path(target).read_bytes() == before
    assert FindDb(path).lookup("2d-a", HERE) == _record("2d-a")


def test_a_database_deleted_while_open_is_recreated_on_the_next_write(tmp_path):
    path = tmp_path / "find.sqlite"
    db = FindDb(path)
    db.store(_record("2d-a"))
    path.unlink()  # the -wal and -shm stay, as after `rm find.sqlite`
    with pytest.warns(FindDbWarning, match="deleted or replaced") as caught:
        db.store(_record("2d-b"))
        db.store(_record("2d-c"))
    assert find_db_warnings(caught) == 1
    assert {r.problem for r in FindDb(path).records()} == {"2d-b", "2d-c"}


def test_a_database_replaced_while_open_is_used_and_keeps_its_rows(tmp_path):
    path = tmp_path / "find.sqlite"
    db = FindDb(path)
    db.store(_record("2d-a"))
    backup = FindDb(tmp_path / "backup.sqlite")
    backup.store(_record("2d-from-the-backup"))
    backup.close()
    os.replace(tmp_path / "backup.sqlite", path)  # the -wal of the file replaced stays
    with pytest.warns(FindDbWarning, match="deleted or replaced"):
        db.store(_record("2d-b"))
    # The stale -wal of the file that was replaced is emptied, not applied over it.
    stored = {r.problem for r in FindDb(path).records()}
    assert stored == {"2d-from-the-backup", "2d-b"}
    assert not list(tmp_path.glob("find.sqlite.corrupt-*"))


# ---- files that are not ours, or of another schema --------------------------------


def _foreign_database(path, tables: str = "users") -> bytes:
    conn = sqlite3.connect(path)
    if tables == "users":
        conn.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)")
        conn.executemany("INSERT INTO users (name) VALUES (?)", [("ada",), ("alan",)])
    elif tables == "meta_of_other_columns":
        conn.execute("CREATE TABLE meta (key TEXT, payload BLOB)")
    else:  # a key/value meta table of the same shape as gemmconv's, without the marker
        conn.execute("CREATE TABLE meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)")
        conn.execute("INSERT INTO meta VALUES ('schema', '1')")
        conn.execute("CREATE TABLE find (problem TEXT)")
    conn.commit()
    conn.close()
    return path.read_bytes()


@pytest.mark.parametrize("tables", ["users", "meta_of_other_columns", "meta_without_marker"])
def test_a_foreign_sqlite_file_is_never_written(tables, tmp_path):
    path = tmp_path / "find.sqlite"
    before = _foreign_database(path, tables)
    db = FindDb(path)
    with pytest.warns(FindDbWarning, match="is not a gemmconv find database") as caught:
        assert db.lookup("2d-a", HERE) is None
        db.store(_record("2d-a"))  # kept in memory for this process
        assert db.lookup("2d-a", HERE).solver == "patch"
    assert find_db_warnings(caught) == 1 and db.in_memory
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["find.sqlite"]
    strict = FindDb(path, strict=True)
    for call in (lambda: strict.records(), lambda: strict.store(_record("2d-a"))):
        with pytest.raises(finddb.FindDbError, match="is not a gemmconv find database"):
            call()
    assert path.read_bytes() == before


def test_a_newer_schema_is_left_in_place_and_not_read(tmp_path):
    path = tmp_path / "find.sqlite"
    writer = FindDb(path)
    writer.store(_record("2d-a"))
    # Closed now, not whenever it is collected: closing the last connection checkpoints
    # the write-ahead log into the file, which would change its bytes mid-test.
    writer.close()
    conn = sqlite3.connect(path)
    conn.execute("UPDATE meta SET value = ? WHERE name = 'schema'", (str(SCHEMA_VERSION + 1),))
    conn.commit()
    conn.close()
    before = path.read_bytes()
    db = FindDb(path)
    with pytest.warns(FindDbWarning, match="schema version '2'.*left in place") as caught:
        assert db.lookup("2d-a", HERE) is None  # its rows mean something else
        db.store(_record("2d-b"))
    assert find_db_warnings(caught) == 1 and db.in_memory
    assert path.read_bytes() == before and not list(tmp_path.glob("*.corrupt-*"))
    with pytest.raises(finddb.FindDbError, match="schema version"):
        FindDb(path, strict=True).records()


def test_a_file_written_before_the_marker_is_used(tmp_path):
    """Files of this schema that gemmconv wrote before it marked them are its own."""
    path = tmp_path / "find.sqlite"
    FindDb(path).store(_record("2d-a"))
    conn = sqlite3.connect(path)
    conn.execute("DELETE FROM meta WHERE name = ?", (finddb.MARKER[0],))
    conn.commit()
    conn.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        db = FindDb(path)
        assert db.lookup("2d-a", HERE).solver == "patch"
        db.store(_record("2d-b"))
    assert len(FindDb(path).records()) == 2


def test_a_strict_database_refuses_an_unusable_location(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(finddb.FindDbError, match="cannot open"):
        FindDb(blocker / "find.sqlite", strict=True).store(_record("2d-a"))


# ---- real file modes, in a process that does not run as root ----------------------------

FINDDB_SOURCE = Path(finddb.__file__)

# Loads finddb.py on its own (its imports are the standard library's), so a child
# process starts in a fraction of a second instead of importing torch.
_LOAD_FINDDB = f"""
import importlib.util, json, os, sys, warnings
spec = importlib.util.spec_from_file_location("finddb", {str(FINDDB_SOURCE)!r})
finddb = importlib.util.module_from_spec(spec)
sys.modules["finddb"] = finddb
spec.loader.exec_module(finddb)
HERE = finddb.Identity(*{list(HERE.values())!r})
"""
# File modes do not stop root: a child running as root becomes user nobody, after
# loading (the interpreter may live where nobody cannot read).
_NOT_ROOT = """
if os.geteuid() == 0:
    os.setgroups([])
    os.setresgid(65534, 65534, 65534)
    os.setresuid(65534, 65534, 65534)
"""


def _run_finddb_child(code: str, not_root: bool = False) -> subprocess.Popen:
    """``code`` in a child process, after finddb is loaded as ``finddb``; ``not_root``:
    in a process that file modes apply to."""
    prelude = _LOAD_FINDDB + (_NOT_ROOT if not_root else "")
    return subprocess.Popen(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


_WRITING_CHILD = """
import time
path, signals, worker, count = sys.argv[1:]
open(os.path.join(signals, f"ready-{worker}"), "w").close()
deadline = time.monotonic() + 60
while not os.path.exists(os.path.join(signals, "go")) and time.monotonic() < deadline:
    time.sleep(0.001)
db = finddb.FindDb(path)
for i in range(count):
    db.store(finddb.Record(f"2d-w{worker}-p{i}", HERE, "patch", {"pad_to": 16}, float(i), 4096))
    # Interleave reads with the writes, as a real process would.
    assert db.lookup(f"2d-w{worker}-p{i}", HERE) is not None
"""


def test_a_file_another_process_is_adopting_is_waited_for_not_given_up(tmp_path, monkeypatch):
    """sqlite answers "database is locked" at once, past its busy handler, to a process
    switching a file to WAL while another does: the open waits it out and stores into
    the file, where it used to fall back to an in-memory database."""
    real, busy_answers = FindDb._adopt, [2]

    def adopt_after_busy(self, conn):
        if busy_answers[0]:
            busy_answers[0] -= 1
            error = sqlite3.OperationalError("database is locked")
            error.sqlite_errorcode = 5  # SQLITE_BUSY
            raise error
        return real(self, conn)

    monkeypatch.setattr(FindDb, "_adopt", adopt_after_busy)
    path = str(tmp_path / "find.sqlite")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        db = FindDb(path)
        db.store(Record("2d-busy", HERE, "patch", {}, 1.0, 0))
    assert busy_answers == [0]
    monkeypatch.setattr(FindDb, "_adopt", real)
    assert [r.problem for r in FindDb(path).records()] == ["2d-busy"]


def test_four_processes_writing_at_once_lose_nothing(tmp_path):
    path = str(tmp_path / "find.sqlite")
    count = 40
    # Each child loads finddb alone (no torch: it starts in a fraction of a second) and
    # waits for the others to be ready, so that the four write at once.
    children = [
        _run_finddb_child(
            _WRITING_CHILD.replace("sys.argv[1:]", repr((path, str(tmp_path), w, count)))
        )
        for w in range(4)
    ]
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"ready-{w}").exists() for w in range(4)):
            for child in children:
                assert child.poll() is None, child.communicate()
            assert time.monotonic() < deadline, "a child never started"
            time.sleep(0.01)
        (tmp_path / "go").touch()
        results = [child.communicate(timeout=120) for child in children]
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
    assert [child.returncode for child in children] == [0, 0, 0, 0], results
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the shared file must still be healthy
        stored = {r.problem for r in FindDb(path).records()}
    # The children's output (warnings included) says why, when a row is missing.
    assert stored == {f"2d-w{w}-p{i}" for w in range(4) for i in range(count)}, results


@pytest.fixture
def shared_tmp():
    """A directory a process of another user may enter (pytest's tmp_path is private)."""
    path = Path(tempfile.mkdtemp(prefix="gemmconv-finddb-"))
    path.chmod(0o777)
    yield path
    for root, dirs, _ in os.walk(path):
        for d in dirs:
            os.chmod(os.path.join(root, d), 0o777)
    shutil.rmtree(path)


_READ_ONLY_CHILD = """
path = sys.argv[1]
report = {}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    db = finddb.FindDb(path)
    hit = db.lookup("2d-a", HERE)
    report["hit"] = None if hit is None else hit.solver
    for problem in ("2d-b", "2d-c"):
        db.store(finddb.Record(problem, HERE, "im2col", {}, 1.0, 0))
    report["read_only"], report["in_memory"] = getattr(db, "read_only", None), db.in_memory
    report["warnings"] = [str(w.message) for w in caught]
try:
    finddb.FindDb(path, strict=True).store(finddb.Record("2d-d", HERE, "im2col", {}, 1.0, 0))
    report["strict"] = "stored"
except Exception as e:
    report["strict"] = f"{type(e).__name__}: {e}"
print(json.dumps(report))
"""


@pytest.mark.parametrize("read_only", ["file", "directory"])
def test_a_read_only_file_or_directory_is_read_and_never_written(read_only, shared_tmp):
    directory = shared_tmp / "cache"
    directory.mkdir()
    path = directory / "find.sqlite"
    db = FindDb(path)
    db.store(_record("2d-a", solver="patch"))
    db.close()
    assert sorted(p.name for p in directory.iterdir()) == ["find.sqlite"]  # WAL checkpointed
    path.chmod(0o444 if read_only == "file" else 0o666)
    directory.chmod(0o777 if read_only == "file" else 0o555)
    before = path.read_bytes()
    child = _run_finddb_child(_READ_ONLY_CHILD.replace("sys.argv[1]", repr(str(path))), True)
    out, err = child.communicate(timeout=60)
    assert child.returncode == 0, err
    report = json.loads(out)
    assert report["hit"] == "patch", report  # its rows are used
    assert report["read_only"] and not report["in_memory"], report
    assert len(report["warnings"]) == 1 and "read-only" in report["warnings"][0], report
    assert report["strict"].startswith("FindDbError: "), report
    assert "read-only; nothing was written" in report["strict"], report
    assert path.read_bytes() == before
    assert {r.problem for r in FindDb(path).records()} == {"2d-a"}


# ---- two processes recovering the same unreadable file ---------------------------------

_RECOVERING_CHILD = """
import os, time
path, signals = sys.argv[1], sys.argv[2]
real_recover = finddb.FindDb._recover

def delayed_recover(self, error):
    # The injected delay: it has seen the file fail, and recovers only after the
    # parent process has recovered it and written its rows.
    open(os.path.join(signals, "failed"), "w").close()
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(signals, "go")) and time.monotonic() < deadline:
        time.sleep(0.01)
    return real_recover(self, error)

finddb.FindDb._recover = delayed_recover
warnings.simplefilter("ignore")
db = finddb.FindDb(path)
db.lookup("2d-a", HERE)
db.store(finddb.Record("2d-from-the-child", HERE, "patch", {}, 1.0, 0))
print(json.dumps({"in_memory": db.in_memory}))
"""


def test_two_processes_recovering_one_file_lose_no_row(shared_tmp):
    path = shared_tmp / "find.sqlite"
    garbage = b"this is not an sqlite database\\x00" * 200
    path.write_bytes(garbage)
    signals = shared_tmp / "signals"
    signals.mkdir(mode=0o777)
    signals.chmod(0o777)
    code = _RECOVERING_CHILD.replace("sys.argv[1], sys.argv[2]", repr((str(path), str(signals))))
    child = _run_finddb_child(code)
    try:
        deadline = time.monotonic() + 60
        while not (signals / "failed").exists():
            assert child.poll() is None, child.communicate()
            assert time.monotonic() < deadline, "the child never read the file"
            time.sleep(0.01)
        # This process recovers the file first, and fills the new one.
        with pytest.warns(FindDbWarning, match="unreadable"):
            db = FindDb(path)
            db.store_many([_record(f"2d-{i}") for i in range(100)])
        (signals / "go").touch()
        out, err = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == 0, err
    assert json.loads(out) == {"in_memory": False}
    stored = {r.problem for r in FindDb(path).records()}
    assert stored == {f"2d-{i}" for i in range(100)} | {"2d-from-the-child"}
    aside = [p for p in shared_tmp.iterdir() if ".corrupt-" in p.name]
    assert len(aside) == 1 and aside[0].read_bytes() == garbage, aside
