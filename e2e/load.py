"""Steady client load against an orchestrator, with every request's outcome recorded, so a scenario
can check that each one completed or was refused cleanly (never hung, never an unexplained error)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import grpc

from omnistage.client import OmniClient

# A refusal a client can act on: the orchestrator says which stage is unavailable or that it is full.
CLEAN_FAILURES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


@dataclass
class Outcome:
    started: float
    finished: float
    ok: bool
    code: grpc.StatusCode | None = None
    message: str = ""
    text_chars: int = 0
    audio_samples: int = 0
    retry_after: str = ""   # the orchestrator's hint on a refusal (trailing metadata `retry-after`)


@dataclass
class SteadyLoad:
    """`concurrency` clients, each sending the next request as soon as its last one ended. With `resolve`, a
    client whose request failed UNAVAILABLE connects again to what `resolve()` names (a client behind a
    Service would reach the orchestrator's new replica the same way)."""
    endpoint: str
    concurrency: int = 2
    deadline_s: float = 60.0
    request: dict = field(default_factory=lambda: {"prompt": "Tell me about the sea.", "max_tokens": 8,
                                                   "max_codec_frames": 25})
    outcomes: list[Outcome] = field(default_factory=list)
    resolve: Callable[[], str] | None = None

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._client, daemon=True, name=f"load-{i}")
                         for i in range(self.concurrency)]

    def __enter__(self) -> "SteadyLoad":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(self.deadline_s + 5)

    def _client(self) -> None:
        endpoint = self.endpoint
        while not self._stop.is_set():
            with OmniClient(endpoint) as client:
                while not self._stop.is_set():
                    t0 = time.monotonic()
                    try:
                        r = client.generate(timeout=self.deadline_s, **self.request)
                        out = Outcome(t0, time.monotonic(), True, text_chars=len(r.text),
                                      audio_samples=len(r.pcm) // 2)
                    except grpc.RpcError as e:
                        hint = dict(e.trailing_metadata() or ()).get("retry-after", "")
                        out = Outcome(t0, time.monotonic(), False, e.code(), e.details() or "", retry_after=hint)
                    with self._lock:
                        self.outcomes.append(out)
                    if not out.ok and out.code == grpc.StatusCode.UNAVAILABLE and self.resolve is not None:
                        break
            if self.resolve is not None and not self._stop.is_set():
                endpoint = self._resolved(endpoint)

    def _resolved(self, last: str) -> str:
        try:
            return self.resolve()
        except Exception:  # noqa: BLE001 - nothing to resolve to yet (the new replica is not ready): keep the last
            self._stop.wait(0.5)
            return last

    def count(self) -> int:
        with self._lock:
            return len(self.outcomes)

    def completed_after(self, t: float) -> int:
        with self._lock:
            return sum(1 for o in self.outcomes if o.ok and o.started >= t)

    def failures(self) -> list[Outcome]:
        with self._lock:
            return [o for o in self.outcomes if not o.ok]
