"""Logits through shared-memory slots: the handle decodes to what inline bytes would, bad handles
are refused naming the field, released slots are gone."""
from __future__ import annotations

import pytest
import torch

from specdec import pb
from specdec.errors import InvalidArgument
from specdec.logits_shm import LogitsSlots
from specdec.weights.shared import SHM_DIR


@pytest.fixture()
def slots():
    s = LogitsSlots("test-instance")
    yield s
    s.release_all()


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp8_e4m3"])
def test_a_handle_reads_back_what_inline_bytes_carry(slots, fmt):
    logits = torch.randn(3, 1000) * 5
    name, enc = slots.write("req", logits, fmt)
    via_handle = pb.logits_from_pb(pb.logits_handle_to_pb(name, enc, "test-instance"), "target_logits")
    inline = pb.logits_from_pb(pb.logits_to_pb(logits, fmt), "target_logits")
    assert torch.equal(via_handle, inline)
    # The next step of the same request rewrites the same slot (smaller or larger).
    name2, enc2 = slots.write("req", logits[:1], fmt)
    assert name2 == name
    assert pb.logits_from_pb(pb.logits_handle_to_pb(name2, enc2, "x"), "t").shape == (1, 1000)


def test_bad_handles_name_the_field(slots):
    name, enc = slots.write("req", torch.randn(2, 64), "fp32")
    good = pb.logits_handle_to_pb(name, enc, "i")
    cases = {"segment_name": ("memory", "segment_name", "../../etc/passwd"),
             "num_bytes": ("memory", "num_bytes", enc.num_bytes * 4)}
    for field, (part, attr, value) in cases.items():
        bad = type(good)()
        bad.CopyFrom(good)
        setattr(getattr(bad.handle, part), attr, value)
        with pytest.raises(InvalidArgument) as e:
            pb.logits_from_pb(bad, "target_logits")
        assert field in e.value.field
    bad = type(good)()
    bad.CopyFrom(good)
    bad.handle.num_rows = 3                                   # shape does not match the bytes
    with pytest.raises(InvalidArgument, match="target_logits.handle"):
        pb.logits_from_pb(bad, "target_logits")
    slots.release("req")
    assert not (SHM_DIR / name).exists()
    with pytest.raises(InvalidArgument, match="no logits slot"):
        pb.logits_from_pb(good, "target_logits")
