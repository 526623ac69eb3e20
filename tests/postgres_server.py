"""A real PostgreSQL server for tests: initdb into a temporary folder, `postgres` on a unix socket only (no TCP).

The server runs as the current user, or as the `postgres` user (through runuser) when the tests run as
root, which initdb refuses. Its unix socket lies in its own folder, so it never meets a system server.
`stop()` and `start()` take it down and bring it back on the same socket and data (a backend outage): no other
process can take that address in between.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path
from urllib.parse import quote

import psycopg

from tests.polling import wait_until_sync

SUPERUSER = "omnistage"
# initdb and a first start on a busy 2-core machine take a few seconds; a bound, not an expectation.
START_TIMEOUT_S = 120


def _bin_dir() -> Path:
    found = shutil.which("initdb")
    if found:
        return Path(found).parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    if not versions:
        raise AssertionError("no PostgreSQL server (initdb) on PATH or under /usr/lib/postgresql/*/bin: "
                             "`make setup` installs it (apt-get install postgresql)")
    return Path(versions[-1]).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PostgresServer:
    def __init__(self) -> None:
        self.bin = _bin_dir()
        self.root = Path(tempfile.mkdtemp(prefix="omnistage-pg-"))
        self.data, self.sockets, self.log = self.root / "data", self.root / "sockets", self.root / "server.log"
        self.sockets.mkdir()
        self.user: str | None = None
        if os.geteuid() == 0:  # initdb and postgres refuse to run as root
            self.user = "postgres"
            entry = pwd.getpwnam(self.user)
            for path in (self.root, self.sockets):
                os.chown(path, entry.pw_uid, entry.pw_gid)
        self.port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self._run([str(self.bin / "initdb"), "-D", str(self.data), "-U", SUPERUSER, "-A", "trust", "-E", "UTF8",
                   "--no-sync"], check=True)

    def url(self, database: str = "postgres") -> str:
        # Over its own unix socket: a restart (stop(), start()) never finds its address taken by another process
        # meanwhile, as a TCP port could be; the port only names the socket file.
        return f"postgresql://{SUPERUSER}@/{database}?host={quote(str(self.sockets), safe='')}&port={self.port}"

    def _command(self, argv: list[str]) -> list[str]:
        return argv if self.user is None else ["runuser", "-u", self.user, "--", *argv]

    def _run(self, argv: list[str], check: bool) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(self._command(argv), check=check, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def start(self) -> None:
        assert self.proc is None, "already running"
        # fsync off: the tests never crash the machine, and it keeps the server light on a shared disk.
        argv = [str(self.bin / "postgres"), "-D", str(self.data), "-p", str(self.port), "-k", str(self.sockets),
                "-c", "listen_addresses=", "-c", "fsync=off", "-c", "full_page_writes=off"]
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(self._command(argv), stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        wait_until_sync(self._accepts, START_TIMEOUT_S, 0.1, what="postgres accepting connections",
                        detail=lambda: self.log.read_text()[-2000:])

    def _accepts(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"postgres exited ({self.proc.returncode}): {self.log.read_text()[-2000:]}")
        try:
            with psycopg.connect(self.url(), connect_timeout=2):
                return True
        except psycopg.OperationalError:
            return False

    def stop(self) -> None:
        """Fast shutdown (SIGINT): open sessions are ended, as when a database server goes away."""
        if self.proc is None:
            return
        if self.proc.poll() is not None:  # it died by itself: nothing to stop
            self.proc = None
            return
        # runuser keeps its child in the foreground of the session: signal the server itself through its pid file.
        pid = int((self.data / "postmaster.pid").read_text().split()[0])
        os.kill(pid, signal.SIGINT)
        self.proc.wait(timeout=START_TIMEOUT_S)
        self.proc = None

    def create_database(self) -> str:
        """A fresh empty database; its URL."""
        name = "jobs_" + uuid.uuid4().hex[:12]
        with psycopg.connect(self.url(), autocommit=True) as admin:
            admin.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)
