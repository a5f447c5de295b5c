"""What rendered Kubernetes objects say, for the wiring tests of deploy/k8s: which pods a selector
picks, a container's variables (secret values read from the rendered Secrets) and ports, the files
mounted from Secrets, and which peers the NetworkPolicies let in. Selectors are matchLabels only;
anything else fails an assertion rather than being half understood."""

from __future__ import annotations

import base64
import re
from collections.abc import Iterator
from typing import Any

from tests.deploy.kustomize import pod_spec

Obj = dict[str, Any]


def one(objects: list[Obj], kind: str, name: str) -> Obj:
    found = [obj for obj in objects if obj["kind"] == kind and obj["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} objects"
    return found[0]


def of_kind(objects: list[Obj], kind: str) -> list[Obj]:
    return [obj for obj in objects if obj["kind"] == kind]


def workloads(objects: list[Obj]) -> Iterator[tuple[Obj, Obj]]:
    """(workload, its pod template) of every Deployment and StatefulSet."""
    for obj in objects:
        if pod_spec(obj) is not None:
            yield obj, obj["spec"]["template"]


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def pods_selected(objects: list[Obj], selector: dict[str, str]) -> list[Obj]:
    """The pod templates whose labels carry every label of `selector` (matchLabels only)."""
    return [template for _, template in workloads(objects) if matches(selector, template["metadata"]["labels"])]


def match_labels(selector: Obj) -> dict[str, str]:
    assert set(selector) <= {"matchLabels"}, f"only matchLabels selectors are checked here: {selector}"
    return selector.get("matchLabels", {})


def module_of(container: Obj) -> str:
    """The service a container runs: python -m MODULE."""
    command = container.get("command", [])
    assert command[:2] == ["python", "-m"] and len(command) == 3, container["name"]
    return command[2]


# What the downward API gives a container for a fieldRef (a stand-in pod's values).
DOWNWARD_API = {"status.podIP": "10.244.1.7", "metadata.name": "specdec-gateway-7d9f-abcde"}


def env_of(container: Obj, objects: list[Obj]) -> dict[str, str]:
    """The container's variables as Kubernetes sets them: secretKeyRef values read from the rendered
    Secrets, fieldRef values from the downward API (DOWNWARD_API), and $(NAME) in a value replaced
    by an earlier variable's value."""
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), var["value"])
        elif "fieldRef" in var["valueFrom"]:
            env[var["name"]] = DOWNWARD_API[var["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            ref = var["valueFrom"]["secretKeyRef"]
            secret = one(objects, "Secret", ref["name"])
            env[var["name"]] = base64.b64decode(secret["data"][ref["key"]]).decode()
    return env


def container_ports(container: Obj) -> dict[str | int, int]:
    """port name and number -> number, of a container's declared ports."""
    ports: dict[str | int, int] = {}
    for port in container.get("ports", []):
        ports[port["containerPort"]] = port["containerPort"]
        if "name" in port:
            ports[port["name"]] = port["containerPort"]
    return ports


def containers(objects: list[Obj]) -> Iterator[tuple[Obj, Obj]]:
    for workload, template in workloads(objects):
        for container in template["spec"]["containers"]:
            yield workload, container


def container_running(objects: list[Obj], module: str) -> tuple[Obj, Obj]:
    found = [(w, c) for w, c in containers(objects) if c.get("command", [])[-1:] == [module]]
    assert len(found) == 1, f"{module}: {len(found)} containers"
    return found[0]


def host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def secret_keys(objects: list[Obj], name: str) -> set[str]:
    return set(one(objects, "Secret", name).get("data", {}))


def mounted_files(template: Obj, container: Obj, objects: list[Obj]) -> dict[str, tuple[str, str]]:
    """path in the container -> (secret, key), of every secret item mounted into it."""
    volumes = {volume["name"]: volume for volume in template["spec"].get("volumes", [])}
    files = {}
    for mount in container.get("volumeMounts", []):
        volume = volumes[mount["name"]]
        sources = [s["secret"] for s in volume.get("projected", {}).get("sources", []) if "secret" in s]
        sources += [{"name": volume["secret"]["secretName"], **volume["secret"]}] if "secret" in volume else []
        for source in sources:
            keys = secret_keys(objects, source["name"])
            for item in source.get("items") or [{"key": key, "path": key} for key in keys]:
                assert item["key"] in keys, f"Secret {source['name']} has no key {item['key']}"
                files[f"{mount['mountPath']}/{item['path']}"] = (source["name"], item["key"])
    return files


def labels_of(objects: list[Obj], module: str) -> dict[str, str]:
    workload, _ = container_running(objects, module)
    return workload["spec"]["template"]["metadata"]["labels"]


def sources_allowed(objects: list[Obj], labels: dict[str, str], port: int) -> list[Obj] | None:
    """The `from` peers of every ingress rule that lets a connection to `port` into pods with
    `labels`; None when no policy selects those pods (everything may connect)."""
    policies = [p for p in of_kind(objects, "NetworkPolicy") if matches(match_labels(p["spec"]["podSelector"]), labels)]
    if not policies:
        return None
    peers: list[Obj] = []
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            if "ports" in rule and port not in [p["port"] for p in rule["ports"]]:
                continue
            peers.extend(rule.get("from") or [{"anywhere": True}])
    return peers


def is_only_from(objects: list[Obj], peers: list[Obj] | None, source_module: str) -> bool:
    """Every peer is a pod selector of this namespace that selects the source's pods and no other."""
    source = labels_of(objects, source_module)
    if not peers:
        return False
    for peer in peers:
        if set(peer) != {"podSelector"}:
            return False
        selected = pods_selected(objects, match_labels(peer["podSelector"]))
        if not selected or any(pod["metadata"]["labels"] != source for pod in selected):
            return False
    return True


def service_reaches(objects: list[Obj], address: str, module: str) -> bool:
    """host:port is a Service whose port leads to the container running `module` on its SPECDEC_PORT."""
    host, port = host_port(address)
    service = one(objects, "Service", host.split(".")[0])
    workload, container = container_running(objects, module)
    if not matches(service["spec"]["selector"], workload["spec"]["template"]["metadata"]["labels"]):
        return False
    targets = [p.get("targetPort", p["port"]) for p in service["spec"]["ports"] if p["port"] == port]
    ports = container_ports(container)
    return len(targets) == 1 and ports.get(targets[0]) == int(env_of(container, objects)["SPECDEC_PORT"])
