"""specdec.proto_enum: a Python enum is held to the proto enum it mirrors."""

from __future__ import annotations

import enum

import pytest

from specdec import proto_enum
from specdec.task_type import TaskType, from_pb, to_pb
from specdec.v1 import common_pb2


def test_an_enum_that_does_not_mirror_its_proto_enum_is_refused():
    class Short(enum.StrEnum):  # CREATIVE missing, as after a value added to the proto
        STRUCTURED = "structured"
        CODE = "code"

    class Misspelt(enum.StrEnum):
        STRUCTURED = "structured"
        CODE = "Code"
        CREATIVE = "creative"

    for wrong in (Short, Misspelt):
        with pytest.raises(AssertionError, match="does not mirror"):
            proto_enum.check_mirrors(wrong, common_pb2.TaskType)
    proto_enum.check_mirrors(TaskType, common_pb2.TaskType)


def test_task_types_go_both_ways_and_unspecified_is_none():
    for task_type in TaskType:
        assert from_pb(to_pb(task_type)) is task_type
    assert to_pb(TaskType.CODE) == common_pb2.TASK_TYPE_CODE
    assert from_pb(common_pb2.TASK_TYPE_UNSPECIFIED) is None
    with pytest.raises(ValueError, match="got 99"):
        from_pb(99)
