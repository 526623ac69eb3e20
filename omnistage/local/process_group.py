"""Ending a process started as the leader of its own group (`start_new_session=True`): the process is asked
to stop (SIGTERM, to it alone: it drains and ends its helpers itself), and when it has not within its grace,
its whole group is killed (SIGKILL: helper processes it started go with it)."""

from __future__ import annotations

import os
import signal
import subprocess


def signal_group(popen: subprocess.Popen, sig: int) -> None:
    """`sig` to the process's group; nothing when the group is gone already."""
    try:
        os.killpg(popen.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_group(popen: subprocess.Popen, wait_s: float = 30.0) -> None:
    """The group killed, and the process reaped."""
    signal_group(popen, signal.SIGKILL)
    popen.wait(wait_s)


def stop_group(popen: subprocess.Popen, grace_s: float = 60.0, wait_s: float = 30.0) -> None:
    """SIGTERM to the process, then the group killed if it has not ended within `grace_s`."""
    if popen.poll() is not None:
        return
    popen.send_signal(signal.SIGTERM)
    try:
        popen.wait(grace_s)
    except subprocess.TimeoutExpired:
        kill_group(popen, wait_s)
