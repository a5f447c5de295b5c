"""Which of a deployment's SPECDEC_* variables a service reads (compose.yaml, the Kubernetes
manifests): a misspelt or obsolete one is ignored silently by the service."""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping

import pytest

from specdec.service.flags import Flags


def parse_service_config(module: str) -> object:
    """The service's own configuration, built from os.environ and no argument."""
    if module == "draft_svc":
        return importlib.import_module("draft_svc.config").from_args([], os.environ)
    return importlib.import_module(f"{module}.config").parse_config([])


def unread_variables(module: str, env: Mapping[str, str], monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """The SPECDEC_* variables of `env` that `module`'s configuration code does not look up, its
    configuration parsed from exactly that environment (a value it refuses fails the test)."""
    looked_up: set[str] = set()
    variables = Flags.variables

    def recording(self: Flags, name: str, *, shared: bool = True) -> tuple[str, ...]:
        found = variables(self, name, shared=shared)
        looked_up.update(found)
        return found

    with monkeypatch.context() as m:
        m.setattr(Flags, "variables", recording)
        for name in [name for name in os.environ if name.startswith("SPECDEC_")]:
            m.delenv(name)
        for name, value in env.items():
            m.setenv(name, value)
        assert parse_service_config(module) is not None
    return {name for name in env if name.startswith("SPECDEC_")} - looked_up
