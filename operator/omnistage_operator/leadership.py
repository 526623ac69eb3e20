"""Which of several operator replicas reconciles: kopf peering, as leader election.

kopf's peering is not an election: every replica writes a keep-alive (its priority, lifetime, last seen) into
a KopfPeering object (ClusterKopfPeering when serving every namespace); a replica pauses its watches while a
live peer has a higher priority, and *every* replica pauses when two live peers share the highest one. So each
replica takes a priority of its own, from its start time: the oldest live replica leads, a new one (a
rolling update's surge pod) waits until the older ones are gone, and a leader that stops cleanly removes its
record at once (a crashed one is dropped when its lifetime runs out, 60 s by default).

kopf's pause stops its watch streams only: the work queue and its workers are ours (workqueue.py), so they
ask `leads` before each reconcile, from the same peering objects kopf reads. Pure apart from
`follow_peering`, which polls them.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import logging
import random
import time
from typing import Callable, Iterable, Mapping

log = logging.getLogger("omnistage.operator")

PEERING_GROUP, PEERING_VERSION = "kopf.dev", "v1"
CLUSTER_PEERINGS, NAMESPACED_PEERINGS = "clusterkopfpeerings", "kopfpeerings"
DEFAULT_LIFETIME = 60          # kopf's assumption for a peer that does not say its lifetime
POLL_SECONDS = 5.0


def start_priority(now: float | None = None, jitter: int | None = None) -> int:
    """A priority that is higher the earlier this replica started (so the oldest leads); the random low
    digits keep two replicas started in the same millisecond apart (equal priorities freeze them both)."""
    ms = int((time.time() if now is None else now) * 1000)
    return -(ms * 1000 + (random.randrange(1000) if jitter is None else jitter))


def _parse_time(text: str | None) -> _dt.datetime | None:
    if not text:
        return None
    try:
        t = _dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return t if t.tzinfo else t.replace(tzinfo=_dt.timezone.utc)


def leads(peering_status: Mapping | None, me: str, my_priority: int, now: _dt.datetime) -> bool:
    """True when no other live peer in this peering object has a priority as high as ours (kopf's own rule
    for pausing, seen from the one that keeps running). A peer whose record has no readable time counts as
    live: better to wait a lifetime than to run beside it."""
    for identity, info in (peering_status or {}).items():
        if identity == me or not isinstance(info, Mapping):
            continue
        seen = _parse_time(info.get("lastseen"))
        lifetime = _dt.timedelta(seconds=int(info.get("lifetime", DEFAULT_LIFETIME)))
        if seen is not None and seen + lifetime <= now:
            continue    # dead: kopf removes it soon
        if int(info.get("priority", 0)) >= my_priority:
            return False
    return True


def leads_everywhere(statuses: Iterable[Mapping | None], me: str, my_priority: int, now: _dt.datetime) -> bool:
    """Leader only if leading in every peering object read (one per served namespace when namespaced)."""
    return all(leads(s, me, my_priority, now) for s in statuses)


async def follow_peering(read_statuses: Callable[[], list], me: str, my_priority: int, active: asyncio.Event,
                         period: float = POLL_SECONDS) -> None:
    """Keep `active` set while this replica leads. `read_statuses` (blocking) returns the peering objects'
    `status` maps; a failed read keeps the last answer (the API server may blink; kopf's own keep-alives
    decide the rest)."""
    decided = False
    while True:
        try:
            statuses = await asyncio.to_thread(read_statuses)
        except Exception as e:  # noqa: BLE001 - any read failure: keep the last decision, try again
            log.warning("peering: could not read the peering objects: %s", e)
        else:
            leading = leads_everywhere(statuses, me, my_priority, _dt.datetime.now(_dt.timezone.utc))
            if leading != active.is_set() or not decided:
                log.info("peering: %s (%s)", "leading: reconciling" if leading else "standing by", me)
                active.set() if leading else active.clear()
                decided = True
        await asyncio.sleep(period)
