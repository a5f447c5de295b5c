"""What a model path must hold, checked without torch: a Hugging Face-style directory's files and a
GGUF file's header. The primary checks them as it loads (loader.resolve_model_dir, gguf_convert);
inference.py checks a --model_path before it starts any service, so that a path that holds no
model is a one-line error naming it, not a service's traceback after the others have started.
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.gguf_reader import READER_SUPPORTED_VERSIONS


def check_model_path(path: Path) -> None:
    """What loader.resolve_model_dir refuses of `path` before loading or converting it: a path
    that does not exist, a directory without config.json or safetensors weights, a file that is not
    a .gguf, a GGUF whose header is truncated or corrupt (FileNotFoundError, ValueError or OSError
    naming the path)."""
    if not path.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist")
    if path.is_dir():
        validate_model_dir(path)
    elif path.suffix.lower() != ".gguf":
        raise ValueError(f"model path {str(path)!r} is neither a model directory nor a .gguf file")
    else:
        check_gguf_header(path)


def validate_model_dir(model_dir: Path) -> None:
    """Raise a clear error unless `model_dir` holds a config.json and safetensors weights."""
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"model directory {str(model_dir)!r} has no config.json")
    if not any(model_dir.glob("*.safetensors")):
        raise FileNotFoundError(
            f"model directory {str(model_dir)!r} has no *.safetensors weights "
            "(only safetensors checkpoints are supported)"
        )


class GGUFFileError(ValueError):
    """A GGUF file that cannot be read (truncated, corrupt, or holding what this converter cannot
    convert); the message names the file and what is wrong."""


# GGUF metadata value types (gguf.GGUFValueType) -> their size in bytes; STRING (8) and ARRAY (9) vary
_GGUF_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_GGUF_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # name length, n_dims, type, offset
_GGUF_UINT32 = 4
_GGUF_ALIGNMENT_KEY = "general.alignment"  # the tensor data's alignment, a uint32 (default 32)
_GGUF_DEFAULT_ALIGNMENT = 32
_GGUF_MAX_DIMS = 4  # GGML_MAX_DIMS


def check_gguf_header(path: Path) -> None:
    """Walk the header's counts and lengths against the file's size before `GGUFReader` reads it:
    the reader slices past the end without complaint, so a count of 2^60 array items (a corrupt or
    hostile file) looped on empty reads until memory ran out. GGUFFileError naming the file otherwise."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 24:
            raise GGUFFileError(f"GGUF file {path} is {size} bytes, shorter than a GGUF header")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:  # pages read as the walk reaches them
            _walk_header(path, data, size)


def _walk_header(path: Path, data: mmap.mmap, size: int) -> None:
    walk = _HeaderWalk(path, data, size)
    if data[:4] != b"GGUF":
        raise GGUFFileError(f"GGUF file {path} does not start with the GGUF magic (not a GGUF file)")
    if (version := walk.read(4, "I", "the version")[0]) not in READER_SUPPORTED_VERSIONS:
        raise GGUFFileError(
            f"GGUF file {path} has format version {version}; this reader takes {READER_SUPPORTED_VERSIONS}"
        )
    tensor_count, offset = walk.read(8, "Q", "the tensor count")
    kv_count, offset = walk.read(offset, "Q", "the metadata count")
    if tensor_count * _GGUF_MIN_TENSOR_INFO_BYTES > size - offset:
        raise walk.bad(8, f"{tensor_count} tensors claimed, more than the file holds")
    if kv_count * (8 + 4) > size - offset:
        raise walk.bad(16, f"{kv_count} metadata fields claimed, more than the file holds")
    offset, alignment = walk.metadata(offset, kv_count)
    # The tensor infos, then the tensor data from the next multiple of the alignment on: a file cut
    # short in its data (an interrupted download) has a whole header, and the reader's short slices
    # failed only deep in the conversion.
    offset, data_bytes = walk.tensor_infos(offset, tensor_count)
    data_start = offset + -offset % alignment
    if data_bytes and data_start + data_bytes > size:
        raise walk.bad(data_start, f"the tensor data of {data_bytes} bytes runs past the end")


