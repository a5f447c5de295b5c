"""A gateway's owner id: the name it holds its requests' leases under in the state store.

`gateway@10.1.2.3:50050#9f0c3a7d52e1b486` names where the gateway is reached (its advertised
address, --advertise_address) and which process it is (a random nonce drawn at start). The address
lets another gateway ask whether the owner of a request still answers (gateway.owner_probe) instead
of waiting for its lease to lapse; the nonce tells this process from an earlier one on the same
address: a gateway that starts on an address holds its port, so a request owned by another instance
at that address belongs to a process that is gone, and the new one takes it over at start-up.

The nonce is also a grpc.health.v1 service name of the gateway's server (`instance_health_name`):
a probe that asks for it learns whether this very instance, not merely some process, is there.
"""

from __future__ import annotations

import ipaddress
import secrets
from dataclasses import dataclass

OWNER_PREFIX = "gateway@"
NONCE_SEPARATOR = "#"
NUM_NONCE_BYTES = 8  # 16 hex digits: two processes never draw the same
# Listening hosts that name no one address: peers reach such a gateway at its host name.
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]"})
INSTANCE_HEALTH_PREFIX = "specdec.gateway.instance/"


@dataclass(frozen=True, slots=True)
class OwnerId:
    """address: host:port where other gateways reach this one; nonce: this process's random id."""

    address: str
    nonce: str

    def __post_init__(self) -> None:
        if not self.address or NONCE_SEPARATOR in self.address:
            raise ValueError(f"address must be a non-empty host:port without {NONCE_SEPARATOR!r}, got {self.address!r}")
        if not self.nonce or NONCE_SEPARATOR in self.nonce:
            raise ValueError(f"nonce must be a non-empty word without {NONCE_SEPARATOR!r}, got {self.nonce!r}")

    @classmethod
    def new(cls, address: str) -> OwnerId:
        """A fresh instance at address."""
        return cls(address, secrets.token_hex(NUM_NONCE_BYTES))

    @classmethod
    def parse(cls, text: str) -> OwnerId | None:
        """The owner id in a stored owner; None for one that names no gateway instance (an owner
        from an older release or a tool, which only its lease's expiry frees)."""
        if not text.startswith(OWNER_PREFIX):
            return None
        address, separator, nonce = text[len(OWNER_PREFIX) :].rpartition(NONCE_SEPARATOR)
        if not separator or not address or not nonce:
            return None
        return cls(address, nonce)

    @property
    def instance_health_name(self) -> str:
        """The health service name this instance reports SERVING (and no other process does)."""
        return f"{INSTANCE_HEALTH_PREFIX}{self.nonce}"

    def is_other_instance_at(self, other: OwnerId | None) -> bool:
        """Whether other is an earlier (or a stray) process at this instance's address."""
        return other is not None and other.address == self.address and other.nonce != self.nonce

    def __str__(self) -> str:
        return f"{OWNER_PREFIX}{self.address}{NONCE_SEPARATOR}{self.nonce}"


def default_advertise_address(host: str, port: int, hostname: str) -> str:
    """Where peers reach a gateway that was given no --advertise_address: the listening host when it
    is one address ("10.0.0.5", "127.0.0.1", "::1" -> "[::1]"), else (a wildcard) the machine's name.
    E.g. ("0.0.0.0", 50050, "gw-7") -> "gw-7:50050"; ("127.0.0.1", 50050, "gw-7") -> "127.0.0.1:50050"."""
    if host in WILDCARD_HOSTS:
        return f"{hostname}:{port}"
    bare = host.strip("[]")
    try:
        is_v6 = ipaddress.ip_address(bare).version == 6
    except ValueError:  # a host name
        is_v6 = False
    return f"[{bare}]:{port}" if is_v6 else f"{host}:{port}"
