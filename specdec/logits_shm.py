"""Verify logits through POSIX shared memory, for a validator on the same machine as the primary.

The primary keeps two segments per active request, `/dev/shm/specdec-logits-<pid>-<128 random
bits>`, and writes them in turn, one verify each; the handle it returns (segment name, byte count,
format, shape, fp8 row scales) travels in the protobuf instead of the bytes. Two slots are enough:
a greedy request's loop validates a step beside the next step's verify (gateway/loop.py), never
further behind, so the validator always reads a slot before its next overwrite. Slots are removed
when the request is released; the slots of a primary that died without cleaning up are swept when
the next one starts.

A verify that asks for its features (specdec.features) has them written into the same slot, after
the logits at the next multiple of FEATURES_ALIGN bytes: one file, one lifecycle; the handle gives
their offset. The draft pool reads them there (read_features_slot) at the request's next Propose,
before the verify after next overwrites the slot.

A slot is a capability: its name cannot be guessed (a caller that was not handed it cannot make
the validator read another request's logits) and its file is 0600 (other users of the machine
cannot read it).

The reader maps the named file read-only and checks every field before using it; a handle
that does not describe a live slot gets InvalidArgument naming the field.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import threading
from pathlib import Path

from specdec.errors import InvalidArgument, quoted
from specdec.features import EncodedFeatures
from specdec.logits_codec import EncodedLogits, encode_logits
from specdec.weights.shared import SHM_DIR

SLOT_PREFIX = "specdec-logits"
SLOT_NAME_BYTES = 16  # random bytes in a slot's name
SLOT_MODE = 0o600
_SLOT_NAME = re.compile(rf"^{SLOT_PREFIX}-[0-9]+-[0-9a-f]{{{2 * SLOT_NAME_BYTES}}}$")
_SLOT_OWNER_PID = re.compile(rf"^{SLOT_PREFIX}-([0-9]+)-")  # any slot name, older formats too


SLOTS_PER_REQUEST = 2  # written in turn: a step's logits stay readable while the next verify writes
FEATURES_ALIGN = 64  # features start at a cache-line boundary after the logits


def features_offset(num_logits_bytes: int) -> int:
    """Byte offset of the features in a slot whose logits take num_logits_bytes."""
    return -(-num_logits_bytes // FEATURES_ALIGN) * FEATURES_ALIGN


class LogitsSlots:
    """The primary's side: SLOTS_PER_REQUEST shared-memory slots per request, written in turn."""

    def __init__(self, instance_id: str) -> None:
        self.instance_id = instance_id
        self._names: dict[str, list[str]] = {}
        self._writes: dict[str, int] = {}
        self._lock = threading.Lock()

    def write(
        self, request_id: str, logits, fmt: str, features: EncodedFeatures | None = None
    ) -> tuple[str, EncodedLogits]:
        """Encode logits [R, V] into the request's next slot, and `features` after them (at
        features_offset(len(encoded.data))); returns (segment name, encoded metadata)."""
        encoded = encode_logits(logits, fmt)
        size = len(encoded.data) if features is None else features_offset(len(encoded.data)) + features.num_bytes
        with self._lock:
            names = self._names.get(request_id)
            if names is None:
                names = self._names[request_id] = [_new_slot_name() for _ in range(SLOTS_PER_REQUEST)]
            count = self._writes.get(request_id, 0)
            self._writes[request_id] = count + 1
            name = names[count % SLOTS_PER_REQUEST]
        fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, SLOT_MODE)
        try:
            os.fchmod(fd, SLOT_MODE)  # whatever the umask or an earlier file left
            os.ftruncate(fd, size)
            os.pwrite(fd, encoded.data, 0)
            if features is not None:
                os.pwrite(fd, features.data, features_offset(len(encoded.data)))
        finally:
            os.close(fd)
        return name, encoded

    def release(self, request_id: str) -> None:
        with self._lock:
            names = self._names.pop(request_id, [])
            self._writes.pop(request_id, None)
        for name in names:
            (SHM_DIR / name).unlink(missing_ok=True)

    def release_all(self) -> None:
        for request_id in list(self._names):
            self.release(request_id)


def _new_slot_name() -> str:
    return f"{SLOT_PREFIX}-{os.getpid()}-{secrets.token_hex(SLOT_NAME_BYTES)}"


def cleanup_stale_slots() -> list[str]:
    """Unlink the logits slots of primaries that are no longer running (the pid in the name)."""
    removed = []
    for path in SHM_DIR.glob(f"{SLOT_PREFIX}-*"):
        match = _SLOT_OWNER_PID.match(path.name)
        if match is not None and not Path(f"/proc/{match.group(1)}").exists():
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed


def read_slot(
    segment_name: str,
    num_bytes: int,
    fmt: str,
    num_rows: int,
    vocab_size: int,
    row_scales: tuple[float, ...] | None,
    field: str,
) -> EncodedLogits:
    """Map a slot read-only and return its logits (copied out, so the slot may be rewritten)."""
    data = _read_region(segment_name, 0, num_bytes, field, "the validator")
    try:
        return EncodedLogits(fmt, num_rows, vocab_size, data, row_scales)
    except ValueError as e:
        raise InvalidArgument(field, str(e)) from None


def read_features_slot(
    segment_name: str, offset: int, num_bytes: int, dtype: str, num_rows: int, hidden_size: int, field: str
) -> EncodedFeatures:
    """Map a slot read-only and return the features a verify wrote after its logits (copied out)."""
    if offset % FEATURES_ALIGN:
        raise InvalidArgument(f"{field}.memory.offset", f"{offset} is not a multiple of {FEATURES_ALIGN}")
    data = _read_region(segment_name, offset, num_bytes, field, "the draft pool")
    try:
        return EncodedFeatures(dtype, num_rows, hidden_size, data)
    except ValueError as e:
        raise InvalidArgument(field, str(e)) from None


def _read_region(segment_name: str, offset: int, num_bytes: int, field: str, reader: str) -> bytes:
    """Bytes [offset, offset + num_bytes) of a live slot, every field checked (InvalidArgument naming it)."""
    if not _SLOT_NAME.match(segment_name):
        raise InvalidArgument(f"{field}.memory.segment_name", f"not a logits slot name: {quoted(segment_name)}")
    path = Path(SHM_DIR) / segment_name
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise InvalidArgument(
            f"{field}.memory.segment_name",
            f"no logits slot {segment_name!r} on this machine (is {reader} co-located with the primary?)",
        ) from None
    try:
        size = os.fstat(fd).st_size
        if num_bytes <= 0 or offset < 0 or size < offset + num_bytes:
            raise InvalidArgument(
                f"{field}.memory.num_bytes", f"{num_bytes} bytes at offset {offset} asked, the slot holds {size}"
            )
        with mmap.mmap(fd, offset + num_bytes, prot=mmap.PROT_READ) as m:
            data = m[offset : offset + num_bytes]
    finally:
        os.close(fd)
    return data
