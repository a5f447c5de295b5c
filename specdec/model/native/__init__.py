"""Native 4-bit/8-bit kernels (`csrc/`): the quantized matmuls and each layer's dense parts in C.

Why: on a 2-core AVX2 CPU an int4 step through torch's packed kernels cost ~30 ms, of which ~10 ms
were the matmuls and the rest ~500 small tensor ops and their dispatch. The library multiplies the
GGUF's own Q4_1 values (and per-channel int8 rows), stored interleaved by 16 output columns
(`pack_q4_1`, `pack_int8`), against activations quantized per block of 32 as llama.cpp does, and
runs everything of a layer except attention in two calls:

    pre:   RMSNorm -> q/k/v products -> RoPE                    (one call)
    attn:  KV-cache write + SDPA over the span(s)               (torch, as for every precision)
    post:  o product + residual -> RMSNorm -> gate/up -> SiLU*up -> down + residual   (one call)

Every output is computed row by row in a fixed order, so a row's result does not depend on how many
rows share the step: the engine's k-row verify equals 1-row decoding bit for bit.

The C sources are laid out by concern, as llama.cpp's ggml-cpu: `qgemm.h` declares every exported
function and struct; `impl.h` is internal (ISA detection, constants, fp16 helpers); `quants.c`
quantizes activations; `gemm.c` runs the products' parallel loop and picks one product path
(`gemm_avx512.c`, `gemm_avx2.c`, or the portable `gemm_generic.c`; each compiles to nothing when
its instruction set is off, and `gemm.h` says how to add one); `ops.c` holds the fused layer parts,
`forward.c` a whole forward's layers in one parallel region (`NativeStack`), `scratch.c` each
thread's scratch, `attention.c` the attention, `logits.c` the logits helpers, `profile.c` the
forward's timer, `abi.c` the structs' layout.

The library is compiled on first use for the machine at hand (`cc -O3 -march=native -fopenmp`,
every `csrc/*.c` in one invocation, a few seconds) into `~/.cache/specdec/native/`, keyed by every
source and header, the compiler and the CPU's flags, and loaded with ctypes (no Python objects cross
the boundary, only tensor data pointers; ctypes releases the GIL during the call). At load the
ctypes mirrors of the structs (`QWeight`, `QLayer`, `QSpan`) are checked field by field against the
layout the C compiler chose (`qgemm_abi`); a mismatch refuses the library, naming the field. Its
OpenMP calls share torch's runtime: torch loads its libgomp first and the library's dependency
resolves to it by soname. Without a C compiler, or with SPECDEC_NATIVE_KERNELS=0, `library()` is
None and int4/int8 run on torch's packed kernels.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator

import torch

log = logging.getLogger(__name__)

Tensor = torch.Tensor

SOURCE_DIR = Path(__file__).with_name("csrc")  # every .c here is compiled into the one library
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
ENV_SWITCH = "SPECDEC_NATIVE_KERNELS"  # "0": never build or use the native kernels
AMX_SWITCH = "SPECDEC_NATIVE_AMX"  # "0": never use the AMX tiles, even where the CPU has them
# "1": time every forward's products, attention and the rest (csrc/profile.c; `forward_profile`)
PROFILE_SWITCH = "SPECDEC_NATIVE_PROFILE"
# 4-bit products of at least this many rows run on AMX tiles where the library has the path
# (csrc/gemm_amx.c); fewer rows stay on AVX-512: inside the whole forward the tiles' per-call
# unpacking and per-block rescale cost more than they save below ~32 rows (measured: docs/benchmarks.md,
# "The 4-bit AMX crossover"). Either path gives the same bits, so this moves only time.
AMX_MIN_ROWS = 32
ATT_LANES_SWITCH = "SPECDEC_NATIVE_ATT_LANES"  # "0": never keys in lanes; N: from chunks of N queries
# Attention chunks of at least this many queries may take their scores with keys in lanes (the AVX-512
# build's csrc/attention.c); whether they do is measured once per build and machine (choose_att_lanes):
# on the 2-vCPU Zen 4 EPYC the lanes ran 5-13 % slower than the 4 x 4 tiles for 5 to 16 rows of a
# 9-head model, where the Xeon had adopted them (docs/benchmarks.md, "EPYC-512: attention paths,
# measured per machine"). Same bits.
ATT_LANES_MIN_QUERIES = 6
QK = 32  # weights per block
COLUMNS = 16  # output columns interleaved per group in the packed layouts (csrc/gemm.h)
KIND_Q4, KIND_Q8, KIND_Q8T = 4, 8, 9  # csrc/qgemm.h: QW_Q4, QW_Q8, QW_Q8T (QW_Q8's weights, activations per token)
# What the native attention reads from the KV cache. fp16 (rounded to nearest even on write, as
# torch's .half()) halves the bytes a step's attention streams, which bound it on the CPU: models
# whose attention runs natively keep their cache in fp16 (`Transformer.kv_dtype`).
KV_DTYPES = (torch.float32, torch.float16)

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_status: str | None = None  # why `library()` is None, once tried
_disabled = False  # see `disabled()`
_amx_status = ""  # why the AMX tiles are off, once the library is loaded ("" while on or not built)
_att_lanes_status = ""  # choose_att_lanes's words, once the library is loaded ("" without the lanes)


class AbiMismatch(RuntimeError):
    """The library's structs are not laid out as their ctypes mirrors say (`abi_mismatch`)."""