class _HeaderWalk:
    """Reads a GGUF header's fields in order, each checked against the file's size; every method
    takes the offset to read at and returns the offset after what it read."""

    def __init__(self, path: Path, data: mmap.mmap, size: int) -> None:
        self.path, self.data, self.size = path, data, size
        # the version's low half is 0 read in little-endian order: a big-endian file (the reader takes both)
        self.order = ">" if struct.unpack_from("<I", data, 4)[0] & 0xFFFF == 0 else "<"

    def bad(self, offset: int, what: str) -> GGUFFileError:
        return GGUFFileError(
            f"GGUF file {self.path} is truncated or corrupt: {what} at byte {offset} (file: {self.size} bytes)"
        )

    def read(self, offset: int, fmt: str, what: str) -> tuple[int, int]:
        n = struct.calcsize(self.order + fmt)
        if offset + n > self.size:
            raise self.bad(offset, f"{what} runs past the end")
        return struct.unpack_from(self.order + fmt, self.data, offset)[0], offset + n

    def string(self, offset: int, what: str) -> int:
        length, offset = self.read(offset, "Q", f"{what}'s length")
        if offset + length > self.size:
            raise self.bad(offset, f"{what} of {length} bytes runs past the end")
        return offset + length

    def value(self, offset: int, kind: int, what: str) -> int:
        if kind in _GGUF_SCALAR_SIZES:
            if offset + _GGUF_SCALAR_SIZES[kind] > self.size:
                raise self.bad(offset, f"{what} runs past the end")
            return offset + _GGUF_SCALAR_SIZES[kind]
        if kind == _GGUF_STRING:
            return self.string(offset, what)
        if kind != _GGUF_ARRAY:
            raise self.bad(offset, f"{what} has unknown value type {kind}")
        item_kind, offset = self.read(offset, "I", f"{what}'s item type")
        count, offset = self.read(offset, "Q", f"{what}'s length")
        if count * _GGUF_SCALAR_SIZES.get(item_kind, 8) > self.size - offset:
            raise self.bad(offset, f"{what} claims {count} items, more than the file holds")
        if item_kind in _GGUF_SCALAR_SIZES:  # checked whole above
            return offset + count * _GGUF_SCALAR_SIZES[item_kind]
        for _ in range(count):
            offset = self.value(offset, item_kind, what)
        return offset

    def metadata(self, offset: int, kv_count: int) -> tuple[int, int]:
        """Walk kv_count metadata fields -> (the offset after them, the tensor data's alignment)."""
        alignment = _GGUF_DEFAULT_ALIGNMENT
        for _ in range(kv_count):
            key_start = offset
            offset = self.string(offset, "a metadata key")
            key = self.data[key_start + 8 : offset].decode("utf-8", "replace")
            kind, offset = self.read(offset, "I", f"metadata {key!r}'s type")
            if key == _GGUF_ALIGNMENT_KEY and kind == _GGUF_UINT32:
                alignment = self.read(offset, "I", f"metadata {key!r}")[0] or alignment  # the reader refuses 0
            offset = self.value(offset, kind, f"metadata {key!r}")
        return offset, alignment

    def tensor_infos(self, offset: int, tensor_count: int) -> tuple[int, int]:
        """Walk tensor_count tensor infos -> (the offset after them, the bytes their data spans)."""
        data_bytes = 0
        for _ in range(tensor_count):
            name_start = offset
            offset = self.string(offset, "a tensor name")
            name = self.data[name_start + 8 : offset].decode("utf-8", "replace")
            num_dims, offset = self.read(offset, "I", f"tensor {name!r}'s number of dimensions")
            if num_dims > _GGUF_MAX_DIMS:
                raise self.bad(offset, f"tensor {name!r} claims {num_dims} dimensions")
            num_items = 1
            for _ in range(num_dims):
                dim, offset = self.read(offset, "Q", f"tensor {name!r}'s shape")
                num_items *= dim
            kind, offset = self.read(offset, "I", f"tensor {name!r}'s type")
            start, offset = self.read(offset, "Q", f"tensor {name!r}'s offset")
            try:
                block_size, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
            except (ValueError, KeyError):
                raise self.bad(offset, f"tensor {name!r} has unknown type {kind}") from None
            data_bytes = max(data_bytes, start + num_items // block_size * block_bytes)
        return offset, data_bytes
