"""deploy/k8s: every overlay rendered (tests/deploy/kustomize.py, and `kubectl kustomize` where
kubectl is installed), every object valid against the Kubernetes schemas offline
(kubernetes-validate, strict: an unknown field fails), and the wiring checked end to end: Services
select pods and target their ports, probes ask the right health service on a declared port,
secrets and keys exist, files named by *_FILE variables are mounted, NetworkPolicies let only the
gateways reach the nodes and only the HTTP fronts reach the gateways, the gateway's addresses name
the node Service's pods and ports, the autoscalers scale Deployments on gauges the services export,
and every container's environment parses with the service's own configuration code."""

from __future__ import annotations

import base64
import contextlib
import http.server
import importlib
import ipaddress
import shutil
import ssl
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml
from grpc_health.v1 import health as grpc_health
from grpc_health.v1 import health_pb2
from prometheus_client import CollectorRegistry

from tests.service_env import unread_variables
from specdec import healthcheck
from specdec.service import ServerConfig, create_server
from specdec.service.api_keys import key_hash, new_key
from specdec.service.auth import new_service_token
from tests.deploy.kustomize import KustomizeError, object_key, render, split_image, strategic_merge
from tests.deploy.manifests import (
    container_ports,
    container_running,
    containers,
    DOWNWARD_API,
    env_of,
    host_port,
    is_only_from,
    labels_of,
    match_labels,
    matches,
    module_of,
    mounted_files,
    of_kind,
    one,
    pods_selected,
    service_reaches,
    sources_allowed,
    workloads,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
K8S_DIR = REPO_ROOT / "deploy" / "k8s"
OVERLAYS = ("cpu", "gpu", "dev-redis")
# The oldest Kubernetes the manifests are written for (native gRPC probes, autoscaling/v2 and
# policy/v1 are GA well before it) and the newest whose schemas the pinned kubernetes-validate has.
KUBERNETES_VERSIONS = ("1.30.0", "1.37.0")
# The service each image command runs, and the name its grpc.health.v1 reports (its servicer's).
HEALTH_SERVICES = {
    "primary_svc": ("primary_pb2", "PrimaryService"),
    "draft_svc": ("draft_pb2", "DraftService"),
    "validator_svc": ("validator_pb2", "ValidatorService"),
    "gateway": ("gateway_pb2", "GenerationService"),
}
NODE_MODULES = ("primary_svc", "draft_svc", "validator_svc")
# The prefix of each service's own variables (specdec/service/flags.py).
SERVICE_PREFIXES = {
    "primary_svc": "PRIMARY",
    "draft_svc": "DRAFT",
    "validator_svc": "VALIDATOR",
    "gateway": "GATEWAY",
    "http_svc": "HTTP",
}
# The image's own environment (Dockerfile): what a container sees besides its manifest's env.
IMAGE_ENV = {"SPECDEC_HOST": "0.0.0.0", "SPECDEC_CACHE_DIR": "/cache"}
GPU_RESOURCE = "nvidia.com/gpu"
REDIS_URL = "redis://:a-password@redis.internal.example:6379/0"

Obj = dict[str, Any]


# --- rendering -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def k8s_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """deploy/k8s with the files a user provides: a fresh service token, an API keys file and an
    external Redis URL (git ignores them in the repository)."""
    root = tmp_path_factory.mktemp("deploy") / "k8s"
    shutil.copytree(K8S_DIR, root, ignore=shutil.ignore_patterns("service_token", "api_keys", "redis_url"))
    (root / "secrets" / "service_token").write_text(new_service_token() + "\n")
    (root / "secrets" / "api_keys").write_text(f"alice {key_hash(new_key())}\nbob {key_hash(new_key())}\n")
    (root / "redis" / "external" / "redis_url").write_text(REDIS_URL)
    return root


@pytest.fixture(scope="module")
def rendered(k8s_dir: Path) -> dict[str, list[Obj]]:
    return {overlay: render(k8s_dir / "overlays" / overlay) for overlay in OVERLAYS}


def _normalized(obj: Obj) -> Obj:
    """kubectl wraps the base64 of secret data in lines: compare the bytes."""
    if obj["kind"] != "Secret":
        return obj
    return {**obj, "data": {key: base64.b64decode(value) for key, value in obj.get("data", {}).items()}}


def _kubectl_kustomize(directory: Path) -> list[Obj]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the Python renderer alone is checked")
    result = subprocess.run(
        [kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_renderer_gives_what_kubectl_kustomize_gives(k8s_dir: Path, rendered: dict, overlay: str) -> None:
    theirs = {object_key(obj): _normalized(obj) for obj in _kubectl_kustomize(k8s_dir / "overlays" / overlay)}
    ours = {object_key(obj): _normalized(obj) for obj in rendered[overlay]}
    assert sorted(ours) == sorted(theirs)
    for key, obj in ours.items():
        assert obj == theirs[key], key


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_object_is_valid_against_the_kubernetes_schema(rendered: dict, overlay: str, version: str) -> None:
    for obj in rendered[overlay]:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{overlay}: {object_key(obj)} on Kubernetes {version}: {e.message} at {list(e.path)}")


def test_schema_validation_rejects_an_unknown_field(rendered: dict) -> None:
    """The check above is not vacuous: a misspelt field of a container fails it."""
    statefulset = one(rendered["cpu"], "StatefulSet", "specdec-node")
    broken = strategic_merge(statefulset, {"spec": {"template": {"spec": {"containers": [{"name": "primary"}]}}}})
    broken["spec"]["template"]["spec"]["containers"][0]["readynessProbe"] = {"grpc": {"port": 50051}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[-1], strict=True)


# --- Services, ports, probes ---------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_service_selects_pods_and_targets_their_ports(rendered: dict, overlay: str) -> None:
    objects = rendered[overlay]
    for service in of_kind(objects, "Service"):
        pods = pods_selected(objects, service["spec"]["selector"])
        assert pods, f"Service {service['metadata']['name']} selects no pod"
        for pod in pods:
            ports = {k: v for c in pod["spec"]["containers"] for k, v in container_ports(c).items()}
            for port in service["spec"]["ports"]:
                target = port.get("targetPort", port["port"])
                assert target in ports, f"Service {service['metadata']['name']}: no container port {target!r}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_container_ports_are_unique_in_a_pod_and_the_ones_the_services_listen_on(rendered: dict, overlay: str) -> None:
    """Containers of a Pod share its network: two on one port would not start. SPECDEC_PORT and
    SPECDEC_METRICS_PORT, the ports the services bind, are the declared ones."""
    objects = rendered[overlay]
    for workload, template in workloads(objects):
        numbers = [p["containerPort"] for c in template["spec"]["containers"] for p in c.get("ports", [])]
        assert len(numbers) == len(set(numbers)), f"{workload['metadata']['name']}: {numbers}"
        for container in template["spec"]["containers"]:
            env = env_of(container, objects)
            declared = set(container_ports(container).values())
            for variable in ("SPECDEC_PORT", "SPECDEC_METRICS_PORT"):
                if variable in env:
                    assert int(env[variable]) in declared, f"{container['name']}: {variable}={env[variable]}"


def _health_service(module: str) -> str | None:
    if module not in HEALTH_SERVICES:
        return None
    proto, service = HEALTH_SERVICES[module]
    return importlib.import_module(f"specdec.v1.{proto}").DESCRIPTOR.services_by_name[service].full_name


def _health_client_args(probe: Obj) -> list[str] | None:
    """The arguments of an exec probe that runs the image's health client (python -m
    specdec.healthcheck), else None."""
    command = probe.get("exec", {}).get("command", [])
    return command[3:] if command[:3] == ["python", "-m", "specdec.healthcheck"] else None


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_ask_declared_ports_and_the_services_health_name(rendered: dict, overlay: str) -> None:
    """A grpc: probe, or the image's health client (an exec probe), asks the service's health name at
    the port the service listens on."""
    for _, container in containers(rendered[overlay]):
        ports = container_ports(container)
        env = env_of(container, rendered[overlay])
        module = module_of(container) if container.get("command", [""])[0] == "python" else None
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = container.get(kind)
            if probe is None:
                continue
            handler = next(key for key in ("grpc", "httpGet", "tcpSocket", "exec") if key in probe)
            if handler == "exec":
                args = _health_client_args(probe)
                if args is None:
                    continue
                parsed = healthcheck._parse_args(args)
                host, port = host_port(parsed.address)
                assert ipaddress.ip_address(host).is_loopback, f"{container['name']} {kind}: {parsed.address}"
                assert port == int(env["SPECDEC_PORT"]) and port in ports.values(), f"{container['name']} {kind}"
                if module in HEALTH_SERVICES:
                    assert not parsed.http_path and parsed.service == _health_service(module), f"{container['name']}"
                continue
            assert probe[handler]["port"] in ports, f"{container['name']} {kind}: port {probe[handler]['port']}"
            if handler == "grpc":
                assert ports[probe["grpc"]["port"]] == int(env["SPECDEC_PORT"]), f"{container['name']} {kind}"
                assert probe["grpc"]["service"] == _health_service(module or ""), f"{container['name']} {kind}"
        if module in HEALTH_SERVICES:
            assert {"readinessProbe", "livenessProbe"} <= set(container), f"{container['name']}: probes missing"
            for kind in ("readinessProbe", "livenessProbe"):
                probe = container[kind]
                assert "grpc" in probe or _health_client_args(probe) is not None, f"{container['name']} {kind}"


def _serves_tls(module: str, env: dict[str, str], certificate: tuple[Path, Path], monkeypatch) -> bool:
    """Whether the service reads a certificate and key from its environment and serves TLS with them
    (SPECDEC_<SERVICE>_TLS_CERT / _KEY, the --tls_cert / --tls_key flags)."""
    prefix = SERVICE_PREFIXES[module]
    cert, key = (str(path) for path in certificate)
    tls_env = {**env, f"SPECDEC_{prefix}_TLS_CERT": cert, f"SPECDEC_{prefix}_TLS_KEY": key}
    return f"SPECDEC_{prefix}_TLS_CERT" not in unread_variables(module, tls_env, monkeypatch)


@contextlib.contextmanager
def _tls_server(certificate: tuple[Path, Path], grpc_service: str) -> Iterator[tuple[int, int]]:
    """(gRPC port, HTTPS port) of two servers on 127.0.0.1 serving TLS with `certificate`: gRPC health
    reporting `grpc_service` SERVING, and HTTP answering 200 to every GET (the front's /health and
    /metrics)."""
    cert, key = certificate

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the standard library's name
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    health_servicer = grpc_health.HealthServicer()
    health_servicer.set(grpc_service, health_pb2.HealthCheckResponse.SERVING)
    config = ServerConfig(host="127.0.0.1", tls_cert_file=str(cert), tls_key_file=str(key))
    server, grpc_port = create_server(
        "127.0.0.1:0", [], health_servicer=health_servicer, credentials=config.server_credentials()
    )
    server.start()
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield grpc_port, httpd.server_address[1]
    finally:
        httpd.shutdown()
        httpd.server_close()
        server.stop(None)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_probes_of_a_service_serving_tls_pass_once_tls_is_on(
    rendered: dict, overlay: str, certificate: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gateway and the HTTP front serve TLS once their container sets SPECDEC_*_TLS_CERT / _KEY
    (docs/kubernetes.md). Kubernetes' grpc: probe speaks plaintext only, and an httpGet probe's
    scheme is fixed in the manifest: with TLS on, their pods would never get ready (and the front's
    liveness probe would restart it). Their probes run the image's health client instead, which checks
    over TLS with the container's SPECDEC_HEALTHCHECK_TLS_CA_FILE: run here, with that variable set,
    against servers serving TLS, each passes."""
    objects = rendered[overlay]
    serving_tls = set()
    for _, container in containers(objects):
        if container.get("command", [""])[0] != "python":
            continue
        module = module_of(container)
        if not _serves_tls(module, {**IMAGE_ENV, **env_of(container, objects)}, certificate, monkeypatch):
            continue
        serving_tls.add(module)
        kinds = ("startupProbe", "readinessProbe", "livenessProbe")
        probes = {kind: container[kind] for kind in kinds if kind in container}
        assert probes, f"{container['name']}: no probe"
        with _tls_server(certificate, _health_service(module) or "") as (grpc_port, https_port):
            for kind, probe in probes.items():
                args = _health_client_args(probe)
                assert args is not None, f"{overlay} {container['name']} {kind}: {probe} cannot speak TLS"
                parsed = healthcheck._parse_args(args)
                host, _ = host_port(parsed.address)
                port = https_port if parsed.http_path else grpc_port
                args = [f"{host}:{port}", *args[1:]]  # the test's server in place of the container's port
                with monkeypatch.context() as m:
                    m.setenv(healthcheck.CA_FILE_VARIABLE, str(certificate[0]))
                    assert healthcheck.main(args) == 0, f"{overlay} {container['name']} {kind}"
                assert healthcheck.main([*args, "--timeout", "1"]) == 1, "the server must refuse plaintext"
    assert serving_tls == {"gateway", "http_svc"}