_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float


def _c_fields(*declarations: tuple[type, str]) -> list[tuple[str, type]]:
    """A struct's `_fields_` written as C declares it, a type then its names: (_I64, "n k") is
    `int64_t n, k;`. Every pointer is `_P` except typed ones the Python side follows."""
    return [(name, ctype) for ctype, names in declarations for name in names.split()]


class QWeight(ctypes.Structure):
    """The C struct `qweight` (csrc/qgemm.h): one quantized matrix by pointer, valid while its tensors live."""

    _fields_ = _c_fields((_I32, "kind pad"), (_P, "w scale bias"), (_I64, "n k"), (_P, "d m"))


class QLayer(ctypes.Structure):
    """The C struct `qlayer`: one decoder layer's norms and seven products."""

    _fields_ = _c_fields((_P, "norm1 norm2"), (_F32, "eps1 eps2"), (ctypes.POINTER(QWeight), "q k v o gate up down"))


class QSpan(ctypes.Structure):
    """The C struct `qspan`: one sequence's rows of the batch and its KV cache."""

    _fields_ = _c_fields(
        (_I64, "start n num_cached"),
        (_P, "k_cache v_cache"),
        (_I64, "layer_stride capacity"),
        (_P, "mask"),
        (_I64, "half"),
    )


_W, _LAYERS, _SPANS = ctypes.POINTER(QWeight), ctypes.POINTER(QLayer), ctypes.POINTER(QSpan)

# Every function of csrc/qgemm.h, in its order: name -> (result type, argument types). Pointers to
# tensor data are _P (a tensor's data_ptr()); `tests/specdec/model/test_native_abi.py` checks the
# table against the header's prototypes.
FUNCTIONS: dict[str, tuple[type | None, list[type]]] = {
    "qgemm_abi_names": (ctypes.c_char_p, []),
    "qgemm_abi": (_I64, [ctypes.POINTER(_I64), _I64]),
    "qgemm_quantize_rows": (None, [_P, _I64, _I64, _P, _P, _P]),
    "qgemm_isa": (ctypes.c_char_p, []),
    "qgemm_amx_built": (_I32, []),
    "qgemm_set_amx": (_I64, [_I64]),
    "qgemm_amx_min_rows": (_I64, []),
    "qgemm_amx_token_min_rows": (_I64, []),
    "qgemm_linear": (_I32, [_P, _I64, _W, _P, _I32]),
    "qgemm_rmsnorm": (None, [_P, _I64, _I64, _P, _F32, _P]),
    "qgemm_layer_pre": (_I32, [_P, _I64, _I64, _P, _F32, _W, _W, _W, _I64, _I64, _I64, _P, _P, _P, _P, _P, _P, _I32]),
    "qgemm_layer_post": (_I32, [_P, _P, _I64, _I64, _W, _P, _F32, _W, _W, _W, _P, _I32]),
    "qgemm_forward": (_I32, [_P, _I64, _I64, _LAYERS, _I64, _I64, _I64, _I64, _P, _P, _P, _SPANS, _I64, _I32]),
    "qgemm_set_att_lanes": (_I32, [_I32]),
    "qgemm_att_lanes": (_I32, []),
    "qgemm_attention": (_I32, [_P, _I64, _I64, _I64, _I64, _P, _P, _I32, _I64, _I64, _P, _P, _I32]),
    "qgemm_argmax_rows": (None, [_P, _I64, _I64, _P]),
    "qgemm_argmax_rows_masked": (None, [_P, _I64, _I64, _P, _I64, _P]),
    "qgemm_encode_e4m3": (_I32, [_P, _I64, _I64, _F32, _P, _P]),
    "qgemm_byte_histograms": (None, [_P, _I64, _I64, _P]),
    "qgemm_byte_histograms_masked": (None, [_P, _I64, _I64, _P, _I64, _P]),
    "qgemm_set_profile": (None, [_I32]),
    "qgemm_profile": (_I64, [_P]),
    "qgemm_profile_reset": (None, []),
}


