"""The find database: which solver won a benchmark, per problem and machine, in sqlite.

One file per user, at ``$GEMMCONV_DB`` or ``<cache dir>/gemmconv/find.sqlite`` (the
cache dir is ``$XDG_CACHE_HOME`` or ``~/.cache``). A row is keyed by the problem key
and the identity of what measured it: device name, compute capability, torch version,
gemmconv version. A lookup sees only rows of the current identity, so results from
another GPU or another release are ignored, never reused.

Several processes may read and write the file at once: it runs in WAL mode with a
busy timeout, and every write is one short transaction. The database must never be
why a convolution fails, so a file sqlite cannot read is moved aside (renamed with a
``.corrupt-<timestamp>`` suffix) with one warning and rebuilt, and a location that
cannot be written degrades to an in-memory database with one warning.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import platform
import sqlite3
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

log = logging.getLogger("gemmconv.finddb")

SCHEMA_VERSION = 1
BUSY_TIMEOUT_MS = 30_000
IN_MEMORY = ":memory:"

T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS find (
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
);
CREATE TABLE IF NOT EXISTS rates (
    device TEXT NOT NULL,
    capability TEXT NOT NULL,
    torch_version TEXT NOT NULL,
    gemmconv_version TEXT NOT NULL,
    rates TEXT NOT NULL,
    created REAL NOT NULL,
    PRIMARY KEY (device, capability, torch_version, gemmconv_version)
);
"""

_IDENTITY_COLUMNS = ("device", "capability", "torch_version", "gemmconv_version")


class FindDbWarning(UserWarning):
    """The find database could not be used as asked; it carried on degraded."""


@dataclasses.dataclass(frozen=True)
class Identity:
    """What a measurement is valid for."""

    device: str
    capability: str
    torch_version: str
    gemmconv_version: str

    def values(self) -> tuple[str, str, str, str]:
        return (self.device, self.capability, self.torch_version, self.gemmconv_version)


