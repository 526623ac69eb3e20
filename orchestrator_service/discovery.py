"""Where the stage replicas are.

Local mode: static `--stage-endpoint` addresses. In a cluster: watch the
Endpoints of each stage's Service (`<pipeline>-<stage>`, port `grpc`) and keep
the router's replica set equal to the ready addresses, so scaled, drained and
replaced replicas are picked up without a restart.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from typing import Any, Callable

from omnistage.spec import Pipeline

log = logging.getLogger("omnistage.orchestrator")
GRPC_PORT_NAME = "grpc"


def service_name(pipeline: str, stage: str) -> str:
    return f"{pipeline}-{stage}"


def ready_addresses(endpoints: Any, port_name: str = GRPC_PORT_NAME) -> list[str]:
    """`host:port` of every ready address of an Endpoints object (dict or kubernetes client model)."""
    obj = endpoints.to_dict() if hasattr(endpoints, "to_dict") else endpoints
    out = []
    for subset in obj.get("subsets") or []:
        ports = subset.get("ports") or []
        port = next((p["port"] for p in ports if p.get("name") == port_name), None)
        if port is None and len(ports) == 1:
            port = ports[0]["port"]
        if port is None:
            continue
        for addr in subset.get("addresses") or []:  # notReadyAddresses are left out on purpose
            out.append(f"{addr['ip']}:{port}")
    return sorted(set(out))


class KubernetesDiscovery:
    """Watches Endpoints in one namespace on a thread; hands updates to the event loop."""

    def __init__(self, pipeline: Pipeline, namespace: str, apply: Callable[[str, list[str]], None]):
        self.namespace = namespace
        self.by_service = {service_name(pipeline.name, s.name): s.name for s in pipeline.stages}
        self.apply = apply
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.synced = asyncio.Event()

    def start(self) -> None:
        from kubernetes import client, config

        if os.environ.get("KUBECONFIG"):
            config.load_kube_config()
        else:
            config.load_incluster_config()
        self._api = client.CoreV1Api()
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="endpoints-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _publish(self, stage: str, addrs: list[str]) -> None:
        self._loop.call_soon_threadsafe(self.apply, stage, addrs)

    def _run(self) -> None:
        from kubernetes import watch

        backoff = 0.5
        while not self._stop.is_set():
            try:
                listing = self._api.list_namespaced_endpoints(self.namespace)
                seen = set()
                for ep in listing.items:
                    if ep.metadata.name in self.by_service:
                        seen.add(ep.metadata.name)
                        self._publish(self.by_service[ep.metadata.name], ready_addresses(ep))
                for svc in set(self.by_service) - seen:
                    self._publish(self.by_service[svc], [])
                self._loop.call_soon_threadsafe(self.synced.set)
                backoff = 0.5
                w = watch.Watch()
                for event in w.stream(self._api.list_namespaced_endpoints, self.namespace,
                                      resource_version=listing.metadata.resource_version, timeout_seconds=60):
                    if self._stop.is_set():
                        w.stop()
                        return
                    ep = event["object"]
                    stage = self.by_service.get(ep.metadata.name)
                    if stage is None:
                        continue
                    addrs = [] if event["type"] == "DELETED" else ready_addresses(ep)
                    self._publish(stage, addrs)
            except Exception as e:  # noqa: BLE001 - the watch restarts with a fresh list
                log.warning("endpoints watch in %s failed (%s); retrying in %.1fs", self.namespace, e, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)
