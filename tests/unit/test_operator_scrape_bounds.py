"""The stage planner's scrapes of tenant pods are bounded: a body drip-fed (or headers drip-fed) ends at the
scrape's deadline, a huge body at its size cap, each with no figure; and only the pods the pipeline's own
Deployments made (through their ReplicaSets) are scraped, not any pod wearing the pipeline's labels.

The pods' /metrics here are real HTTP servers on 127.0.0.1; each records whether the operator hung up
before the server ran out of what it had to send (the behaviour asserted), never how long that took.
"""

from __future__ import annotations

import socket
import threading

import pytest

from omnistage_operator import autoscaler
from omnistage_operator.autoscaler import Autoscaler
from omnistage_operator.planning import Plans, ScrapeTarget

SAFETY_S = 60.0   # a generous bound on each server thread, so a failing test ends instead of hanging
EXPOSITION = b"# TYPE omnistage_stage_units_total counter\nomnistage_stage_units_total 1\n"


class PodServer:
    """A pod's HTTP port on 127.0.0.1 that answers one scrape as `answer(conn)` says, and records whether the
    client went away before the answer was all sent."""

    def __init__(self, answer):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(SAFETY_S)
        self.port = self.sock.getsockname()[1]
        self.answer = answer
        self.client_gone = False
        self.sent = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        with conn:
            conn.settimeout(SAFETY_S)
            try:
                conn.recv(65536)   # the GET
                for piece in self.answer():
                    conn.sendall(piece)
                    self.sent += len(piece)
            except (BrokenPipeError, ConnectionResetError):
                self.client_gone = True
            except OSError:
                pass

    def target(self) -> ScrapeTarget:
        return ScrapeTarget("p", "127.0.0.1", self.port)

    def close(self):
        self.sock.close()
        self.thread.join(SAFETY_S)


def drip(headers: bytes, body: bytes, pause: threading.Event):
    """`headers` then `body`, a byte at a time, with a pause between bytes: forever, as far as a
    per-read timeout can tell."""
    def answer():
        for b in headers + body:
            pause.wait(0.02)
            yield bytes([b])
    return answer


@pytest.fixture
def scrape(monkeypatch):
    monkeypatch.setattr(autoscaler, "SCRAPE_DEADLINE_S", 0.5, raising=False)
    a = Autoscaler(None, Plans())
    servers = []

    def run(answer, **consts):
        for k, v in consts.items():
            monkeypatch.setattr(autoscaler, k, v, raising=False)
        srv = PodServer(answer)
        servers.append(srv)
        return a._read(srv.target()), srv
    yield run
    a.close()
    for s in servers:
        s.close()


def test_a_normal_scrape_reads_the_exposition(scrape):
    head = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(EXPOSITION)
    text, srv = scrape(lambda: [head, EXPOSITION])
    assert text == EXPOSITION.decode()


def test_a_drip_fed_body_ends_at_the_deadline_with_no_figure(scrape):
    body = EXPOSITION * 25   # ~2 KB at a byte per pause: far longer than any scrape may take
    head = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
    text, srv = scrape(drip(head, body, threading.Event()))
    assert text is None
    srv.thread.join(SAFETY_S)
    assert srv.client_gone and srv.sent < len(head) + len(body)


def test_drip_fed_headers_end_at_the_deadline_with_no_figure(scrape):
    head = b"HTTP/1.1 200 OK\r\n" + b"X-Pad: " + b"a" * 2000 + b"\r\n\r\n"
    text, srv = scrape(drip(head, EXPOSITION, threading.Event()))
    assert text is None
    srv.thread.join(SAFETY_S)
    assert srv.client_gone


def test_a_huge_body_ends_at_the_size_cap_with_no_figure(scrape):
    total = 64 * 1024 * 1024
    head = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % total
    piece = EXPOSITION * (65536 // len(EXPOSITION))

    def answer():
        yield head
        for _ in range(total // len(piece)):
            yield piece
    # a deadline no scrape here reaches: only the size cap can end this one
    text, srv = scrape(answer, SCRAPE_DEADLINE_S=SAFETY_S, SCRAPE_MAX_BYTES=1024 * 1024)
    assert text is None
    srv.thread.join(SAFETY_S)
    assert srv.client_gone and srv.sent < total


# ------------------------------------------------------------------------------- whose pods

def _obj(kind, name, uid, owner_uid=None, owner_kind=None, labels=None):
    meta = {"name": name, "uid": uid, "labels": labels or {}}
    if owner_uid:
        meta["ownerReferences"] = [{"kind": owner_kind, "name": "x", "uid": owner_uid, "controller": True}]
    return {"kind": kind, "metadata": meta}


def test_only_pods_of_the_pipelines_own_replica_sets_are_scraped():
    from omnistage_operator.planning import owned_pods

    deployments = [_obj("Deployment", "p-talker", "d1", "pipe", "OmniPipeline"),
                   _obj("Deployment", "p-fake", "d2", "someone", "OmniPipeline")]   # not this pipeline's
    replica_sets = [_obj("ReplicaSet", "p-talker-1", "rs1", "d1", "Deployment"),
                    _obj("ReplicaSet", "p-fake-1", "rs2", "d2", "Deployment"),
                    _obj("ReplicaSet", "loose", "rs3")]
    pods = [_obj("Pod", "ours", "u1", "rs1", "ReplicaSet"),
            _obj("Pod", "via-other-deployment", "u2", "rs2", "ReplicaSet"),
            _obj("Pod", "via-loose-rs", "u3", "rs3", "ReplicaSet"), _obj("Pod", "bare", "u4"),
            _obj("Pod", "forged-owner-kind", "u5", "d1", "Deployment")]
    assert [p["metadata"]["name"] for p in owned_pods(pods, replica_sets, deployments, "pipe")] == ["ours"]
