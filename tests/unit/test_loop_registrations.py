"""The tests' guard on the event loop (conftest `_no_stale_loop_registrations`): a descriptor closed behind the
loop's back leaves a stale entry in asyncio's map, and a socket that gets its number and registers for reading
would never be polled. The guard refuses that registration at once, naming what held the number."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest

from ..conftest import StaleLoopRegistration


async def test_a_registration_over_a_descriptor_closed_behind_the_loop_is_refused():
    loop = asyncio.get_running_loop()
    first, peer = socket.socketpair()

    def held_first() -> None:
        pass

    loop.add_reader(first.fileno(), held_first)
    number = first.fileno()
    os.close(first.detach())  # closed without remove_reader: the kernel drops it, asyncio's map keeps it
    again, other = socket.socketpair()
    try:
        if again.fileno() != number:  # the number went elsewhere meanwhile: reuse it on purpose
            os.dup2(again.fileno(), number)
            again.close()
            again = socket.socket(fileno=number)
        with pytest.raises(StaleLoopRegistration, match=rf"descriptor {number} .*held_first"):
            loop.add_reader(again.fileno(), lambda: None)
    finally:
        loop.remove_reader(number)  # the stale entry goes: the loop is the session's
        for s in (again, other, peer):
            s.close()
