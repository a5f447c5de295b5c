"""A `WeightManifest` to and from its protobuf message (common.proto `WeightManifest`).

The protobuf carries, besides the handle and the tensor table, the model's config.json text,
its precision and its id, so one message is all a peer needs to rebuild the model:

    pb = manifest_to_pb(shared.manifest, config_json, "fp32", "smollm2-135m")      # primary
    manifest, config_json, precision, model_id = manifest_from_pb(pb)               # draft pool

The memory handle names the whole segment: offset 0, num_bytes = total_bytes. Conversion
checks only what the wire adds (an unset kind, a region that is not the whole segment);
`specdec.weights.shared.attach` checks everything else before mapping. Errors are
`HandleError`s whose field is the protobuf path (`wire_field` turns attach's domain field
names into those paths), so a servicer can answer INVALID_ARGUMENT naming the field.
"""

from __future__ import annotations

from specdec.v1 import common_pb2
from specdec.weights.shared import KIND_CUDA_IPC, KIND_SHARED_MEMORY, HandleError, TensorDescriptor, WeightManifest

_KIND_TO_PB = {KIND_SHARED_MEMORY: common_pb2.HANDLE_KIND_SHARED_MEMORY, KIND_CUDA_IPC: common_pb2.HANDLE_KIND_CUDA_IPC}
_KIND_FROM_PB = {v: k for k, v in _KIND_TO_PB.items()}

# attach()'s field names -> the field of the protobuf WeightManifest that carries them
_WIRE_FIELDS = {
    "kind": "memory.kind",
    "segment_name": "memory.segment_name",
    "cuda_ipc_handle": "memory.cuda_ipc_handle",
    "device_index": "memory.device_index",
    "total_bytes": "memory.num_bytes",
    "owner_instance_id": "memory.owner_instance_id",
}


def wire_field(field: str) -> str:
    """The protobuf path of a `HandleError.field`: E.g. "total_bytes" -> "memory.num_bytes";
    tensor fields ("tensors.offset") have the same path on the wire."""
    return _WIRE_FIELDS.get(field, field)


def manifest_to_pb(m: WeightManifest, config_json: str, precision: str, model_id: str) -> common_pb2.WeightManifest:
    memory = common_pb2.MemoryHandle(
        kind=_KIND_TO_PB[m.kind],
        segment_name=m.segment_name,
        cuda_ipc_handle=m.cuda_ipc_handle,
        device_index=m.device_index,
        offset=0,
        num_bytes=m.total_bytes,
        owner_instance_id=m.owner_instance_id,
    )
    tensors = [
        common_pb2.TensorDescriptor(
            name=d.name, dtype=d.dtype, shape=list(d.shape), offset=d.offset, num_bytes=d.num_bytes
        )
        for d in m.tensors
    ]
    return common_pb2.WeightManifest(
        memory=memory, tensors=tensors, model_config_json=config_json, precision=precision, model_id=model_id
    )


def manifest_from_pb(pb: common_pb2.WeightManifest) -> tuple[WeightManifest, str, str, str]:
    """-> (manifest, model_config_json, precision, model_id); raises HandleError(field, ...)."""
    if not pb.HasField("memory"):
        raise HandleError("memory", "is not set")
    memory = pb.memory
    kind = _KIND_FROM_PB.get(memory.kind)
    if kind is None:
        raise HandleError(
            "memory.kind", f"must be HANDLE_KIND_SHARED_MEMORY or HANDLE_KIND_CUDA_IPC, got {memory.kind}"
        )
    if memory.offset != 0:
        raise HandleError("memory.offset", f"must be 0 (the handle names the whole segment), got {memory.offset}")
    if not pb.model_config_json:
        raise HandleError("model_config_json", "is empty")
    tensors = tuple(
        TensorDescriptor(name=t.name, dtype=t.dtype, shape=tuple(t.shape), offset=t.offset, num_bytes=t.num_bytes)
        for t in pb.tensors
    )
    manifest = WeightManifest(
        kind=kind,
        segment_name=memory.segment_name,
        cuda_ipc_handle=memory.cuda_ipc_handle,
        device_index=memory.device_index,
        total_bytes=memory.num_bytes,
        owner_instance_id=memory.owner_instance_id,
        tensors=tensors,
    )
    return manifest, pb.model_config_json, pb.precision, pb.model_id
