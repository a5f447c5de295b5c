"""Task types: what a request generates (structured output, code, prose), which sets the adaptive
controller's prior acceptance before a request has any statistics of its own.

One definition, the mirror of the proto enum `common.TaskType` (held to it at import,
specdec.proto_enum): `TASK_TYPE_CODE` is `TaskType.CODE`, whose value "code" is what logs, stats
and the stored controller state say.
"""

from __future__ import annotations

import enum

from specdec import proto_enum
from specdec.v1 import common_pb2


class TaskType(enum.StrEnum):
    STRUCTURED = "structured"
    CODE = "code"
    CREATIVE = "creative"


proto_enum.check_mirrors(TaskType, common_pb2.TaskType)


def from_pb(number: int) -> TaskType | None:
    """None for TASK_TYPE_UNSPECIFIED (the gateway infers the type); ValueError for an unknown number."""
    if number == proto_enum.UNSPECIFIED:
        return None
    return proto_enum.member(TaskType, common_pb2.TaskType, number)


def to_pb(task_type: TaskType) -> common_pb2.TaskType:
    return proto_enum.number(common_pb2.TaskType, task_type)
