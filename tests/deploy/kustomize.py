"""A small renderer of the kustomizations in deploy/k8s, for machines without kubectl.

It applies the part of kustomize those kustomizations use, and refuses anything else, so that it
cannot silently render something kustomize would not:
- `resources`: YAML files (several documents each) and directories holding a kustomization.yaml,
  rendered first, in order;
- `patches` with a `path` only: strategic-merge patches, matched to their object by apiVersion
  group, kind and name. Lists of the Kubernetes fields below are merged item by item on their merge
  key (containers by name, volumeMounts by mountPath, …), as the API's patchMergeKey says; any
  other list is replaced whole, and a `$patch` directive is refused;
- `images`: newName, newTag and digest for every container whose image has that name;
- `secretGenerator`: `files` (KEY=PATH or PATH) and `literals` (KEY=VALUE), under
  `generatorOptions.disableNameSuffixHash: true` only (kustomize's name hash is not reproduced).

With kubectl present, tests/deploy/test_k8s.py checks that this renderer and `kubectl kustomize`
give the same objects.
"""

from __future__ import annotations

import base64
import copy
from pathlib import Path
from typing import Any

import yaml

KUSTOMIZATION_FILE = "kustomization.yaml"
SUPPORTED_KEYS = frozenset(
    {"apiVersion", "kind", "resources", "patches", "images", "secretGenerator", "generatorOptions"}
)
# List fields merged item by item, and the key naming an item (the API's patchMergeKey; `ports` is
# a container's by containerPort, a Service's by port).
MERGE_KEYS = {
    "containers": ("name",),
    "initContainers": ("name",),
    "env": ("name",),
    "volumes": ("name",),
    "volumeMounts": ("mountPath",),
    "ports": ("containerPort", "port"),
    "imagePullSecrets": ("name",),
}
WORKLOAD_POD_SPEC_PATHS = {
    "Pod": ("spec",),
    "Deployment": ("spec", "template", "spec"),
    "StatefulSet": ("spec", "template", "spec"),
    "DaemonSet": ("spec", "template", "spec"),
    "Job": ("spec", "template", "spec"),
}

Obj = dict[str, Any]


class KustomizeError(ValueError):
    """A kustomization uses what this renderer does not do, or is inconsistent."""


def object_key(obj: Obj) -> tuple[str, str, str]:
    """(API group, kind, name): what identifies an object of one namespace."""
    api_version = obj.get("apiVersion", "")
    group = api_version.split("/")[0] if "/" in api_version else ""
    return group, obj["kind"], obj["metadata"]["name"]


def render(directory: Path) -> list[Obj]:
    """The objects of the kustomization in `directory`, patches, images and generators applied."""
    directory = Path(directory)
    path = directory / KUSTOMIZATION_FILE
    if not path.is_file():
        raise KustomizeError(f"{directory}: no {KUSTOMIZATION_FILE}")
    kustomization = yaml.safe_load(path.read_text()) or {}
    unsupported = set(kustomization) - SUPPORTED_KEYS
    if unsupported:
        raise KustomizeError(f"{path}: fields this renderer does not apply: {sorted(unsupported)}")
    objects: list[Obj] = []
    for resource in kustomization.get("resources", []):
        target = directory / resource
        objects.extend(render(target) if target.is_dir() else _load_documents(target))
    objects.extend(_generate_secrets(directory, kustomization))
    for patch in kustomization.get("patches", []):
        _apply_patch(objects, directory, patch)
    for image in kustomization.get("images", []):
        _apply_image(objects, image)
    seen: set[tuple[str, str, str]] = set()
    for obj in objects:
        if object_key(obj) in seen:
            raise KustomizeError(f"{path}: {object_key(obj)} is defined twice")
        seen.add(object_key(obj))
    return objects


