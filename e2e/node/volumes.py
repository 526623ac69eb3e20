"""Pod volumes made on the host, as a kubelet would, then bind-mounted at each container's
mountPath inside the pod's own mount namespace: configMap, secret and downwardAPI volumes are
written as files, emptyDir is a fresh folder, hostPath and PersistentVolumes (hostPath or local)
are used in place."""

from __future__ import annotations

import base64
import os
from pathlib import Path
from typing import Any, Mapping

from .podspec import Lookup, PodSpecError, field_value


def materialize(pod: Mapping[str, Any], volume: Mapping[str, Any], pod_dir: Path, lookup: Lookup) -> str:
    """The host path that backs one volume (created when the volume type creates one)."""
    ns, name = pod["metadata"]["namespace"], volume["name"]
    here = pod_dir / "volumes" / name
    if "emptyDir" in volume:
        here.mkdir(parents=True, exist_ok=True)
        os.chmod(here, 0o777)   # any pod user may write, as with the kubelet's emptyDir
        return str(here)
    if "configMap" in volume or "secret" in volume:
        kind, src = ("ConfigMap", volume["configMap"]) if "configMap" in volume else ("Secret", volume["secret"])
        ref = src.get("name") or src.get("secretName")
        obj = lookup(kind, ns, ref)
        if obj is None:
            if src.get("optional"):
                obj = {}
            else:
                raise PodSpecError(f'volume "{name}": {kind} "{ref}" not found')
        data = dict(obj.get("data") or {})
        if kind == "Secret":
            data = {k: base64.b64decode(v) for k, v in data.items()}
        _write_items(here, data, src.get("items"), src.get("defaultMode", 0o644), f'volume "{name}"')
        return str(here)
    if "downwardAPI" in volume:
        src = volume["downwardAPI"]
        data = {item["path"]: field_value(pod, item["fieldRef"]["fieldPath"]) for item in src.get("items") or ()}
        _write_items(here, data, None, src.get("defaultMode", 0o644), f'volume "{name}"')
        return str(here)
    if "hostPath" in volume:
        return _host_path(volume["hostPath"], name)
    if "persistentVolumeClaim" in volume:
        claim = volume["persistentVolumeClaim"]["claimName"]
        pvc = lookup("PersistentVolumeClaim", ns, claim)
        if pvc is None or not (pvc.get("spec") or {}).get("volumeName"):
            raise PodSpecError(f'volume "{name}": PersistentVolumeClaim "{claim}" is not bound')
        pv = lookup("PersistentVolume", "", pvc["spec"]["volumeName"])
        spec = (pv or {}).get("spec") or {}
        path = (spec.get("hostPath") or spec.get("local") or {}).get("path")
        if not path:
            raise PodSpecError(f'volume "{name}": only hostPath and local PersistentVolumes can be mounted here')
        return path
    kinds = sorted(set(volume) - {"name"})
    raise PodSpecError(f'volume "{name}": type {kinds} is not supported by the e2e node agent')


def _host_path(src: Mapping[str, Any], name: str) -> str:
    path, kind = src["path"], src.get("type") or ""
    if kind == "DirectoryOrCreate":
        os.makedirs(path, exist_ok=True)
    elif kind == "Directory" and not os.path.isdir(path):
        raise PodSpecError(f'volume "{name}": hostPath {path} is not a directory')
    elif kind == "" and not os.path.exists(path):
        os.makedirs(path, exist_ok=True)
    return path


def _write_items(here: Path, data: Mapping[str, Any], items, mode: int, what: str) -> None:
    here.mkdir(parents=True, exist_ok=True)
    os.chmod(here, 0o755)
    chosen = [(i["key"], i["path"], i.get("mode", mode)) for i in items] if items else \
             [(k, k, mode) for k in data]
    for key, rel, file_mode in chosen:
        if key not in data:
            raise PodSpecError(f"{what}: key {key!r} not found")
        target = here / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        value = data[key]
        target.write_bytes(value if isinstance(value, bytes) else str(value).encode())
        os.chmod(target, file_mode)
