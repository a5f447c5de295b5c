"""The primary's features on the wire: fp16 / bf16 encoding, inline or after the logits in a logits
slot, row selection for the pool, and bad payloads refused naming the field."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec import pb
from specdec.errors import InvalidArgument
from specdec.features import DTYPE_BF16, DTYPE_FP16, EncodedFeatures, decode_features, encode_features
from specdec.logits_shm import FEATURES_ALIGN, LogitsSlots, features_offset
from specdec.v1 import common_pb2


@pytest.fixture()
def slots():
    s = LogitsSlots("test-instance")
    yield s
    s.release_all()


def test_fp32_rows_travel_as_fp16_and_bf16_rows_as_they_are():
    x = torch.tensor([[1.0, -2.5, 0.1], [3.0, 1e-3, -7.0]])  # [R=2, C=3]
    enc = encode_features(x)
    assert (enc.dtype, enc.num_rows, enc.hidden_size, len(enc.data)) == (DTYPE_FP16, 2, 3, 12)
    assert np.array_equal(decode_features(enc), x.half().float().numpy())
    b = torch.randn(4, 8).to(torch.bfloat16)
    enc_b = encode_features(b)
    assert enc_b.dtype == DTYPE_BF16 and np.array_equal(decode_features(enc_b), b.float().numpy())  # exact


def test_values_beyond_fp16_go_as_bf16_not_infinity():
    enc = encode_features(torch.tensor([[1.0, 1e5]]))
    assert enc.dtype == DTYPE_BF16 and np.isfinite(decode_features(enc)).all()


def test_rows_are_selected_in_order():
    x = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    assert np.array_equal(decode_features(encode_features(x).rows([3, 0])), x[[3, 0]].numpy())


def test_features_after_the_logits_in_a_slot_read_back_like_inline_ones(slots):
    logits, x = torch.randn(3, 1000), torch.randn(3, 64)  # 3 rows: root + 2 nodes
    enc = encode_features(x)
    name, enc_logits = slots.write("req", logits, "fp32", enc)  # 12000 bytes: the features at 12032
    handle = pb.features_handle_to_pb(name, enc, len(enc_logits.data), "test-instance")
    assert handle.memory.offset == features_offset(len(enc_logits.data)) and handle.memory.offset % FEATURES_ALIGN == 0
    inline = pb.features_to_pb(enc)
    assert np.array_equal(pb.features_from_pb(handle), pb.features_from_pb(inline))
    # the logits are where they were
    assert torch.equal(pb.logits_from_pb(pb.logits_handle_to_pb(name, enc_logits, "i"), "l"), logits)
    # The gateway's row choice (root and accepted node 1 -> rows 0, 2): a handle names them, inline slices.
    for features in (handle, inline):
        chosen = pb.select_feature_rows(features, [0, 2])
        assert np.array_equal(pb.features_from_pb(chosen), x.half().float().numpy()[[0, 2]])
    assert list(pb.select_feature_rows(handle, [0, 2]).rows) == [0, 2]
    assert not pb.select_feature_rows(inline, [0, 2]).HasField("memory")  # only the rows travel on


def _with(features: common_pb2.Features, **changes) -> common_pb2.Features:
    bad = common_pb2.Features()
    bad.CopyFrom(features)
    for path, value in changes.items():
        target = bad
        *parents, attr = path.split("__")
        for part in parents:
            target = getattr(target, part)
        setattr(target, attr, value)
    return bad


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"dtype": "float32"}, "features.dtype"),
        ({"hidden_size": 0}, "features"),
        ({"num_rows": 5}, "features.memory.num_bytes"),  # 5 rows in the bytes of 3: the size check
        ({"memory__segment_name": "../../etc/passwd"}, "features.memory.segment_name"),
        ({"memory__segment_name": "specdec-logits-1-" + "0" * 32}, "features.memory.segment_name"),
        ({"memory__offset": 8}, "features.memory.offset"),
        ({"memory__num_bytes": 1 << 30}, "features.memory.num_bytes"),
        ({"memory__kind": common_pb2.HANDLE_KIND_CUDA_IPC}, "features.memory.kind"),
    ],
)
def test_bad_handles_are_refused_naming_the_field(slots, changes, field):
    enc = encode_features(torch.randn(3, 64))
    name, enc_logits = slots.write("req", torch.randn(3, 100), "fp32", enc)
    good = pb.features_handle_to_pb(name, enc, len(enc_logits.data), "i")
    if field == "features.memory.num_bytes" and "num_rows" in changes:
        changes["memory__num_bytes"] = 5 * 64 * 2
    with pytest.raises(InvalidArgument) as e:
        pb.features_from_pb(_with(good, **changes))
    assert e.value.field == field


def test_bad_inline_features_and_rows_are_refused_naming_the_field():
    good = pb.features_to_pb(EncodedFeatures(DTYPE_FP16, 2, 4, bytes(16)))
    with pytest.raises(InvalidArgument) as e:
        pb.features_from_pb(_with(good, data=bytes(15)))
    assert e.value.field == "features.data"
    bad_rows = _with(good)
    bad_rows.rows.extend([0, 2])
    with pytest.raises(InvalidArgument) as e:
        pb.features_from_pb(bad_rows)
    assert e.value.field == "features.rows"
    with pytest.raises(InvalidArgument) as e:
        pb.features_from_pb(common_pb2.Features(dtype=DTYPE_FP16, num_rows=1, hidden_size=1))
    assert e.value.field == "features"


def test_rows_naming_more_rows_than_the_payload_holds_are_refused_before_any_is_copied():
    # A row index is a byte on the wire, a decoded row is hidden_size floats: rows repeating a row
    # would have a message of a few MB decode to GBs. Each row is meant once (at most num_rows).
    good = pb.features_to_pb(EncodedFeatures(DTYPE_FP16, 2, 4, bytes(16)))
    repeated = _with(good)
    repeated.rows.extend([0, 1, 0])
    with pytest.raises(InvalidArgument) as e:
        pb.features_from_pb(repeated)
    assert e.value.field == "features.rows"
    named = _with(good)
    named.rows.extend([1, 0])
    assert pb.features_from_pb(named).shape == (2, 4)
