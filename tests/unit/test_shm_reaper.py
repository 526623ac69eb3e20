"""The shared-memory orphan reaper: it removes the segments of dead producers of this pid namespace, and
nothing else. A foreign entry of a matching name (a directory, another user's file, a link) is skipped with
a warning, and never stops a store from starting: /dev/shm is world-writable, so anyone can plant one."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from omnistage.connector import shm
from omnistage.connector.shm import SEGMENT_PREFIX, ShmStore, reap_orphans

OTHER_UID = 54321   # a uid no file of this test belongs to


@pytest.fixture(scope="module")
def dead_pid() -> int:
    """The pid of a process that has exited (and been waited for)."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def orphan_name(pid: int, n: int = 0) -> str:
    return f"{SEGMENT_PREFIX}{shm._PID_NS}-{pid}-deadbeef-{n}"


def test_a_dead_producers_segment_is_reaped(tmp_path, dead_pid):
    (tmp_path / orphan_name(dead_pid)).write_bytes(b"x")
    live = tmp_path / orphan_name(os.getpid())
    live.write_bytes(b"x")
    assert reap_orphans(tmp_path) == 1
    assert [p.name for p in tmp_path.iterdir()] == [live.name]


def test_a_planted_directory_is_skipped_with_a_warning_and_the_store_starts(tmp_path, dead_pid, caplog):
    planted = tmp_path / orphan_name(dead_pid, 1)
    planted.mkdir()
    (tmp_path / orphan_name(dead_pid, 2)).write_bytes(b"x")
    with caplog.at_level(logging.WARNING, logger="omnistage"):
        store = ShmStore("host", lambda: 0.0, str(tmp_path))   # raised IsADirectoryError before
    assert store.dir == tmp_path
    assert [p.name for p in tmp_path.iterdir()] == [planted.name]   # the real orphan went, the directory stayed
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and planted.name in warnings[0] and "not a regular file" in warnings[0]


def test_a_link_is_skipped_not_followed(tmp_path, dead_pid):
    target = tmp_path / "victim"
    target.write_bytes(b"keep")
    link = tmp_path / orphan_name(dead_pid)
    link.symlink_to(target)
    assert reap_orphans(tmp_path) == 0
    assert link.is_symlink() and target.read_bytes() == b"keep"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user")
def test_another_users_file_is_skipped(tmp_path, dead_pid, caplog):
    foreign = tmp_path / orphan_name(dead_pid)
    foreign.write_bytes(b"x")
    os.chown(foreign, OTHER_UID, OTHER_UID)
    with caplog.at_level(logging.WARNING, logger="omnistage"):
        assert reap_orphans(tmp_path) == 0
    assert foreign.exists()
    assert any("owned by uid 54321" in r.getMessage() for r in caplog.records)


def test_an_entry_that_cannot_be_removed_is_skipped_and_the_rest_reaped(tmp_path, dead_pid, caplog):
    """A removal that fails (as in sticky /dev/shm for a file of another user) costs that entry only."""
    names = [orphan_name(dead_pid, n) for n in range(3)]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    refused = tmp_path / names[1]
    real_unlink = os.unlink

    def unlink(path, *a, **kw):   # the one failure the kernel gives for a sticky directory
        if os.fspath(path) == os.fspath(refused):
            raise PermissionError(1, "Operation not permitted", os.fspath(path))
        return real_unlink(path, *a, **kw)

    mp = pytest.MonkeyPatch()
    mp.setattr(shm.os, "unlink", unlink)
    try:
        with caplog.at_level(logging.WARNING, logger="omnistage"):
            assert reap_orphans(tmp_path) == 2
    finally:
        mp.undo()
    assert [p.name for p in tmp_path.iterdir()] == [refused.name]
    assert any(refused.name in r.getMessage() and "Operation not permitted" in r.getMessage()
               for r in caplog.records)
