"""The weight layout of every matrix: decided once where the weights are converted, then carried.

A matrix of the model (a projection, the embedding, an untied lm_head) is stored in one of a few
layouts; which one follows from the precision, the matrix's shape and whether the native kernels
(`specdec.model.native`) built on this machine. `precision.convert_weights` makes that choice once
and records it per matrix as a `MatrixLayout` (layout, logical shape, the tensors that hold it).
`ModelWeights` carries the records beside the tensors: the layers read them, the shared-memory
manifest exports them (`specdec.weights`), and the draft pool builds its layers from the exported
records instead of guessing from tensor names.

    layout              tensors (in order)                                 served by
    DENSE               <m>.weight [N, K] fp32/bf16/fp16                   F.linear
    FP8                 <m>.weight [N, K] e4m3, <m>.weight_scale [N]       F.linear on the widened weight
    TORCH_INT4          <m>.weight_int4 [N, K/2], ..._scales_zeros [K/32, N, 2]   aten int4pack
    TORCH_INT8          <m>.weight_int8 [N, K] int8, <m>.weight_int8_scale [N]     aten int8pack
    NATIVE_INT4         <m>.weight_q4_1 [N/16, K/32, 256], _d, _m [N/16, K/32, 16]  native Q4_1
    NATIVE_INT8         <m>.weight_int8_columns [N/16, K/4, 16, 4], <m>.weight_int8_scale [N]
    NATIVE_INT8_TOKEN   <m>.weight_int8_token_columns (as NATIVE_INT8), <m>.weight_int8_scale [N]

The tensor names keep their suffixes, so a reader that predates the records (an older draft pool)
still finds them; `ModelWeights.from_names` is the reverse, for tensors that come without records
(an older primary's manifest, tensors assembled by hand).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from specdec.model import native

Tensor = torch.Tensor

WEIGHT = ".weight"
FP8_SCALE = ".weight_scale"
INT4_WEIGHT, INT4_SCALES_ZEROS = ".weight_int4", ".weight_int4_scales_zeros"
INT8_WEIGHT, INT8_SCALE = ".weight_int8", ".weight_int8_scale"
Q4_1_NIBBLES, Q4_1_D, Q4_1_M = ".weight_q4_1", ".weight_q4_1_d", ".weight_q4_1_m"
INT8_COLUMNS = ".weight_int8_columns"
INT8_TOKEN_COLUMNS = ".weight_int8_token_columns"


class WeightLayout(enum.Enum):
    """How one matrix is stored (see the module docstring's table)."""

    DENSE = "dense"
    FP8 = "fp8"
    TORCH_INT4 = "torch_int4"
    TORCH_INT8 = "torch_int8"
    NATIVE_INT4 = "native_int4"
    NATIVE_INT8 = "native_int8"
    NATIVE_INT8_TOKEN = "native_int8_token"

    @property
    def is_native(self) -> bool:
        return self in NATIVE_LAYOUTS

    @property
    def is_packed(self) -> bool:
        """Held by packed int4/int8 kernels, which give a row the same bits whatever the row count."""
        return self not in (WeightLayout.DENSE, WeightLayout.FP8)


NATIVE_LAYOUTS = frozenset({WeightLayout.NATIVE_INT4, WeightLayout.NATIVE_INT8, WeightLayout.NATIVE_INT8_TOKEN})
# the suffixes of a layout's tensors, in the order its layer takes them
SUFFIXES: dict[WeightLayout, tuple[str, ...]] = {
    WeightLayout.DENSE: (WEIGHT,),
    WeightLayout.FP8: (WEIGHT, FP8_SCALE),
    WeightLayout.TORCH_INT4: (INT4_WEIGHT, INT4_SCALES_ZEROS),
    WeightLayout.TORCH_INT8: (INT8_WEIGHT, INT8_SCALE),
    WeightLayout.NATIVE_INT4: (Q4_1_NIBBLES, Q4_1_D, Q4_1_M),
    WeightLayout.NATIVE_INT8: (INT8_COLUMNS, INT8_SCALE),
    WeightLayout.NATIVE_INT8_TOKEN: (INT8_TOKEN_COLUMNS, INT8_SCALE),
}
# int8 rows that also serve a lookup (`quant.Int8Embedding`)
INT8_ROW_LAYOUTS = frozenset({WeightLayout.TORCH_INT8, WeightLayout.NATIVE_INT8, WeightLayout.NATIVE_INT8_TOKEN})


@dataclasses.dataclass(frozen=True, slots=True)
class MatrixLayout:
    """One matrix: the module it belongs to, its layout, its logical shape [out_features,
    in_features], and the names of the tensors that hold it (in `SUFFIXES` order)."""

    module: str
    layout: WeightLayout
    shape: tuple[int, int]
    tensors: tuple[str, ...]

    @classmethod
    def of(cls, module: str, layout: WeightLayout, shape: tuple[int, ...]) -> MatrixLayout:
        assert len(shape) == 2, (module, shape)
        return cls(module, layout, (int(shape[0]), int(shape[1])), tuple(module + s for s in SUFFIXES[layout]))


def why_not_native(shape: tuple[int, ...], lib: Any) -> str:
    """Why the native packed layouts cannot hold an [N, K] matrix here ("" when they can): the
    kernels did not build (`lib` None), or the shape is not whole groups of output columns and
    whole blocks of inputs."""
    if lib is None:
        return f"native kernels {native.status()}"
    if len(shape) != 2 or not native.fits(*shape):
        return f"shape {tuple(shape)} is not whole groups of {native.COLUMNS} outputs and blocks of {native.QK} inputs"
    return ""


class ModelWeights(Mapping[str, Tensor]):
    """Named tensors (Hugging Face names) and the layout of every matrix among them; reads as the
    plain mapping of tensors."""

    def __init__(self, tensors: Mapping[str, Tensor], matrices: Iterable[MatrixLayout]) -> None:
        self.tensors = dict(tensors)
        self.matrices: dict[str, MatrixLayout] = {m.module: m for m in matrices}
        for m in self.matrices.values():
            if missing := [name for name in m.tensors if name not in self.tensors]:
                raise KeyError(missing[0])

    @classmethod
    def from_names(cls, tensors: Mapping[str, Tensor]) -> ModelWeights:
        """The records read back from the tensor names (for tensors that come without them)."""
        return cls(tensors, _matrices_by_name(tensors))

    def matrix(self, module: str) -> MatrixLayout | None:
        return self.matrices.get(module)

    def __getitem__(self, name: str) -> Tensor:
        return self.tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)


