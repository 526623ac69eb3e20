"""The operator's one door to the API server (blocking calls, run in worker threads): read an
OmniPipeline, its children and its pods, create / merge-patch / delete children, patch status, post Events.
Every write goes through here, so writes can be counted."""

from __future__ import annotations

import logging
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import kubernetes
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import ConflictError, NotFoundError

from .certificates import CERT_MANAGER_API
from .conditions import now_rfc3339
from .leadership import CLUSTER_PEERINGS, NAMESPACED_PEERINGS, PEERING_GROUP, PEERING_VERSION
from .vocabulary import API_VERSION, LABEL_PIPELINE, MANAGED_BY

log = logging.getLogger("omnistage.operator")
MERGE_PATCH = "application/merge-patch+json"


def _as_dict(_client, data: dict) -> dict:
    """Responses as plain dicts: the dynamic client's ResourceInstance wrapping costs more CPU than the
    request itself when many pipelines reconcile at once."""
    return data


RAW = {"serializer": _as_dict}


def load_client_config() -> kubernetes.client.ApiClient:
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    return kubernetes.client.ApiClient()


def served_pdb_version(api_client: kubernetes.client.ApiClient) -> str:
    """policy/v1 where served (Kubernetes >= 1.21), else policy/v1beta1."""
    groups = kubernetes.client.ApisApi(api_client).get_api_versions().groups
    policy = next((g for g in groups if g.name == "policy"), None)
    versions = {v.version for v in policy.versions} if policy else set()
    return "policy/v1" if "v1" in versions else "policy/v1beta1"


