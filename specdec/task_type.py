"""Task types: what a request generates (structured output, code, prose), which sets the adaptive
controller's prior acceptance before a request has any statistics of its own.

One definition, derived from the proto enum `common.TaskType` (specdec.proto_enum):
`TASK_TYPE_CODE` is `TaskType.CODE`, whose value "code" is what logs, stats and the stored
controller state say. A type added to the proto is a type here, with no map to keep in step.
"""

from __future__ import annotations

from specdec import proto_enum
from specdec.v1 import common_pb2

TaskType = proto_enum.str_enum("TaskType", common_pb2.TaskType, __name__)


def from_pb(number: int) -> TaskType | None:
    """None for TASK_TYPE_UNSPECIFIED (the gateway infers the type); ValueError for an unknown number."""
    if number == proto_enum.UNSPECIFIED:
        return None
    return proto_enum.member(TaskType, common_pb2.TaskType, number)


def to_pb(task_type: TaskType) -> int:
    return proto_enum.number(common_pb2.TaskType, task_type)
