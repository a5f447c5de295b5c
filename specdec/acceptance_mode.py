"""Acceptance modes: the rule that decides which nodes of a verified tree the primary accepts.

  greedy     a node is accepted when its token is the primary's argmax; lossless at temperature 0
  sample     recursive rejection sampling (Leviathan et al. 2023; SpecInfer for trees); lossless
  threshold  opt-in, lossy: a node is accepted when the primary gives its token at least
             acceptance_threshold times the probability of its top token

The gateway decides a request's mode once (`select_mode`) and sends it (ValidateRequest.mode); the
validator checks what it is sent (`check_mode`) and applies it, never deriving a mode of its own.
The mirror of the proto enum `validator.AcceptanceMode` (held to it at import, specdec.proto_enum):
ACCEPTANCE_MODE_GREEDY is AcceptanceMode.GREEDY == "greedy".
"""

from __future__ import annotations

import enum

from specdec import proto_enum
from specdec.sampling import SamplingParams
from specdec.v1 import validator_pb2


class AcceptanceMode(enum.StrEnum):
    GREEDY = "greedy"
    SAMPLE = "sample"
    THRESHOLD = "threshold"


proto_enum.check_mirrors(AcceptanceMode, validator_pb2.AcceptanceMode)
THRESHOLD_OFF = 0.0  # acceptance_threshold of the lossless modes


def check_threshold(acceptance_threshold: float) -> None:
    """A request's acceptance_threshold: in [0, 1], 0 for off (ValueError naming the field)."""
    if not 0.0 <= acceptance_threshold <= 1.0:  # also refuses NaN
        raise ValueError(f"acceptance_threshold must be in [0, 1] (0: off), got {acceptance_threshold}")


def select_mode(sampling: SamplingParams, acceptance_threshold: float) -> AcceptanceMode:
    """The mode of a request: threshold when it asks for one, else the lossless mode of its sampling."""
    check_threshold(acceptance_threshold)
    if acceptance_threshold != THRESHOLD_OFF:
        return AcceptanceMode.THRESHOLD
    return AcceptanceMode.GREEDY if sampling.is_greedy else AcceptanceMode.SAMPLE


def check_mode(mode: AcceptanceMode, sampling: SamplingParams, acceptance_threshold: float) -> None:
    """What a mode needs of the step's other inputs; ValueError whose first word is the field at fault."""
    if mode == AcceptanceMode.THRESHOLD:
        if not 0.0 < acceptance_threshold <= 1.0:
            raise ValueError(f"acceptance_threshold must be in (0, 1] in threshold mode, got {acceptance_threshold}")
    elif acceptance_threshold != THRESHOLD_OFF:
        raise ValueError(f"acceptance_threshold is for threshold mode only; {mode} mode got {acceptance_threshold}")
    if mode == AcceptanceMode.GREEDY and not sampling.is_greedy:
        raise ValueError("mode greedy needs sampling.temperature = 0")


def from_pb(number: int) -> AcceptanceMode:
    """ValueError for ACCEPTANCE_MODE_UNSPECIFIED too: the sender decides the mode, always."""
    return proto_enum.member(AcceptanceMode, validator_pb2.AcceptanceMode, number)


def to_pb(mode: AcceptanceMode) -> validator_pb2.AcceptanceMode:
    return proto_enum.number(validator_pb2.AcceptanceMode, mode)
