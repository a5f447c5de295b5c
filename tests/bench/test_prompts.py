"""The prompt sets the benchmarks read by default ship with the repository, in the row format they load."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from bench.prompts import DEFAULT_DATA_DIR, load_prompts
from bench.suite import SuiteConfig

REPOSITORY = Path(__file__).resolve().parents[2]


def test_the_default_scenarios_read_the_shipped_prompts():
    config = SuiteConfig()
    assert config.data_dir == DEFAULT_DATA_DIR == REPOSITORY / "bench" / "data"  # nothing outside the clone
    assert (DEFAULT_DATA_DIR / "README.md").is_file()  # sources and licences travel with the rows
    prompts = load_prompts(DEFAULT_DATA_DIR, list(config.scenarios), num_prompts=2)
    assert [p.scenario for p in prompts] == [s for s in config.scenarios for _ in range(2)]
    assert all(p.prompt for p in prompts)
    assert any(p.schema for p in prompts if p.scenario == "json")


@pytest.mark.parametrize(
    ("command", "entry"),
    [("bench.sampled", "parse_args"), ("bench.drafts", "main"), ("bench.drafter", "parse_args")],
)
def test_an_unknown_scenario_is_a_usage_error_naming_it(command, entry, monkeypatch, capsys) -> None:  # noqa: ANN001
    """Before: the name reached load_prompts and ended in a FileNotFoundError traceback (for drafts,
    after its stack had started)."""
    monkeypatch.setattr(sys, "argv", [command, "--scenarios", "json,nope"])
    with pytest.raises(SystemExit) as exited:
        getattr(importlib.import_module(command), entry)()
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert "--scenarios: no prompt file for nope" in error and "json" in error


def test_a_prompt_is_measured_as_the_service_encodes_it(bos_tokenizer):
    """The benchmarks' token counts and in-process baselines read a prompt as the gateway does: a raw
    (completion) prompt after the BOS where the model takes one, a chat as its template writes it."""
    from bench.prompts import BenchPrompt
    from gateway.chat import PromptEncoder
    from gateway.config import Limits, SpeculationDefaults
    from gateway.params import params_from_pb
    from specdec.v1 import gateway_pb2

    encoder = PromptEncoder(bos_tokenizer)
    for is_completion in (True, False):
        prompt = BenchPrompt("p", "code", "def fib(n):", None, None, is_completion)
        request = gateway_pb2.GenerateRequest()
        if is_completion:
            request.prompt = prompt.prompt
        else:
            request.chat.messages.add(role="user", content=prompt.prompt)
        expected = encoder.encode(params_from_pb(request, Limits(), SpeculationDefaults()))
        assert prompt.token_ids(bos_tokenizer) == expected
        assert expected[0] == bos_tokenizer.bos_token_id