# --- secrets -------------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_secret_references_name_existing_secrets_and_keys(rendered: dict, overlay: str) -> None:
    objects = rendered[overlay]
    for _, template in workloads(objects):
        for container in template["spec"]["containers"]:
            for var in container.get("env", []):
                for ref_kind, kind in (("secretKeyRef", "Secret"), ("configMapKeyRef", "ConfigMap")):
                    ref = var.get("valueFrom", {}).get(ref_kind)
                    if ref is not None:
                        target = one(objects, kind, ref["name"])
                        assert ref["key"] in target.get("data", {}), f"{var['name']}: {kind} {ref['name']}"
            mounted_files(template, container, objects)  # asserts every mounted item's key


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_file_variable_names_a_mounted_secret(rendered: dict, overlay: str) -> None:
    """SPECDEC_SERVICE_TOKEN_FILE, *_API_KEYS_FILE: a file the container has, from a real Secret."""
    objects = rendered[overlay]
    for _, template in workloads(objects):
        for container in template["spec"]["containers"]:
            files = mounted_files(template, container, objects)
            for name, value in env_of(container, objects).items():
                if name.startswith("SPECDEC_") and name.endswith("_FILE"):
                    assert value in files, f"{container['name']}: {name}={value} is not mounted"


def test_service_token_and_api_keys_reach_the_services_that_check_them(rendered: dict) -> None:
    objects = rendered["cpu"]
    for module in (*NODE_MODULES, "gateway"):
        _, container = container_running(objects, module)
        assert "SPECDEC_SERVICE_TOKEN_FILE" in env_of(container, objects), module
    for module, variable in (("gateway", "SPECDEC_GATEWAY_API_KEYS_FILE"), ("http_svc", "SPECDEC_HTTP_API_KEYS_FILE")):
        _, container = container_running(objects, module)
        assert variable in env_of(container, objects), module
    _, http = container_running(objects, "http_svc")
    assert "SPECDEC_SERVICE_TOKEN_FILE" not in env_of(http, objects), "the HTTP front is a public client"


