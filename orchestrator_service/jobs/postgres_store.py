"""The job store on a PostgreSQL server: every orchestrator replica of a cluster shares it.

A claim locks its row with FOR UPDATE SKIP LOCKED (two replicas never take the same job, and neither waits
on the other's), and a creation holds a transaction-scoped advisory lock on its owner so the quota's count
and the insert are one step. psycopg 3 runs on a few worker threads, each transaction on a pooled
connection; a pooled connection found dead (the server restarted) is replaced before its transaction
begins, so a restart costs no failed call once the server is back. Leases are timed on the server's clock
(`clock_timestamp()`), the one clock every replica shares: replicas whose own clocks disagree by more than a
lease neither take over a live lease nor keep a dead one.
"""

from __future__ import annotations

import hashlib
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from omnistage.store_url import redacted_url
from orchestrator_service.jobs.sql_store import Cursor, Dialect, SqlJobStore

# Store calls one replica runs at once: the runner renews each running job's lease about once a second
# (--jobs-concurrency, 2 by default) while the API reads; more threads would only queue on the server.
THREADS = 4
# How long a connection attempt may take before the store counts as unavailable (the caller answers 503):
# a reachable server answers in milliseconds, one that is down refuses at once or never answers.
CONNECT_TIMEOUT_S = 5
# A statement the server cannot finish in this long (a lock held by a replica frozen mid-transaction) fails
# as unavailable instead of holding a worker thread for good; every statement here takes milliseconds.
STATEMENT_TIMEOUT_S = 30.0
# A session frozen inside a transaction (its process paused) loses it after this, releasing its locks;
# the store's transactions never wait on the client between statements.
IDLE_IN_TRANSACTION_TIMEOUT_S = 60.0
# A server that vanished without closing the connection (its node died, a partition) is noticed by TCP
# keepalives after about idle + interval x count = 5 + 2 x 3 s, and unacknowledged writes fail after 15 s.
KEEPALIVES: dict[str, Any] = {"keepalives": 1, "keepalives_idle": 5, "keepalives_interval": 2, "keepalives_count": 3,
                              "tcp_user_timeout": 15_000}

POSTGRES = Dialect(blob="BYTEA", real="DOUBLE PRECISION", begin_write="BEGIN",
                   claim_lock=" FOR UPDATE SKIP LOCKED", placeholder="%s",
                   table_exists="SELECT to_regclass(?) IS NOT NULL",
                   column_exists="SELECT COUNT(*) > 0 FROM information_schema.columns"
                                 " WHERE table_schema = current_schema() AND table_name = ? AND column_name = ?")


def _lock_key(name: str) -> int:
    """A signed 64-bit advisory lock key for `name` (stable across processes, unlike hash())."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "big", signed=True)


_SCHEMA_LOCK = _lock_key("omnistage_jobs schema")


def owner_lock_key(owner: str) -> int:
    """The advisory lock a creation holds on its owner while it counts the owner's queued jobs."""
    return _lock_key("omnistage_jobs owner " + owner)


def with_options(url: str, options: str) -> str:
    """The server options of a connection to `url`: the URL's own (`?options=-csearch_path%3Dvideo`), then
    `options` (libpq takes one `options` value: a keyword argument would replace the URL's)."""
    own = conninfo_to_dict(url).get("options")
    return f"{own} {options}" if own else options


class PostgresJobStore(SqlJobStore):
    dialect = POSTGRES

    def __init__(self, url: str, pipeline: str, statement_timeout_s: float = STATEMENT_TIMEOUT_S,
                 server_clock: bool = True, **settings: Any):
        """`server_clock` False: leases are timed on the `now` each call passes (tests of the contract);
        `settings`: SqlJobStore's (max_attempts, ttl_s)."""
        super().__init__(threads=THREADS, pipeline=pipeline, **settings)
        self.url = url
        self.name = redacted_url(url)
        self.statement_timeout_s = statement_timeout_s
        self.server_clock = server_clock

    def _connect(self) -> Any:
        options = (f"-c statement_timeout={int(self.statement_timeout_s * 1000)}"
                   f" -c idle_in_transaction_session_timeout={int(IDLE_IN_TRANSACTION_TIMEOUT_S * 1000)}")
        return psycopg.connect(self.url, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S,
                               application_name="omnistage-orchestrator", options=with_options(self.url, options),
                               **KEEPALIVES)

    def _unreachable(self, error: BaseException) -> bool:
        # OperationalError: refused, server gone, connection lost, admin shutdown, statement timeout;
        # InterfaceError: the connection was closed under us.
        return isinstance(error, (psycopg.OperationalError, psycopg.InterfaceError))

    def _lost(self, connection: Any) -> bool:
        return bool(connection.broken or connection.closed)

    def _lock_owner(self, cur: Cursor, owner: str) -> None:
        cur.execute("SELECT pg_advisory_xact_lock(?)", (owner_lock_key(owner),))

    def _lock_schema(self, cur: Cursor) -> None:
        # Two replicas creating the table at once would collide in the catalog (a unique violation).
        cur.execute("SELECT pg_advisory_xact_lock(?)", (_SCHEMA_LOCK,))

    def _lease_now(self, cur: Cursor, now: float) -> float:
        if not self.server_clock:
            return now
        # clock_timestamp(): the time now, not the transaction's start (now()), as the caller's `now` would be.
        return float(cur.execute("SELECT extract(epoch FROM clock_timestamp())").fetchone()[0])