def model_weights(weights: Mapping[str, Tensor]) -> ModelWeights:
    """`weights` with its records: its own, or read from the names when it carries none."""
    return weights if isinstance(weights, ModelWeights) else ModelWeights.from_names(weights)


def count_layouts(matrices: Iterable[MatrixLayout]) -> dict[str, int]:
    """E.g. {"native_int4": 210, "native_int8": 1}: what a start-up log states."""
    counts: dict[str, int] = {}
    for m in matrices:
        counts[m.layout.value] = counts.get(m.layout.value, 0) + 1
    return counts


# the first tensor of each layout names it; the more specific suffixes first
_BY_FIRST_SUFFIX = (
    WeightLayout.NATIVE_INT8_TOKEN,
    WeightLayout.NATIVE_INT8,
    WeightLayout.NATIVE_INT4,
    WeightLayout.TORCH_INT4,
    WeightLayout.TORCH_INT8,
    WeightLayout.DENSE,
)


def _matrices_by_name(tensors: Mapping[str, Tensor]) -> list[MatrixLayout]:
    matrices = []
    for name, tensor in tensors.items():
        for layout in _BY_FIRST_SUFFIX:
            suffix = SUFFIXES[layout][0]
            if not name.endswith(suffix):
                continue
            module = name.removesuffix(suffix)
            if layout is WeightLayout.DENSE:
                if tensor.dim() != 2:
                    break  # a norm's weight: not a matrix
                if module + FP8_SCALE in tensors:
                    layout = WeightLayout.FP8
            matrices.append(MatrixLayout.of(module, layout, _logical_shape(layout, tuple(tensor.shape))))
            break
    return matrices


def _logical_shape(layout: WeightLayout, stored: tuple[int, ...]) -> tuple[int, int]:
    """[N, K] of a matrix from the shape of its layout's first tensor."""
    if layout is WeightLayout.TORCH_INT4:
        return stored[0], stored[1] * 2  # two nibbles a byte
    if layout is WeightLayout.NATIVE_INT4:
        return stored[0] * native.COLUMNS, stored[1] * native.QK
    if layout in (WeightLayout.NATIVE_INT8, WeightLayout.NATIVE_INT8_TOKEN):
        return stored[0] * native.COLUMNS, stored[1] * 4
    return stored[0], stored[1]