# --- the environment as the services read it -----------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_environment_parses_and_every_variable_is_read(
    rendered: dict, overlay: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each service's configuration code accepts its container's environment, and reads every
    SPECDEC_* variable the manifest sets (a misspelt one would be ignored silently)."""
    objects = rendered[overlay]
    for _, container in containers(objects):
        if container.get("command", [""])[0] != "python":
            continue
        env = {**IMAGE_ENV, **env_of(container, objects)}
        unread = unread_variables(module_of(container), env, monkeypatch) - set(IMAGE_ENV)
        assert not unread, f"{overlay} {container['name']}: variables no flag reads: {sorted(unread)}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_service_links_are_off(rendered: dict, overlay: str) -> None:
    """Kubernetes' service links would set SPECDEC_GATEWAY_PORT=tcp://… for the specdec-gateway
    Service and SPECDEC_HTTP_PORT for specdec-http: variables the gateway and the front read as their
    --port."""
    for workload, template in workloads(rendered[overlay]):
        assert template["spec"].get("enableServiceLinks") is False, workload["metadata"]["name"]


# --- the node ------------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_node_is_one_pod_of_primary_draft_and_validator_sharing_memory(rendered: dict, overlay: str) -> None:
    objects = rendered[overlay]
    statefulset = one(objects, "StatefulSet", "specdec-node")
    spec = statefulset["spec"]["template"]["spec"]
    assert sorted(module_of(c) for c in spec["containers"]) == sorted(NODE_MODULES)
    assert spec["shareProcessNamespace"] is True
    shm_volumes = {v["name"] for v in spec["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"}
    for container in spec["containers"]:
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert mounts.get("/dev/shm") in shm_volumes, f"{container['name']}: /dev/shm is not the shared emptyDir"
    _, draft = container_running(objects, "draft_svc")
    _, primary = container_running(objects, "primary_svc")
    host, port = host_port(env_of(draft, objects)["SPECDEC_PRIMARY_ADDRESS"])
    assert ipaddress.ip_address(host).is_loopback and port == int(env_of(primary, objects)["SPECDEC_PORT"])


def test_the_gpu_overlay_gives_the_primary_one_gpu_and_nothing_else_a_gpu(rendered: dict) -> None:
    for overlay in OVERLAYS:
        for _, container in containers(rendered[overlay]):
            resources = container.get("resources", {})
            gpus = {**resources.get("requests", {}), **resources.get("limits", {})}.get(GPU_RESOURCE)
            module = module_of(container) if container.get("command", [""])[0] == "python" else None
            if overlay == "gpu" and module == "primary_svc":
                assert gpus == 1
                assert split_image(container["image"])[1] == ":cuda"
                assert env_of(container, rendered[overlay])["SPECDEC_DEVICE"] == "cuda"
            else:
                assert gpus is None, f"{overlay} {container['name']}"
                if module is not None:
                    assert split_image(container["image"])[1] == ":cpu", f"{overlay} {container['name']}"


# --- who reaches whom ----------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_gateways_reach_the_nodes_and_only_http_fronts_and_gateways_reach_the_gateways(
    rendered: dict, overlay: str
) -> None:
    objects = rendered[overlay]
    for module in NODE_MODULES:
        _, container = container_running(objects, module)
        port = int(env_of(container, objects)["SPECDEC_PORT"])
        peers = sources_allowed(objects, labels_of(objects, module), port)
        assert is_only_from(objects, peers, "gateway"), f"{module}:{port} is reachable from {peers}"
    _, gateway = container_running(objects, "gateway")
    peers = sources_allowed(objects, labels_of(objects, "gateway"), int(env_of(gateway, objects)["SPECDEC_PORT"]))
    assert peers is not None and len(peers) == 2, f"the gateway is reachable from {peers}"
    # the HTTP fronts call it; the other gateways ask it whether it still runs its requests
    assert {module for module in ("http_svc", "gateway") if any(is_only_from(objects, [p], module) for p in peers)} == {
        "http_svc",
        "gateway",
    }, f"the gateway is reachable from {peers}"
    _, http = container_running(objects, "http_svc")
    assert sources_allowed(objects, labels_of(objects, "http_svc"), int(env_of(http, objects)["SPECDEC_PORT"]))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_select_pods_and_allow_declared_ports(rendered: dict, overlay: str) -> None:
    objects = rendered[overlay]
    for policy in of_kind(objects, "NetworkPolicy"):
        name = policy["metadata"]["name"]
        pods = pods_selected(objects, match_labels(policy["spec"]["podSelector"]))
        assert pods, f"NetworkPolicy {name} selects no pod"
        declared = {p for pod in pods for c in pod["spec"]["containers"] for p in container_ports(c).values()}
        for rule in policy["spec"].get("ingress", []):
            for port in rule.get("ports", []):
                assert port["port"] in declared, f"NetworkPolicy {name}: no selected pod listens on {port['port']}"
            for peer in rule.get("from", []):
                if "podSelector" in peer and "namespaceSelector" not in peer:
                    assert pods_selected(objects, match_labels(peer["podSelector"])), f"{name}: {peer}"


# --- addresses -----------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_gateway_advertises_its_pod_ip_at_its_own_port(rendered: dict, overlay: str) -> None:
    """The address in a gateway's owner id (other gateways health-check it there before adopting
    its requests) is the pod's IP from the downward API, at the port the gateway listens on."""
    objects = rendered[overlay]
    _, gateway = container_running(objects, "gateway")
    env = env_of(gateway, objects)
    host, port = host_port(env["SPECDEC_GATEWAY_ADVERTISE_ADDRESS"])
    assert host == DOWNWARD_API["status.podIP"]
    assert port == int(env["SPECDEC_PORT"]) and port in container_ports(gateway).values()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_gateway_reaches_one_node_through_the_node_service(rendered: dict, overlay: str) -> None:
    """specdec-node-<i>.specdec-node: pod i of the StatefulSet under its headless governing Service,
    so primary, draft and validator are the services of one node; each port is the one its
    container listens on."""
    objects = rendered[overlay]
    _, gateway = container_running(objects, "gateway")
    env = env_of(gateway, objects)
    for flag, module in (("PRIMARY", "primary_svc"), ("DRAFT", "draft_svc"), ("VALIDATOR", "validator_svc")):
        host, port = host_port(env[f"SPECDEC_GATEWAY_{flag}_ADDRESS"])
        pod_name, service_name = host.split(".")[:2]
        statefulset, container = container_running(objects, module)
        assert statefulset["kind"] == "StatefulSet" and statefulset["spec"]["serviceName"] == service_name
        ordinal = pod_name.removeprefix(statefulset["metadata"]["name"] + "-")
        assert ordinal.isdigit() and int(ordinal) < statefulset["spec"]["replicas"], host
        service = one(objects, "Service", service_name)
        assert service["spec"]["clusterIP"] == "None", "per-pod DNS names need a headless Service"
        assert matches(service["spec"]["selector"], statefulset["spec"]["template"]["metadata"]["labels"])
        assert port == int(env_of(container, objects)["SPECDEC_PORT"]) and port in container_ports(container).values()
        assert port in [p["port"] for p in service["spec"]["ports"]]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_http_front_reaches_the_gateways_through_their_service(rendered: dict, overlay: str) -> None:
    objects = rendered[overlay]
    _, http = container_running(objects, "http_svc")
    assert service_reaches(objects, env_of(http, objects)["SPECDEC_HTTP_GATEWAY_ADDRESS"], "gateway")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_gateways_share_one_redis(rendered: dict, overlay: str) -> None:
    """A Redis URL, never empty (empty: each gateway's own in-process store, nothing shared); with
    the development Redis, its Service in front of the Redis pod."""
    objects = rendered[overlay]
    _, gateway = container_running(objects, "gateway")
    url = urlsplit(env_of(gateway, objects)["SPECDEC_GATEWAY_REDIS_URL"])
    assert url.scheme in ("redis", "rediss") and url.hostname
    if overlay != "dev-redis":
        assert url.geturl() == REDIS_URL
        return
    service = one(objects, "Service", url.hostname)
    (redis,) = pods_selected(objects, service["spec"]["selector"])
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == url.port]
    assert container_ports(redis["spec"]["containers"][0]).get(port["targetPort"]) == 6379
    assert is_only_from(objects, sources_allowed(objects, redis["metadata"]["labels"], 6379), "gateway")


