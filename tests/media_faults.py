"""Decoders that fail as a hostile file can make a real one fail, for the orchestrator's decode workers
(sent to a worker by name: this module stays light to import)."""

from __future__ import annotations

import os
import signal
import threading

from orchestrator_service.media_check import check_in_worker

HANG, CRASH = b"hang", b"crash"


def failing_decoder(wire, limits, accepts):
    """The real check, except for a part whose bytes say to hang (a decode that never ends) or to crash (a
    native fault, as a decoder's bug would raise)."""
    if HANG in wire[0]:
        threading.Event().wait()
    if CRASH in wire[0]:
        os.kill(os.getpid(), signal.SIGSEGV)
    return check_in_worker(wire, limits, accepts)


def hang() -> None:
    threading.Event().wait()


def allocate(nbytes: int) -> int:
    import numpy as np
    return len(np.ones(nbytes, np.uint8))


def hang_marked(marker: str) -> None:
    """Hang, once `marker` (a file) says that the call has begun."""
    open(marker, "w").close()
    threading.Event().wait()
