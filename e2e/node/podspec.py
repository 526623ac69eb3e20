"""What a kubelet derives from a pod spec before it starts a container, done the same way here:
environment (values, downward API, ConfigMap and Secret keys), `$(VAR)` expansion of command and
args, named container ports, and the Kubernetes service environment. Pure functions."""

from __future__ import annotations

import base64
import re
from typing import Any, Callable, Mapping

Lookup = Callable[[str, str, str], "dict | None"]   # (kind, namespace, name) -> object or None


class PodSpecError(ValueError):
    """The pod cannot start as specified (a kubelet would report CreateContainerConfigError)."""


def field_value(pod: Mapping[str, Any], path: str) -> str:
    meta, spec, status = pod["metadata"], pod["spec"], pod.get("status") or {}
    simple = {
        "metadata.name": meta.get("name"), "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"), "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName"), "status.podIP": status.get("podIP"),
        "status.hostIP": status.get("hostIP"),
    }
    if path in simple:
        return simple[path] or ""
    m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
    if m:
        return (meta.get(m.group(1)) or {}).get(m.group(2), "")
    raise PodSpecError(f"downward API field {path!r} is not supported by the e2e node agent")


def resource_value(container: Mapping[str, Any], ref: Mapping[str, Any]) -> str:
    part, _, name = ref["resource"].partition(".")
    value = ((container.get("resources") or {}).get(part) or {}).get(name)
    return str(value) if value is not None else "0"


def _key_of(obj: dict | None, key: str, kind: str, ref: Mapping[str, Any]) -> str | None:
    if obj is None:
        if ref.get("optional"):
            return None
        raise PodSpecError(f"{kind} {ref.get('name')!r} not found")
    if kind == "Secret":
        data = {k: base64.b64decode(v).decode() for k, v in (obj.get("data") or {}).items()}
    else:
        data = obj.get("data") or {}
    if key not in data:
        if ref.get("optional"):
            return None
        raise PodSpecError(f"key {key!r} not found in {kind} {ref.get('name')!r}")
    return data[key]


def container_env(pod: Mapping[str, Any], container: Mapping[str, Any], lookup: Lookup,
                  base: Mapping[str, str]) -> dict[str, str]:
    """The container's environment: `base` (what the runtime adds), then envFrom, then env, each
    value expanded against what came before it, as the kubelet does."""
    ns = pod["metadata"]["namespace"]
    env = dict(base)
    for src in container.get("envFrom") or ():
        prefix = src.get("prefix", "")
        for kind, key in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
            if key in src:
                ref = src[key]
                obj = lookup(kind, ns, ref["name"])
                if obj is None and not ref.get("optional"):
                    raise PodSpecError(f"{kind} {ref['name']!r} not found")
                for name in (obj or {}).get("data") or {}:
                    env[prefix + name] = _key_of(obj, name, kind, ref)
    for item in container.get("env") or ():
        name = item["name"]
        if "value" in item:
            env[name] = expand(item["value"], env)
        elif "valueFrom" in item:
            vf = item["valueFrom"]
            if "fieldRef" in vf:
                env[name] = field_value(pod, vf["fieldRef"]["fieldPath"])
            elif "resourceFieldRef" in vf:
                env[name] = resource_value(container, vf["resourceFieldRef"])
            elif "configMapKeyRef" in vf or "secretKeyRef" in vf:
                kind, ref = (("ConfigMap", vf["configMapKeyRef"]) if "configMapKeyRef" in vf
                             else ("Secret", vf["secretKeyRef"]))
                value = _key_of(lookup(kind, ns, ref["name"]), ref["key"], kind, ref)
                if value is not None:
                    env[name] = value
        else:
            env[name] = ""
    return env


_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes `$(VAR)` expansion: known names are replaced, unknown ones kept, `$$` escapes."""
    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))
    return _VAR.sub(sub, text)


def command_line(container: Mapping[str, Any], env: Mapping[str, str], python: str) -> list[str]:
    """command + args, expanded. There are no images here, so a container must name its command; the
    image's `python` is this repository's virtual environment."""
    argv = [expand(a, env) for a in (container.get("command") or [])] + \
           [expand(a, env) for a in (container.get("args") or [])]
    if not container.get("command"):
        raise PodSpecError(f"container {container['name']!r} has no command: the e2e node agent runs no "
                           "images, so it cannot use an image's entrypoint")
    if argv[0] in ("python", "python3"):
        argv[0] = python
    return argv


def named_port(container: Mapping[str, Any], port: int | str) -> int:
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in container.get("ports") or ():
        if p.get("name") == port:
            return int(p["containerPort"])
    raise PodSpecError(f"container {container['name']!r} has no port named {port!r}")


def kubernetes_service_env(apiserver_host: str, apiserver_port: int) -> dict[str, str]:
    """What a kubelet puts in every pod for the `kubernetes` Service. Without kube-proxy its virtual IP
    leads nowhere, so the agent hands out the apiserver's own address (stands in for kube-proxy)."""
    return {"KUBERNETES_SERVICE_HOST": apiserver_host, "KUBERNETES_SERVICE_PORT": str(apiserver_port),
            "KUBERNETES_SERVICE_PORT_HTTPS": str(apiserver_port),
            "KUBERNETES_PORT": f"tcp://{apiserver_host}:{apiserver_port}"}
