"""The owner probe's check over gRPC: does a gateway instance answer its health service?

One grpc.health.v1 Check of the instance's own name (gateway.owner_id.OwnerId.instance_health_name)
at its advertised address, within timeout_s, on a channel opened for it: probes are rare (one per
owner per verdict, gateway.owner_probe), and a channel kept to a dead address would only back off.
Any answer, SERVING or NOT_SERVING (draining), means the instance is there; no answer in time, a
refused connection, or NOT_FOUND (another process holds the address now: the instance is gone)
means it is not.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.owner_id import OwnerId
from gateway.owner_probe import OwnerCheck

DEFAULT_CHECK_TIMEOUT_S = 1.0


def health_check(credentials: grpc.ChannelCredentials | None, timeout_s: float = DEFAULT_CHECK_TIMEOUT_S) -> OwnerCheck:
    """The OwnerCheck of an owner's instance health; credentials: TLS to peers (None: plaintext)."""

    async def is_answering(owner: OwnerId) -> bool:
        if credentials is None:
            channel = grpc.aio.insecure_channel(owner.address)
        else:
            channel = grpc.aio.secure_channel(owner.address, credentials)
        try:
            stub = health_pb2_grpc.HealthStub(channel)
            await stub.Check(health_pb2.HealthCheckRequest(service=owner.instance_health_name), timeout=timeout_s)
        except grpc.RpcError:
            return False
        finally:
            await channel.close()
        return True

    return is_answering