def cache_dir() -> Path:
    return Path.home() / ".cache" / "specdec" / "native"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")


def sources() -> list[Path]:
    """The library's C sources and headers, in a fixed order."""
    return sorted(p for p in SOURCE_DIR.iterdir() if p.suffix in (".c", ".h"))


def _source_hash() -> str:
    """Every source and header, by name and content: any change rebuilds."""
    h = hashlib.sha256()
    for p in sources():
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def _build(cc: str, extra_flags: tuple[str, ...] = ()) -> Path:
    flags = CFLAGS + extra_flags
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256(
        "\0".join((_source_hash(), cc, version, " ".join(flags), _cpu_flags(), platform.machine())).encode()
    ).hexdigest()[:16]
    target = cache_dir() / f"qgemm-{key}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        result = subprocess.run(
            [cc, *flags, "-o", tmp, *(str(p) for p in sources() if p.suffix == ".c"), "-lm"],
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(f"{cc} failed: {result.stderr.strip()[-2000:]}")
        os.replace(tmp, target)  # atomic: processes building at once all see a whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("native kernels built: %s", target)
    return target


def _declare(lib: ctypes.CDLL) -> None:
    for name, (restype, argtypes) in FUNCTIONS.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, restype


def abi_mismatch(lib: ctypes.CDLL) -> str | None:
    """Where the ctypes mirrors (`QWeight`, `QLayer`, `QSpan`) differ from the structs as the C
    compiler laid them out (`qgemm_abi`: each struct's size, each field's offset and size, by name),
    naming the struct or field; None where they agree."""
    names = lib.qgemm_abi_names().decode().split()
    count = lib.qgemm_abi(None, 0)
    values = (ctypes.c_int64 * count)()
    lib.qgemm_abi(values, count)
    assert count == 2 * len(names), (count, names)
    in_c = {name: (values[2 * i], values[2 * i + 1]) for i, name in enumerate(names)}
    for c_name, mirror in (("qweight", QWeight), ("qlayer", QLayer), ("qspan", QSpan)):
        mine = {c_name: (0, ctypes.sizeof(mirror))}
        for field in mirror._fields_:
            desc = getattr(mirror, field[0])
            mine[f"{c_name}.{field[0]}"] = (desc.offset, desc.size)
        theirs = {n: v for n, v in in_c.items() if n == c_name or n.startswith(c_name + ".")}
        for name in [*mine, *(n for n in theirs if n not in mine)]:
            if name not in theirs:
                return f"{name} is in {mirror.__name__}, not in C"
            if name not in mine:
                return f"{name} is in C, not in {mirror.__name__}"
            if mine[name] != theirs[name]:
                (c_offset, c_size), (offset, size) = theirs[name], mine[name]
                if name == c_name:
                    return f"sizeof({c_name}) is {c_size} in C, {size} in {mirror.__name__}"
                return (
                    f"{name} is at offset {c_offset} size {c_size} in C, "
                    f"offset {offset} size {size} in {mirror.__name__}"
                )
    return None


