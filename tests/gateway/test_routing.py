"""The router: prefix keys over the primary's cache blocks, the consistent-hash ring, the load bound."""

from __future__ import annotations

import pytest

from gateway.routing import HashRing, LoadLimits, NodeLoad, choose_node, prefix_key


def test_the_key_is_the_first_full_blocks_only():
    system = list(range(100, 108))  # two blocks of 4
    assert prefix_key(system + [1, 2, 3], 4, 2) == prefix_key(system + [9], 4, 2)
    assert prefix_key(system + [1, 2, 3], 4, 2) != prefix_key(system[:4] + [0, 0, 0, 0], 4, 2)
    # shorter than a block: all of it
    assert prefix_key([1, 2], 4, 2) != prefix_key([1, 3], 4, 2)
    assert prefix_key([1, 2, 3, 4, 5], 4, 2) == prefix_key([1, 2, 3, 4, 6], 4, 2)  # one full block keys it


def test_tenants_sharing_a_prompt_get_different_keys():
    assert prefix_key([1, 2, 3, 4], 4, 1, "acme") != prefix_key([1, 2, 3, 4], 4, 1, "globex")


def test_the_ring_walks_every_node_once_and_is_deterministic():
    ring = HashRing(["a:1", "b:1", "c:1"])
    for key in (0, 1 << 20, 2**64 - 1, prefix_key([5, 6, 7], 16, 4)):
        walk = list(ring.walk(key))
        assert sorted(walk) == ["a:1", "b:1", "c:1"]
        assert walk == list(HashRing(["c:1", "a:1", "b:1"]).walk(key))
    assert list(HashRing([]).walk(5)) == []


def test_keys_spread_evenly_and_removing_a_node_moves_only_its_keys():
    nodes = [f"10.0.0.{i}:50051" for i in range(4)]
    ring, smaller = HashRing(nodes), HashRing(nodes[:3])
    keys = [prefix_key([k, k + 1, k + 2], 16, 4) for k in range(4000)]
    owners = [next(ring.walk(k)) for k in keys]
    counts = {n: owners.count(n) for n in nodes}
    assert all(700 < c < 1300 for c in counts.values()), counts  # 1000 each, within 30 %
    for key, owner in zip(keys, owners):
        if owner != nodes[3]:
            assert next(smaller.walk(key)) == owner  # only the removed node's keys move


def test_a_node_over_its_limits_sheds_to_the_next_on_the_ring():
    ring = HashRing(["a", "b", "c"])
    key = prefix_key([1, 2, 3], 16, 4)
    order = list(ring.walk(key))
    limits = LoadLimits(max_kv_fraction=0.5, max_active_requests=4, max_queue_depth=8)
    idle = {n: NodeLoad(0, 100, 0, 0) for n in order}
    assert choose_node(ring, key, order, idle, limits) == order[0]
    for over in (NodeLoad(50, 100, 0, 0), NodeLoad(0, 100, 4, 0), NodeLoad(0, 100, 0, 8)):
        assert choose_node(ring, key, order, {**idle, order[0]: over}, limits) == order[1]
    # every node over: the first healthy one anyway (its primary queues or refuses)
    full = {n: NodeLoad(99, 100, 0, 0) for n in order}
    assert choose_node(ring, key, order, full, limits) == order[0]
    # unknown budget (no report yet): never over the KV limit
    assert not limits.is_over(NodeLoad(10**12, 0, 0, 0))


def test_unhealthy_and_excluded_nodes_get_nothing():
    ring = HashRing(["a", "b", "c"])
    key = prefix_key([9], 16, 4)
    order = list(ring.walk(key))
    assert choose_node(ring, key, order[1:], {}, LoadLimits()) == order[1]
    assert choose_node(ring, key, order, {}, LoadLimits(), exclude=order[:2]) == order[2]
    assert choose_node(ring, key, [], {}, LoadLimits()) is None


@pytest.mark.parametrize("kwargs", [{"max_kv_fraction": 0.0}, {"max_kv_fraction": 1.5}, {"max_active_requests": -1}])
def test_limits_check_themselves(kwargs):
    with pytest.raises(ValueError):
        LoadLimits(**kwargs)