def _load_documents(path: Path) -> list[Obj]:
    if not path.is_file():
        raise KustomizeError(f"resource {path} does not exist")
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _generate_secrets(directory: Path, kustomization: Obj) -> list[Obj]:
    generators = kustomization.get("secretGenerator", [])
    if generators and not kustomization.get("generatorOptions", {}).get("disableNameSuffixHash"):
        raise KustomizeError(f"{directory}: secretGenerator without disableNameSuffixHash: true")
    secrets = []
    for generator in generators:
        unsupported = set(generator) - {"name", "files", "literals", "type"}
        if unsupported:
            raise KustomizeError(f"{directory}: secretGenerator fields not applied: {sorted(unsupported)}")
        data: dict[str, bytes] = {}
        for entry in generator.get("files", []):
            key, _, file_name = entry.rpartition("=") if "=" in entry else (Path(entry).name, "", entry)
            file_path = directory / file_name
            if not file_path.is_file():
                raise KustomizeError(f"{directory}: secretGenerator {generator['name']}: no file {file_name}")
            data[key] = file_path.read_bytes()
        for entry in generator.get("literals", []):
            key, _, value = entry.partition("=")
            data[key] = value.encode()
        secrets.append(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": generator["name"]},
                "type": generator.get("type", "Opaque"),
                "data": {key: base64.b64encode(value).decode() for key, value in data.items()},
            }
        )
    return secrets


def _apply_patch(objects: list[Obj], directory: Path, patch: Obj) -> None:
    if set(patch) != {"path"}:
        raise KustomizeError(f"{directory}: only strategic-merge patches by path are applied, got {patch}")
    documents = _load_documents(directory / patch["path"])
    for document in documents:
        matches = [i for i, obj in enumerate(objects) if object_key(obj) == object_key(document)]
        if len(matches) != 1:
            raise KustomizeError(f"{patch['path']}: {object_key(document)} matches {len(matches)} objects")
        objects[matches[0]] = strategic_merge(objects[matches[0]], document)


def strategic_merge(base: Any, patch: Any, field: str = "") -> Any:
    """`patch` over `base`: maps merged key by key, MERGE_KEYS lists item by item, others replaced.

    E.g. env [{name: a, value: x}, {name: b, value: z}] patched with [{name: b, value: y}] gives
    [{name: b, value: y}, {name: a, value: x}]: the patched items first, in the patch's order, then
    the others in theirs (kustomize's order)."""
    if isinstance(patch, dict):
        if any(key.startswith("$") for key in patch):
            raise KustomizeError(f"patch directives are not applied: {sorted(patch)}")
        merged = copy.deepcopy(base) if isinstance(base, dict) else {}
        for key, value in patch.items():
            merged[key] = strategic_merge(merged.get(key), value, key) if value is not None else None
        return {key: value for key, value in merged.items() if value is not None}
    if isinstance(patch, list) and field in MERGE_KEYS and isinstance(base, list):
        patched, rest = [], list(base)
        for item in patch:
            key = next((k for k in MERGE_KEYS[field] if k in item), None)
            if key is None:
                raise KustomizeError(f"an item of {field} without its merge key {MERGE_KEYS[field]}: {item}")
            old = next((old for old in rest if old.get(key) == item[key]), None)
            if old is not None:
                rest.remove(old)
            patched.append(strategic_merge(old, item))
        return patched + copy.deepcopy(rest)
    return copy.deepcopy(patch)


def pod_spec(obj: Obj) -> Obj | None:
    """The pod spec of a workload (Deployment, StatefulSet, …); None for any other object."""
    path = WORKLOAD_POD_SPEC_PATHS.get(obj["kind"])
    if path is None:
        return None
    spec: Obj = obj
    for step in path:
        spec = spec[step]
    return spec


def _apply_image(objects: list[Obj], image: Obj) -> None:
    unsupported = set(image) - {"name", "newName", "newTag", "digest"}
    if unsupported:
        raise KustomizeError(f"images fields not applied: {sorted(unsupported)}")
    for obj in objects:
        spec = pod_spec(obj)
        if spec is None:
            continue
        for container in spec.get("containers", []) + spec.get("initContainers", []):
            name, reference = split_image(container["image"])
            if name != image["name"]:
                continue
            if "digest" in image:
                reference = "@" + image["digest"]
            elif "newTag" in image:
                reference = ":" + image["newTag"]
            container["image"] = image.get("newName", name) + reference


def split_image(image: str) -> tuple[str, str]:
    """(name, ":tag" or "@digest" or "") of an image reference; a registry's port is in the name.

    E.g. "reg:5000/specdec:cpu" -> ("reg:5000/specdec", ":cpu"); "specdec" -> ("specdec", "")."""
    if "@" in image:
        name, _, digest = image.partition("@")
        return name, "@" + digest
    last_slash = image.rfind("/")
    colon = image.rfind(":")
    if colon > last_slash:
        return image[:colon], image[colon:]
    return image, ""
