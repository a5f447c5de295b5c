"""The small kustomize renderer of tests/deploy/kustomize.py on hand-made cases: keyed lists merged
item by item in kustomize's order, other lists replaced, directives refused, image references split
with a registry port in the name."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.deploy.kustomize import KustomizeError, render, split_image, strategic_merge


def test_strategic_merge_merges_keyed_lists_and_replaces_others() -> None:
    base = {"containers": [{"name": "a", "env": [{"name": "X", "value": "1"}, {"name": "Y", "value": "2"}]}]}
    patch = {"containers": [{"name": "a", "env": [{"name": "Y", "value": "3"}], "args": ["--z"]}]}
    merged_env = [{"name": "Y", "value": "3"}, {"name": "X", "value": "1"}]
    assert strategic_merge(base, patch) == {"containers": [{"name": "a", "env": merged_env, "args": ["--z"]}]}
    assert strategic_merge({"command": ["a", "b"]}, {"command": ["c"]}) == {"command": ["c"]}
    assert strategic_merge({"a": {"b": 1, "c": 2}}, {"a": {"c": None}}) == {"a": {"b": 1}}


def test_strategic_merge_refuses_directives() -> None:
    with pytest.raises(KustomizeError):
        strategic_merge({"containers": [{"name": "a"}]}, {"containers": [{"name": "a", "$patch": "delete"}]})


def test_split_image_keeps_a_registry_port_in_the_name() -> None:
    assert split_image("reg:5000/specdec:cpu") == ("reg:5000/specdec", ":cpu")
    assert split_image("reg:5000/specdec") == ("reg:5000/specdec", "")
    assert split_image("specdec@sha256:ab") == ("specdec", "@sha256:ab")


@pytest.mark.parametrize(
    "kustomization",
    [
        "namePrefix: x-\n",
        "secretGenerator:\n  - name: s\n    literals: [a=b]\n",
        "patches:\n  - path: p.yaml\n    target: {kind: Deployment}\n",
    ],
)
def test_what_the_renderer_does_not_do_is_refused(tmp_path: Path, kustomization: str) -> None:
    """A name prefix, a generated name with kustomize's hash suffix, a patch by target: refused,
    never rendered differently from kustomize."""
    (tmp_path / "kustomization.yaml").write_text(kustomization)
    with pytest.raises(KustomizeError):
        render(tmp_path)


def test_a_literal_secret_and_a_patch_render(tmp_path: Path) -> None:
    (tmp_path / "deployment.yaml").write_text(
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: d}\n"
        "spec:\n  template:\n    spec:\n      containers: [{name: c, image: 'reg:5000/app:1'}]\n"
    )
    (tmp_path / "patch.yaml").write_text(
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: d}\n"
        "spec:\n  template:\n    spec:\n      containers: [{name: c, args: [--x]}]\n"
    )
    (tmp_path / "kustomization.yaml").write_text(
        "resources: [deployment.yaml]\npatches: [{path: patch.yaml}]\n"
        "images: [{name: 'reg:5000/app', newTag: '2'}]\n"
        "generatorOptions: {disableNameSuffixHash: true}\nsecretGenerator: [{name: s, literals: [k=v]}]\n"
    )
    deployment, secret = render(tmp_path)
    assert deployment["spec"]["template"]["spec"]["containers"] == [
        {"name": "c", "image": "reg:5000/app:2", "args": ["--x"]}
    ]
    assert secret == {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "s"},
        "type": "Opaque",
        "data": {"k": "dg=="},
    }
