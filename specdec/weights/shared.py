"""Weights in memory another process maps zero-copy, described as plain data.

The owner (the primary) packs every weight tensor into ONE segment, 64-byte aligned, and
then runs on views into that segment, so there is a single copy on the machine:

* CPU: a POSIX shared-memory file `/dev/shm/<segment_name>`, mapped MAP_SHARED; readable by
  its owner's user alone (0600: the draft pool runs as the same user), its name unguessable
  (128 random bits after the owner's pid);
* GPU: one `cudaMalloc` block exported with `cudaIpcGetMemHandle` (64 opaque bytes).

A `WeightManifest` (segment name or IPC handle, per tensor: name, dtype, shape, byte offset, byte
count, and per matrix its layout, `specdec.model.layout.MatrixLayout`) is all a peer needs to
rebuild the same views and the same layers; it travels as explicit protobuf fields, never pickled.
`attach` checks every field before mapping anything.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import secrets
import uuid
from pathlib import Path
from typing import Iterable, Mapping, cast

import torch

from specdec.model.layout import SUFFIXES, MatrixLayout, ModelWeights, WeightLayout

SHM_DIR = Path("/dev/shm")
ALIGNMENT = 64
SEGMENT_PREFIX = "specdec-weights"
KIND_SHARED_MEMORY = "shared_memory"
KIND_CUDA_IPC = "cuda_ipc"
CUDA_IPC_HANDLE_BYTES = 64
_SEGMENT_NAME = re.compile(r"^[A-Za-z0-9._-]{1,200}$")
SEGMENT_NAME_RANDOM_BYTES = 16  # 128 bits
SEGMENT_MODE = 0o600  # owner only: the weights are nobody else's to read or write

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
    "int8": torch.int8,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class HandleError(ValueError):
    """A manifest or handle that does not describe a segment this process can map."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclasses.dataclass(frozen=True, slots=True)
class TensorDescriptor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    num_bytes: int


@dataclasses.dataclass(frozen=True, slots=True)
class WeightManifest:
    kind: str  # KIND_SHARED_MEMORY or KIND_CUDA_IPC
    segment_name: str  # shared memory: the file name under /dev/shm
    cuda_ipc_handle: bytes  # CUDA IPC: cudaIpcMemHandle_t bytes
    device_index: int  # CUDA device; -1 on CPU
    total_bytes: int
    owner_instance_id: str
    tensors: tuple[TensorDescriptor, ...]
    # the layout of every matrix among the tensors, as the owner decided it; empty from an owner that
    # predates the records (its layouts are then read from the tensor names)
    matrices: tuple[MatrixLayout, ...] = ()


def _layout(weights: Mapping[str, torch.Tensor]) -> tuple[list[TensorDescriptor], int]:
    descriptors, offset = [], 0
    for name, t in weights.items():
        num_bytes = t.numel() * t.element_size()
        descriptors.append(TensorDescriptor(name, DTYPE_NAMES[t.dtype], tuple(t.shape), offset, num_bytes))
        offset += math.ceil(num_bytes / ALIGNMENT) * ALIGNMENT
    return descriptors, max(offset, ALIGNMENT)


def _mapped_storage(path: Path, nbytes: int) -> torch.UntypedStorage:
    """The file mapped shared (MAP_SHARED) as untyped storage. torch's stubs type from_file as its
    base class's, which set_ does not take; at run time it is an UntypedStorage."""
    return cast(torch.UntypedStorage, torch.UntypedStorage.from_file(str(path), shared=True, nbytes=nbytes))


def _views(base: torch.Tensor, descriptors: tuple[TensorDescriptor, ...]) -> dict[str, torch.Tensor]:
    # base: [total_bytes] uint8; each view aliases it (no copy).
    return {d.name: base[d.offset : d.offset + d.num_bytes].view(DTYPES[d.dtype]).view(d.shape) for d in descriptors}


