"""The job store in one SQLite file: one host's orchestrators (`omnistage serve`, a single-node deployment).

Several orchestrator processes may share the file: WAL mode lets readers run beside the one writer, every
writing transaction begins IMMEDIATE (it takes the write lock before reading, so two claims never pick the
same job), and a busy timeout makes a writer wait for the lock instead of failing at once. The stdlib driver
runs on one worker thread per store, so the event loop never waits on the file.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from omnistage.store_url import redacted_url, sqlite_file
from orchestrator_service.jobs.sql_store import Dialect, SqlJobStore

# How long a writer waits for another process's write lock before the store counts as unavailable: every
# transaction here is a few statements (milliseconds), so 5 s only runs out when the file is stuck.
BUSY_TIMEOUT_S = 5.0
# SQLite's primary result codes that mean the file cannot be used now (sqlite.org/rescode.html), as opposed to a
# statement the database refuses (SQLITE_ERROR: "no such column", a schema the code does not match), which is
# raised as the error it is: retrying it would answer 503 for good.
UNREACHABLE_CODES = frozenset({
    3,   # SQLITE_PERM: access denied
    5,   # SQLITE_BUSY: another process holds the lock past the busy timeout
    6,   # SQLITE_LOCKED
    7,   # SQLITE_NOMEM
    8,   # SQLITE_READONLY: a read-only file or volume
    10,  # SQLITE_IOERR: disk I/O error
    11,  # SQLITE_CORRUPT
    13,  # SQLITE_FULL: the disk is full
    14,  # SQLITE_CANTOPEN: the file or its folder cannot be opened
    15,  # SQLITE_PROTOCOL: a locking protocol error (WAL)
    26,  # SQLITE_NOTADB: the file is not a database (replaced or corrupt)
})

SQLITE = Dialect(blob="BLOB", real="REAL", begin_write="BEGIN IMMEDIATE", claim_lock="", placeholder="?",
                 table_exists="SELECT COUNT(*) FROM sqlite_master WHERE type = 'table' AND name = ?",
                 column_exists="SELECT COUNT(*) FROM pragma_table_info(?) WHERE name = ?")


def sqlite_path(url: str) -> Path:
    """The file of a `sqlite:///abs/path.db` (or `sqlite:relative/path.db`) URL; ValueError when it names a host or
    no file."""
    path = sqlite_file(url)
    if path is None:
        names_host = url.startswith("sqlite://") and not url[len("sqlite://"):].startswith("/") and len(url) > 9
        why = "a sqlite URL names a file (sqlite:///path/jobs.db), not a host" if names_host else \
            "names no file (sqlite:///path/jobs.db)"
        raise ValueError(f"job store URL {redacted_url(url)!r}: {why}")
    return Path(path)


class SqliteJobStore(SqlJobStore):
    dialect = SQLITE

    def __init__(self, path: Path | str, pipeline: str, busy_timeout_s: float = BUSY_TIMEOUT_S, **settings: Any):
        # one connection: SQLite has one writer at a time anyway; `settings`: SqlJobStore's (max_attempts, ttl_s)
        super().__init__(threads=1, pipeline=pipeline, **settings)
        self.path = Path(path)
        self.busy_timeout_s = busy_timeout_s
        self.name = f"sqlite://{self.path}" if self.path.is_absolute() else f"sqlite:{self.path}"

    def _connect(self) -> Any:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # isolation_level None: the store begins its transactions itself; check_same_thread False: close() may
        # run on another thread than the worker (only one thread uses the connection at a time).
        connection = sqlite3.connect(self.path, timeout=self.busy_timeout_s, isolation_level=None,
                                     check_same_thread=False)
        try:
            connection.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_s * 1000)}")
            (mode,) = connection.execute("PRAGMA journal_mode = WAL").fetchone()
            if mode.lower() != "wal":
                raise sqlite3.OperationalError(f"{self.path}: journal mode {mode}, not WAL")
        except BaseException:
            connection.close()
            raise
        return connection

    def _unreachable(self, error: BaseException) -> bool:
        # By SQLite's result code: cannot open, locked past the busy timeout, disk I/O error, read-only, not a
        # database (UNREACHABLE_CODES); an error without one is the store's own (a folder it cannot create, the
        # journal mode refused). A bad statement, integrity and programming errors are the caller's, not the file's.
        code = getattr(error, "sqlite_errorcode", None)
        if code is not None:
            return code & 0xFF in UNREACHABLE_CODES
        return isinstance(error, (sqlite3.OperationalError, OSError)) or type(error) is sqlite3.DatabaseError
