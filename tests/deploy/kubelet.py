"""A container's environment as kubelet builds it from a rendered pod spec.

Order and precedence follow kubelet: the service links of every Service with a cluster IP in the
pod's namespace (plus the API server's ``kubernetes`` Service) come first, then ``envFrom`` (with
its optional prefix), then ``env``, whose ``$(VAR)`` references expand from what is set so far and
whose ``valueFrom`` reads the downward API, a ConfigMap or a Secret. The cluster assigns the IPs;
here they are made up, one per Service.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

Lookup = Callable[[str, str], Mapping[str, str]]
"""(kind, name) -> data of that ConfigMap or Secret."""


def service_links(services: list[dict[str, Any]]) -> dict[str, str]:
    """What kubelet injects for these Services (headless ones get none)."""
    env: dict[str, str] = {}
    linked = [s for s in services if s["spec"].get("clusterIP") != "None"]
    kubernetes = {
        "metadata": {"name": "kubernetes"},
        "spec": {"ports": [{"name": "https", "port": 443, "protocol": "TCP"}]},
    }
    for n, service in enumerate([kubernetes, *linked], start=1):
        name = service["metadata"]["name"].upper().replace("-", "_")
        ip = f"10.96.0.{n}"
        ports = service["spec"]["ports"]
        env[f"{name}_SERVICE_HOST"] = ip
        env[f"{name}_SERVICE_PORT"] = str(ports[0]["port"])
        first = ports[0]
        env[f"{name}_PORT"] = f"{first.get('protocol', 'TCP').lower()}://{ip}:{first['port']}"
        for p in ports:
            proto = p.get("protocol", "TCP")
            if "name" in p:
                env[f"{name}_SERVICE_PORT_{p['name'].upper().replace('-', '_')}"] = str(p["port"])
            base = f"{name}_PORT_{p['port']}_{proto}"
            env[base] = f"{proto.lower()}://{ip}:{p['port']}"
            env[f"{base}_PROTO"] = proto.lower()
            env[f"{base}_PORT"] = str(p["port"])
            env[f"{base}_ADDR"] = ip
    return env


def container_environment(
    container: dict[str, Any],
    fields: Mapping[str, str],
    lookup: Lookup,
    services: list[dict[str, Any]],
) -> dict[str, str]:
    """``fields``: downward-API values by field path (metadata.name, ...)."""
    env = service_links(services)
    for source in container.get("envFrom", []):
        prefix = source.get("prefix", "")
        for kind, ref in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
            if ref in source:
                env |= {prefix + k: v for k, v in lookup(kind, source[ref]["name"]).items()}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), var["value"])
            continue
        source = var["valueFrom"]
        if "fieldRef" in source:
            env[var["name"]] = fields[source["fieldRef"]["fieldPath"]]
        elif "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            env[var["name"]] = lookup("ConfigMap", ref["name"])[ref["key"]]
        else:
            ref = source["secretKeyRef"]
            env[var["name"]] = lookup("Secret", ref["name"])[ref["key"]]
    return env
