"""The find database: which solver won a benchmark, per problem and machine, in sqlite.

One file per user, at ``$GEMMCONV_DB`` or ``<cache dir>/gemmconv/find.sqlite`` (the
cache dir is ``$XDG_CACHE_HOME`` or ``~/.cache``). A row is keyed by the problem key
and the identity of what measured it: device name, compute capability, torch version,
gemmconv version. A lookup sees only rows of the current identity, so results from
another GPU or another release are ignored, never reused.

Several processes may read and write the file at once: it runs in WAL mode with a
busy timeout, and every write is one short transaction. The database must never be
why a convolution fails, and must never destroy what it holds:

- a file sqlite cannot read (not a database, or malformed) is moved aside (renamed
  with a ``.corrupt-<timestamp>-<pid>`` suffix) with one warning and rebuilt. The
  check and the rename happen under an exclusive lock on ``<file>.lock``, and only
  while the file is still the one that failed, so two processes recovering at once
  never move aside the database one of them has just rebuilt;
- a file that is not a gemmconv database (another application's sqlite file: no
  gemmconv marker in a ``meta`` table) or that holds another schema version is left
  as it is, neither read nor written: one warning, and the process carries on with
  an in-memory database;
- a read-only file or directory is opened read-only: its rows are used, and a result
  that cannot be stored is dropped with one warning;
- a location that cannot hold a database degrades to an in-memory one, one warning;
- a row that does not parse (a value a find never writes, or text that is not UTF-8,
  in any column) is a miss, with one warning; the other rows read as ever;
- a file deleted, or replaced by a rename, while a process has it open is noticed
  before that process's next write (one stat of the path): it leaves the old file,
  first emptying the -wal it may have left at the path (sqlite would otherwise apply
  it to the new file), and stores into the file now at the path, one warning.

``FindDb(path, strict=True)`` (the ``gemmconv db`` commands) raises ``FindDbError``
where the default degrades, so a command that cannot do what it was asked says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import platform
import sqlite3
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

try:
    import fcntl
except ImportError:  # not POSIX: recovery relies on its re-checks alone
    fcntl = None

log = logging.getLogger("gemmconv.finddb")

# What a database call may raise that must not stop a convolution: sqlite errors
# (locked past the busy timeout, disk full, I/O), file errors, a record refused.
DATABASE_ERRORS = (sqlite3.Error, OSError, ValueError)

SCHEMA_VERSION = 1
BUSY_TIMEOUT_MS = 30_000
IN_MEMORY = ":memory:"
# The row of the meta table that marks a file as a gemmconv find database.
MARKER = ("application", "gemmconv find database")

T = TypeVar("T")

_TABLES = (
    "CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)",
    """CREATE TABLE IF NOT EXISTS find (
    problem TEXT NOT NULL,
    device TEXT NOT NULL,
    capability TEXT NOT NULL,
    torch_version TEXT NOT NULL,
    gemmconv_version TEXT NOT NULL,
    solver TEXT NOT NULL,
    config TEXT NOT NULL,
    time_ms REAL NOT NULL,
    workspace_bytes INTEGER NOT NULL,
    created REAL NOT NULL,
    PRIMARY KEY (problem, device, capability, torch_version, gemmconv_version)
)""",
    """CREATE TABLE IF NOT EXISTS rates (
    device TEXT NOT NULL,
    capability TEXT NOT NULL,
    torch_version TEXT NOT NULL,
    gemmconv_version TEXT NOT NULL,
    rates TEXT NOT NULL,
    created REAL NOT NULL,
    PRIMARY KEY (device, capability, torch_version, gemmconv_version)
)""",
)

_IDENTITY_COLUMNS = ("device", "capability", "torch_version", "gemmconv_version")
# Named, never positional, so a table that carries extra columns still reads and writes.
_FIND_COLUMNS = ("problem", *_IDENTITY_COLUMNS, "solver", "config", "time_ms", "workspace_bytes")
_JSON_FIELDS = frozenset(_FIND_COLUMNS)

# sqlite's primary result codes (the sqlite3 module names them from Python 3.11 on).
_SQLITE_BUSY, _SQLITE_READONLY, _SQLITE_CORRUPT, _SQLITE_CANTOPEN, _SQLITE_NOTADB = 5, 8, 11, 14, 26
# What each means in sqlite's messages, for Pythons whose errors carry no code.
_CODE_MESSAGES = {
    _SQLITE_READONLY: "readonly database",
    _SQLITE_CORRUPT: "malformed",
    _SQLITE_CANTOPEN: "unable to open",
    _SQLITE_NOTADB: "not a database",
}


class FindDbWarning(UserWarning):
    """The find database could not be used as asked; it carried on degraded."""


class FindDbError(RuntimeError):
    """A strict find database (``gemmconv db``) cannot do what it was asked."""


class _NotOurs(Exception):
    """The file is another application's, or of another schema: never to be touched."""