class SharedWeights:
    """The owner's side: a segment holding every weight, and views into it."""

    def __init__(self, manifest: WeightManifest, base: torch.Tensor, keepalive: object = None) -> None:
        self.manifest, self._base, self._keepalive = manifest, base, keepalive
        self.tensors = _views(base, manifest.tensors)

    @classmethod
    def create(
        cls,
        weights: Mapping[str, torch.Tensor],
        device: torch.device | str = "cpu",
        instance_id: str | None = None,
        matrices: Iterable[MatrixLayout] = (),
    ) -> "SharedWeights":
        """Copy `weights` into a new segment; `matrices` (their layouts) travel in the manifest."""
        device = torch.device(device)
        layouts = tuple(matrices)
        instance_id = instance_id or uuid.uuid4().hex[:12]
        descriptors, total = _layout(weights)
        if device.type == "cuda":
            base, handle, keepalive = _cuda_alloc_exported(total, device)
            manifest = WeightManifest(
                KIND_CUDA_IPC, "", handle, device.index or 0, total, instance_id, tuple(descriptors), layouts
            )
        else:
            cleanup_stale_segments()
            name = f"{SEGMENT_PREFIX}-{os.getpid()}-{secrets.token_hex(SEGMENT_NAME_RANDOM_BYTES)}"
            path = SHM_DIR / name
            # O_EXCL: a file someone placed at the name beforehand is never taken over; the mode is
            # set at creation (a umask can only narrow it), so the segment is never readable by others.
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, SEGMENT_MODE)
            with os.fdopen(fd, "wb") as f:
                _reserve(f.fileno(), path, total)
            storage = _mapped_storage(path, total)
            base = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (total,), (1,))
            keepalive = None
            manifest = WeightManifest(
                KIND_SHARED_MEMORY, name, b"", -1, total, instance_id, tuple(descriptors), layouts
            )
        shared = cls(manifest, base, keepalive)
        for name, t in weights.items():
            shared.tensors[name].copy_(t)
        return shared

    @property
    def num_bytes(self) -> int:
        return self.manifest.total_bytes

    def model_weights(self) -> ModelWeights:
        """The views with their matrices' layouts, what `Transformer` runs on."""
        return _model_weights(self.tensors, self.manifest.matrices)

    def unlink(self) -> None:
        """Remove the segment's name; mappings (ours and peers') stay valid until unmapped."""
        if self.manifest.kind == KIND_SHARED_MEMORY:
            (SHM_DIR / self.manifest.segment_name).unlink(missing_ok=True)


def _reserve(fd: int, path: Path, total: int) -> None:
    """Give the segment its `total` bytes of memory now. A sparse file (truncate) left a /dev/shm
    smaller than the weights (a container's 64 MB default) to fail on the copy that follows, as a
    SIGBUS that killed the process without a word; here it is an OSError saying what to raise."""
    try:
        os.posix_fallocate(fd, 0, total)
    except OSError as e:
        path.unlink(missing_ok=True)
        free = os.statvfs(SHM_DIR)
        raise OSError(
            e.errno,
            f"{SHM_DIR} has no room for the {total}-byte weight segment ({free.f_bavail * free.f_frsize} bytes "
            f"free): {e.strerror}; give it more (a container's shm_size)",
        ) from None


def attach(manifest: WeightManifest, announced: WeightManifest | None = None) -> ModelWeights:
    """Map a peer's segment and return views of every tensor in it, without copying, with the
    layouts of its matrices as the manifest carries them.

    announced: the manifest the owner itself exports; when given, `manifest` must name the same
    memory (a caller cannot make this process map some other segment or IPC handle), on the same
    device and of the same size: a CUDA IPC mapping extends as far as the manifest's total_bytes
    says (unlike a file, an opened handle has no size to check), so the owner's real handle with a
    larger total_bytes would map, and the smoke forward read, device memory past its allocation."""
    _check_manifest(manifest)
    if announced is not None:
        if (manifest.kind, manifest.segment_name, manifest.cuda_ipc_handle) != (
            announced.kind,
            announced.segment_name,
            announced.cuda_ipc_handle,
        ):
            raise HandleError("segment_name", "not the memory the primary exports (ExportWeights)")
        if manifest.device_index != announced.device_index:
            raise HandleError(
                "device_index",
                f"the primary exports memory of device {announced.device_index}, not {manifest.device_index}",
            )
        if manifest.total_bytes != announced.total_bytes:
            raise HandleError(
                "total_bytes",
                f"the primary exports {announced.total_bytes} bytes, manifest says {manifest.total_bytes}",
            )
    if manifest.kind == KIND_CUDA_IPC:
        base = _cuda_open_exported(manifest)
    else:
        path = SHM_DIR / manifest.segment_name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise HandleError("segment_name", f"no shared-memory segment {manifest.segment_name!r}") from None
        if size != manifest.total_bytes:
            raise HandleError("total_bytes", f"segment holds {size} bytes, manifest says {manifest.total_bytes}")
        storage = _mapped_storage(path, size)
        base = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (size,), (1,))
    return _model_weights(_views(base, manifest.tensors), manifest.matrices)


