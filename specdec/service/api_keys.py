"""API keys of the public gateway: who a caller is, from `authorization: Bearer <key>`.

The keys file holds one tenant per line, the key itself never, only its SHA-256:

    # tenant  sha256 of the key (hex)
    alice     2c26b46b68ffc68ff99b453c1d30413413422d706483bfa0f98a5e886266e7ae

A key is 256 random bits behind a fixed prefix (new_key), so a plain hash is enough: nothing to guess from it, and
a stolen file grants nothing. `python -m specdec.service.api_keys add NAME FILE` appends a new
tenant and prints its key once. A request belongs to the tenant whose key created it; the
gateway scopes request ids by tenant, so another tenant's GetRequest/Cancel finds nothing
(NOT_FOUND, the same as an unknown id: no existence oracle).
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import ssl
import sys
from collections.abc import Iterable
from pathlib import Path

from specdec.errors import Unauthenticated
from specdec.flags import Flag
from specdec.host_check import is_loopback

AUTHORIZATION = "authorization"
BEARER = "Bearer "
KEY_BYTES = 32
KEY_PREFIX = "specdec-"
_TENANT = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


def new_key() -> str:
    """KEY_PREFIX and 256 random bits, URL-safe base64. The prefix keeps a key from starting with
    '-' (one in 64 bare keys did: `inference.py --api_key KEY` then read it as an option) and lets
    secret scanners recognise one; only the hash is stored, so earlier keys stay valid."""
    return KEY_PREFIX + secrets.token_urlsafe(KEY_BYTES)


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class ApiKeys:
    """tenant by key hash; built from the keys file (ValueError naming the line when malformed)."""

    def __init__(self, tenants_by_hash: dict[str, str]) -> None:
        if not tenants_by_hash:
            raise ValueError("the API keys file names no tenant")
        self._tenants_by_hash = dict(tenants_by_hash)

    @classmethod
    def from_file(cls, path: str | Path) -> ApiKeys:
        tenants_by_hash: dict[str, str] = {}
        for number, line in enumerate(Path(path).read_text().splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2 or not _TENANT.match(parts[0]) or not _SHA256_HEX.match(parts[1]):
                raise ValueError(f"{path}:{number}: expected `tenant sha256-hex` (tenant: letters, digits, _.-)")
            if parts[1] in tenants_by_hash:
                raise ValueError(f"{path}:{number}: the same key hash as tenant {tenants_by_hash[parts[1]]!r}")
            tenants_by_hash[parts[1]] = parts[0]
        return cls(tenants_by_hash)

    @property
    def tenants(self) -> set[str]:
        return set(self._tenants_by_hash.values())

    def tenant(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
        """The tenant whose key the call carries; Unauthenticated when none matches."""
        for key, value in metadata or ():
            if key != AUTHORIZATION:
                continue
            text = value.decode() if isinstance(value, bytes) else value
            # Looked up by the hash of the key: how long the lookup takes says nothing about the key. The
            # scheme's name is case-insensitive (RFC 9110, 11.1): "bearer KEY" is the same credential.
            is_bearer = text[: len(BEARER)].lower() == BEARER.lower()
            tenant = self._tenants_by_hash.get(key_hash(text[len(BEARER) :].strip())) if is_bearer else None
            if tenant is not None:
                return tenant
        raise Unauthenticated(
            "authorization", f"a valid API key is required (metadata '{AUTHORIZATION}: {BEARER.strip()} <key>')"
        )


def public_access_flags(*, keys_help: str, tls_what: str, tls_group: str = "server") -> tuple[Flag, ...]:
    """--api_keys_file, --allow_insecure_public, --tls_cert and --tls_key: a public front's access
    flags (the gateway's and the HTTP front's), the same way for both. The TLS files set
    tls_cert_file / tls_key_file of the `tls_group` config."""
    return (
        Flag("--api_keys_file", "", help=keys_help),
        Flag(
            "--allow_insecure_public",
            False,
            help="without --api_keys_file, listen on a non-loopback --host anyway",
            field="is_insecure_public_allowed",
            options={"action": "store_true"},
        ),
        Flag("--tls_cert", "", help=f"PEM certificate chain: serve {tls_what}", group=tls_group, field="tls_cert_file"),
        Flag("--tls_key", "", help="PEM private key of --tls_cert", group=tls_group, field="tls_key_file"),
    )


def check_tls_files(cert_file: str, key_file: str, ca_file: str = "") -> None:
    """A ValueError naming the flag unless --tls_cert and --tls_key (when given) load as a certificate
    chain and its key, and ca_file (--gateway_ca_file, when given) as PEM roots: checked while the
    flags are parsed, so a missing or bad file is one line at start, not a traceback from the
    server or its first client channel."""
    if cert_file and key_file:
        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert_file, key_file)
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"--tls_cert {cert_file!r} / --tls_key {key_file!r}: {e.strerror or e}") from None
    if ca_file:
        try:
            ssl.create_default_context(cafile=ca_file)
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"--gateway_ca_file {ca_file!r}: {e.strerror or e}") from None


def check_public_exposure(host: str, api_keys_file: str, is_insecure_public_allowed: bool) -> None:
    """A public front without API keys listens on loopback only, unless told otherwise explicitly."""
    if not api_keys_file and not is_insecure_public_allowed and not is_loopback(host):
        raise ValueError(
            f"host {host!r} is reachable from other machines: give --api_keys_file, "
            "or --allow_insecure_public to serve anyone who can reach it"
        )


def main(argv: list[str] | None = None) -> int:
    """python -m specdec.service.api_keys add TENANT FILE: append a tenant with a fresh key; print the key."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3 or args[0] != "add" or not _TENANT.match(args[1]):
        print(
            "usage: python -m specdec.service.api_keys add TENANT FILE (tenant: letters, digits, _.-)", file=sys.stderr
        )
        return 2
    tenant, path = args[1], Path(args[2])
    key = new_key()
    line = f"{tenant} {key_hash(key)}\n".encode()
    try:
        with open(path, "a+b") as f:  # appends go to the end, wherever the last read left off
            # A file written by hand may end without a newline: the new line must not join its last one.
            if f.seek(0, os.SEEK_END) > 0:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    line = b"\n" + line
            f.write(line)
        path.chmod(0o600)
    except OSError as e:  # e.g. a file made 0400 for the services' user (README): one line, no key printed
        print(f"error: {str(path)!r}: {e.strerror or e}", file=sys.stderr)
        return 1
    print(key)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
