"""specdec.flags: one declaration gives the parser, the environment default and the config values."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from specdec.flags import NO_FIELD, Flag, names, parse_flags, values


@dataclasses.dataclass(frozen=True, slots=True)
class Inner:
    port: int = 7


@dataclasses.dataclass(frozen=True, slots=True)
class Outer:
    inner: Inner
    max_batch: int = 64
    strategies: tuple[str, ...] = ("a",)
    is_compiled: bool = False


FLAGS = (
    Flag("--port", group="inner"),
    Flag("--max_batch", help="rows"),
    Flag("--strategies", "a", convert=names),
    Flag("--compile", field="is_compiled", options={"action": "store_true"}),
    Flag("--model_name", "", group=NO_FIELD),
)
CONFIGS = {"": Outer, "inner": Inner}


def parse(argv: list[str], environ: dict[str, str] | None = None) -> Outer:
    a = parse_flags("TEST", environ or {}, FLAGS, CONFIGS, argparse.ArgumentParser(), argv)
    return Outer(inner=Inner(**values(a, FLAGS, "inner")), **values(a, FLAGS))


def test_defaults_come_from_the_config_fields() -> None:
    assert parse([]) == Outer(inner=Inner())


def test_flags_set_their_fields_in_their_groups() -> None:
    config = parse(["--port", "9", "--max-batch", "3", "--strategies", "b, c", "--compile", "--model_name", "m"])
    assert config == Outer(inner=Inner(port=9), max_batch=3, strategies=("b", "c"), is_compiled=True)


def test_the_environment_sets_defaults_and_the_command_line_wins() -> None:
    assert parse([], {"SPECDEC_TEST_MAX_BATCH": "5", "SPECDEC_PORT": "8"}) == Outer(inner=Inner(port=8), max_batch=5)
    assert parse(["--max_batch", "6"], {"SPECDEC_TEST_MAX_BATCH": "5"}).max_batch == 6


def test_a_bad_variable_names_itself_and_the_flag() -> None:
    with pytest.raises(ValueError, match="SPECDEC_TEST_MAX_BATCH.*--max_batch"):
        parse([], {"SPECDEC_TEST_MAX_BATCH": "many"})