def _model_weights(tensors: Mapping[str, torch.Tensor], matrices: tuple[MatrixLayout, ...]) -> ModelWeights:
    # an owner that predates the records: its tensor names still say the layouts
    return ModelWeights(tensors, matrices) if matrices else ModelWeights.from_names(tensors)


def _check_manifest(m: WeightManifest) -> None:
    if m.kind == KIND_SHARED_MEMORY:
        if not _SEGMENT_NAME.match(m.segment_name) or not m.segment_name.startswith(SEGMENT_PREFIX):
            raise HandleError("segment_name", f"not a weight segment name: {m.segment_name!r}")
    elif m.kind == KIND_CUDA_IPC:
        if len(m.cuda_ipc_handle) != CUDA_IPC_HANDLE_BYTES:
            raise HandleError("cuda_ipc_handle", f"must be {CUDA_IPC_HANDLE_BYTES} bytes, got {len(m.cuda_ipc_handle)}")
        if not torch.cuda.is_available() or m.device_index >= torch.cuda.device_count():
            raise HandleError("device_index", f"CUDA device {m.device_index} is not visible to this process")
    else:
        raise HandleError("kind", f"unknown handle kind {m.kind!r}")
    if m.total_bytes <= 0:
        raise HandleError("total_bytes", "must be positive")
    if not m.tensors:
        raise HandleError("tensors", "the manifest lists no tensor")
    for d in m.tensors:
        if d.dtype not in DTYPES:
            raise HandleError("tensors.dtype", f"{d.name}: unknown dtype {d.dtype!r}")
        itemsize = DTYPES[d.dtype].itemsize
        if any(s < 0 for s in d.shape) or math.prod(d.shape) * itemsize != d.num_bytes:
            raise HandleError("tensors.shape", f"{d.name}: shape {d.shape} does not hold {d.num_bytes} bytes")
        if d.offset % ALIGNMENT or d.offset < 0 or d.offset + d.num_bytes > m.total_bytes:
            raise HandleError(
                "tensors.offset",
                f"{d.name}: [{d.offset}, +{d.num_bytes}) is outside the {m.total_bytes}-byte segment or misaligned",
            )
    _check_matrices(m.matrices, {d.name for d in m.tensors})


def _check_matrices(matrices: tuple[MatrixLayout, ...], names: set[str]) -> None:
    """Every matrix record names as many listed tensors as its layout holds, and a 2-D shape."""
    for matrix in matrices:
        if not isinstance(matrix.layout, WeightLayout):
            raise HandleError("matrices.layout", f"{matrix.module}: unknown layout {matrix.layout!r}")
        expected = len(SUFFIXES[matrix.layout])
        if len(matrix.tensors) != expected or not set(matrix.tensors) <= names:
            raise HandleError(
                "matrices.tensors",
                f"{matrix.module}: a {matrix.layout.value} matrix is {expected} of the listed tensors, "
                f"got {list(matrix.tensors)}",
            )
        if len(matrix.shape) != 2 or min(matrix.shape) <= 0:
            raise HandleError("matrices.shape", f"{matrix.module}: must be [out_features, in_features] > 0")


def cleanup_stale_segments() -> list[str]:
    """Unlink weight segments left by owners that died without cleaning up (pid in the name): their
    pid gone, or taken by a process that started after the segment was written. In a container the
    restarted primary gets its predecessor's pid (often 1), so "the pid is alive" kept every segment
    a killed primary left, a whole model's memory in /dev/shm per restart."""
    removed = []
    for path in SHM_DIR.glob(f"{SEGMENT_PREFIX}-*"):
        parts = path.name.split("-")
        pid = int(parts[2]) if len(parts) > 3 and parts[2].isdigit() else None
        if pid is None:
            continue
        try:
            written = path.stat().st_mtime
        except FileNotFoundError:
            continue
        if not Path(f"/proc/{pid}").exists() or _started_after(pid, written + PID_REUSE_MARGIN_S):
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed


