"""How slowly a client may take a streamed answer, on both front doors (pure).

A client that stops reading, or reads a trickle, holds its request's admission slot and, down the request's
path, the stages' buffers; counting only whether some send succeeded lets a reader of a few bytes a second
hold them for the whole answer. So a door measures the time its sends wait on the client (data is ready,
the connection's buffers are full) against the bytes the client takes: each byte taken earns 1/MIN_READ_BPS
seconds of allowed waiting, and a client starts with, and may bank at most, GRACE_S of it. A reader that
stopped is cut after GRACE_S of waiting; one slower than MIN_READ_BPS, after GRACE_S plus what it read
earned; a reader at or above the rate never is. Time the server spends making the answer is not the
client's: only time spent waiting in a send counts.
"""

from __future__ import annotations

from dataclasses import dataclass

# How long a send may wait on a client that takes nothing: long enough for a client pausing to decode or
# play what it has (and for TCP's retransmission backoff on a lossy link), short enough that a stopped
# reader gives its slot back within a minute.
GRACE_S = 60.0
# The slowest reading served: 8 KiB/s (64 kbit/s) is below any link a speech answer can be heard over
# (24 kHz 16-bit PCM is 48 KB/s) and far above the ~1 KB/s trickle that pins a request.
MIN_READ_BPS = 8 * 1024


@dataclass
class ConsumerPace:
    """One streamed answer's reading pace: ask `allowed_wait(n)` before a send of n bytes and bound the
    send by it; report it with `sent(n, waited)`. `too_slow(waited)` says why a send that waited that long
    ends the request."""

    grace_s: float = GRACE_S
    min_bps: float = MIN_READ_BPS
    credit_s: float | None = None  # waiting the client may still cause; None: the full grace
    taken: int = 0                 # bytes the client took so far
    waited_s: float = 0.0          # time the sends waited on it so far

    def __post_init__(self):
        if self.credit_s is None:
            self.credit_s = self.grace_s

    def allowed_wait(self, nbytes: int) -> float:
        """How long a send of `nbytes` may wait: the credit left plus what these bytes earn."""
        assert self.credit_s is not None
        return max(0.0, self.credit_s + nbytes / self.min_bps)

    def sent(self, nbytes: int, waited_s: float) -> None:
        """A send of `nbytes` completed after waiting `waited_s`."""
        assert self.credit_s is not None
        self.taken += nbytes
        self.waited_s += waited_s
        self.credit_s = min(self.grace_s, self.credit_s + nbytes / self.min_bps - waited_s)

    def too_slow(self, nbytes: int, waited_s: float) -> str:
        """Why a send of `nbytes` that waited `waited_s` (its `allowed_wait`) ends the request."""
        return (f"the client read {self.taken} bytes while the answer waited {self.waited_s + waited_s:.1f} s "
                f"on it, under the minimum of {self.min_bps:.0f} bytes/s after a grace of {self.grace_s:g} s; "
                f"the request was cancelled")
