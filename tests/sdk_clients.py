"""The OpenAI SDK clients the tests make (`Served.aio()` / `.sync()`), kept until their module ends and closed
then, in order.

Left to the garbage collector, an AsyncOpenAI closes itself from `__del__` by scheduling a task, and that
resurrects the client after the transports of its connections were finalized in the same collection: their
sockets closed behind the event loop. The task's later close of those transports then unregisters whatever
socket got the number in between, a server's listening socket among them, which the loop never polls again:
its next client waits for its read timeout. Closed explicitly, a client closes its transports in order."""

from __future__ import annotations

from typing import TypeVar

C = TypeVar("C")
_OPEN: list = []


def kept(client: C) -> C:
    """`client`, kept open until the module ends (then closed by `close_all`)."""
    _OPEN.append(client)
    return client


async def close_all() -> None:
    clients = list(_OPEN)
    _OPEN.clear()
    for client in clients:
        closing = client.close()
        if closing is not None:  # AsyncOpenAI.close is a coroutine; OpenAI.close is not
            await closing
