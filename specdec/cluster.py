"""A local cluster on loopback: several nodes and several gateways sharing one Redis.

A node is one primary with its draft pool and validator (specdec.launcher's services, named
"primary-0", "draft-0", "validator-0", ...); every gateway ("gateway-0", ...) routes to all of
the nodes (--nodes) and shares the state store, so any gateway can serve or adopt any request.

    specs = cluster_specs(StackConfig(redis_url=url), num_nodes=2, num_gateways=2)
    with Stack(specs=specs) as stack:
        stack.addresses["gateway-1"]

The single-node stack (service_specs) is the same services without the suffixes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from specdec.launcher import DRAFT, GATEWAY, HTTP, PRIMARY, VALIDATOR, ServiceSpec, StackConfig, service_specs

_NODE_SERVICES = (PRIMARY, DRAFT, VALIDATOR)
_ADDRESS_FLAGS = ("--primary_address", "--draft_address", "--validator_address")


def node_name(service: str, index: int) -> str:
    """The cluster's name of a node's (or gateway's) service, e.g. node_name("primary", 1) == "primary-1"."""
    return f"{service}-{index}"


def _renamed(spec: ServiceSpec, index: int) -> ServiceSpec:
    """A node's service: its name and the services it depends on suffixed with the node's index."""
    return dataclasses.replace(
        spec,
        name=node_name(spec.name, index),
        depends_on=tuple(node_name(d, index) for d in spec.depends_on),
        address_flags=tuple((flag, node_name(d, index)) for flag, d in spec.address_flags),
    )


def cluster_specs(
    config: StackConfig, num_nodes: int, num_gateways: int, gateway_args: Sequence[str] = ()
) -> tuple[ServiceSpec, ...]:
    """The services of num_nodes nodes and num_gateways gateways, in start order. Nodes start one
    after the other (each primary times its verify passes at start-up, best on an idle CPU).
    gateway_args: more flags for every gateway (e.g. --owner_lease_s)."""
    if num_nodes < 1 or num_gateways < 1:
        raise ValueError(f"num_nodes and num_gateways must be >= 1, got {num_nodes}, {num_gateways}")
    if not config.redis_url and num_gateways > 1:
        raise ValueError("gateways share requests through Redis: give a redis_url for more than one gateway")
    if config.is_serving_http:
        raise ValueError("the HTTP front is not part of a cluster's specs (run one per gateway)")
    single = {s.name: s for s in service_specs(config)}
    specs: list[ServiceSpec] = []
    for i in range(num_nodes):
        node = [_renamed(single[name], i) for name in _NODE_SERVICES]
        if i > 0:  # after the previous node's primary calibrated
            node[0] = dataclasses.replace(node[0], depends_on=(node_name(PRIMARY, i - 1),))
        specs += node
    nodes = tuple((node_name(PRIMARY, i), node_name(DRAFT, i), node_name(VALIDATOR, i)) for i in range(num_nodes))
    gateway = single[GATEWAY]
    command = tuple(a for a in gateway.command if a not in _ADDRESS_FLAGS) + tuple(gateway_args)
    for g in range(num_gateways):
        specs.append(
            dataclasses.replace(
                gateway,
                name=node_name(GATEWAY, g),
                command=command,
                depends_on=tuple(n for node in nodes for n in node),
                address_flags=(),
                node_services=nodes,
            )
        )
    assert HTTP not in {s.name for s in specs}
    return tuple(specs)
