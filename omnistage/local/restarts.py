"""How `omnistage serve` restarts a process that died, as a Deployment's kubelet restarts a container:
the policy (crash-loop backoff) and the bound on a process's log file. Pure but for `rotate_log`."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

# Crash-loop backoff, as the kubelet's: the first restart after RESTART_BACKOFF_S, each next one after
# twice the last, at most RESTART_BACKOFF_MAX_S; a process that stayed up RESTART_RESET_AFTER_S before it
# died starts over at RESTART_BACKOFF_S (a crash after a long healthy run is not a crash loop).
RESTART_BACKOFF_S = 1.0
RESTART_BACKOFF_MAX_S = 60.0
RESTART_RESET_AFTER_S = 120.0

# A process's log file is copied to `<log>.1` and emptied in place once it passes LOG_MAX_BYTES (what
# logrotate calls copytruncate: the process keeps its file open, and writes in append mode, so it goes on
# at the new end); the older copies move up (`.1` -> `.2`), LOG_BACKUPS of them kept. A process's logs take
# at most (1 + LOG_BACKUPS) x LOG_MAX_BYTES, plus what it writes between two checks of serve's loop: 192 MiB,
# a day or more of access lines at a laptop's load. `omnistage serve --log-max-bytes --log-backups` set them.
LOG_MAX_BYTES = 64 << 20
LOG_BACKUPS = 2
LOG_TAIL_BYTES = 64 << 10   # what is read back to show a process's last lines


def restart_delay(failures: int) -> float:
    """Seconds before the restart that follows `failures` (1, 2, ...) deaths in a row."""
    return min(RESTART_BACKOFF_S * 2.0 ** max(failures - 1, 0), RESTART_BACKOFF_MAX_S)


def failures_after_death(failures: int, up_s: float) -> int:
    """Deaths in a row, counting this one, of a process that had been up `up_s` seconds."""
    return 1 if up_s >= RESTART_RESET_AFTER_S else failures + 1


def rotate_log(path: Path, max_bytes: int = LOG_MAX_BYTES, backups: int = LOG_BACKUPS) -> bool:
    """Once the log passes `max_bytes`: its copies move up one (`<path>.N` -> `<path>.N+1`, the oldest beyond
    `backups` gone), it is copied to `<path>.1` and emptied; True when it did. Lines the process writes
    between the copy and the truncation are lost (a few, at most). `backups` 0: only emptied."""
    try:
        if os.stat(path).st_size <= max_bytes:
            return False
        for n in range(backups - 1, 0, -1):
            older = path.with_name(f"{path.name}.{n}")
            if older.exists():
                os.replace(older, path.with_name(f"{path.name}.{n + 1}"))
        if backups > 0:
            shutil.copyfile(path, path.with_name(path.name + ".1"))
        os.truncate(path, 0)
    except OSError:
        return False   # a full disk, a file gone: the next check tries again
    return True


def log_tail(path: Path, lines: int) -> str:
    """The last `lines` lines of a log, read from its last LOG_TAIL_BYTES only."""
    try:
        with open(path, "rb") as f:
            f.seek(max(f.seek(0, os.SEEK_END) - LOG_TAIL_BYTES, 0))
            return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
