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

import contextlib
import dataclasses
import sys
from collections.abc import Callable, Sequence

from specdec.launcher import (
    DRAFT,
    GATEWAY,
    HTTP,
    PRIMARY,
    VALIDATOR,
    ServiceError,
    ServiceSpec,
    Stack,
    StackConfig,
    service_specs,
)
from specdec.redis_server import redis_server
from specdec.state_store.redis_url import redacted_url
from specdec.supervisor import RestartPolicy, Supervisor

_NODE_SERVICES = (PRIMARY, DRAFT, VALIDATOR)
# serve_cluster's status when a service kept exiting and was given up: inference.py's for a stack
# under --serve that gave one up (EXIT_STACK_FAILED).
EXIT_GIVEN_UP = 3
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
                started_beside=(),
                address_flags=(),
                node_services=nodes,
            )
        )
    assert HTTP not in {s.name for s in specs}
    return tuple(specs)


def serve_cluster(
    config: StackConfig,
    num_nodes: int,
    num_gateways: int,
    policy: RestartPolicy,
    say: Callable[[str], None],
    print_line: Callable[[str], None] = print,
) -> int:
    """`inference.py --serve --nodes N --gateways M`: the cluster on loopback with one Redis (a
    throwaway redis-server unless config.redis_url names one), every address printed (one
    `name address` line each: the gateways' first), until Ctrl-C / SIGTERM (KeyboardInterrupt,
    returned 0) or a service that keeps exiting (EXIT_GIVEN_UP, its error on stderr). Services
    that exit are restarted on their address (specdec.supervisor): a restarted primary's node gets
    requests again once healthy."""
    with contextlib.ExitStack() as exits:
        if not config.redis_url:
            config = dataclasses.replace(config, redis_url=exits.enter_context(redis_server()).url)
        config = dataclasses.replace(config, is_serving_http=False)
        say(
            f"starting {num_nodes} nodes and {num_gateways} gateways on one Redis ({redacted_url(config.redis_url)})..."
        )
        stack = exits.enter_context(Stack(config, specs=cluster_specs(config, num_nodes, num_gateways)))
        names = sorted(stack.addresses, key=lambda n: (not n.startswith(GATEWAY), n))
        for name in names:
            print_line(f"{name} {stack.addresses[name]}")
        say(f"serving GenerationService (gRPC) at every gateway above; logs: {stack.log_dir}; Ctrl-C stops")
        try:
            Supervisor(stack, policy, say=say).run()
        except ServiceError as e:
            # On stderr even when say() is silent (--quiet): it is why the command exits.
            print(f"error: {e}", file=sys.stderr, flush=True)
            return EXIT_GIVEN_UP
        except KeyboardInterrupt:
            say("stopping the cluster...")
    return 0
