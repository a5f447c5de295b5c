"""specdec.service.flags: every service's flags take their defaults from the environment one way."""

from __future__ import annotations

import argparse

import pytest

from specdec.service.flags import Flags, parse_bool


def flags(environ: dict[str, str]) -> Flags:
    return Flags(argparse.ArgumentParser(), "GATEWAY", environ)


def test_the_service_variable_wins_over_the_shared_one_and_the_flag_over_both():
    f = flags({"SPECDEC_GATEWAY_PORT": "7", "SPECDEC_PORT": "8", "SPECDEC_METRICS_PORT": "9"})
    f.add("--port", 50050)
    f.add("--metrics_port", 0)
    f.add("--host", "127.0.0.1")
    a = f.parser.parse_args([])
    assert (a.port, a.metrics_port, a.host) == (7, 9, "127.0.0.1")
    assert f.parser.parse_args(["--port", "6"]).port == 6


def test_a_service_only_flag_ignores_the_shared_variable():
    f = flags({"SPECDEC_NUM_THREADS": "8"})
    f.add("--num_threads", 1, shared=False)
    assert f.parser.parse_args([]).num_threads == 1


def test_typed_defaults_and_named_variables():
    f = flags({"SPECDEC_RPC_TIMEOUT_S": "2.5", "SPECDEC_MODEL": "/m", "SPECDEC_GATEWAY_ADAPTIVE": "off"})
    f.add("--rpc_timeout_s", 60.0)
    f.add("--model_path", None, env=("MODEL_PATH", "MODEL"), type=str)
    f.add("--adaptive", True)
    a = f.parser.parse_args([])
    assert (a.rpc_timeout_s, a.model_path, a.adaptive) == (2.5, "/m", False)
    assert f.parser.parse_args(["--adaptive"]).adaptive is True


@pytest.mark.parametrize(
    "variable, flag, default, kwargs",
    [
        ("SPECDEC_GATEWAY_PORT", "--port", 1, {}),
        ("SPECDEC_ADAPTIVE", "--adaptive", True, {}),
        ("SPECDEC_GATEWAY_DEVICE", "--device", "cpu", {"choices": ("cpu", "cuda")}),
    ],
)
def test_a_bad_variable_names_itself_and_its_flag(variable, flag, default, kwargs):
    with pytest.raises(ValueError, match=f"{variable} \\(the default of {flag}\\)"):
        flags({variable: "tpu"}).add(flag, default, **kwargs)


def test_parse_bool_reads_the_usual_spellings_only():
    assert [parse_bool(t) for t in ("1", "true", "Yes", " on ", "0", "false", "NO", "off")] == [True] * 4 + [False] * 4
    with pytest.raises(argparse.ArgumentTypeError, match="true or false"):
        parse_bool("maybe")
