"""specdec.flags: one declaration gives the parser, the environment default and the config values."""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specdec.flags import EXIT_BAD_CONFIG, NO_FIELD, Flag, names, parse_flags, values

REPO_ROOT = Path(__file__).resolve().parents[2]


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


@pytest.mark.parametrize(
    ("module", "argv", "environ", "named"),
    [
        ("gateway", ["--max_active_requests", "0"], {}, "max_active_requests"),
        ("gateway", [], {"SPECDEC_GATEWAY_PORT": "x"}, "SPECDEC_GATEWAY_PORT"),
        ("primary_svc", ["--max_context", "8"], {}, "max_context"),
        ("validator_svc", ["--num_threads", "-1"], {}, "num_threads"),
        ("draft_svc", [], {"SPECDEC_PORT": "x"}, "SPECDEC_PORT"),
        ("http_svc", [], {"SPECDEC_HTTP_MAX_BODY_BYTES": "x"}, "SPECDEC_HTTP_MAX_BODY_BYTES"),
        # a log level the logging set-up refuses: before, a traceback from there, after the parse
        ("gateway", [], {"SPECDEC_LOG_LEVEL": "verbose"}, "SPECDEC_LOG_LEVEL"),
        ("primary_svc", ["--log_level", "verbose"], {}, "--log_level"),
        ("validator_svc", [], {"SPECDEC_VALIDATOR_LOG_LEVEL": "trace"}, "SPECDEC_VALIDATOR_LOG_LEVEL"),
        ("http_svc", ["--log-level", "verbose"], {}, "--log-level"),
        # TLS files that do not load: before, a traceback from the server (or its first channel)
        ("gateway", ["--allow_unauthenticated", "--tls_cert", "/no/cert", "--tls_key", "/no/key"], {}, "--tls_cert"),
        ("http_svc", [], {"SPECDEC_HTTP_TLS_CERT": "/no/cert", "SPECDEC_HTTP_TLS_KEY": "/no/key"}, "--tls_cert"),
        ("http_svc", ["--gateway_ca_file", "/nonexistent/ca.pem"], {}, "--gateway_ca_file"),
    ],
)
def test_a_service_refuses_a_bad_value_in_one_line_not_a_traceback(
    module: str, argv: list[str], environ: dict[str, str], named: str
) -> None:
    """What a value that does not parse, or one the config refuses, looks like at the service's start."""
    done = subprocess.run(
        [sys.executable, "-m", module, *argv],
        cwd=REPO_ROOT,
        env={**os.environ, **environ},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == EXIT_BAD_CONFIG, done.stderr[-2000:]
    assert named in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("value", ["-1", "100000"])
def test_every_service_refuses_a_thread_count_torch_cannot_run(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A negative count made torch raise at start-up, a huge one made libgomp abort the process at the
    first product (Thread creation failed): each service's config refuses both, naming the flag; a
    count within the bound parses."""
    from draft_svc.config import from_args as draft_config
    from gateway.config import parse_config as gateway_config
    from primary_svc.config import parse_config as primary_config
    from validator_svc.config import parse_config as validator_config

    for parse in (primary_config, gateway_config, validator_config):
        with pytest.raises(ValueError, match=f"num_threads must be in .*got {value}"):
            parse(["--num_threads", value])
        parse(["--num_threads", "2"])
    with pytest.raises(SystemExit):  # the draft service's parser reports its config's ValueError
        draft_config(["--num_threads", value], {})
    assert f"num_threads must be in [0, 1024] (0: torch's default), got {value}" in capsys.readouterr().err
    draft_config(["--num_threads", "2"], {})
