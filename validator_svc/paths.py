"""The two ways this service runs the acceptance rule, behind one interface, chosen once at start-up.

  torch  the reference (acceptance.py) on logits decoded to fp32 on the host: every mode, any machine.
         fp8 logits in the modes row statistics decide are not decoded: their statistics come from
         each row's byte counts (fp8_stats.py; the grammar mask's allowed positions only), then
         the host walk.
  cuda   the row_stats RawKernel (kernel.py) straight on the wire's fp32 / bf16 / fp8_e4m3 bytes,
         grammar mask applied from its packed words in the kernel, then the host walk over the
         per-row results (at most N integer comparisons). No decoded [N+1, V] tensor on the host.
         This covers greedy and temperature-0 threshold validation, the modes the kernel's row
         statistics decide. The sampled modes (rejection sampling; threshold at temperature > 0)
         need whole rows after temperature / top-k / top-p, so this path hands them to the torch
         path: same results, decoded on the host.

Both return what acceptance.validate_tree returns for the same step (the kernel tests check the
kernel against the reference; tests/validator_svc/test_paths.py checks the two paths through the
servicer).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Protocol, Sequence


from specdec.grammar.bitmask import TokenBitmask
from specdec.model import native
from specdec.logits_codec import FORMAT_FP8_E4M3, EncodedLogits, decode_logits
from specdec.sampling import SamplingParams
from specdec.acceptance_mode import AcceptanceMode
from validator_svc.acceptance import ValidationResult, validate_tree
from validator_svc.fp8_stats import fp8_row_stats
from validator_svc.kernel import CudaRowStats, RowStats, RowStatsFn, cuda_device_count, validate_from_stats

PATH_TORCH = "torch"
PATH_CUDA = "cuda"
DEVICES = ("auto", "cpu", "cuda")


@dataclasses.dataclass(frozen=True, slots=True)
class ValidationInputs:
    """One step to validate, checked by the servicer: a tree of N nodes and its N+1 logits rows."""

    token_ids: Sequence[int]  # [N]
    parents: Sequence[int]  # [N], -1 for a child of the root
    target_logits: EncodedLogits  # [N+1, V] as they came on the wire, not decoded
    sampling: SamplingParams
    mode: AcceptanceMode  # as sent, checked (specdec.acceptance_mode.check_mode)
    acceptance_threshold: float = 0.0  # in (0, 1] in threshold mode, else 0
    argmax_ids: Sequence[int] | None = None  # [N+1], the primary's fp32 argmax, when sent
    position: int = 0  # with sampling.seed, selects the random streams (acceptance.validate_tree)
    allowed: TokenBitmask | None = None  # [N+1] rows of packed grammar mask


class ValidationPath(Protocol):
    name: str  # PATH_TORCH or PATH_CUDA: logged at start-up, the `path` label of the metric

    def warm_up(self) -> None:
        """Do the one-time work (kernel compilation) before the first request."""

    def validate(self, inputs: ValidationInputs) -> ValidationResult:
        """ValueError naming the field for inputs the rule refuses."""


class TorchPath:
    """The reference rule on the host."""

    name = PATH_TORCH

    def warm_up(self) -> None:
        native.library()  # the fp8 byte counts: built (once a machine) at start-up, not on the first request

    def validate(self, inputs: ValidationInputs) -> ValidationResult:
        if inputs.target_logits.format == FORMAT_FP8_E4M3 and is_decided_by_row_stats(inputs):
            stats = fp8_row_stats(
                inputs.target_logits, inputs.token_ids, inputs.parents, inputs.argmax_ids, inputs.allowed
            )
            return walk_row_stats(stats, inputs)
        return validate_tree(
            inputs.token_ids,
            inputs.parents,
            decode_logits(inputs.target_logits),
            inputs.sampling,
            inputs.mode,
            acceptance_threshold=inputs.acceptance_threshold,
            argmax_ids=inputs.argmax_ids,
            position=inputs.position,
            allowed=inputs.allowed,
        )


class CudaPath:
    """The kernel's row statistics and the host walk; the sampled modes go to `host` (see the module doc)."""

    name = PATH_CUDA

    def __init__(self, row_stats: RowStatsFn | None = None, host: ValidationPath | None = None) -> None:
        # row_stats: the kernel; a test passes a stand-in to prove this path is the one called.
        self.row_stats = row_stats if row_stats is not None else CudaRowStats()
        self.host = host if host is not None else TorchPath()

    def warm_up(self) -> None:
        compile_kernel = getattr(self.row_stats, "compile", None)
        if compile_kernel is not None:
            compile_kernel()

    def validate(self, inputs: ValidationInputs) -> ValidationResult:
        if not is_decided_by_row_stats(inputs):
            return self.host.validate(inputs)
        stats = self.row_stats(inputs.target_logits, inputs.token_ids, inputs.parents, inputs.allowed)
        return walk_row_stats(stats, inputs)


def walk_row_stats(stats: RowStats, inputs: ValidationInputs) -> ValidationResult:
    """The host walk of a step whose rows' statistics are known (either path)."""
    return validate_from_stats(
        stats,
        inputs.token_ids,
        inputs.parents,
        argmax_ids=inputs.argmax_ids,
        acceptance_threshold=inputs.acceptance_threshold,
    )


def is_decided_by_row_stats(inputs: ValidationInputs) -> bool:
    """Greedy, and threshold at temperature 0 (p(x) >= t max p  <=>  logit(x) - row max >= log t),
    need only per-row max, argmax and the children's logits: what the kernel computes."""
    return inputs.mode == AcceptanceMode.GREEDY or (
        inputs.mode == AcceptanceMode.THRESHOLD and inputs.sampling.is_greedy
    )


def make_path(
    device: str, *, device_count: Callable[[], int] = cuda_device_count, row_stats: RowStatsFn | None = None
) -> ValidationPath:
    """ "cpu" -> torch; "cuda" -> the kernel (refused when no CUDA device is visible, so a
    misconfigured node fails at start-up, not on its first request); "auto" -> cuda when a device is
    visible. device_count and row_stats are the seams a test without a GPU uses."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    if device == "cpu":
        return TorchPath()
    num_devices = device_count()
    if device == "cuda" and num_devices == 0:
        raise ValueError("device is cuda but no CUDA device is visible (CuPy, the driver or a GPU is missing)")
    return CudaPath(row_stats) if num_devices > 0 else TorchPath()
