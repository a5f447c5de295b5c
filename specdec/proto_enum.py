"""Python enums that mirror the proto's enums, held to them at import, so the two cannot drift.

    class TaskType(enum.StrEnum):                 # TASK_TYPE_CODE -> TaskType.CODE == "code"
        ...
    check_mirrors(TaskType, common_pb2.TaskType)  # at import: AssertionError naming the difference
    member(TaskType, common_pb2.TaskType, common_pb2.TASK_TYPE_CODE)  # TaskType.CODE
    number(common_pb2.TaskType, TaskType.CODE)                        # common_pb2.TASK_TYPE_CODE

The members are written out (not built from the proto at run time) so that the type checker knows
them; check_mirrors makes a value added to the proto fail every import until the enum has it.
"""

from __future__ import annotations

import enum
from typing import Any

UNSPECIFIED = 0  # proto3: the value of an enum field that was not set
_UNSPECIFIED_SUFFIX = "UNSPECIFIED"


def _prefix(proto_enum: Any) -> str:
    """The prefix of every value's name: ACCEPTANCE_MODE_ from ACCEPTANCE_MODE_UNSPECIFIED."""
    unspecified = proto_enum.Name(UNSPECIFIED)
    assert unspecified.endswith(_UNSPECIFIED_SUFFIX), f"{unspecified}: value 0 of a proto enum is *_UNSPECIFIED"
    return unspecified.removesuffix(_UNSPECIFIED_SUFFIX)


def check_mirrors(str_enum_type: type[enum.StrEnum], proto_enum: Any) -> None:
    """The enum has a member per set value of `proto_enum`: its name without the prefix, its value
    that name in lower case (what logs, stats and stored state say)."""
    prefix = _prefix(proto_enum)
    expected = {n.removeprefix(prefix): n.removeprefix(prefix).lower() for n, v in proto_enum.items() if v}
    actual = {m.name: m.value for m in str_enum_type}
    if actual != expected:
        raise AssertionError(f"{str_enum_type.__name__} {actual} does not mirror its proto enum {expected}")


def member(str_enum_type: Any, proto_enum: Any, value: int) -> Any:
    """The member of an enum number; ValueError for UNSPECIFIED and for a number the proto does not
    define (a newer peer's)."""
    if value == UNSPECIFIED or value not in proto_enum.values():
        raise ValueError(f"must be one of {[m.value for m in str_enum_type]}, got {value}")
    return str_enum_type[proto_enum.Name(value).removeprefix(_prefix(proto_enum))]


def number(proto_enum: Any, value: enum.Enum) -> Any:  # a value of the proto enum (an int)
    return proto_enum.Value(_prefix(proto_enum) + value.name)
