"""--nodes: static nodes with default or own ports, a DNS name, and every malformed value refused
with an error naming --nodes."""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path

import pytest
import yaml

from gateway.config import parse_config
from gateway.node_pool import resolve_dns
from gateway.nodes import NodeAddress, parse_nodes
from specdec.errors import InvalidArgument


def test_static_nodes_take_the_gateways_draft_and_validator_ports_unless_they_name_their_own():
    spec = parse_nodes("10.0.0.5:50051, node-b:7051/7052/7053,[fd00::7]:9000", 50052, 50053)
    assert spec.dns is None
    assert spec.static == (
        NodeAddress("10.0.0.5:50051", "10.0.0.5:50052", "10.0.0.5:50053"),
        NodeAddress("node-b:7051", "node-b:7052", "node-b:7053"),
        NodeAddress("[fd00::7]:9000", "[fd00::7]:50052", "[fd00::7]:50053"),
    )
    assert [n.node_id for n in spec.static] == ["10.0.0.5:50051", "node-b:7051", "[fd00::7]:9000"]


def test_a_dns_name_stands_for_its_addresses_at_the_given_ports():
    spec = parse_nodes("dns:///specdec-nodes.default.svc:50051", 50052, 50053)
    assert spec.static == () and spec.dns is not None
    assert spec.dns.name == "specdec-nodes.default.svc"
    assert spec.dns.at("10.1.2.3") == NodeAddress("10.1.2.3:50051", "10.1.2.3:50052", "10.1.2.3:50053")
    own = parse_nodes("dns:///nodes:1/2/3", 50052, 50053).dns
    assert own is not None and own.at("fd00::1").validator_address == "[fd00::1]:3"


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "empty entry"),
        ("a:1,,b:1", "empty entry"),
        ("a", "not host:port"),
        ("a:0", "1..65535"),
        ("a:70000", "1..65535"),
        ("a:x", "1..65535"),
        ("a:5\u00b2", "1..65535"),  # a digit to str.isdigit, not to int(): a ValueError naming nothing before
        (":50051", "no valid host"),
        ("a:1/2", "host:primary_port/draft_port/validator_port"),
        ("a:1/2/3/4", "host:primary_port/draft_port/validator_port"),
        ("a:1/1/2", "three different ports"),
        ("a:1,a:1/5/6", "listed twice"),
        ("dns:///n:1,a:1", "stands alone"),
        ("fd00::1:50051", "not host:port"),
        ("[fd00::1:50051", r"\[addr\]:port"),
    ],
)
def test_malformed_nodes_are_refused_naming_the_flag(text, message):
    with pytest.raises(InvalidArgument, match=message) as e:
        parse_nodes(text, 50052, 50053)
    assert e.value.field == "--nodes"


def test_the_gateway_flag_parses_nodes_and_without_it_keeps_its_one_node(monkeypatch):
    for name in ("SPECDEC_GATEWAY_NODES", "SPECDEC_NODES"):
        monkeypatch.delenv(name, raising=False)
    assert parse_config([]).nodes is None
    config = parse_config(["--nodes", "a:1,b:1", "--draft_address", "x:7", "--node_max_active_requests", "3"])
    assert config.nodes is not None and [n.draft_address for n in config.nodes.static] == ["a:7", "b:7"]
    assert config.node_pool.limits.max_active_requests == 3
    with pytest.raises(ValueError, match="--nodes"):
        parse_config(["--nodes", "a:1,,b:2"])


@pytest.mark.parametrize("name", ["nodes..svc", ".svc", "x" * 64 + ".svc"])
def test_a_dns_name_the_resolver_cannot_encode_is_refused_naming_the_flag(name):
    """An empty label or one over 63 characters fails getaddrinfo's IDNA encoding with a UnicodeError,
    not a lookup's OSError, which the pool's resolve does not catch: the gateway's start failed on
    that traceback rather than on an error naming --nodes."""
    with pytest.raises(UnicodeError):
        asyncio.run(resolve_dns(name, 50051))
    with pytest.raises(InvalidArgument, match="no DNS name") as e:
        parse_nodes(f"dns:///{name}:50051", 50052, 50053)
    assert e.value.field == "--nodes"


def test_the_nodes_value_docs_kubernetes_gives_is_the_node_services_name_at_the_primarys_port(monkeypatch):
    """docs/kubernetes.md told operators SPECDEC_GATEWAY_NODES=specdec-node: no dns:/// scheme and no
    port, which --nodes refuses, so a gateway configured as written did not start."""
    root = Path(__file__).parents[2]
    text = (root / "docs" / "kubernetes.md").read_text()
    service = yaml.safe_load((root / "deploy" / "k8s" / "base" / "node-service.yaml").read_text())
    values = re.findall(r"SPECDEC_GATEWAY_NODES=([^`\s]+)", text)
    assert values
    for name in [name for name in os.environ if name.startswith("SPECDEC_")]:
        monkeypatch.delenv(name)
    for value in values:
        monkeypatch.setenv("SPECDEC_GATEWAY_NODES", value)
        nodes = parse_config([]).nodes
        assert nodes is not None and nodes.dns is not None and nodes.dns.name == service["metadata"]["name"]
        assert nodes.dns.at("10.0.0.5") == NodeAddress("10.0.0.5:50051", "10.0.0.5:50052", "10.0.0.5:50053")
