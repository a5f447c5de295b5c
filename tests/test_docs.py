"""The user documentation against the product: every flag README.md names is one that a command of
the project accepts, and the values the deployment pages tell a user to set parse."""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn
from unittest import mock

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
# Flags of other programs that README's commands call: pip install and docker build / compose.
OTHER_PROGRAMS_FLAGS = {"--index-url", "--no-deps", "--target", "--profile", "--build"}


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def _parser_of(call: Callable[[], Any]) -> argparse.ArgumentParser:
    """The parser that `call` builds, caught at its parse_args (nothing after it runs)."""

    def catch(self: argparse.ArgumentParser, *_: Any, **__: Any) -> NoReturn:
        raise _Parsed(self)

    with mock.patch.object(argparse.ArgumentParser, "parse_args", catch):
        try:
            call()
        except _Parsed as parsed:
            return parsed.parser
    raise AssertionError(f"{call} parsed no arguments")


def _options(parser: argparse.ArgumentParser) -> set[str]:
    options = set(parser._option_string_actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                options |= _options(sub)
    return options


def product_flags() -> set[str]:
    """Every option of inference.py, the five services, `python -m bench` (the suite and `load`)
    and `python -m draft_svc.heads`, in every spelling each accepts."""
    import bench.load
    import bench.suite
    import draft_svc.config
    import draft_svc.heads.__main__ as heads
    import gateway.config
    import http_svc.config
    import inference
    import primary_svc.config
    import validator_svc.config

    calls: list[Callable[[], Any]] = [
        lambda: inference.parse_args([]),
        lambda: gateway.config.parse_config([]),
        lambda: primary_svc.config.parse_config([]),
        lambda: draft_svc.config.from_args([], os.environ),
        lambda: validator_svc.config.parse_config([]),
        lambda: http_svc.config.parse_config([]),
        lambda: bench.suite.parse_config([]),
        lambda: bench.load.main([]),
        lambda: heads.parse_args(["train", "--out", "x"]),
    ]
    flags: set[str] = set()
    for call in calls:
        flags |= _options(_parser_of(call))
    return flags


def test_every_flag_readme_names_is_accepted() -> None:
    text = (REPO_ROOT / "README.md").read_text()
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9_-]*[a-z0-9]", text))
    unknown = sorted(named - product_flags() - OTHER_PROGRAMS_FLAGS)
    assert not unknown, f"README.md names flags that no command accepts: {unknown}"


def test_the_kubernetes_page_nodes_value_parses() -> None:
    """docs/kubernetes.md tells an operator what to set SPECDEC_GATEWAY_NODES to for several nodes:
    the gateway must accept it (a value it refuses stops every gateway at start-up)."""
    from gateway.nodes import parse_nodes

    values = re.findall(r"SPECDEC_GATEWAY_NODES=([^`\s]+)", (REPO_ROOT / "docs" / "kubernetes.md").read_text())
    assert values
    for value in values:
        spec = parse_nodes(value, 50052, 50053)
        assert spec.dns is not None and spec.dns.name == "specdec-node", value


def test_every_benchmark_takes_both_spellings() -> None:
    """README: every command line, `bench` included, takes kebab-case flags and their snake_case
    spellings alike (a BooleanOptionalAction's `--no-x` excepted: `--no_x` would turn x on)."""
    import importlib

    from bench.__main__ import BENCHMARKS
    from specdec.flag_spellings import other_spelling

    one_spelling = {}
    for name in BENCHMARKS:
        module = importlib.import_module(f"bench.{name}")
        with mock.patch("sys.argv", [f"python -m bench {name}"]):
            parser = _parser_of(module.main)
        options = _options(parser)
        negations = {
            o
            for a in parser._actions
            if isinstance(a, argparse.BooleanOptionalAction)
            for o in a.option_strings
            if o.startswith("--no-")
        }
        one_spelling[name] = sorted(
            o for o in options - negations if o.startswith("--") and other_spelling(o) not in options
        )
    assert not any(one_spelling.values()), {n: o for n, o in one_spelling.items() if o}


@pytest.mark.parametrize("flag", ["--nodes", "--tensormt_optimizer", "--api-key-file"])
def test_product_flags_sees_every_parser(flag: str) -> None:
    """The collection above reaches the parsers it names (a gateway, a primary, an inference.py flag)."""
    assert flag in product_flags()
