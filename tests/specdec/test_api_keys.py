"""API keys of the public gateway: the file holds hashes only, a call's key names its tenant,
anything else is UNAUTHENTICATED; a public host needs keys unless explicitly allowed."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from specdec.service.api_keys import KEY_PREFIX, ApiKeys, key_hash, main, new_key
from gateway.config import parse_config
from inference import build_parser
from specdec.host_check import is_loopback
from specdec.errors import Unauthenticated


def test_add_appends_a_hash_and_prints_the_key_once(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "api_keys"
    assert main(["add", "alice", str(path)]) == 0
    alice = capsys.readouterr().out.strip()
    assert main(["add", "bob", str(path)]) == 0
    bob = capsys.readouterr().out.strip()
    text = path.read_text()
    assert alice not in text and bob not in text and key_hash(alice) in text
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    keys = ApiKeys.from_file(path)
    assert keys.tenants == {"alice", "bob"}
    assert keys.tenant([("authorization", f"Bearer {alice}")]) == "alice"
    assert keys.tenant([("user-agent", "x"), ("authorization", f"Bearer {bob}".encode())]) == "bob"
    assert {keys.tenant([("authorization", f"{scheme} {alice}")]) for scheme in ("bearer", "BEARER")} == {"alice"}
    assert main(["add", "no spaces", str(path)]) == 2


@pytest.mark.parametrize(
    "last_line", ["# tenants of the staging gateway", f"bob {key_hash('b')}"], ids=["comment", "tenant"]
)
def test_add_to_a_file_whose_last_line_has_no_newline_starts_a_line_of_its_own(
    tmp_path: Path, capsys: pytest.CaptureFixture, last_line: str
) -> None:
    """A file written by hand (or `printf`) may end without a newline: the new tenant was glued to
    its last line, into a comment (a key printed that no gateway ever accepts) or onto a tenant's
    line (a file the gateway refuses to start with)."""
    path = tmp_path / "api_keys"
    path.write_text(f"carol {key_hash('c')}\n{last_line}")
    assert main(["add", "alice", str(path)]) == 0
    alice = capsys.readouterr().out.strip()
    keys = ApiKeys.from_file(path)
    assert keys.tenant([("authorization", f"Bearer {alice}")]) == "alice"
    assert keys.tenant([("authorization", "Bearer c")]) == "carol"
    assert path.read_text().endswith("\n")


@pytest.mark.parametrize("where", ["missing/api_keys", "."], ids=["no-folder", "a-folder"])
def test_add_to_a_file_it_cannot_write_is_one_error_line_and_no_key(
    tmp_path: Path, capsys: pytest.CaptureFixture, where: str
) -> None:
    """A file it may not write (0400 for the services' user, as the README's compose setup leaves it;
    here paths that fail the same way as root too) raised a traceback."""
    path = tmp_path / where
    assert main(["add", "alice", str(path)]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: ") and str(path) in err and "Traceback" not in err


def test_a_new_key_never_reads_as_a_command_line_option() -> None:
    """Bare URL-safe base64 starts with '-' one time in 64, and argparse then takes
    `--api_key KEY` for two options (the CLI's usage error, seen once in CI)."""
    keys = {new_key() for _ in range(2000)}
    assert len(keys) == 2000
    parser = build_parser()
    for key in keys:
        assert key.startswith(KEY_PREFIX) and len(key) == len(KEY_PREFIX) + 43
        assert parser.parse_args(["--api_key", key]).api_key == key


@pytest.mark.parametrize(
    "metadata", [None, [], [("authorization", "Bearer wrong")], [("authorization", "key")], [("x-api-key", "Bearer k")]]
)
def test_calls_without_a_known_key_are_unauthenticated(tmp_path: Path, metadata) -> None:
    path = tmp_path / "api_keys"
    path.write_text(f"# tenant hash\nalice {key_hash('k')}\n")
    with pytest.raises(Unauthenticated, match="authorization"):
        ApiKeys.from_file(path).tenant(metadata)


@pytest.mark.parametrize(
    "text, match",
    [
        ("alice k\n", ":1:"),
        (f"a b {key_hash('k')}\n", ":1:"),
        (f"alice {key_hash('k')}\nbob {key_hash('k')}\n", "same key"),
        ("# nobody\n", "no tenant"),
    ],
)
def test_a_malformed_keys_file_is_refused_naming_the_line(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "api_keys"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        ApiKeys.from_file(path)


def test_a_public_host_needs_api_keys_or_an_explicit_flag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HOST", "API_KEYS_FILE", "ALLOW_INSECURE_PUBLIC"):
        monkeypatch.delenv(f"SPECDEC_{name}", raising=False)
        monkeypatch.delenv(f"SPECDEC_GATEWAY_{name}", raising=False)
    assert parse_config([]).server.host == "127.0.0.1"
    with pytest.raises(ValueError, match="--api_keys_file"):
        parse_config(["--host", "0.0.0.0"])
    assert parse_config(["--host", "0.0.0.0", "--allow_insecure_public"]).is_insecure_public_allowed
    assert parse_config(["--host", "0.0.0.0", "--api_keys_file", str(tmp_path / "keys")]).api_keys_file
    assert all(map(is_loopback, ("127.0.0.1", "127.3.2.1", "::1", "[::1]", "localhost")))
    assert not any(map(is_loopback, ("0.0.0.0", "::", "10.0.0.1", "gateway.example.com")))
