"""Task types: what a request generates (structured output, code, prose), which sets the adaptive
controller's prior acceptance before a request has any statistics of its own.

One definition, derived from the proto enum `common.TaskType`: `TASK_TYPE_CODE` is `TaskType.CODE`,
whose value "code" is what logs, stats and the stored controller state say. A type added to the
proto is a type here, with no map to keep in step.
"""

from __future__ import annotations

import enum

from specdec.v1 import common_pb2

_PREFIX = "TASK_TYPE_"
UNSPECIFIED = common_pb2.TASK_TYPE_UNSPECIFIED  # the request leaves it to the gateway to infer

TaskType = enum.StrEnum(  # type: ignore[misc]
    "TaskType",
    [
        (name.removeprefix(_PREFIX), name.removeprefix(_PREFIX).lower())
        for name, number in common_pb2.TaskType.items()
        if number != UNSPECIFIED
    ],
    module=__name__,
)


def from_pb(number: int) -> TaskType | None:
    """The task type of an enum number; None for TASK_TYPE_UNSPECIFIED; ValueError for a number the
    proto does not define (a newer client's)."""
    if number == UNSPECIFIED:
        return None
    try:
        return TaskType[common_pb2.TaskType.Name(number).removeprefix(_PREFIX)]
    except ValueError:
        raise ValueError(f"unknown task type {number}") from None


def to_pb(task_type: TaskType) -> int:
    return common_pb2.TaskType.Value(_PREFIX + task_type.name)
