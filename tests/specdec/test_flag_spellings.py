"""specdec.flag_spellings: every long flag in kebab-case and snake_case, on every command line."""

from __future__ import annotations

import argparse
import importlib

import pytest

from specdec.flag_spellings import add_spellings, other_spelling


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--max_new_tokens", type=int)
    p.add_argument("--num-prompts", type=int)
    p.add_argument("--port", type=int)
    p.add_argument("--logits_via_handle", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--no-schema", action="store_true")
    return add_spellings(p)


def test_other_spelling_swaps_separators() -> None:
    assert other_spelling("--max_new_tokens") == "--max-new-tokens"
    assert other_spelling("--num-prompts") == "--num_prompts"
    assert other_spelling("--port") == "--port"


@pytest.mark.parametrize(
    "argv",
    [
        ["--max-new-tokens", "8", "--num-prompts", "2"],
        ["--max_new_tokens", "8", "--num_prompts", "2"],
        ["--max-new-tokens=8", "--num_prompts=2"],
    ],
)
def test_both_spellings_set_the_same_destination(argv: list[str]) -> None:
    a = parser().parse_args(argv)
    assert (a.max_new_tokens, a.num_prompts) == (8, 2)


def test_boolean_flags_take_both_spellings_and_their_negation() -> None:
    assert parser().parse_args(["--logits-via-handle"]).logits_via_handle is True
    assert parser().parse_args(["--no-logits-via-handle"]).logits_via_handle is False
    assert parser().parse_args(["--no-logits_via_handle"]).logits_via_handle is False
    assert parser().parse_args(["--no-chat"]).chat is False
    with pytest.raises(SystemExit):  # no `--no_chat`: it would read as "on"
        parser().parse_args(["--no_chat"])


def test_a_flag_named_no_x_takes_both_spellings() -> None:
    """A store_true flag whose name starts with `no-` (bench's --no-schema) is no negation of another."""
    assert parser().parse_args(["--no_schema"]).no_schema is True
    assert parser().parse_args(["--no-schema"]).no_schema is True
    assert parser().parse_args([]).no_schema is False


def test_help_shows_the_kebab_spelling_first() -> None:
    text = parser().format_help()
    assert "--max-new-tokens MAX_NEW_TOKENS, --max_new_tokens MAX_NEW_TOKENS" in text


def test_errors_name_the_kebab_spelling(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parser().parse_args(["--max_new_tokens", "x"])
    assert "argument --max-new-tokens/--max_new_tokens" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("module", "argv", "dest", "value"),
    [
        ("gateway.config", ["--max-active-requests", "7"], "max_active_requests", 7),
        ("primary_svc.config", ["--max-context", "512"], "max_context", 512),
        ("draft_svc.config", ["--primary-address", "127.0.0.1:1"], "primary_address", "127.0.0.1:1"),
        ("validator_svc.config", ["--log-level", "DEBUG"], "log_level", "DEBUG"),
        ("http_svc.config", ["--gateway-address", "127.0.0.1:1"], "gateway_address", "127.0.0.1:1"),
    ],
)
def test_every_service_takes_kebab_flags(module: str, argv: list[str], dest: str, value: object) -> None:
    config_module = importlib.import_module(module)
    config = config_module.from_args(argv, {}) if module == "draft_svc.config" else config_module.parse_config(argv)
    assert _find(config, dest) == value


def _find(config: object, dest: str) -> object:
    """A field of a config or of one of its nested configs."""
    if hasattr(config, dest):
        return getattr(config, dest)
    for name in getattr(config, "__dataclass_fields__", {}):
        found = _find(getattr(config, name), dest)
        if found is not None:
            return found
    return None
