"""The ports of a local Redis Cluster's nodes (specdec.redis_cluster.free_port_pairs): each node's
port and its cluster bus port (+ 10000) free, below the kernel's ephemeral range where it has room,
where no connection or bind to port 0 of another process can take them before the node binds."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from specdec import redis_cluster
from specdec.redis_cluster import BUS_PORT_OFFSET, DEFAULT_EPHEMERAL_PORTS, LOOPBACK, ephemeral_ports, free_port_pairs


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((LOOPBACK, port))
        except OSError:
            return False
        return True


def test_port_pairs_are_free_distinct_and_below_the_ephemeral_range():
    low, _ = ephemeral_ports()
    ports = free_port_pairs(12)
    assert len(set(ports)) == 12
    assert all(1024 <= p and p + BUS_PORT_OFFSET < low for p in ports)
    assert all(_is_free(p) and _is_free(p + BUS_PORT_OFFSET) for p in ports)


def test_a_taken_port_or_bus_port_is_not_handed_out(monkeypatch: pytest.MonkeyPatch):
    """The draws land on a pair whose bus port is taken, then on one whose own port is: both skipped."""
    with socket.socket() as bus, socket.socket() as node:
        bus.bind((LOOPBACK, 0))
        node.bind((LOOPBACK, 0))
        # the last draw: a pair free now (a fixed one may be held by a node of another test's cluster)
        free = next(p for p in range(20001, 22000) if _is_free(p) and _is_free(p + BUS_PORT_OFFSET))
        draws = iter([bus.getsockname()[1] - BUS_PORT_OFFSET, node.getsockname()[1], free])
        monkeypatch.setattr(redis_cluster.random.Random, "randint", lambda self, a, b: next(draws))
        monkeypatch.setattr(redis_cluster, "ephemeral_ports", lambda: (65000, 65535))
        assert free_port_pairs(1) == [free]


def test_without_room_below_the_range_the_kernel_chooses(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(redis_cluster, "ephemeral_ports", lambda: (5000, 60999))
    ports = free_port_pairs(3)
    assert all(p + BUS_PORT_OFFSET <= 65535 and _is_free(p) and _is_free(p + BUS_PORT_OFFSET) for p in ports)


def test_the_ephemeral_range_is_the_kernel_s_or_linux_s_default(tmp_path: Path):
    (tmp_path / "range").write_text("40000\t50000\n")
    assert ephemeral_ports(tmp_path / "range") == (40000, 50000)
    assert ephemeral_ports(tmp_path / "missing") == DEFAULT_EPHEMERAL_PORTS
    (tmp_path / "bad").write_text("x")
    assert ephemeral_ports(tmp_path / "bad") == DEFAULT_EPHEMERAL_PORTS
