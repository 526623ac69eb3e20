"""How many requests one client may hold at once, on both front doors (pure).

A client is its API key when keys are on (a key names a tenant even behind a proxy), else its address (the
gRPC peer's host, the HTTP connection's). Without a cap one client fills maxInflight and the wait queue and
everyone else is refused; with it, one client holds at most a share of them and the rest is left to others.
A client over its cap is refused at once (RESOURCE_EXHAUSTED / 429, naming the cap), before it queues.

Loopback addresses are not capped by address: a request from the same machine is the operator's own (a
benchmark, `omnistage serve` on a laptop) or comes through a local proxy or sidecar, where every client
shares the one address and a cap would cap them all together. For the same reason neither are the
addresses of the proxies an operator names (OMNISTAGE_TRUSTED_PROXIES: addresses or networks, comma
separated, e.g. an ingress's pod network): behind them, keys tell clients apart. Keys are capped wherever
they come from.
"""

from __future__ import annotations

import contextlib
import ipaddress
import urllib.parse
from dataclasses import dataclass, field
from typing import Iterator, Mapping

from omnistage.contract.launch import is_loopback

from .admission import Overloaded

# One client may hold at most this share of the places the orchestrator has (maxInflight + maxQueued):
# a half leaves the other half to everyone else while a lone client still gets most of the pipeline.
CLIENT_SHARE = 0.5
# ... and at least this many: a small pipeline (maxInflight 4) still lets one client stream a few answers,
# and an images request of n images (n requests, at most MAX_IMAGES = 10) always fits one client's cap.
CLIENT_FLOOR = 16
ENV_TRUSTED_PROXIES = "OMNISTAGE_TRUSTED_PROXIES"
# Whether loopback addresses are capped (see above); tests set it to exercise the cap from 127.0.0.1.
CAP_LOOPBACK = False
# A client refused for its cap is told to retry after this long: its own requests end within seconds.
RETRY_AFTER_S = 1.0


def default_cap(max_inflight: int, max_queued: int) -> int:
    """The requests one client may hold: CLIENT_SHARE of the orchestrator's places, at least CLIENT_FLOOR."""
    return max(CLIENT_FLOOR, int(CLIENT_SHARE * (max_inflight + max_queued)))


Networks = tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]


def peer_host(peer: str | None) -> str | None:
    """The host of a gRPC peer string (`ipv4:1.2.3.4:5`, `ipv6:[::1]:5`, or percent-encoded as gRPC Python
    gives it, `ipv6:%5B::1%5D:5`); None for anything else."""
    kind, _, rest = urllib.parse.unquote(peer or "").partition(":")
    if kind == "ipv4":
        return rest.rpartition(":")[0] or None
    if kind == "ipv6":
        return rest.rpartition(":")[0].strip("[]") or None
    return None


def trusted_proxies(env: Mapping[str, str]) -> Networks:
    """The networks named by OMNISTAGE_TRUSTED_PROXIES (empty: none); a bad entry is named."""
    out = []
    for entry in filter(None, (e.strip() for e in env.get(ENV_TRUSTED_PROXIES, "").split(","))):
        try:
            out.append(ipaddress.ip_network(entry, strict=False))
        except ValueError:
            raise ValueError(f"{ENV_TRUSTED_PROXIES}: {entry!r} is not an address or network") from None
    return tuple(out)


def client_of(key_index: int | None, host: str | None, trusted: Networks = ()) -> str | None:
    """Who a request's client is, for the cap: its key's place in the configured keys, else its address;
    None (not capped) for an unknown address, a proxy's in `trusted` or, unless CAP_LOOPBACK, a loopback one
    (an IPv4 address mapped into IPv6 counts as the IPv4 one)."""
    if key_index is not None:
        return f"API key #{key_index}"
    if not host:
        return None
    if is_loopback(host) and not CAP_LOOPBACK:
        return None
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return f"address {host}"
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return None if any(ip in net for net in trusted) else f"address {ip}"


@dataclass
class ClientCap:
    limit: int
    held: dict[str, int] = field(default_factory=dict)
    trusted: Networks = ()  # proxies' networks: their addresses are not capped (client_of)

    def check(self, client: str | None) -> None:
        """Overloaded when `client` holds `limit` requests already (asked before a request's costly checks,
        such as decoding its media, as well as when it is counted)."""
        n = self.held.get(client, 0) if client is not None else 0
        if n >= self.limit:
            raise Overloaded(f"{client} already has {n} requests in flight, the most one client may have "
                             f"(a share of maxInflight + maxQueued)", RETRY_AFTER_S)

    @contextlib.contextmanager
    def holding(self, client: str | None) -> Iterator[None]:
        """Count one request of `client` while in the block; Overloaded when it holds `limit` already."""
        if client is None:
            yield
            return
        self.check(client)
        n = self.held.get(client, 0)
        self.held[client] = n + 1
        try:
            yield
        finally:
            if self.held[client] <= 1:
                del self.held[client]
            else:
                self.held[client] -= 1


def key_index(keys, header: str | None) -> int | None:
    """The place in `keys` (ApiKeys) of the key `header` carries; None without keys or without a match."""
    if not keys.required:
        return None
    key = keys.match(header)
    return None if key is None else keys.keys.index(key)
