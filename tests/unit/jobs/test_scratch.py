"""A replica's scratch folder (where MP4s grow before they are whole): a replica killed with -9 never removes its
own, so the next one to start on the host sweeps the folders whose owner is gone (no process holds the folder's
lock, whatever its pid) and no other."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from orchestrator_service.jobs.replica import SCRATCH_LOCK, SCRATCH_PREFIX, SCRATCH_UNLOCKED_GRACE_S, new_scratch

HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(60)
"""


def test_a_new_scratch_sweeps_the_folders_no_replica_holds_and_keeps_the_held_ones(tmp_path):
    dead = tmp_path / f"{SCRATCH_PREFIX}dead"  # a replica killed with -9: its lock file, held by no one
    dead.mkdir()
    (dead / SCRATCH_LOCK).touch()
    (dead / "video_1.0.mp4").write_bytes(b"partial")
    stale = tmp_path / f"{SCRATCH_PREFIX}stale"  # killed before it took its lock, long ago
    stale.mkdir()
    os.utime(stale, (time.time() - 2 * SCRATCH_UNLOCKED_GRACE_S,) * 2)
    starting = tmp_path / f"{SCRATCH_PREFIX}starting"  # made just now, its lock not taken yet
    starting.mkdir()
    other = tmp_path / "something-else"
    other.mkdir()
    alive = tmp_path / f"{SCRATCH_PREFIX}alive"  # another process (any pid namespace) holds it
    alive.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(alive / SCRATCH_LOCK)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        mine, fd = new_scratch(tmp_path)
        try:
            assert mine.is_dir() and mine.name.startswith(SCRATCH_PREFIX)
            assert not dead.exists() and not stale.exists()
            assert alive.is_dir() and starting.is_dir() and other.is_dir()
            again, fd2 = new_scratch(tmp_path)  # the next replica leaves this one's folder, held by its lock
            os.close(fd2)
            assert mine.is_dir() and again.is_dir()
        finally:
            os.close(fd)
        last, fd3 = new_scratch(tmp_path)  # its lock closed (its process gone): swept
        os.close(fd3)
        assert not mine.exists() and not again.exists() and last.is_dir()
    finally:
        holder.kill()
        holder.wait()
