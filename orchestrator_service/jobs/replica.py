"""One orchestrator replica's part of the job API, as the server wires it: the store its `--jobs-store` URL names,
the content folder, the door-neutral operations (given to the servicer, so both doors share them) and the runner.
Without a store the operations exist and refuse to create jobs (NO_STORE)."""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from . import open_store
from .api import JobApi, JobSettings
from .content import ContentStore
from .runner import RENEW_S, JobRunner
from .sqlite_store import sqlite_path
from .store import JobStore, StoreUnavailable

log = logging.getLogger("omnistage.orchestrator.jobs")
CONTENT_BESIDE_SQLITE = "content"  # the content folder a sqlite store has by default: beside its file
LEASE_RENEWALS = 2  # a lease lasts at least this many renewals: one renewal missed (a slow store) never loses it


SCRATCH_PREFIX = "omnistage-jobs-"
SCRATCH_LOCK = ".owner.lock"  # held (flock) by the replica whose folder it is, for as long as it lives
SCRATCH_UNLOCKED_GRACE_S = 60.0  # a folder with no lock file yet is a replica's being made: left alone this long


def new_scratch(base: Path | None = None) -> tuple[Path, int]:
    """A new scratch folder for this replica's MP4s in `base` (the system's temporary folder) and the descriptor of
    the lock it holds on it (closing it frees the folder to be swept), after sweeping the folders whose replica is
    gone: one killed with -9 never removed its own (its partial MP4s). A folder is its replica's while that process
    holds its lock (whatever its pid, in whatever pid namespace shares this folder)."""
    base = Path(base or tempfile.gettempdir())
    for old in base.glob(f"{SCRATCH_PREFIX}*"):
        if old.is_dir() and _abandoned(old):
            shutil.rmtree(old, ignore_errors=True)
    folder = Path(tempfile.mkdtemp(prefix=SCRATCH_PREFIX, dir=base))
    fd = os.open(folder / SCRATCH_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return folder, fd


def _abandoned(folder: Path) -> bool:
    """No process holds the folder's lock (one made just now without its lock yet is not abandoned)."""
    try:
        fd = os.open(folder / SCRATCH_LOCK, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        try:
            return time.time() - folder.stat().st_mtime > SCRATCH_UNLOCKED_GRACE_S
        except FileNotFoundError:
            return False
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held: its replica lives
        return False
    finally:
        os.close(fd)  # frees the lock taken, if it was
    return True


class JobsFlagError(ValueError):
    """A jobs flag that cannot work (the process refuses to start, naming it)."""


def check_settings(settings: JobSettings) -> None:
    """The jobs flags' values, each refused naming its flag (pure)."""
    if settings.lease_s < LEASE_RENEWALS * RENEW_S:
        raise JobsFlagError(f"--jobs-lease-s {settings.lease_s:g}: at least {LEASE_RENEWALS * RENEW_S:g} (a lease is "
                            f"renewed every {RENEW_S:g} s and must outlast a missed renewal)")
    if settings.concurrency < 0:
        raise JobsFlagError(f"--jobs-concurrency {settings.concurrency}: 0 (this replica runs no jobs) or more")
    if settings.max_queued_per_key < 1:
        raise JobsFlagError(f"--jobs-max-queued-per-key {settings.max_queued_per_key}: at least 1")
    if not settings.ttl_s >= 0:
        raise JobsFlagError(f"--jobs-ttl-s {settings.ttl_s:g}: 0 or more seconds")
    if settings.max_attempts < 1:
        raise JobsFlagError(f"--jobs-max-attempts {settings.max_attempts}: at least 1")


def content_root(store_url: str, content_dir: str | None) -> Path:
    """Where finished content is kept: `content_dir`, else beside a sqlite store's file (pure). A PostgreSQL
    store is shared by replicas on several hosts: their content folder must be named (a shared volume)."""
    if content_dir:
        return Path(content_dir)
    if store_url.partition(":")[0].lower() == "sqlite":
        return sqlite_path(store_url).parent / CONTENT_BESIDE_SQLITE
    raise JobsFlagError("--jobs-content is needed with a PostgreSQL job store: a folder every orchestrator replica "
                     "mounts (a shared volume), where finished videos are kept")


class ReplicaJobs:
    def __init__(self, servicer, metrics, store_url: str | None, content_dir: str | None,
                 settings: JobSettings = JobSettings()):
        """Checks the flags (JobsFlagError naming the one at fault) and opens nothing yet."""
        check_settings(settings)
        try:
            # the store keeps this pipeline's jobs only: pipelines sharing a database never run each other's
            self.store: JobStore | None = (open_store(store_url, pipeline=servicer.pipeline.name,
                                                      max_attempts=settings.max_attempts, ttl_s=settings.ttl_s)
                                           if store_url else None)
        except ValueError as e:
            raise JobsFlagError(f"--jobs-store: {e}") from None
        content = ContentStore(content_root(store_url, content_dir)) if store_url else None
        self.api = servicer.jobs = JobApi(servicer.pipeline, self.store, content, settings, media=servicer.media)
        self.runner: JobRunner | None = None
        self._servicer, self._metrics = servicer, metrics
        self._scratch: Path | None = None
        self._scratch_lock = -1

    async def start(self) -> None:
        """Open the store (unreachable now: logged, its operations answer 503 until it is back) and start running
        jobs."""
        if self.store is None:
            return
        try:
            await self.store.open()
        except StoreUnavailable as e:
            log.warning("jobs: the store is unreachable at start (%s); jobs wait until it is back", e)
        # MP4s grow here, on this host's disk, and are copied into the content folder once whole.
        self._scratch, self._scratch_lock = await asyncio.to_thread(new_scratch)
        # A full pipeline or a stage without a ready replica is waited out as long as a request may take.
        self.runner = JobRunner(self.api, lambda request: self._servicer.generate(request, media_checked=True),
                                self._metrics, self._scratch,
                                patience_s=self.api.pipeline.limits.request_timeout_seconds or None)
        self.runner.start()
        self._metrics.jobs_slots.set(self.api.settings.concurrency)   # the planner counts jobs free slots take

    async def drain(self, bound: float) -> None:
        """No more claims; running jobs have `bound` seconds to finish, then are stopped and released to the store
        (queued again: another replica claims them at once)."""
        if self.runner is None:
            return
        self.runner.stop_claiming()
        self._metrics.jobs_slots.set(0)   # it takes no more jobs
        await self.runner.wait_idle(bound)
        await self.runner.stop()

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.stop()
        if self.store is not None:
            await self.store.close()
        if self._scratch is not None:
            await asyncio.to_thread(shutil.rmtree, self._scratch, True)
            os.close(self._scratch_lock)
            self._scratch = None