def identity_for(device_type: str, index: int | None = None) -> Identity:
    """The identity of the current process on ``device_type`` (the current CUDA device
    when ``index`` is None)."""
    import torch

    from gemmconv import __version__

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
    """One find result."""

    problem: str
    identity: Identity
    solver: str
    config: dict
    time_ms: float
    workspace_bytes: int

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
    def from_json(cls, row: dict) -> Record:
        try:
            return cls(
                problem=str(row["problem"]),
                identity=Identity(*(str(row[c]) for c in _IDENTITY_COLUMNS)),
                solver=str(row["solver"]),
                config=dict(row.get("config") or {}),
                time_ms=float(row["time_ms"]),
                workspace_bytes=int(row["workspace_bytes"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"find database record {row!r}: missing or bad field ({e})") from e


def default_path() -> Path:
    """``$GEMMCONV_DB``, else the platform cache directory's gemmconv/find.sqlite."""
    explicit = os.environ.get("GEMMCONV_DB")
    if explicit:
        return Path(explicit).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "gemmconv" / "find.sqlite"


class FindDb:
    """A find database file (or an in-memory one). Safe to share between threads."""

    def __init__(self, path: str | os.PathLike | None = None) -> None:
        self.requested_path = str(default_path() if path is None else path)
        self._lock = threading.RLock()
        self._conn: sqlite3.Connection | None = None
        self._pid = -1
        self.path = self.requested_path  # becomes IN_MEMORY when degraded

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
            return self._connect(IN_MEMORY)
        try:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            conn = self._connect(self.path)
        except (OSError, sqlite3.OperationalError) as e:
            return self._degrade(f"cannot open {self.path} ({e})")
        except sqlite3.DatabaseError as e:
            return self._recover(e)
        return conn

    def _connect(self, path: str) -> sqlite3.Connection:
        conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_MS / 1000, check_same_thread=False)
        try:
            conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            if path != IN_MEMORY:
                conn.execute("PRAGMA journal_mode = WAL")
                conn.execute("PRAGMA synchronous = NORMAL")
            with conn:
                conn.executescript(_SCHEMA)
                conn.execute(
                    "INSERT OR IGNORE INTO meta (name, value) VALUES ('schema', ?)",
                    (str(SCHEMA_VERSION),),
                )
            schema = conn.execute("SELECT value FROM meta WHERE name = 'schema'").fetchone()
            if schema is None or schema[0] != str(SCHEMA_VERSION):
                raise sqlite3.DatabaseError(f"schema version {schema!r}, expected {SCHEMA_VERSION}")
        except BaseException:
            conn.close()
            raise
        return conn

    def _recover(self, error: Exception) -> sqlite3.Connection:
        """Move an unreadable file aside and start a fresh one in its place."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        aside = f"{self.path}.corrupt-{stamp}-{os.getpid()}"
        try:
            os.replace(self.path, aside)
            for suffix in ("-wal", "-shm"):
                with contextlib.suppress(FileNotFoundError):
                    os.replace(self.path + suffix, aside + suffix)
        except OSError as e:
            return self._degrade(f"{self.path} is unreadable ({error}) and cannot be moved ({e})")
        warnings.warn(
            f"gemmconv find database {self.path} was unreadable ({error}); moved it to "
            f"{aside} and started a new one",
            FindDbWarning,
            stacklevel=4,
        )
        try:
            return self._connect(self.path)
        except (OSError, sqlite3.Error) as e:
            return self._degrade(f"cannot rebuild {self.path} ({e})")

    def _degrade(self, why: str) -> sqlite3.Connection:
        warnings.warn(
            f"gemmconv find database: {why}; using an in-memory database for this process",
            FindDbWarning,
            stacklevel=4,
        )
        self.path = IN_MEMORY
        return self._connect(IN_MEMORY)

    def _run(self, work: Callable[[sqlite3.Connection], T], write: bool) -> T:
        """Run ``work`` in one transaction. A file that turns out unreadable is moved
        aside and rebuilt, one that refuses writes degrades to memory; either way the
        work is retried once on the new database."""
        with self._lock:
            if not write and self._conn is None and self._absent():
                # Reading a database that does not exist yet: nothing to find, and no
                # reason to create a file (or warn about an unwritable location).
                return work(_EMPTY)
            conn = self._connection()
            try:
                with conn:
                    return work(conn)
            except sqlite3.OperationalError as e:
                if not write or self.in_memory or "readonly" not in str(e).replace(" ", ""):
                    raise
                self._conn = self._degrade(f"{self.path} is read-only ({e})")
            except sqlite3.DatabaseError as e:
                if self.in_memory:
                    raise
                conn.close()
                self._conn = self._recover(e)
            with self._conn:
                return work(self._conn)

    def _absent(self) -> bool:
        return not self.in_memory and not os.path.exists(self.path)

    def close(self) -> None:
        with self._lock:
            if self._conn is not None and self._pid == os.getpid():
                self._conn.close()
            self._conn = None

    # ---- find results -------------------------------------------------------

    def lookup(self, problem: str, identity: Identity) -> Record | None:
        """The stored result for ``problem`` measured under ``identity``, if any."""
        row = self._run(
            lambda conn: conn.execute(
                "SELECT solver, config, time_ms, workspace_bytes FROM find WHERE problem = ? "
                "AND device = ? AND capability = ? AND torch_version = ? "
                "AND gemmconv_version = ?",
                (problem, *identity.values()),
            ).fetchone(),
            write=False,
        )
        if row is None:
            return None
        return Record(problem, identity, row[0], json.loads(row[1]), row[2], row[3])

    def store(self, record: Record) -> None:
        """Insert or replace the result for the record's problem and identity."""
        self.store_many([record])

    def store_many(self, records: list[Record]) -> None:
        rows = [
            (
                r.problem,
                *r.identity.values(),
                r.solver,
                json.dumps(r.config, sort_keys=True),
                float(r.time_ms),
                int(r.workspace_bytes),
                time.time(),
            )
            for r in records
        ]
        self._run(
            lambda conn: conn.executemany(
                "INSERT OR REPLACE INTO find VALUES (?,?,?,?,?,?,?,?,?,?)", rows
            ),
            write=True,
        )

    def records(self, identity: Identity | None = None) -> list[Record]:
        """Every stored result (of ``identity`` only, when given), in a stable order."""
        query = (
            "SELECT problem, device, capability, torch_version, gemmconv_version, solver, "
            "config, time_ms, workspace_bytes FROM find"
        )
        params: tuple = ()
        if identity is not None:
            query += " WHERE device = ? AND capability = ? AND torch_version = ? "
            query += "AND gemmconv_version = ?"
            params = identity.values()
        query += " ORDER BY device, problem"
        rows = self._run(lambda conn: conn.execute(query, params).fetchall(), write=False)
        return [Record(r[0], Identity(*r[1:5]), r[5], json.loads(r[6]), r[7], r[8]) for r in rows]

    def clear(self) -> int:
        """Delete every find result and measured rate; returns the number of results."""

        def delete(conn: sqlite3.Connection) -> int:
            count = conn.execute("DELETE FROM find").rowcount
            conn.execute("DELETE FROM rates")
            return count

        return self._run(delete, write=True)

    def export_json(self, path: str | os.PathLike) -> int:
        records = [r.as_json() for r in self.records()]
        Path(path).write_text(json.dumps({"records": records}, indent=1) + "\n")
        return len(records)

    def import_json(self, path: str | os.PathLike) -> int:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"import file {os.fspath(path)!r}: cannot read JSON ({e})") from e
        if not isinstance(data, dict) or not isinstance(data.get("records"), list):
            raise ValueError(
                f"import file {os.fspath(path)!r}: expected an object with a 'records' list"
            )
        records = [Record.from_json(row) for row in data["records"]]
        self.store_many(records)
        return len(records)

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
        return None if row is None else json.loads(row[0])

    def store_rates(self, identity: Identity, rates: dict) -> None:
        row = (*identity.values(), json.dumps(rates, sort_keys=True), time.time())
        self._run(
            lambda conn: conn.execute("INSERT OR REPLACE INTO rates VALUES (?,?,?,?,?,?)", row),
            write=True,
        )


def _empty_database() -> sqlite3.Connection:
    conn = sqlite3.connect(IN_MEMORY, check_same_thread=False)
    conn.executescript(_SCHEMA)
    return conn


# Stands in for a database file that does not exist yet; never written to.
_EMPTY = _empty_database()

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
    "FindDb",
    "FindDbWarning",
    "Identity",
    "Record",
    "default_path",
    "get_db",
    "identity_for",
    "reset_db",
]
