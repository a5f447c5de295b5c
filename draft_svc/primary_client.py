"""The draft pool's client of the primary: the two RPCs that attaching to its weights needs."""

from __future__ import annotations

import grpc

from draft_svc.weights import ExportedWeights, ModelInfo
from specdec.errors import InvalidArgument, Unavailable
from specdec.service.auth import authenticated_channel
from specdec.service.server import DEFAULT_MAX_MESSAGE_BYTES
from specdec.v1 import primary_pb2, primary_pb2_grpc
from specdec.weights.shared import HandleError
from specdec.weights.wire import manifest_from_pb

DEFAULT_TIMEOUT_S = 10.0


class GrpcPrimaryClient:
    def __init__(self, address: str, timeout_s: float = DEFAULT_TIMEOUT_S, service_token: str | None = None) -> None:
        self.address, self._timeout_s = address, timeout_s
        # Reconnect quickly: after a primary restart the next Attach must find it within a second,
        # not after gRPC's default backoff (up to two minutes).
        self._channel = authenticated_channel(
            grpc.insecure_channel(
                address,
                options=[
                    ("grpc.max_receive_message_length", DEFAULT_MAX_MESSAGE_BYTES),
                    ("grpc.initial_reconnect_backoff_ms", 100),
                    ("grpc.min_reconnect_backoff_ms", 100),
                    ("grpc.max_reconnect_backoff_ms", 1000),
                ],
            ),
            service_token,
        )
        self._stub = primary_pb2_grpc.PrimaryServiceStub(self._channel)

    def get_model_info(self) -> ModelInfo:
        r = self._call("GetModelInfo", primary_pb2.GetModelInfoRequest())
        return ModelInfo(
            instance_id=r.instance_id,
            vocab_size=r.vocab_size,
            max_context_length=r.max_context_length,
            model_id=r.model_id,
        )

    def export_weights(self) -> ExportedWeights:
        return exported_from_pb(self._call("ExportWeights", primary_pb2.ExportWeightsRequest()).manifest)

    def _call(self, method: str, request):
        """The primary's RPC `method`; any failure is Unavailable("primary_address") naming it. The
        call waits for the channel to connect (within its timeout): right after a primary restart
        the channel may still be in its reconnect backoff, and failing fast then would refuse an
        Attach that the primary, serving again, would answer."""
        try:
            return getattr(self._stub, method)(request, timeout=self._timeout_s, wait_for_ready=True)
        except grpc.RpcError as e:
            raise Unavailable(
                "primary_address", f"{method} on {self.address} failed: {e.code().name} {e.details()}"
            ) from None

    def close(self) -> None:
        self._channel.close()


def exported_from_pb(pb) -> ExportedWeights:
    """A protobuf WeightManifest -> ExportedWeights; a malformed one is InvalidArgument("manifest.<field>")."""
    try:
        manifest, config_json, precision, model_id = manifest_from_pb(pb)
    except HandleError as e:
        raise InvalidArgument(f"manifest.{e.field}", str(e).split(": ", 1)[-1]) from None
    return ExportedWeights(manifest, config_json, precision, model_id)
