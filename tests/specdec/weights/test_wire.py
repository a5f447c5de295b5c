"""WeightManifest <-> protobuf: every field survives the round trip; wire-only mistakes name their field."""

from __future__ import annotations

import pytest

from specdec.model.layout import MatrixLayout, WeightLayout
from specdec.v1 import common_pb2
from specdec.weights.shared import KIND_CUDA_IPC, KIND_SHARED_MEMORY, HandleError, TensorDescriptor, WeightManifest
from specdec.weights.wire import manifest_from_pb, manifest_to_pb, wire_field

TENSORS = (
    TensorDescriptor("model.embed_tokens.weight", "bfloat16", (8, 4), 0, 64),
    TensorDescriptor("model.norm.weight", "float32", (4,), 64, 16),
)
MATRICES = (MatrixLayout.of("model.embed_tokens", WeightLayout.DENSE, (8, 4)),)


@pytest.mark.parametrize(
    "manifest",
    [
        WeightManifest(KIND_SHARED_MEMORY, "specdec-weights-1-abc", b"", -1, 128, "abc", TENSORS),
        WeightManifest(KIND_CUDA_IPC, "", bytes(range(64)), 1, 128, "def", TENSORS),
        WeightManifest(KIND_SHARED_MEMORY, "specdec-weights-1-abc", b"", -1, 128, "abc", TENSORS, MATRICES),
    ],
)
def test_round_trip_keeps_every_field(manifest):
    pb = manifest_to_pb(manifest, '{"model_type": "llama"}', "bf16", "smollm2")
    assert pb.memory.offset == 0 and pb.memory.num_bytes == 128
    wire = common_pb2.WeightManifest.FromString(pb.SerializeToString())
    assert manifest_from_pb(wire) == (manifest, '{"model_type": "llama"}', "bf16", "smollm2")


@pytest.mark.parametrize(
    "change, field",
    [
        (lambda pb: pb.ClearField("memory"), "memory"),
        (lambda pb: setattr(pb.memory, "kind", common_pb2.HANDLE_KIND_UNSPECIFIED), "memory.kind"),
        (lambda pb: setattr(pb.memory, "offset", 64), "memory.offset"),
        (lambda pb: setattr(pb, "model_config_json", ""), "model_config_json"),
        (lambda pb: setattr(pb.matrices[0], "layout", common_pb2.WEIGHT_LAYOUT_UNSPECIFIED), "matrices.layout"),
        (lambda pb: setattr(pb.matrices[0], "layout", 99), "matrices.layout"),  # a layout from a newer owner
        (lambda pb: pb.matrices[0].shape.append(2), "matrices.shape"),
    ],
)
def test_wire_mistakes_name_their_field(change, field):
    pb = manifest_to_pb(
        WeightManifest(KIND_SHARED_MEMORY, "specdec-weights-1-abc", b"", -1, 128, "abc", TENSORS, MATRICES),
        "{}",
        "fp32",
        "m",
    )
    change(pb)
    with pytest.raises(HandleError) as e:
        manifest_from_pb(pb)
    assert e.value.field == field


def test_every_layout_has_its_wire_value():
    """WeightLayout.X travels as WEIGHT_LAYOUT_X, and back."""
    for layout in WeightLayout:
        matrices = (MatrixLayout.of("m", layout, (16, 32)),)
        manifest = WeightManifest(KIND_SHARED_MEMORY, "specdec-weights-1-abc", b"", -1, 128, "abc", TENSORS, matrices)
        pb = manifest_to_pb(manifest, "{}", "int4", "m")
        assert common_pb2.WeightLayout.Name(pb.matrices[0].layout) == "WEIGHT_LAYOUT_" + layout.name
        assert manifest_from_pb(pb)[0].matrices == matrices


def test_attach_fields_map_to_wire_paths():
    assert wire_field("total_bytes") == "memory.num_bytes"
    assert wire_field("segment_name") == "memory.segment_name"
    assert wire_field("tensors.offset") == "tensors.offset"
