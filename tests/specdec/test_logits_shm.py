"""Logits through shared-memory slots: the handle decodes to what inline bytes would, bad handles
are refused naming the field, released slots are gone, names are unguessable, files private,
and the slots of dead primaries are swept."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest
import torch

from specdec import pb
from specdec.errors import InvalidArgument
from specdec.logits_shm import LogitsSlots, cleanup_stale_slots, read_slot
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
    # The next step of the same request writes the other slot: this step's stays readable meanwhile
    # (its validation runs beside that verify); the one after rewrites the first (smaller or larger).
    name2, enc2 = slots.write("req", logits[:1], fmt)
    assert name2 != name
    assert torch.equal(pb.logits_from_pb(pb.logits_handle_to_pb(name, enc, "x"), "t"), inline)
    assert pb.logits_from_pb(pb.logits_handle_to_pb(name2, enc2, "x"), "t").shape == (1, 1000)
    name3, enc3 = slots.write("req", logits[:2], fmt)
    assert name3 == name
    assert pb.logits_from_pb(pb.logits_handle_to_pb(name3, enc3, "x"), "t").shape == (2, 1000)
    slots.release("req")
    assert not (SHM_DIR / name).exists() and not (SHM_DIR / name2).exists()


def test_bad_handles_name_the_field(slots):
    name, enc = slots.write("req", torch.randn(2, 64), "fp32")
    good = pb.logits_handle_to_pb(name, enc, "i")
    cases = {
        "segment_name": ("memory", "segment_name", "../../etc/passwd"),
        "num_bytes": ("memory", "num_bytes", enc.num_bytes * 4),
    }
    for field, (part, attr, value) in cases.items():
        bad = type(good)()
        bad.CopyFrom(good)
        setattr(getattr(bad.handle, part), attr, value)
        with pytest.raises(InvalidArgument) as e:
            pb.logits_from_pb(bad, "target_logits")
        assert field in e.value.field
    bad = type(good)()
    bad.CopyFrom(good)
    bad.handle.num_rows = 3  # shape does not match the bytes
    with pytest.raises(InvalidArgument, match="target_logits.handle"):
        pb.logits_from_pb(bad, "target_logits")
    slots.release("req")
    assert not (SHM_DIR / name).exists()
    with pytest.raises(InvalidArgument, match="no logits slot"):
        pb.logits_from_pb(good, "target_logits")


def test_slot_names_are_unguessable_and_private(slots):
    names = {slots.write(f"req{i}", torch.randn(1, 8), "fp32")[0] for i in range(3)}
    assert len(names) == 3
    for name in names:
        pid, secret = name.removeprefix("specdec-logits-").split("-")
        assert pid == str(os.getpid()) and len(secret) == 32 and int(secret, 16) >= 0  # 128 random bits
        assert stat.S_IMODE((SHM_DIR / name).stat().st_mode) == 0o600
    guessed = f"specdec-logits-{os.getpid()}-0"  # the sequential names of the past
    with pytest.raises(InvalidArgument, match="not a logits slot name"):
        read_slot(guessed, 32, "fp32", 1, 8, None, "target_logits")


def test_slots_of_dead_primaries_are_swept_and_live_ones_kept(slots):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    stale = [SHM_DIR / f"specdec-logits-{dead_pid}-{'ab' * 16}", SHM_DIR / f"specdec-logits-{dead_pid}-7"]
    for path in stale:
        path.write_bytes(b"\0" * 16)
    live, _ = slots.write("req", torch.randn(1, 8), "fp32")
    try:
        assert {p.name for p in stale} <= set(cleanup_stale_slots())  # others' stale slots may go too
        assert not any(p.exists() for p in stale) and (SHM_DIR / live).exists()
    finally:
        for path in stale:
            path.unlink(missing_ok=True)
