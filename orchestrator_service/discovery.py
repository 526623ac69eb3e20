"""Where the stage replicas are.

Local mode: static `--stage-endpoint` addresses, or an endpoints file that
`omnistage serve` rewrites as it adds and drains replicas (`--discovery file`:
a JSON object, stage name -> list of `host:port`, polled; every stage listed,
a bad file logged and the last good one kept). In a cluster: watch the
EndpointSlices of each stage's Service (`<pipeline>-<stage>`, port `grpc`;
`discovery.k8s.io/v1` where served, else `v1beta1`) and keep the router's
replica set equal to the ready addresses, so scaled, drained and replaced
replicas are picked up without a restart. EndpointSlices rather than core
Endpoints: they carry readiness per address, and (unlike Endpoints) accept
loopback pod IPs, which the e2e harness gives every pod.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any, Callable

from omnistage.api import Pipeline
from omnistage.contract.launch import GRPC_PORT_NAME, stage_service_name

log = logging.getLogger("omnistage.orchestrator")
SERVICE_LABEL = "kubernetes.io/service-name"


def _plain(obj: Any) -> dict:
    return obj.to_dict() if hasattr(obj, "to_dict") else obj


def slice_addresses(endpoint_slice: Any, port_name: str = GRPC_PORT_NAME) -> list[str]:
    """`host:port` of every ready endpoint of one EndpointSlice (ready unless it says otherwise)."""
    sl = _plain(endpoint_slice)
    ports = sl.get("ports") or []
    port = next((p.get("port") for p in ports if p.get("name") == port_name), None)
    if port is None and len(ports) == 1:
        port = ports[0].get("port")
    if port is None:
        return []
    out = []
    for ep in sl.get("endpoints") or []:
        if (ep.get("conditions") or {}).get("ready") is False:
            continue
        out += [f"{a}:{port}" for a in ep.get("addresses") or []]
    return sorted(set(out))


def ready_addresses(slices: list[Any], port_name: str = GRPC_PORT_NAME) -> list[str]:
    """The ready addresses of a Service: the union over its EndpointSlices."""
    return sorted({a for sl in slices for a in slice_addresses(sl, port_name)})


class KubernetesDiscovery:
    """Watches one namespace's EndpointSlices on a thread; hands each stage's addresses to the event loop."""

    def __init__(self, pipeline: Pipeline, namespace: str, apply: Callable[[str, list[str]], None]):
        self.namespace = namespace
        self.by_service = {stage_service_name(pipeline.name, s.name): s.name for s in pipeline.stages}
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
        self._api = client.CustomObjectsApi()
        groups = {g.name: [v.version for v in g.versions] for g in client.ApisApi().get_api_versions().groups}
        served = groups.get("discovery.k8s.io", [])
        if not served:
            raise RuntimeError("the cluster serves no discovery.k8s.io EndpointSlices (Kubernetes >= 1.17 needed)")
        self._version = "v1" if "v1" in served else "v1beta1"
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="endpointslice-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _publish(self, slices: dict[str, dict], services) -> None:
        for svc in services:
            mine = [s for s in slices.values() if (s["metadata"].get("labels") or {}).get(SERVICE_LABEL) == svc]
            self._loop.call_soon_threadsafe(self.apply, self.by_service[svc], ready_addresses(mine))

    def _run(self) -> None:
        from kubernetes import watch

        args = ("discovery.k8s.io", self._version, self.namespace, "endpointslices")
        selector = f"{SERVICE_LABEL} in ({','.join(sorted(self.by_service))})"
        backoff = 0.5
        while not self._stop.is_set():
            try:
                listing = self._api.list_namespaced_custom_object(*args, label_selector=selector)
                slices = {s["metadata"]["name"]: s for s in listing["items"]}
                self._publish(slices, self.by_service)
                self._loop.call_soon_threadsafe(self.synced.set)
                backoff = 0.5
                w = watch.Watch()
                for event in w.stream(self._api.list_namespaced_custom_object, *args, label_selector=selector,
                                      resource_version=listing["metadata"]["resourceVersion"], timeout_seconds=60):
                    if self._stop.is_set():
                        w.stop()
                        return
                    sl = event["object"]
                    if event["type"] == "DELETED":
                        slices.pop(sl["metadata"]["name"], None)
                    else:
                        slices[sl["metadata"]["name"]] = sl
                    svc = (sl["metadata"].get("labels") or {}).get(SERVICE_LABEL)
                    if svc in self.by_service:
                        self._publish(slices, [svc])
            except Exception as e:  # noqa: BLE001 - the watch restarts from a fresh list
                log.warning("endpointslice watch in %s failed (%s); retrying in %.1fs", self.namespace, e, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)


FILE_POLL_S = 0.2


def read_endpoints_file(path: str | os.PathLike, pipeline: Pipeline) -> dict[str, list[str]]:
    """The endpoints file's stage -> addresses; ValueError naming what is wrong with it."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"{path}: {e}") from None
    return parse_endpoints_text(text, path, pipeline)


def parse_endpoints_text(text: str, path: str | os.PathLike, pipeline: Pipeline) -> dict[str, list[str]]:
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    known = [s.name for s in pipeline.stages]
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: expected a JSON object of stage name -> list of host:port")
    unknown = sorted(set(doc) - set(known))
    missing = [n for n in known if n not in doc]
    if unknown or missing:
        raise ValueError(f"{path}: " + "; ".join(x for x in (f"unknown stage(s) {', '.join(unknown)}"
                                                              if unknown else "",
                                                              f"no entry for {', '.join(missing)}" if missing else "")
                                                 if x))
    for name, addrs in doc.items():
        if not isinstance(addrs, list) or not all(isinstance(a, str) and a for a in addrs):
            raise ValueError(f"{path}: {name}: expected a list of host:port")
    return {n: sorted(set(doc[n])) for n in known}


class FileDiscovery:
    """Polls an endpoints file (see the module docstring) on the event loop; applies each stage's addresses
    when the file changes."""

    def __init__(self, pipeline: Pipeline, path: str | os.PathLike, apply: Callable[[str, list[str]], None],
                 poll_s: float = FILE_POLL_S):
        self.pipeline = pipeline
        self.path = Path(path)
        self.apply = apply
        self.poll_s = poll_s
        self.synced = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._seen: str | None = None
        self._applied: dict[str, list[str]] = {}

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="endpoints-file")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def poll(self) -> None:
        """Read the file, and apply what changed in it since the last look (its text is compared: two
        writes within one timestamp tick, of the same size, are still two changes)."""
        try:
            text = self.path.read_text()
        except OSError as e:
            log.warning("endpoints file %s: %s", self.path, e)
            return
        if text == self._seen:
            return
        self._seen = text
        try:
            endpoints = parse_endpoints_text(text, self.path, self.pipeline)
        except ValueError as e:
            log.error("endpoints file: %s (keeping the replicas known before)", e)
            return
        for stage, addrs in endpoints.items():
            if self._applied.get(stage) != addrs:
                self.apply(stage, addrs)
        self._applied = endpoints
        self.synced.set()

    async def _run(self) -> None:
        while True:
            self.poll()
            await asyncio.sleep(self.poll_s)