# --- autoscaling and disruptions -----------------------------------------------------------------


def _exported_gauges(module: str) -> set[str]:
    registry = CollectorRegistry()
    if module == "gateway":
        importlib.import_module("gateway.metrics").GatewayMetrics(registry)
    else:
        importlib.import_module("http_svc.metrics").HttpMetrics(registry)
    return {family.name for family in registry.collect() if family.type == "gauge"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_autoscalers_scale_deployments_on_gauges_their_pods_export(rendered: dict, overlay: str) -> None:
    objects = rendered[overlay]
    autoscalers = of_kind(objects, "HorizontalPodAutoscaler")
    assert {hpa["spec"]["scaleTargetRef"]["name"] for hpa in autoscalers} == {"specdec-gateway", "specdec-http"}
    for hpa in autoscalers:
        target = hpa["spec"]["scaleTargetRef"]
        deployment = one(objects, target["kind"], target["name"])
        assert target["kind"] == "Deployment" and target["apiVersion"] == deployment["apiVersion"]
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        gauges = _exported_gauges(module_of(container))
        for metric in hpa["spec"]["metrics"]:
            assert metric["type"] == "Pods" and metric["pods"]["target"]["type"] == "AverageValue"
            assert metric["pods"]["metric"]["name"] in gauges, f"{target['name']}: {metric['pods']['metric']['name']}"
        assert "SPECDEC_METRICS_PORT" in env_of(container, objects), "the metric must be scraped"
        assert deployment["spec"]["replicas"] >= hpa["spec"]["minReplicas"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_disruption_budgets_select_pods(rendered: dict, overlay: str) -> None:
    objects = rendered[overlay]
    for budget in of_kind(objects, "PodDisruptionBudget"):
        assert pods_selected(objects, match_labels(budget["spec"]["selector"])), budget["metadata"]["name"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workload_and_spread_selectors_match_their_templates(rendered: dict, overlay: str) -> None:
    for workload, template in workloads(rendered[overlay]):
        labels = template["metadata"]["labels"]
        assert matches(match_labels(workload["spec"]["selector"]), labels)
        for constraint in template["spec"].get("topologySpreadConstraints", []):
            assert matches(match_labels(constraint["labelSelector"]), labels), workload["metadata"]["name"]


# --- the user's inputs ---------------------------------------------------------------------------


def test_a_registry_set_with_kustomize_edit_applies_to_every_service_image(k8s_dir: Path, tmp_path: Path) -> None:
    """`kustomize edit set image specdec=REGISTRY/specdec` keeps the tags: cpu and cuda images from
    the registry; the development Redis keeps its own image."""
    root = tmp_path / "k8s"
    shutil.copytree(k8s_dir, root)
    overlay = root / "overlays" / "gpu" / "kustomization.yaml"
    kustomization = yaml.safe_load(overlay.read_text())
    kustomization["images"] = [{"name": "specdec", "newName": "registry.example:5000/team/specdec"}]
    overlay.write_text(yaml.safe_dump(kustomization))
    renderings = [render(overlay.parent)]
    if shutil.which("kubectl"):
        renderings.append(_kubectl_kustomize(overlay.parent))
    for objects in renderings:
        images = {split_image(c["image"]) for _, c in containers(objects)}
        name = "registry.example:5000/team/specdec"
        assert images == {(name, ":cpu"), (name, ":cuda")}


def test_a_missing_secret_file_stops_the_rendering(tmp_path: Path) -> None:
    """As with kustomize: without secrets/service_token nothing is rendered, rather than a node
    whose services refuse every call."""
    root = tmp_path / "k8s"
    shutil.copytree(K8S_DIR, root, ignore=shutil.ignore_patterns("service_token", "api_keys", "redis_url"))
    with pytest.raises(KustomizeError, match="service_token"):
        render(root / "overlays" / "cpu")


def test_the_repository_keeps_no_secret_files() -> None:
    listed = subprocess.run(
        ["git", "ls-files", "deploy/k8s"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    assert listed, "deploy/k8s is not tracked"
    assert not [path for path in listed if Path(path).name in ("service_token", "api_keys", "redis_url")]
