"""A `WeightManifest` to and from its protobuf message (common.proto `WeightManifest`).

The protobuf carries, besides the handle, the tensor table and the matrices' layouts, the model's
config.json text, its precision and its id, so one message is all a peer needs to rebuild the model:

    pb = manifest_to_pb(shared.manifest, config_json, "fp32", "smollm2-135m")      # primary
    manifest, config_json, precision, model_id = manifest_from_pb(pb)               # draft pool

The memory handle names the whole segment: offset 0, num_bytes = total_bytes. Conversion
checks only what the wire adds (an unset kind, a region that is not the whole segment);
`specdec.weights.shared.attach` checks everything else before mapping. Errors are
`HandleError`s whose field is the protobuf path (`wire_field` turns attach's domain field
names into those paths), so a servicer can answer INVALID_ARGUMENT naming the field.
"""

from __future__ import annotations

from typing import cast

from specdec.model.layout import MatrixLayout, WeightLayout
from specdec.v1 import common_pb2
from specdec.weights.shared import KIND_CUDA_IPC, KIND_SHARED_MEMORY, HandleError, TensorDescriptor, WeightManifest

_KIND_TO_PB = {KIND_SHARED_MEMORY: common_pb2.HANDLE_KIND_SHARED_MEMORY, KIND_CUDA_IPC: common_pb2.HANDLE_KIND_CUDA_IPC}
_KIND_FROM_PB = {v: k for k, v in _KIND_TO_PB.items()}
# WeightLayout.NATIVE_INT8 <-> WEIGHT_LAYOUT_NATIVE_INT8, and so on for every layout
_LAYOUT_TO_PB = {
    layout: cast(common_pb2.WeightLayout, common_pb2.WeightLayout.Value("WEIGHT_LAYOUT_" + layout.name))
    for layout in WeightLayout
}
_LAYOUT_FROM_PB = {v: k for k, v in _LAYOUT_TO_PB.items()}

# WeightManifest's handle fields -> the MemoryHandle fields that carry them (kind goes through
# _KIND_TO_PB; offset is 0 on the wire)
_MEMORY_FIELDS = {
    "segment_name": "segment_name",
    "cuda_ipc_handle": "cuda_ipc_handle",
    "device_index": "device_index",
    "total_bytes": "num_bytes",
    "owner_instance_id": "owner_instance_id",
}
# attach()'s field names -> the field of the protobuf WeightManifest that carries them
_WIRE_FIELDS = {"kind": "memory.kind"} | {field: f"memory.{wire}" for field, wire in _MEMORY_FIELDS.items()}


def wire_field(field: str) -> str:
    """The protobuf path of a `HandleError.field`: E.g. "total_bytes" -> "memory.num_bytes";
    tensor fields ("tensors.offset") have the same path on the wire."""
    return _WIRE_FIELDS.get(field, field)


def manifest_to_pb(m: WeightManifest, config_json: str, precision: str, model_id: str) -> common_pb2.WeightManifest:
    memory = common_pb2.MemoryHandle(
        kind=_KIND_TO_PB[m.kind], offset=0, **{wire: getattr(m, field) for field, wire in _MEMORY_FIELDS.items()}
    )
    tensors = [
        common_pb2.TensorDescriptor(
            name=d.name, dtype=d.dtype, shape=list(d.shape), offset=d.offset, num_bytes=d.num_bytes
        )
        for d in m.tensors
    ]
    matrices = [
        common_pb2.MatrixLayout(
            module=x.module, layout=_LAYOUT_TO_PB[x.layout], shape=list(x.shape), tensors=list(x.tensors)
        )
        for x in m.matrices
    ]
    return common_pb2.WeightManifest(
        memory=memory,
        tensors=tensors,
        model_config_json=config_json,
        precision=precision,
        model_id=model_id,
        matrices=matrices,
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
        **{field: getattr(memory, wire) for field, wire in _MEMORY_FIELDS.items()},
        tensors=tensors,
        matrices=tuple(_matrix_from_pb(x) for x in pb.matrices),
    )
    return manifest, pb.model_config_json, pb.precision, pb.model_id


def _matrix_from_pb(pb: common_pb2.MatrixLayout) -> MatrixLayout:
    """The record as sent; `attach` checks its tensors and shape against the manifest."""
    layout = _LAYOUT_FROM_PB.get(pb.layout)
    if layout is None:
        known = ", ".join(common_pb2.WeightLayout.Name(v) for v in _LAYOUT_FROM_PB)
        raise HandleError("matrices.layout", f"{pb.module}: must be one of {known}, got {pb.layout}")
    if len(pb.shape) != 2:
        raise HandleError("matrices.shape", f"{pb.module}: must be [out_features, in_features], got {list(pb.shape)}")
    return MatrixLayout(pb.module, layout, (pb.shape[0], pb.shape[1]), tuple(pb.tensors))