# An owner writes its segment after it starts; the margin covers /proc's whole-second boot time and a
# wall clock stepped since (a segment it misses is cleaned by a later start)
PID_REUSE_MARGIN_S = 60.0


def _started_after(pid: int, when: float) -> bool:
    """Whether process `pid` started after `when` (seconds since the epoch); False when unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        boot = next(
            int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime")
        )
        start_ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, starttime: after the name, fields 3..
    except (OSError, StopIteration, ValueError, IndexError):
        return False
    return boot + start_ticks / os.sysconf("SC_CLK_TCK") > when


# --- CUDA IPC (GPU nodes only; CuPy provides the runtime calls) ---------------------------


def _cuda_alloc_exported(total: int, device: torch.device):
    import cupy

    with cupy.cuda.Device(device.index or 0):
        ptr = cupy.cuda.runtime.malloc(total)  # the allocation base: exportable as is
        handle = bytes(cupy.cuda.runtime.ipcGetMemHandle(ptr))
        mem = cupy.cuda.UnownedMemory(ptr, total, owner=None, device_id=device.index or 0)
        arr = cupy.ndarray((total,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
    base = torch.from_dlpack(arr)
    keepalive = _CudaFree(ptr, device.index or 0)
    return base, handle, keepalive


def _cuda_open_exported(m: WeightManifest) -> torch.Tensor:
    import cupy

    try:
        with cupy.cuda.Device(m.device_index):
            ptr = cupy.cuda.runtime.ipcOpenMemHandle(
                m.cuda_ipc_handle, cupy.cuda.runtime.cudaIpcMemLazyEnablePeerAccess
            )
            # the mapping is closed when the last view of it is freed (the memory, via the DLPack
            # export, holds its owner); open without close kept every attachment mapped for good
            mem = cupy.cuda.UnownedMemory(
                ptr, m.total_bytes, owner=_CudaIpcMapping(ptr, m.device_index), device_id=m.device_index
            )
            arr = cupy.ndarray((m.total_bytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
    except cupy.cuda.runtime.CUDARuntimeError as e:
        raise HandleError("cuda_ipc_handle", f"cannot open the IPC handle: {e}") from None
    return torch.from_dlpack(arr)


class _CudaIpcMapping:
    """An opened IPC handle, closed with its last user. The driver counts the opens of a handle in a
    process and unmaps at the last close (cudaIpcOpenMemHandle: memory it returns must be freed with
    cudaIpcCloseMemHandle): without the close, every attachment a draft pool gave up (a restarted
    primary's predecessor, an Attach refused after mapping) stayed mapped until the pool exited."""

    def __init__(self, ptr: int, device_index: int) -> None:
        import cupy

        self._cupy, self.ptr, self.device_index = cupy, ptr, device_index

    def __del__(self) -> None:
        with self._cupy.cuda.Device(self.device_index):
            self._cupy.cuda.runtime.ipcCloseMemHandle(self.ptr)


class _CudaFree:
    def __init__(self, ptr: int, device_index: int) -> None:
        import cupy

        # the module is held, not imported in __del__: at interpreter exit imports no longer work
        self._cupy, self.ptr, self.device_index = cupy, ptr, device_index

    def __del__(self) -> None:
        with self._cupy.cuda.Device(self.device_index):
            self._cupy.cuda.runtime.free(self.ptr)


def manifest_to_dict(m: WeightManifest) -> dict:
    """Plain data (JSON-safe; the IPC handle as hex, layouts by value) for logs, tests and config files."""
    d = dataclasses.asdict(m)
    d["cuda_ipc_handle"] = m.cuda_ipc_handle.hex()
    d["matrices"] = [dict(dataclasses.asdict(x), layout=x.layout.value) for x in m.matrices]
    return d


def manifest_from_dict(d: dict) -> WeightManifest:
    tensors = tuple(
        TensorDescriptor(t["name"], t["dtype"], tuple(t["shape"]), t["offset"], t["num_bytes"]) for t in d["tensors"]
    )
    matrices = tuple(
        MatrixLayout(x["module"], WeightLayout(x["layout"]), tuple(x["shape"]), tuple(x["tensors"]))
        for x in d.get("matrices", ())
    )
    return WeightManifest(
        d["kind"],
        d["segment_name"],
        bytes.fromhex(d["cuda_ipc_handle"]),
        d["device_index"],
        d["total_bytes"],
        d["owner_instance_id"],
        tensors,
        matrices,
    )
