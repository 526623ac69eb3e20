"""A core for the engine process's own tests (`engine_process.py`): each step waits until the test lets it
go, a byte on `gate`, so a test holds steps outstanding for as long as it needs without timing anything.
Each sequence's value is its spec, handed back by every step that includes it."""

from __future__ import annotations

import os


class GateCore:
    def __init__(self, gate):
        self.gate = gate  # the child's end of a pipe: the test sends a byte per step it lets go
        self.specs: dict[int, object] = {}

    def info(self) -> dict:
        return {"gate": True}

    def add(self, sid: int, spec) -> None:
        self.specs[sid] = spec

    def release(self, sid: int) -> None:
        self.specs.pop(sid, None)

    def preempt(self, sid: int) -> None:
        pass

    def step(self, sids: list[int], feeds=None) -> list:
        self.gate.recv_bytes()
        return [(self.specs[s], "done", 0) for s in sids]

    def stats(self) -> tuple[int, int]:
        return len(self.specs), 0


def _load(pid: int) -> "UnreadableIn":
    if os.getpid() == pid:
        raise TypeError("this answer cannot be rebuilt here")
    return UnreadableIn(pid)


class UnreadableIn:
    """A value that travels to the core and back but cannot be unpickled in process `pid` (the stage's): an
    answer the stage process cannot read."""

    def __init__(self, pid: int):
        self.pid = pid

    def __reduce__(self):
        return _load, (self.pid,)
