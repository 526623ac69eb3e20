"""Bytes of client requests held at once, across requests: a request takes its bytes as they come (or its
size when it arrives) and gives them all back when it ends (served, refused or cancelled), so requests held
together never exceed the capacity, and those of one client no more than its share when there is one (so one
client sending slowly cannot keep every other request out). Pure: no I/O; each front door answers
`BudgetFull` in its own shape (gRPC RESOURCE_EXHAUSTED, HTTP 429)."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator


class BudgetFull(Exception):
    """A take that would pass the capacity or the client's share; the caller may retry once held requests
    have ended. `capacity` is the bound it would pass."""

    def __init__(self, message: str, capacity: int, wanted: int):
        self.capacity, self.wanted = capacity, wanted
        super().__init__(message)


class ByteBudget:
    def __init__(self, capacity: int, per_client: int | None = None):
        self.capacity, self.per_client, self.held = capacity, per_client, 0
        self.by_client: dict[str, int] = {}

    @contextlib.contextmanager
    def holding(self, client: str = "") -> Iterator[Callable[[int], None]]:
        """`with budget.holding(address) as take: take(n)`; a take past the capacity, or past the client's
        share, raises BudgetFull and takes nothing; whatever was taken is given back when the block ends."""
        taken = 0

        def take(n: int) -> None:
            nonlocal taken
            mine = self.by_client.get(client, 0)
            if self.per_client is not None and mine + n > self.per_client:
                raise BudgetFull(f"this client ({client or 'unknown address'}) holds {mine} bytes of requests "
                                 f"already; one client may hold at most {self.per_client} at once",
                                 self.per_client, n)
            if self.held + n > self.capacity:
                raise BudgetFull(f"the server holds as many request bytes as it takes at once ({self.capacity} "
                                 "bytes)", self.capacity, n)
            self.held += n
            self.by_client[client] = mine + n
            taken += n

        try:
            yield take
        finally:
            self.held -= taken
            left = self.by_client.pop(client, 0) - taken
            if left:
                self.by_client[client] = left