class Kube:
    def __init__(self, api_client: kubernetes.client.ApiClient | None = None, cert_manager: bool = False):
        self.api_client = api_client or load_client_config()
        self.dyn = DynamicClient(self.api_client)
        self.pdb_api_version = served_pdb_version(self.api_client)
        self.child_kinds = (("v1", "ConfigMap"), ("v1", "ServiceAccount"), ("v1", "Service"),
                            ("apps/v1", "Deployment"), (self.pdb_api_version, "PodDisruptionBudget"),
                            ("networking.k8s.io/v1", "NetworkPolicy"),
                            ("rbac.authorization.k8s.io/v1", "Role"),
                            ("rbac.authorization.k8s.io/v1", "RoleBinding"))
        if cert_manager:   # resolved only when used: the kind exists only where cert-manager is installed
            self.child_kinds += ((CERT_MANAGER_API, "Certificate"),)
        # Resolve every resource once, here: discovery caches are not safe to fill from many threads.
        self._resources = {kind: self.dyn.resources.get(api_version=av, kind=kind) for av, kind in self.child_kinds}
        self._pipelines = self.dyn.resources.get(api_version=API_VERSION, kind="OmniPipeline")
        self._events = self.dyn.resources.get(api_version="v1", kind="Event")
        self._pods = self.dyn.resources.get(api_version="v1", kind="Pod")
        self._replica_sets = self.dyn.resources.get(api_version="apps/v1", kind="ReplicaSet")
        # Secrets are read one by one by name, never listed or watched: the operator's RBAC holds no list or
        # watch of Secrets, so it cannot enumerate them (in its own namespace it may get only the CA's).
        self._unlisted = {"Secret": self.dyn.resources.get(api_version="v1", kind="Secret")}
        self._readers = ThreadPoolExecutor(max_workers=len(self.child_kinds), thread_name_prefix="kube-read")
        self._lock = threading.Lock()
        self._local = threading.local()
        self.writes = 0

    def _wrote(self) -> None:
        with self._lock:
            self.writes += 1
        self._local.writes = self.thread_writes() + 1

    def thread_writes(self) -> int:
        """Writes made so far by the calling thread (a reconcile runs in one thread)."""
        return getattr(self._local, "writes", 0)

    # ----------------------------------------------------------------------------- reads

    def get_pipeline(self, namespace: str, name: str) -> dict | None:
        try:
            return self._pipelines.get(name=name, namespace=namespace, **RAW)
        except NotFoundError:
            return None

    def list_children(self, namespace: str, pipeline: str) -> dict[tuple[str, str], dict]:
        """Every child carrying the pipeline's label, by (kind, name)."""
        def one_kind(kind: str) -> list[dict]:
            return self.list_kind(kind, namespace, pipeline)

        # Eight small lists, one round trip of waiting: the latency of a reconcile is mostly these.
        lists = list(self._readers.map(one_kind, self._resources))
        return {(kind, obj["metadata"]["name"]): obj for kind, items in zip(self._resources, lists) for obj in items}

    def list_kind(self, kind: str, namespace: str, pipeline: str) -> list[dict]:
        """The children of one kind carrying the pipeline's label."""
        res = self._resources[kind]
        items = res.get(namespace=namespace, label_selector=f"{LABEL_PIPELINE}={pipeline}", **RAW)["items"]
        for obj in items:
            obj.update(apiVersion=res.group_version, kind=kind)   # list items carry neither
        return items

    def list_pods(self, namespace: str, pipeline: str) -> list[dict]:
        """The pods of every stage and of the orchestrator (read, never written: they are the
        Deployments' own)."""
        return self._pods.get(namespace=namespace, label_selector=f"{LABEL_PIPELINE}={pipeline}", **RAW)["items"]

    def list_replica_sets(self, namespace: str, pipeline: str) -> list[dict]:
        """The ReplicaSets of the pipeline's Deployments (they carry its pod labels), read by the stage planner
        to tell the pods those made from any pod wearing the labels."""
        return self._replica_sets.get(namespace=namespace, label_selector=f"{LABEL_PIPELINE}={pipeline}",
                                      **RAW)["items"]

    def get(self, kind: str, namespace: str, name: str) -> dict | None:
        try:
            return self._resource(kind).get(name=name, namespace=namespace, **RAW)
        except NotFoundError:
            return None

    def peering_statuses(self, name: str, namespaces: tuple[str, ...]) -> list[dict | None]:
        """The `status` of the KopfPeering `name` in each namespace, or of the ClusterKopfPeering when
        `namespaces` is empty (leadership.py); an absent object reads as None."""
        api = kubernetes.client.CustomObjectsApi(self.api_client)
        group, version = PEERING_GROUP, PEERING_VERSION
        out = []
        for ns in namespaces or (None,):
            try:
                obj = (api.get_namespaced_custom_object(group, version, ns, NAMESPACED_PEERINGS, name) if ns else
                       api.get_cluster_custom_object(group, version, CLUSTER_PEERINGS, name))
            except kubernetes.client.ApiException as e:
                if e.status != 404:
                    raise
                obj = {}
            out.append(obj.get("status"))
        return out

    def get_secret(self, namespace: str, name: str) -> dict | None:
        return self.get("Secret", namespace, name)

    def _resource(self, kind: str):
        return self._resources.get(kind) or self._unlisted[kind]

    # ---------------------------------------------------------------------------- writes

    def create(self, obj: dict) -> dict | None:
        """The created object, or None when one of that name exists already."""
        try:
            return self._resource(obj["kind"]).create(body=obj, namespace=obj["metadata"]["namespace"], **RAW)
        except ConflictError:
            return None
        finally:
            self._wrote()

    def patch(self, obj: dict) -> dict:
        meta = obj["metadata"]
        self._wrote()
        return self._resource(obj["kind"]).patch(body=obj, name=meta["name"], namespace=meta["namespace"],
                                                  content_type=MERGE_PATCH, **RAW)

    def delete(self, kind: str, namespace: str, name: str) -> None:
        self._wrote()
        try:
            self._resource(kind).delete(name=name, namespace=namespace, **RAW)
        except NotFoundError:
            pass

    def scale(self, kind: str, namespace: str, name: str, replicas: int) -> None:
        """Set a Deployment's replicas through its scale subresource (what `kubectl scale` and HPA write)."""
        self._wrote()
        self._resources[kind].scale.patch(body={"spec": {"replicas": replicas}}, name=name, namespace=namespace,
                                          content_type=MERGE_PATCH, **RAW)

    def patch_status(self, namespace: str, name: str, status_patch: dict) -> None:
        self._wrote()
        self._pipelines.status.patch(body={"status": status_patch}, name=name, namespace=namespace,
                                     content_type=MERGE_PATCH, **RAW)

    def post_event(self, owner: dict, type_: str, reason: str, message: str) -> None:
        meta = owner["metadata"]
        now = now_rfc3339()
        self._wrote()
        try:
            self._events.create(namespace=meta["namespace"], body={
                "apiVersion": "v1", "kind": "Event",
                "metadata": {"name": f"{meta['name']}.{uuid.uuid4().hex[:12]}", "namespace": meta["namespace"]},
                "involvedObject": {"apiVersion": owner.get("apiVersion", API_VERSION), "kind": "OmniPipeline",
                                   "name": meta["name"], "namespace": meta["namespace"], "uid": meta.get("uid"),
                                   "resourceVersion": meta.get("resourceVersion")},
                "type": type_, "reason": reason, "message": message[:1024], "count": 1,
                "firstTimestamp": now, "lastTimestamp": now,
                "source": {"component": MANAGED_BY}, "reportingComponent": MANAGED_BY}, **RAW)
        except kubernetes.client.ApiException as e:   # an Event is best effort; never fail a reconcile on it
            log.warning("could not post event %s on %s/%s: %s", reason, meta["namespace"], meta["name"], e.reason)


def owned_by(obj: dict, owner_uid: str) -> bool:
    return any(ref.get("uid") == owner_uid for ref in obj["metadata"].get("ownerReferences") or ())


def controller_uid(obj: dict) -> str | None:
    return next((ref.get("uid") for ref in obj["metadata"].get("ownerReferences") or () if ref.get("controller")),
                None)
