"""The nodes a gateway routes to, as --nodes names them.

A node is one primary with its draft pool and validator on one host (they share the primary's
weights and logits through IPC, so they are placed together). --nodes is either a comma list of
static nodes or one DNS name whose A/AAAA records are the nodes (a Kubernetes headless Service),
re-resolved periodically:

    10.0.0.5:50051,10.0.0.6:50051                 draft and validator at the ports of the gateway's
                                                  --draft_address / --validator_address, on each host
    10.0.0.5:50051/50052/50053,[fd00::7]:7051/7052/7053
                                                  host:primary_port/draft_port/validator_port
    dns:///specdec-nodes.default.svc:50051        every address the name resolves to, at these ports
    dns:///specdec-nodes:50051/50052/50053          (the optional /draft/validator as above)

A node's id is its primary's address, "host:primary_port": what the state store records as the
request's node (RequestState.node) and what the logs and metrics name.
"""

from __future__ import annotations

import dataclasses

from specdec.errors import InvalidArgument

DNS_SCHEME = "dns:///"
FLAG = "--nodes"


@dataclasses.dataclass(frozen=True, slots=True)
class NodeAddress:
    """One node's three services. Without --nodes the gateway's one node is its --primary_address,
    --draft_address and --validator_address, as they are."""

    primary_address: str
    draft_address: str
    validator_address: str

    @property
    def node_id(self) -> str:
        return self.primary_address

    @staticmethod
    def on_host(host: str, primary_port: int, draft_port: int, validator_port: int) -> NodeAddress:
        return NodeAddress(_join(host, primary_port), _join(host, draft_port), _join(host, validator_port))


@dataclasses.dataclass(frozen=True, slots=True)
class DnsNodes:
    """A DNS name whose addresses are the nodes, each with these ports."""

    name: str
    primary_port: int
    draft_port: int
    validator_port: int

    def at(self, host: str) -> NodeAddress:
        """The node at one of the name's addresses."""
        return NodeAddress.on_host(host, self.primary_port, self.draft_port, self.validator_port)


@dataclasses.dataclass(frozen=True, slots=True)
class NodeSpec:
    """What --nodes names: static nodes, or a DNS name (exactly one of them)."""

    static: tuple[NodeAddress, ...] = ()
    dns: DnsNodes | None = None

    def __post_init__(self) -> None:
        if bool(self.static) == (self.dns is not None):
            raise ValueError("a NodeSpec names static nodes or a DNS name, exactly one")


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def split_host_port(address: str, what: str) -> tuple[str, int]:
    """("host", port) of "host:port" or "[v6]:port"; InvalidArgument naming --nodes otherwise."""
    if address.startswith("["):
        host, sep, port_text = address[1:].partition("]:")
        if not sep:
            raise InvalidArgument(FLAG, f"{what} {address!r}: an IPv6 host is written [addr]:port")
    else:
        host, sep, port_text = address.rpartition(":")
        if not sep or ":" in host:
            raise InvalidArgument(FLAG, f"{what} {address!r} is not host:port")
    if not host or any(c.isspace() or c in "/,[]" for c in host):
        raise InvalidArgument(FLAG, f"{what} {address!r} has no valid host")
    return host, parse_port(port_text, f"{what} {address!r}")


def parse_port(text: str, what: str) -> int:
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= 65535:
        raise InvalidArgument(FLAG, f"{what}: port {text!r} must be a number in 1..65535")
    return int(text)


def _ports(address: str, default_ports: tuple[int, int]) -> tuple[str, int, int, int]:
    """(host, primary, draft, validator) of "host:primary[/draft/validator]"."""
    primary, *others = address.split("/")
    host, primary_port = split_host_port(primary, "node")
    if not others:
        return host, primary_port, *default_ports
    if len(others) != 2:
        raise InvalidArgument(
            FLAG, f"node {address!r} is host:primary_port or host:primary_port/draft_port/validator_port"
        )
    draft_port, validator_port = (parse_port(p, f"node {address!r}") for p in others)
    if len({primary_port, draft_port, validator_port}) != 3:
        raise InvalidArgument(FLAG, f"node {address!r}: its three services need three different ports")
    return host, primary_port, draft_port, validator_port


def _check_dns_name(name: str) -> None:
    """InvalidArgument naming --nodes unless name can be looked up: the resolver (getaddrinfo) encodes
    it with IDNA, which raises UnicodeError, not the OSError of a failed lookup, for an empty label or
    one over 63 characters ("nodes..svc"): the gateway's start then failed on a traceback."""
    try:
        name.encode("idna")
    except UnicodeError:
        raise InvalidArgument(FLAG, f"{name!r} is no DNS name (a label is empty or over 63 characters)") from None


def parse_nodes(text: str, default_draft_port: int, default_validator_port: int) -> NodeSpec:
    """The nodes of a --nodes value (see the module's docstring); InvalidArgument naming --nodes
    for anything else: an empty entry, a bad port, a node listed twice, a DNS name among others.

    default_*_port: the ports of the gateway's --draft_address and --validator_address, for
    nodes that name only their primary's.

    # E.g. parse_nodes("a:1,b:1/5/6", 2, 3) -> static (a:1 draft a:2 validator a:3, b:1 draft b:5 validator b:6)
    """
    entries = [e.strip() for e in text.split(",")]
    if not text.strip() or any(not e for e in entries):
        raise InvalidArgument(FLAG, f"{text!r} has an empty entry; give host:port[,host:port...] or dns:///name:port")
    defaults = (default_draft_port, default_validator_port)
    if any(e.startswith(DNS_SCHEME) for e in entries):
        if len(entries) != 1:
            raise InvalidArgument(FLAG, "a dns:/// name stands alone (its records are the nodes)")
        name, primary_port, draft_port, validator_port = _ports(entries[0][len(DNS_SCHEME) :], defaults)
        _check_dns_name(name)
        return NodeSpec(dns=DnsNodes(name, primary_port, draft_port, validator_port))
    nodes = tuple(NodeAddress.on_host(*_ports(e, defaults)) for e in entries)
    seen: set[str] = set()
    for node in nodes:
        if node.node_id in seen:
            raise InvalidArgument(FLAG, f"node {node.node_id} is listed twice")
        seen.add(node.node_id)
    return NodeSpec(static=nodes)
