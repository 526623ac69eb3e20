"""The client API's bearer keys, one set for both front doors (gRPC metadata `authorization: Bearer KEY`,
HTTP header `Authorization: Bearer KEY`), and the priority ceiling they lift.

A key entry is `KEY` or `KEY:N`: N is the highest `priority` a request with that key may ask for. A key never
holds `:`, so an entry reads one way only (an entry with a `:` that is not `KEY:N` is refused at load). Without
such a key a request may ask for at most the pipeline's `spec.deployment.orchestrator.maxPriority`, so an
anonymous or ordinary client cannot jump the queue. The key given is compared with every configured key in
constant time with no early exit: how long the check takes says nothing about which key (if any) matched.
Pure: no I/O."""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Iterable


class ApiKeyError(ValueError):
    """A configured key entry that cannot be used, naming the problem (never the key)."""


@dataclass(frozen=True)
class ApiKey:
    secret: bytes
    max_priority: int | None  # None: the pipeline's ceiling


def parse_entry(entry: str, index: int) -> ApiKey:
    """`KEY` or `KEY:N` (N a non-negative integer; KEY without `:`)."""
    key, sep, n = entry.strip().partition(":")
    if not key:
        raise ApiKeyError(f"API key {index}: must not be empty")
    if sep and not (n.isascii() and n.isdigit()):  # a ':' inside a key would read as a priority grant
        raise ApiKeyError(f"API key {index}: write KEY or KEY:N (N the highest priority it allows, digits only); "
                          "a key must not contain ':'")
    if any(c.isspace() or not c.isprintable() for c in key):
        raise ApiKeyError(f"API key {index}: must not contain spaces or control characters")
    return ApiKey(key.encode(), int(n) if n else None)


def bearer(header: str | None) -> bytes:
    """The token of `Bearer TOKEN` (b"" for anything else)."""
    scheme, _, token = (header or "").partition(" ")
    return token.strip().encode() if scheme.lower() == "bearer" else b""


class ApiKeys:
    def __init__(self, entries: Iterable[str] = (), max_priority: int = 0):
        self.keys = tuple(parse_entry(e, i) for i, e in enumerate(entries))
        self.max_priority = max_priority

    @property
    def required(self) -> bool:
        """True when a key is needed at all (some are configured)."""
        return bool(self.keys)

    def match(self, header: str | None) -> ApiKey | None:
        """The configured key the header carries, or None."""
        given = bearer(header)
        found = None
        for key in self.keys:
            if hmac.compare_digest(given, key.secret) and found is None:
                found = key
        return found

    def ceiling(self, key: ApiKey | None) -> int:
        """The highest priority a request with `key` may ask for."""
        if key is not None and key.max_priority is not None:
            return max(key.max_priority, self.max_priority)
        return self.max_priority

    def refusal(self, header: str | None, priority: int) -> tuple[str, str] | None:
        """None when a request with this Authorization header may ask for `priority`; else (reason, message):
        reason "unauthenticated" (keys are required and none matched) or "priority" (above the ceiling)."""
        key = self.match(header)
        if self.required and key is None:
            return ("unauthenticated", "incorrect API key provided" if header else
                    "missing API key: send it as Authorization: Bearer KEY")
        ceiling = self.ceiling(key)
        if priority > ceiling:
            return ("priority", f"priority {priority} is above {ceiling}, the most this caller may ask for; "
                                "a key that allows more (KEY:N) is needed")
        return None