def _load(cc: str, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """Build (or find) and load the library, declare its functions and check the struct mirrors."""
    lib = ctypes.CDLL(str(_build(cc, extra_flags)))
    _declare(lib)
    mismatch = abi_mismatch(lib)
    if mismatch is not None:
        raise AbiMismatch(f"ctypes mirror differs from csrc/qgemm.h: {mismatch}")
    return lib


def variant(extra_flags: tuple[str, ...]) -> ctypes.CDLL:
    """The kernels built with `extra_flags` after the usual ones (say `-mno-avx512f` for the AVX2
    path on an AVX-512 machine), loaded beside `library()`: for comparing instruction paths."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
    return _load(cc, extra_flags)


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Within: `library()` is None, so models loaded here run on torch's kernels (benchmarks compare both)."""
    global _disabled
    _disabled, before = True, _disabled
    try:
        yield
    finally:
        _disabled = before


def library() -> ctypes.CDLL | None:
    """The compiled kernels, building them on first call; None (and `status()` says why) if unavailable."""
    global _library, _status, _amx_status, _att_lanes_status
    if _disabled:
        return None
    with _lock:
        if _library is not None or _status is not None:
            return _library
        if os.environ.get(ENV_SWITCH, "1") == "0":
            _status = f"disabled by {ENV_SWITCH}=0"
            return None
        cc = _compiler()
        if cc is None:
            _status = "no C compiler (cc, gcc or clang) on PATH"
            log.warning("native kernels unavailable: %s; int4/int8 use torch's packed kernels", _status)
            return None
        try:
            lib = _load(cc)
        except AbiMismatch as e:
            _status = str(e)
            log.error("native kernels refused: %s; int4/int8 use torch's packed kernels", _status)
            return None
        except (OSError, RuntimeError) as e:
            _status = f"build or load failed: {e}"
            log.warning("native kernels unavailable: %s; int4/int8 use torch's packed kernels", _status)
            return None
        # Published only once set up: a refused SPECDEC_NATIVE_ATT_LANES fails every call alike, rather
        # than the first while later ones get a library on the default path.
        _amx_status = enable_amx(lib)
        _att_lanes_status = choose_att_lanes(lib)
        _library = lib
        lib.qgemm_set_profile(os.environ.get(PROFILE_SWITCH, "0") == "1")
        log.info("native kernels loaded (%s)", path(lib))
        return lib


# x86-64 Linux: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) asks the kernel for the AMX tile
# data state (8 KB a thread, saved on context switches); without it the first tile instruction is SIGILL.
_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1023, 18


def request_tile_data() -> str | None:
    """Ask the OS for the AMX tile data state for this process; None when granted, else why not."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return (
            f"tile data is requested through Linux x86-64's arch_prctl, not on {platform.system()} {platform.machine()}"
        )
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) != 0:
        return f"the kernel refused the tile data state (arch_prctl: {os.strerror(ctypes.get_errno())})"
    return None


def enable_amx(lib: ctypes.CDLL, min_rows: int = AMX_MIN_ROWS) -> str:
    """Turn the AMX products on for calls of at least `min_rows` rows where the library has them and the
    OS grants the tiles; returns why they stay off ("" when on, or when this build has no AMX path)."""
    if not lib.qgemm_amx_built():
        lib.qgemm_set_amx(0)
        return ""
    if os.environ.get(AMX_SWITCH, "1") == "0":
        lib.qgemm_set_amx(0)
        return f"AMX off by {AMX_SWITCH}=0"
    refused = request_tile_data()
    if refused is not None:
        lib.qgemm_set_amx(0)
        log.warning(
            "native kernels: AMX tiles unavailable (%s); the products stay on %s", refused, lib.qgemm_isa().decode()
        )
        return f"AMX unavailable: {refused}"
    if lib.qgemm_set_amx(min_rows) != min_rows:  # the library checks the grant itself
        return "AMX unavailable: the tile data state was not granted"
    return ""


def _time_att_paths(lib: ctypes.CDLL, rounds: int = 5, calls: int = 4) -> tuple[float, float]:
    """The fastest of rounds x calls attention calls with keys in lanes and without, alternated round by
    round, in seconds: 8 tree rows of a model with 12 heads of 64 over 4 KV heads after 1,024 tokens of
    fp16 cache (chunks of 12 queries on 2 threads: the lanes' side of the threshold)."""
    gen = torch.Generator().manual_seed(0)
    n, heads, kv_heads, dim, context = 8, 12, 4, 64, 1024
    q = torch.randn(n, heads, dim, generator=gen)
    k = torch.randn(kv_heads, context + n, dim, generator=gen).half()
    v = torch.randn(kv_heads, context + n, dim, generator=gen).half()
    mask = torch.ones(n, context + n, dtype=torch.bool)
    mask[:, context:] = torch.tril(torch.ones(n, n, dtype=torch.bool))
    best = {ATT_LANES_MIN_QUERIES: float("inf"), 0: float("inf")}
    try:
        for _ in range(rounds):
            for min_queries in best:
                lib.qgemm_set_att_lanes(min_queries)
                for _ in range(calls):
                    start = time.perf_counter()
                    attend(lib, q, k, v, context + n, mask)
                    best[min_queries] = min(best[min_queries], time.perf_counter() - start)
    finally:
        lib.qgemm_set_att_lanes(0)
    return best[ATT_LANES_MIN_QUERIES], best[0]


def choose_att_lanes(lib: ctypes.CDLL) -> str:
    """Set from how many queries a chunk's attention scores run with keys in lanes, and return it in
    words: ATT_LANES_SWITCH's count where set; else the choice measured for this build on this machine
    (cached beside the library; measured in ~10 ms when not): ATT_LANES_MIN_QUERIES where the lanes were
    at least 3 % faster, else never. Builds without AVX-512 have no lanes: "". The bits are the same
    either way, so the choice moves only time."""
    before = lib.qgemm_att_lanes()
    has_lanes = lib.qgemm_set_att_lanes(ATT_LANES_MIN_QUERIES) > 0  # 0 where the build has no lanes
    lib.qgemm_set_att_lanes(before)
    if not has_lanes:
        return ""
    forced = os.environ.get(ATT_LANES_SWITCH)
    if forced is not None:
        try:
            min_queries = int(forced)
        except ValueError:
            raise ValueError(f"{ATT_LANES_SWITCH} must be an integer (0: never), got {forced!r}") from None
        lib.qgemm_set_att_lanes(min_queries)
        return f"attention keys in lanes {_lanes_words(min_queries)} by {ATT_LANES_SWITCH}"
    cached = Path(lib._name).with_suffix(".att-lanes")
    try:
        min_queries = int(cached.read_text())
        how = "measured before"
    except (OSError, ValueError):
        lanes_s, tiles_s = _time_att_paths(lib)
        min_queries = ATT_LANES_MIN_QUERIES if lanes_s < 0.97 * tiles_s else 0
        how = f"measured {lanes_s * 1e6:.0f} against {tiles_s * 1e6:.0f} us"
        try:  # atomic, as the library's own file: processes loading at once read a whole one
            fd, tmp = tempfile.mkstemp(dir=cached.parent)
            with os.fdopen(fd, "w") as f:
                f.write(str(min_queries))
            os.replace(tmp, cached)
        except OSError as e:  # a read-only cache: measured again by the next process
            log.warning("native kernels: the attention path's choice not cached (%s)", e)
    lib.qgemm_set_att_lanes(min_queries)
    return f"attention keys in lanes {_lanes_words(min_queries)} ({how})"


def _lanes_words(min_queries: int) -> str:
    return f"from {min_queries} queries" if min_queries > 0 else "never"


def path(lib: ctypes.CDLL) -> str:
    """The products' instruction path(s), for logs and benchmark headers: 'AVX512+VNNI', or
    'AMX-INT8 from 32 rows, else AVX512+VNNI', with why AMX is off where the CPU has it, and where
    attention takes keys in lanes (choose_att_lanes)."""
    isa = lib.qgemm_isa().decode()
    rows = lib.qgemm_amx_min_rows()
    if rows:
        token_rows = lib.qgemm_amx_token_min_rows()
        isa = f"{isa}, AMX-INT8 tiles for 4-bit products of {rows}+ rows and per-token 8-bit ones of {token_rows}+"
    elif _amx_status and lib is _library:
        isa = f"{isa}; {_amx_status}"
    return f"{isa}; {_att_lanes_status}" if _att_lanes_status and lib is _library else isa


def status() -> str:
    """'available (PATH)', `path`'s words, or why not."""
    lib = library()
    if lib is None:
        return f"unavailable: {'disabled here' if _disabled else _status}"
    return f"available ({path(lib)})"


def identity() -> str:
    """What a measurement of the int4/int8 step depends on here: the kernels' sources and whether they run."""
    return _source_hash()[:16] + " " + status()


@dataclasses.dataclass(frozen=True)
class ForwardProfile:
    """Where the native forwards' time went (csrc/profile.c), summed since the last reset: the
    products, attention, and the rest of `qgemm_forward` (norms, quantization, RoPE, the KV write,
    SiLU, residuals, and each phase's wait for its slowest thread)."""

    num_forwards: int
    products_s: float
    attention_s: float
    rest_s: float

    @property
    def total_s(self) -> float:
        return self.products_s + self.attention_s + self.rest_s


def set_profile(lib: ctypes.CDLL, is_on: bool) -> None:
    """Turn the forward's timer on or off (at load: on under SPECDEC_NATIVE_PROFILE=1), and reset it."""
    lib.qgemm_set_profile(int(is_on))
    lib.qgemm_profile_reset()


def forward_profile(lib: ctypes.CDLL, reset: bool = False) -> ForwardProfile:
    """The timer's sums since the last reset (all zero while it is off); `reset` starts new ones."""
    seconds = (ctypes.c_double * 3)()
    num_forwards = lib.qgemm_profile(seconds)
    if reset:
        lib.qgemm_profile_reset()
    return ForwardProfile(num_forwards, seconds[0], seconds[1], seconds[2])


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _ok(status: int) -> None:
    """A kernel's returned status: nonzero where it could not allocate its scratch memory."""
    if status:
        raise MemoryError("native kernel: out of memory")


def _rope_pointers(rope, positions: Tensor) -> tuple[int, int, int]:
    """The cos_t, sin_t and positions arguments of qgemm_layer_pre and qgemm_forward."""
    return rope.cos.data_ptr(), rope.sin.data_ptr(), positions.data_ptr()


# --- layers ------------------------------------------------------------------------------------


def fits(n: int, k: int) -> bool:
    """Whether an [n, k] matrix has the packed layouts' shape: whole groups of columns and blocks."""
    return n % COLUMNS == 0 and k % QK == 0


def pack_q4_1(q: Tensor, d: Tensor, m: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Q4_1 values (q uint8 [N, K] in 0..15, d/m fp16 [N, K/32]) -> the kernels' layout (csrc/gemm.h):
    nibbles uint8 [N/16, G, 256] and d, m fp16 [N/16, G, 16]: the same values, columns interleaved."""
    n, k = q.shape
    g = k // QK
    v = q.reshape(n // COLUMNS, COLUMNS, g, 8, 4)  # [group, column, block, 4-weight step, byte]
    nibbles = v[:, :, :, :4] | (v[:, :, :, 4:] << 4)  # step j low, step j + 4 high
    nibbles = nibbles.permute(0, 2, 3, 1, 4).reshape(n // COLUMNS, g, 4 * COLUMNS * 4).contiguous()

    def per_group(t: Tensor) -> Tensor:
        return t.to(torch.float16).reshape(n // COLUMNS, COLUMNS, g).transpose(1, 2).contiguous()

    return nibbles, per_group(d), per_group(m)


def unpack_q4_1(nibbles: Tensor, d: Tensor, m: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The inverse of `pack_q4_1`: (q [N, K], d [N, K/32], m [N, K/32])."""
    nv, g, _ = nibbles.shape
    b = nibbles.view(nv, g, 4, COLUMNS, 4).permute(0, 3, 1, 2, 4)  # [group, column, block, step, byte]
    q = torch.cat((b & 0x0F, b >> 4), dim=3).reshape(nv * COLUMNS, g * QK)
    return q, d.transpose(1, 2).reshape(nv * COLUMNS, g), m.transpose(1, 2).reshape(nv * COLUMNS, g)


def pack_int8(w: Tensor) -> Tensor:
    """int8 rows [N, K] -> the kernels' layout: uint8 [N/16, K/4, 16, 4] holding w + 128 (see csrc/gemm.h)."""
    n, k = w.shape
    biased = (w.view(torch.uint8) ^ 0x80).reshape(n // COLUMNS, COLUMNS, k // 4, 4)
    return biased.transpose(1, 2).contiguous()


def int8_rows(cols: Tensor, rows: Tensor) -> Tensor:
    """Rows `rows` [T] of a matrix in `pack_int8`'s layout, as int8 [T, K] (a gather, no full copy)."""
    nv, k4, _, _ = cols.shape
    return (cols[rows // COLUMNS, :, rows % COLUMNS, :].reshape(rows.shape[0], k4 * 4) ^ 0x80).view(torch.int8)


class QuantLinear:
    """A 4-bit (GGUF Q4_1 values) or 8-bit (int8 rows, fp32 scale) matrix run by the native kernels,
    over tensors in the kernels' layout (`pack_q4_1`, `pack_int8`), which the model's weights hold
    (so the draft pool maps them as they are). `from_q4_1` and `from_int8` pack plain tensors.
    The float activations are quantized inside the call: per block of 32, or with `per_token` (8-bit
    rows only) per row, each value a 15-bit integer in two int8 halves (csrc/qgemm.h, QW_Q8T).
    """

    def __init__(
        self,
        lib: ctypes.CDLL,
        *,
        q4: tuple[Tensor, Tensor, Tensor] | None = None,
        int8: tuple[Tensor, Tensor] | None = None,
        bias: Tensor | None = None,
        per_token: bool = False,
    ) -> None:
        self.lib = lib
        # the tensors the C struct points into (kept alive here)
        self.q4: tuple[Tensor, Tensor, Tensor] | None = None
        self.int8: tuple[Tensor, Tensor] | None = None
        if q4 is not None:
            nibbles, d, m = self.q4 = tuple(t.contiguous() for t in q4)  # type: ignore[assignment]
            assert nibbles.dtype == torch.uint8 and d.dtype == m.dtype == torch.float16
            self.out_features, self.in_features = nibbles.shape[0] * COLUMNS, nibbles.shape[1] * QK
            self.scale = None
            self.qweight = QWeight(KIND_Q4, 0, nibbles.data_ptr(), None, None, self.out_features, self.in_features)
            self.qweight.d, self.qweight.m = d.data_ptr(), m.data_ptr()
        else:
            assert int8 is not None
            cols, scale = int8
            cols = cols.contiguous()
            self.int8 = (cols, scale)
            assert cols.dtype == torch.uint8 and cols.dim() == 4
            self.out_features, self.in_features = cols.shape[0] * COLUMNS, cols.shape[1] * 4
            self.scale = scale.float().contiguous()  # [N]: a private fp32 copy (N floats)
            assert self.scale.shape == (self.out_features,)
            kind = KIND_Q8T if per_token else KIND_Q8
            self.qweight = QWeight(
                kind, 0, cols.data_ptr(), self.scale.data_ptr(), None, self.out_features, self.in_features
            )
        if self.in_features % QK:
            raise ValueError(
                f"native kernels need an input dimension that is a multiple of {QK}, got {self.in_features}"
            )
        self.bias = None if bias is None else bias.float().contiguous()
        self.qweight.bias = _ptr(self.bias)
        self.ref = ctypes.byref(self.qweight)

    @classmethod
    def from_q4_1(cls, lib: ctypes.CDLL, q: Tensor, d: Tensor, m: Tensor, bias: Tensor | None = None) -> QuantLinear:
        return cls(lib, q4=pack_q4_1(q, d, m), bias=bias)

    @classmethod
    def from_int8(
        cls, lib: ctypes.CDLL, w: Tensor, scale: Tensor, bias: Tensor | None = None, per_token: bool = False
    ) -> QuantLinear:
        return cls(lib, int8=(pack_int8(w), scale), bias=bias, per_token=per_token)

    def __call__(self, x: Tensor) -> Tensor:
        # x: [T, K] -> [T, N] in x's dtype
        x32 = x.float().contiguous()
        out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        if x.shape[0]:
            _ok(self.lib.qgemm_linear(x32.data_ptr(), x.shape[0], self.ref, out.data_ptr(), torch.get_num_threads()))
        return out if x.dtype == torch.float32 else out.to(x.dtype)


def attend(lib: ctypes.CDLL, q: Tensor, k_cache: Tensor, v_cache: Tensor, end: int, mask: Tensor | None) -> Tensor:
    """q [n, H, D] fp32 against cache rows [0, end) of k_cache/v_cache [Hkv, capacity, D] (one layer;
    fp32 or fp16, `KV_DTYPES`), under mask [n, end] bool (None: all rows) -> [n, H, D]. Each row alone,
    keys in cache order."""
    n, heads, dim = q.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k_cache.dtype == v_cache.dtype and k_cache.dtype in KV_DTYPES
    q = q.contiguous()
    if mask is not None:
        mask = mask.contiguous().view(torch.uint8)
    out = torch.empty(n, heads, dim)
    _ok(
        lib.qgemm_attention(
            q.data_ptr(),
            n,
            heads,
            k_cache.shape[0],
            dim,
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            k_cache.dtype == torch.float16,
            k_cache.shape[1],
            end,
            _ptr(mask),
            out.data_ptr(),
            torch.get_num_threads(),
        )
    )
    return out


class NativeLayer:
    """A decoder layer's pre- and post-attention parts, each one native call (see the module docstring).

    Built only when all seven products are `QuantLinear`s and the stream is fp32 on the CPU;
    attention itself stays the layer's own (`Attention.attend`), so trees, masks and row-by-row
    verification work exactly as for every other precision.
    """

    def __init__(self, lib: ctypes.CDLL, block) -> None:  # block: specdec.model.llama.Block
        self.lib, attn, mlp = lib, block.self_attn, block.mlp
        self.attn = attn
        attn.native_attend = functools.partial(attend, lib)  # the layer's attention runs natively too
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.norm1 = block.input_layernorm.weight.float().contiguous()
        self.norm2 = block.post_attention_layernorm.weight.float().contiguous()
        self.eps1, self.eps2 = block.input_layernorm.eps, block.post_attention_layernorm.eps
        self.q, self.k, self.v, self.o = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
        self.gate, self.up, self.down = mlp.gate_proj, mlp.up_proj, mlp.down_proj

    @staticmethod
    def supports(block) -> bool:
        attn, mlp = block.self_attn, block.mlp
        linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        return (
            all(isinstance(lin, QuantLinear) for lin in linears) and block.input_layernorm.weight.device.type == "cpu"
        )

    def __call__(self, x: Tensor, positions: Tensor, rope, spans) -> Tensor:
        # x: [T, C] fp32 -> [T, C]
        T, C = x.shape
        x = x.contiguous()
        positions = positions.contiguous()
        threads = torch.get_num_threads()
        q = torch.empty(T, self.heads, self.head_dim)
        k = torch.empty(T, self.kv_heads, self.head_dim)
        v = torch.empty(T, self.kv_heads, self.head_dim)
        _ok(
            self.lib.qgemm_layer_pre(
                x.data_ptr(),
                T,
                C,
                self.norm1.data_ptr(),
                self.eps1,
                self.q.ref,
                self.k.ref,
                self.v.ref,
                self.heads,
                self.kv_heads,
                self.head_dim,
                *_rope_pointers(rope, positions),
                q.data_ptr(),
                k.data_ptr(),
                v.data_ptr(),
                threads,
            )
        )
        attn = self.attn.attend(q, k, v, spans).reshape(T, self.heads * self.head_dim).contiguous()
        out = torch.empty(T, C)
        _ok(
            self.lib.qgemm_layer_post(
                x.data_ptr(),
                attn.data_ptr(),
                T,
                C,
                self.o.ref,
                self.norm2.data_ptr(),
                self.eps2,
                self.gate.ref,
                self.up.ref,
                self.down.ref,
                out.data_ptr(),
                threads,
            )
        )
        return out


class NativeStack:
    """Every decoder layer of a model in ONE native call per forward (`qgemm_forward`).

    The per-layer path (`NativeLayer`: pre, attention, post) costs three calls and a few tensor ops
    per layer from Python; over 30 layers that was ~4.5 of an 18 ms int4 step on a 2-core AVX2
    CPU. The C loop does the same arithmetic in the same order (same bits), so it is used whenever
    a forward fits it: all layers, native attention, and spans whose caches are whole
    [layers, Hkv, capacity, D] tensors without row-by-row paths. Anything else (the draft pool's
    layer subsets over compact caches) takes the per-layer path.
    """

    def __init__(self, lib: ctypes.CDLL, layers) -> None:  # layers: [specdec.model.llama.Block]
        self.lib, self.num_layers = lib, len(layers)
        first = layers[0].native
        self.heads, self.kv_heads, self.head_dim = first.heads, first.kv_heads, first.head_dim
        self.layers = (QLayer * len(layers))()
        for desc, block in zip(self.layers, layers):
            nl = block.native
            desc.norm1, desc.norm2 = nl.norm1.data_ptr(), nl.norm2.data_ptr()
            desc.eps1, desc.eps2 = nl.eps1, nl.eps2
            for name in ("q", "k", "v", "o", "gate", "up", "down"):
                setattr(desc, name, ctypes.pointer(getattr(nl, name).qweight))
        self._keep = layers  # the tensors the descriptors point into

    def fits(self, spans) -> bool:
        return all(
            s.row_paths is None
            and s.k_cache.dim() == 4
            and s.k_cache.shape[0] == self.num_layers
            and s.k_cache.is_contiguous()
            and s.v_cache.is_contiguous()
            and s.k_cache.dtype == s.v_cache.dtype
            and s.k_cache.dtype in KV_DTYPES
            for s in spans
        )

    def __call__(self, x: Tensor, positions: Tensor, rope, spans) -> Tensor:
        # x: [T, C] fp32 -> [T, C] after every layer; writes each span's new cache rows
        x = x.float().contiguous().clone()
        positions = positions.contiguous()
        descs = (QSpan * len(spans))()
        masks = []
        for d, s in zip(descs, spans):
            mask = None if s.mask is None else s.mask.contiguous().view(torch.uint8)
            masks.append(mask)
            d.start, d.n, d.num_cached = s.start, s.num_tokens, s.num_cached
            d.k_cache, d.v_cache = s.k_cache.data_ptr(), s.v_cache.data_ptr()
            d.layer_stride, d.capacity = s.k_cache.stride(0), s.k_cache.shape[2]
            d.mask = _ptr(mask)
            d.half = s.k_cache.dtype == torch.float16
        _ok(
            self.lib.qgemm_forward(
                x.data_ptr(),
                x.shape[0],
                x.shape[1],
                self.layers,
                self.num_layers,
                self.heads,
                self.kv_heads,
                self.head_dim,
                *_rope_pointers(rope, positions),
                descs,
                len(spans),
                torch.get_num_threads(),
            )
        )
        return x