# sqlite stores INTEGER in 64 bits: a larger workspace could not be stored.
_INT64_MAX = 2**63 - 1


def _shown(value: object) -> str:
    """``repr(value)``, shortened for a message of one line (an integer of hundreds of
    digits in an import file, whose repr Python may even refuse to make)."""
    if isinstance(value, int) and value.bit_length() > 200:
        try:
            digits = str(len(str(abs(value))))
        except ValueError:  # past Python's limit on converting integers to text
            digits = f"about {int(value.bit_length() * math.log10(2)) + 1}"
        return f"<an integer of {digits} digits>"
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"


def _check_text(name: str, value: object, *, may_be_empty: bool = False) -> None:
    if not isinstance(value, str) or (not value and not may_be_empty):
        expected = "a string" if may_be_empty else "a non-empty string"
        raise ValueError(f"{name}={_shown(value)}: expected {expected}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate (a JSON "\ud800"): sqlite cannot store it
        raise ValueError(
            f"{name}={_shown(value)}: expected text UTF-8 can encode (no lone surrogate)"
        ) from None


def _text(raw: bytes) -> str | bytes:
    """The sqlite connections' text factory: a TEXT value that is not UTF-8 (written by
    another tool) comes back as its bytes, so that its row does not parse and is
    skipped, where sqlite3's own decoding would fail the whole query."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw


@dataclasses.dataclass(frozen=True)
class Identity:
    """What a measurement is valid for."""

    device: str
    capability: str
    torch_version: str
    gemmconv_version: str

    def __post_init__(self) -> None:
        for name in _IDENTITY_COLUMNS:
            _check_text(name, getattr(self, name), may_be_empty=name == "capability")

    def values(self) -> tuple[str, str, str, str]:
        return (self.device, self.capability, self.torch_version, self.gemmconv_version)


def identity_for(device_type: str, index: int | None = None) -> Identity:
    """The identity of the current process on ``device_type`` (the current CUDA device
    when ``index`` is None)."""
    import torch

    from gemmconv.core.version import __version__

    if device_type == "cuda" and torch.cuda.is_available():
        index = torch.cuda.current_device() if index is None else index
        major, minor = torch.cuda.get_device_capability(index)
        device, capability = torch.cuda.get_device_name(index), f"{major}.{minor}"
    else:
        device = f"cpu:{platform.machine() or 'unknown'}:{os.cpu_count()}"
        capability = ""
    return Identity(device, capability, torch.__version__, __version__)


@dataclasses.dataclass(frozen=True)
class Record:
    """One find result. A record that could not have come from a find (a time that is
    not a finite number of milliseconds >= 0, an empty problem key...) cannot be made:
    the constructor raises ValueError naming the field."""

    problem: str
    identity: Identity
    solver: str
    config: dict
    time_ms: float
    workspace_bytes: int

    def __post_init__(self) -> None:
        _check_text("problem", self.problem)
        if not isinstance(self.identity, Identity):
            raise ValueError(f"identity={self.identity!r}: expected an Identity")
        _check_text("solver", self.solver)
        if not isinstance(self.config, dict):
            raise ValueError(f"config={_shown(self.config)}: expected a JSON object")
        t = self.time_ms
        try:  # an int too large for a float overflows: not a finite number of milliseconds
            ms = math.nan if isinstance(t, bool) or not isinstance(t, (int, float)) else float(t)
        except OverflowError:
            ms = math.inf
        if not math.isfinite(ms) or ms < 0:
            raise ValueError(f"time_ms={_shown(t)}: expected a finite number of milliseconds >= 0")
        object.__setattr__(self, "time_ms", ms)
        w = self.workspace_bytes
        if isinstance(w, bool) or not isinstance(w, int) or not 0 <= w <= _INT64_MAX:
            raise ValueError(
                f"workspace_bytes={_shown(w)}: expected an integer from 0 to {_INT64_MAX}"
            )

    @property
    def key(self) -> tuple[str, Identity]:
        """What the database keys a result by: one row per problem and identity."""
        return (self.problem, self.identity)

    def as_json(self) -> dict:
        return {
            "problem": self.problem,
            **dataclasses.asdict(self.identity),
            "solver": self.solver,
            "config": self.config,
            "time_ms": self.time_ms,
            "workspace_bytes": self.workspace_bytes,
        }

    @classmethod
    def from_json(cls, row: object) -> Record:
        """The record of an exported JSON object; ValueError names what is wrong."""
        if not isinstance(row, dict):
            raise ValueError(f"{row!r}: expected a JSON object")
        unknown = sorted(str(k) for k in set(row) - _JSON_FIELDS)
        if unknown:
            raise ValueError(f"unknown field(s) {', '.join(unknown)}")
        missing = [f for f in _FIND_COLUMNS if f not in row and f != "config"]
        if missing:
            raise ValueError(f"missing field(s) {', '.join(missing)}")
        return cls(
            problem=row["problem"],
            identity=Identity(*(row[c] for c in _IDENTITY_COLUMNS)),
            solver=row["solver"],
            config=row.get("config", {}),
            time_ms=row["time_ms"],
            workspace_bytes=row["workspace_bytes"],
        )


@dataclasses.dataclass(frozen=True)
class Row:
    """One row of the find table as stored: its record, or why it does not parse."""

    values: dict[str, object]
    record: Record | None
    error: str | None = None


def _row(values: tuple) -> Row:
    """A stored row of the find table's columns (in ``_FIND_COLUMNS`` order), parsed."""
    problem, device, capability, torch_version, gemmconv_version, solver, config = values[:7]
    named = dict(zip(_FIND_COLUMNS, values, strict=True))
    try:
        if not isinstance(config, str):
            raise ValueError(f"config={_shown(config)}: expected JSON text")
        try:
            parsed = json.loads(config)
        except (ValueError, RecursionError) as e:
            raise ValueError(f"config={_shown(config)}: not JSON ({e})") from None
        identity = Identity(device, capability, torch_version, gemmconv_version)
        return Row(named, Record(problem, identity, solver, parsed, *values[7:]))
    except ValueError as e:
        return Row(named, None, str(e))


def default_path() -> Path:
    """``$GEMMCONV_DB``, else the platform cache directory's gemmconv/find.sqlite."""
    explicit = os.environ.get("GEMMCONV_DB")
    if explicit:
        return Path(explicit).expanduser()
    return cache_directory() / "find.sqlite"


def cache_directory() -> Path:
    """gemmconv's folder in the platform cache directory (``$XDG_CACHE_HOME``, else
    ``~/.cache``): the find database and the C++ node's builds."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "gemmconv"


# ---- sqlite errors and files ----------------------------------------------------------


def _error_code(error: sqlite3.Error) -> int | None:
    """sqlite's primary result code of ``error``, read from its message where Python
    does not carry the code."""
    code = getattr(error, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF
    text = str(error)
    return next((c for c, words in _CODE_MESSAGES.items() if words in text), None)


def _unreadable(error: sqlite3.Error) -> bool:
    """Whether ``error`` says the file itself cannot be read as a database: the only
    reason a file is ever moved aside (a constraint or a lock never is)."""
    return _error_code(error) in (_SQLITE_CORRUPT, _SQLITE_NOTADB)


def _file_identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _may_write(path: str) -> bool:
    """Whether this process may write ``path`` and create its -wal and -shm beside it."""
    return os.access(path, os.W_OK) and os.access(os.path.dirname(path) or ".", os.W_OK)


@contextlib.contextmanager
def _exclusive_lock(path: str) -> Iterator[None]:
    """Hold an exclusive lock on the file ``path`` (created if needed; left in place,
    since removing a lock file races with the next process opening it)."""
    with open(path, "a") as handle:
        if fcntl is not None:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _tables(conn: sqlite3.Connection) -> list[str]:
    return sorted(r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'"))


def _check_ours(conn: sqlite3.Connection, path: str) -> bool:
    """Whether the database of ``conn`` is empty (False) or a gemmconv find database of
    this schema (True); _NotOurs, saying what it is, otherwise. Reads only."""
    tables = _tables(conn)
    if not tables:
        return False
    meta: dict = {}
    if "meta" in tables:
        with contextlib.suppress(sqlite3.OperationalError):  # a meta table of other columns
            meta = dict(conn.execute("SELECT name, value FROM meta").fetchall())
    # Files written before the marker existed have the schema row and both tables.
    before_marker = "schema" in meta and {"find", "rates"} <= set(tables)
    if meta.get(MARKER[0]) != MARKER[1] and not before_marker:
        raise _NotOurs(
            f"{path} is not a gemmconv find database (an sqlite database with tables "
            f"{', '.join(tables)}); left untouched"
        )
    if meta.get("schema") != str(SCHEMA_VERSION):
        raise _NotOurs(
            f"{path} holds find database schema version {meta.get('schema')!r}, and this "
            f"gemmconv reads version {SCHEMA_VERSION}; left in place, not used"
        )
    return True


def _create_tables(conn: sqlite3.Connection, path: str) -> None:
    """The tables and the marker, in one transaction that checks again, under the write
    lock, that the file is still empty or ours."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        _check_ours(conn, path)
        for statement in _TABLES:
            conn.execute(statement)
        conn.execute("INSERT OR IGNORE INTO meta VALUES (?, ?)", MARKER)
        conn.execute("INSERT OR IGNORE INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
    except BaseException:
        conn.rollback()
        raise
    conn.commit()


def _retire(conn: sqlite3.Connection) -> None:
    """Close a connection whose file was deleted or replaced at its path. Its -wal file
    may still be at the path, and sqlite would apply its frames to whatever file is
    there now: a checkpoint that truncates it first (sqlite skips the checkpoint on
    closing a moved file) leaves it empty. It waits for no lock: a -wal that another
    connection is using is left as it is."""
    with contextlib.suppress(sqlite3.Error):
        conn.execute("PRAGMA busy_timeout = 0")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
    conn.close()


def _memory_database() -> sqlite3.Connection:
    conn = sqlite3.connect(IN_MEMORY, check_same_thread=False)
    conn.text_factory = _text
    _create_tables(conn, IN_MEMORY)
    return conn


# ---- the database -------------------------------------------------------------------------


class FindDb:
    """A find database file (or an in-memory one). Safe to share between threads.

    ``strict``: raise FindDbError where the default would degrade (a foreign or
    unusable file, a read-only one asked to store)."""

    def __init__(self, path: str | os.PathLike | None = None, *, strict: bool = False) -> None:
        self.requested_path = str(default_path() if path is None else path)
        self.strict = strict
        self._lock = threading.RLock()
        self._conn: sqlite3.Connection | None = None
        self._pid = -1
        self._file: tuple[int, int] | None = None  # the file the connection was opened on
        self._warned: set[tuple] = set()
        self.path = self.requested_path  # becomes IN_MEMORY when degraded
        self.read_only = False

    # ---- opening, recovery, degradation -------------------------------------

    @property
    def in_memory(self) -> bool:
        return self.path == IN_MEMORY

    def _connection(self) -> sqlite3.Connection:
        # A connection must not cross a fork; a child opens its own.
        if self._conn is None or self._pid != os.getpid():
            self._conn = self._open()
            self._pid = os.getpid()
        return self._conn

    def _open(self) -> sqlite3.Connection:
        if self.path == IN_MEMORY:
            return _memory_database()
        if self.read_only or (os.path.exists(self.path) and not _may_write(self.path)):
            return self._open_read_only()
        self._file = _file_identity(self.path)
        try:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            conn = self._connect()
        except (OSError, sqlite3.Error) as e:
            return self._unusable(f"cannot open {self.path} ({e})")
        try:
            self._adopt_when_free(conn)
        except _NotOurs as e:
            conn.close()
            return self._unusable(str(e))
        except sqlite3.Error as e:
            conn.close()
            if _unreadable(e):
                return self._recover(e)
            if _error_code(e) == _SQLITE_READONLY:
                return self._open_read_only()
            return self._unusable(f"cannot open {self.path} ({e})")
        return conn

    def _connect(self, uri: str | None = None) -> sqlite3.Connection:
        conn = sqlite3.connect(
            uri or self.path,
            timeout=BUSY_TIMEOUT_MS / 1000,
            check_same_thread=False,
            uri=uri is not None,
        )
        conn.text_factory = _text
        try:
            conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        except BaseException:
            conn.close()
            raise
        return conn

    def _adopt_when_free(self, conn: sqlite3.Connection) -> None:
        """``_adopt(conn)``, again while another process holds the file: switching it to
        WAL is answered "database is locked" at once, past sqlite's busy handler, while
        another process adopts it (four processes opening a new file together lost one
        to an in-memory database under load), so a busy answer is waited out here, up
        to the busy timeout, as sqlite waits out any other lock."""
        deadline = time.monotonic() + BUSY_TIMEOUT_MS / 1000
        pause = 0.001
        while True:
            try:
                self._adopt(conn)
                return
            except sqlite3.OperationalError as e:
                if _error_code(e) != _SQLITE_BUSY or time.monotonic() + pause > deadline:
                    raise
                if conn.in_transaction:
                    conn.rollback()
            time.sleep(pause)
            pause = min(2 * pause, 0.1)

    def _adopt(self, conn: sqlite3.Connection) -> None:
        """Make ``conn``'s file ready for use: check that it is ours before anything is
        written to it, then set WAL mode and create the tables of an empty file."""
        ours = _check_ours(conn, self.path)
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = NORMAL")
        if not ours:
            _create_tables(conn, self.path)
        self._file = _file_identity(self.path)

    def _open_read_only(self) -> sqlite3.Connection:
        """The file opened read-only: its rows are used, nothing is stored."""
        self.read_only = True
        uri = Path(self.path).resolve().as_uri() + "?mode=ro"
        try:
            try:
                conn, ours = self._connect_checked(uri)
            except sqlite3.OperationalError as e:
                # A WAL file in a directory this process cannot write opens only as
                # immutable (sqlite cannot create the shared-memory file beside it).
                if _error_code(e) not in (_SQLITE_READONLY, _SQLITE_CANTOPEN):
                    raise
                conn, ours = self._connect_checked(uri + "&immutable=1")
        except _NotOurs as e:
            return self._unusable(str(e))
        except sqlite3.Error as e:
            return self._unusable(f"cannot read {self.path}, which is read-only ({e})")
        if not ours:  # an empty file: nothing to read
            conn.close()
            return _memory_database()
        return conn

    def _connect_checked(self, uri: str) -> tuple[sqlite3.Connection, bool]:
        """A connection to ``uri`` and whether the file is ours (False: empty)."""
        conn = self._connect(uri)
        try:
            return conn, _check_ours(conn, self.path)
        except BaseException:
            conn.close()
            raise

    def _recover(self, error: sqlite3.Error) -> sqlite3.Connection:
        """Move the unreadable file aside and start a new one in its place, unless
        another process has done so since it failed here."""
        aside = None
        try:
            with _exclusive_lock(self.path + ".lock"):
                if self._still_unreadable():
                    stamp = time.strftime("%Y%m%d-%H%M%S")
                    aside = f"{self.path}.corrupt-{stamp}-{os.getpid()}"
                    os.replace(self.path, aside)
                    for suffix in ("-wal", "-shm"):
                        with contextlib.suppress(FileNotFoundError):
                            os.replace(self.path + suffix, aside + suffix)
                # Rebuilt under the lock, so a process waiting for it finds the new file.
                conn = self._connect()
                try:
                    self._adopt(conn)
                except BaseException:
                    conn.close()
                    raise
        except (OSError, sqlite3.Error, _NotOurs) as e:
            return self._unusable(f"{self.path} is unreadable ({error}) and was not rebuilt ({e})")
        if aside is not None:
            self._warn(
                f"gemmconv find database {self.path} was unreadable ({error}); moved it to "
                f"{aside} and started a new one"
            )
        return conn

    def _still_unreadable(self) -> bool:
        """Whether the file at the path is the one that failed here, and still fails."""
        if self._file is not None and _file_identity(self.path) != self._file:
            return False  # replaced (rebuilt by another process) since it was opened here
        try:
            probe = sqlite3.connect(Path(self.path).resolve().as_uri() + "?mode=ro", uri=True)
        except sqlite3.Error as e:
            return _unreadable(e)
        try:
            return probe.execute("PRAGMA quick_check").fetchall() != [("ok",)]
        except sqlite3.Error as e:
            return _unreadable(e)
        finally:
            probe.close()

    def _unusable(self, why: str) -> sqlite3.Connection:
        if self.strict:
            raise FindDbError(why)
        self._warn(f"gemmconv find database: {why}; using an in-memory database for this process")
        self.path = IN_MEMORY
        self.read_only = False
        return _memory_database()

    def _refuse_write(self) -> None:
        if self.strict:
            raise FindDbError(f"{self.path} is read-only; nothing was written")
        self._warn(
            f"gemmconv find database {self.path} is read-only: its results are used, "
            "new ones are not stored",
            once=("read-only",),
        )

    def _warn(self, message: str, once: tuple | None = None) -> None:
        if once is not None:
            if once in self._warned:
                return
            self._warned.add(once)
        warnings.warn(message, FindDbWarning, stacklevel=2)

    def _run(self, work: Callable[[sqlite3.Connection], T], write: bool) -> T | None:
        """Run ``work`` in one transaction. A file that turns out unreadable is moved
        aside and rebuilt, and the work retried once on the new file; a write to a
        file that refuses it reopens the file read-only and stores nothing (None)."""
        with self._lock:
            if not write and self._conn is None and self._absent():
                # Reading a database that does not exist yet: nothing to find, and no
                # reason to create a file (or warn about an unwritable location).
                return work(_EMPTY)
            conn = self._connection()
            if write and self._moved():
                conn = self._reopen_moved(conn)
            if write and self.read_only:
                return self._refuse_write()
            try:
                with conn:
                    return work(conn)
            except sqlite3.Error as e:
                if self.in_memory:
                    raise
                if write and _error_code(e) == _SQLITE_READONLY:
                    conn.close()
                    self._conn = self._open_read_only()
                    return self._refuse_write()
                if not _unreadable(e):
                    raise  # a constraint, a lock past the timeout, a full disk: not corruption
                conn.close()
                if self.read_only:
                    why = f"{self.path} is unreadable ({e}) and read-only, so it stays as it is"
                    self._conn = self._unusable(why)
                else:
                    self._conn = self._recover(e)
            if write and self.read_only:
                return self._refuse_write()
            with self._conn:
                return work(self._conn)

    def _absent(self) -> bool:
        return not self.in_memory and not os.path.exists(self.path)

    def _moved(self) -> bool:
        """Whether the file at the path is no longer the one the connection has open
        (deleted, or replaced by a rename): one stat, made before each write."""
        if self.in_memory or self.read_only or self._conn is None:
            return False
        return _file_identity(self.path) != self._file

    def _reopen_moved(self, conn: sqlite3.Connection) -> sqlite3.Connection:
        """Leave the file that was deleted or replaced, and open the one now at the
        path (a new one where there is none), with one warning: results stored from
        now on go where every other process will look for them."""
        self._warn(
            f"gemmconv find database {self.path} was deleted or replaced while this "
            "process had it open; storing results in the file now at that path"
        )
        _retire(conn)
        self._conn, self._file = None, None
        return self._connection()

    def close(self) -> None:
        with self._lock:
            if self._conn is not None and self._pid == os.getpid():
                if self._moved():
                    _retire(self._conn)
                else:
                    self._conn.close()
            self._conn = None

    # ---- find results -------------------------------------------------------

    def _usable(self, row: Row) -> Record | None:
        """The row's record; None, with one warning per row, when it does not parse."""
        if row.record is None:
            self._warn(
                f"gemmconv find database {self.path}: ignoring a row that does not parse "
                f"({row.error}): {row.values}",
                once=("row", *(repr(row.values[c]) for c in _FIND_COLUMNS[:5])),
            )
        return row.record

    def lookup(self, problem: str, identity: Identity) -> Record | None:
        """The stored result for ``problem`` measured under ``identity``, if any (a row
        that does not parse is none, with a warning)."""
        row = self._run(
            lambda conn: conn.execute(
                f"SELECT {', '.join(_FIND_COLUMNS)} FROM find WHERE problem = ? "
                "AND device = ? AND capability = ? AND torch_version = ? "
                "AND gemmconv_version = ?",
                (problem, *identity.values()),
            ).fetchone(),
            write=False,
        )
        return None if row is None else self._usable(_row(row))

    def store(self, record: Record) -> None:
        """Insert or replace the result for the record's problem and identity."""
        self.store_many([record])

    def store_many(self, records: list[Record]) -> int:
        """Store every record in one transaction (all or none); returns how many results
        were written: one per key (problem and identity), the last record of a key
        replacing the ones before it, and 0 where the database refuses writes."""
        last = {r.key: r for r in records}
        rows = [
            (
                r.problem,
                *r.identity.values(),
                r.solver,
                json.dumps(r.config, sort_keys=True),
                r.time_ms,
                r.workspace_bytes,
                time.time(),
            )
            for r in last.values()
        ]
        columns = (*_FIND_COLUMNS, "created")

        def insert(conn: sqlite3.Connection) -> int:
            conn.executemany(
                f"INSERT OR REPLACE INTO find ({', '.join(columns)}) "
                f"VALUES ({', '.join('?' * len(columns))})",
                rows,
            )
            return len(rows)

        return self._run(insert, write=True) or 0

    def rows(self, identity: Identity | None = None) -> list[Row]:
        """Every stored row (of ``identity`` only, when given), parsed where it parses,
        in a stable order."""
        query = f"SELECT {', '.join(_FIND_COLUMNS)} FROM find"
        params: tuple = ()
        if identity is not None:
            query += " WHERE device = ? AND capability = ? AND torch_version = ? "
            query += "AND gemmconv_version = ?"
            params = identity.values()
        query += " ORDER BY device, problem"
        found = self._run(lambda conn: conn.execute(query, params).fetchall(), write=False)
        return [_row(values) for values in found]

    def records(self, identity: Identity | None = None) -> list[Record]:
        """Every stored result (of ``identity`` only, when given), in a stable order;
        rows that do not parse are left out, with one warning each."""
        records = (self._usable(row) for row in self.rows(identity))
        return [r for r in records if r is not None]

    def clear(self) -> int:
        """Delete every find result and measured rate; returns the number of results."""

        def delete(conn: sqlite3.Connection) -> int:
            count = conn.execute("DELETE FROM find").rowcount
            conn.execute("DELETE FROM rates")
            return count

        return self._run(delete, write=True) or 0

    def export_json(self, path: str | os.PathLike) -> int:
        """Write every stored result that parses to ``path`` as JSON; returns how many.
        Rows that do not parse are left out, with one warning each. ValueError, before
        anything is written, where ``path`` is this database's own file (or its -wal or
        -shm), however it is named: the export would overwrite the results it holds."""
        live = self._file_at(path)
        if live is not None:
            raise ValueError(
                f"export file {os.fspath(path)!r} is the find database's own file {live}: "
                "exporting into it would overwrite the database; nothing exported"
            )
        records = [r.as_json() for r in self.records()]
        Path(path).write_text(json.dumps({"records": records}, indent=1) + "\n")
        return len(records)

    def _file_at(self, path: str | os.PathLike) -> str | None:
        """The file of this database (the database, its -wal or its -shm) that ``path``
        names, through a symlink, a relative path or a hard link; None if none."""
        if self.requested_path == IN_MEMORY:
            return None
        for live in (self.requested_path + suffix for suffix in ("", "-wal", "-shm")):
            try:
                if os.path.samefile(path, live):
                    return live
            except OSError:  # one of them does not exist: compare where they would be
                if os.path.realpath(path) == os.path.realpath(live):
                    return live
        return None

    def import_json(self, path: str | os.PathLike) -> int:
        """Store every record of an exported file, or, when any record is bad, none:
        ValueError names the first bad one. Returns the number of results stored: one
        per key, the last record of a key in the file replacing those before it."""
        return self.store_many(read_json(path))

    # ---- measured device rates ----------------------------------------------

    def lookup_rates(self, identity: Identity) -> dict | None:
        row = self._run(
            lambda conn: conn.execute(
                "SELECT rates FROM rates WHERE device = ? AND capability = ? "
                "AND torch_version = ? AND gemmconv_version = ?",
                identity.values(),
            ).fetchone(),
            write=False,
        )
        if row is None:
            return None
        try:  # text only: json.loads would guess an encoding for bytes (not UTF-8 text)
            rates = json.loads(row[0]) if isinstance(row[0], str) else None
        except (ValueError, RecursionError):
            rates = None
        if not isinstance(rates, dict):
            self._warn(
                f"gemmconv find database {self.path}: ignoring unreadable rates {_shown(row[0])}",
                once=("rates", *identity.values()),
            )
            return None
        return rates

    def store_rates(self, identity: Identity, rates: dict) -> None:
        row = (*identity.values(), json.dumps(rates, sort_keys=True), time.time())
        self._run(
            lambda conn: conn.execute("INSERT OR REPLACE INTO rates VALUES (?,?,?,?,?,?)", row),
            write=True,
        )


def read_json(path: str | os.PathLike) -> list[Record]:
    """The records of an exported file, in file order, every one checked (a Record, a
    known solver id); ValueError, naming the file and the first bad record, otherwise."""
    from gemmconv.solvers import solver_ids

    where = f"import file {os.fspath(path)!r}"
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise ValueError(f"{where}: cannot read JSON ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("records"), list):
        raise ValueError(f"{where}: expected an object with a 'records' list")
    known = solver_ids()
    records = []
    for i, row in enumerate(data["records"]):
        problem = row.get("problem") if isinstance(row, dict) else None
        name = f"record {i}" + ("" if problem is None else f" (problem {_shown(problem)})")
        try:
            record = Record.from_json(row)
            if record.solver not in known:
                raise ValueError(
                    f"solver={_shown(record.solver)}: unknown solver id; expected one of "
                    f"{', '.join(known)}"
                )
        except (KeyError, ValueError) as e:
            raise ValueError(f"{where}: {name}: {e}; nothing imported") from None
        records.append(record)
    return records


# Stands in for a database file that does not exist yet; never written to.
_EMPTY = _memory_database()

_shared: FindDb | None = None
_shared_lock = threading.Lock()


def get_db() -> FindDb:
    """The process's database at the current default path (reopened if it changed)."""
    global _shared
    path = str(default_path())
    with _shared_lock:
        if _shared is None or _shared.requested_path != path:
            if _shared is not None:
                _shared.close()
            _shared = FindDb(path)
        return _shared


def reset_db() -> None:
    """Forget the shared database (tests use this after changing $GEMMCONV_DB)."""
    global _shared
    with _shared_lock:
        if _shared is not None:
            _shared.close()
        _shared = None


__all__ = [
    "DATABASE_ERRORS",
    "FindDb",
    "FindDbError",
    "FindDbWarning",
    "Identity",
    "Record",
    "Row",
    "cache_directory",
    "default_path",
    "get_db",
    "identity_for",
    "read_json",
    "reset_db",
]
