"""specdec.task_type: the task types, derived from the proto enum, both ways."""

from __future__ import annotations

import pytest

from specdec.task_type import TaskType, from_pb, to_pb
from specdec.v1 import common_pb2


def test_every_proto_task_type_but_unspecified_is_a_task_type_and_back():
    assert [t.value for t in TaskType] == ["structured", "code", "creative"]
    assert from_pb(common_pb2.TASK_TYPE_CODE) is TaskType.CODE and TaskType.CODE == "code"
    assert from_pb(common_pb2.TASK_TYPE_UNSPECIFIED) is None
    for number in common_pb2.TaskType.values():
        task_type = from_pb(number)
        assert task_type is None or to_pb(task_type) == number


def test_a_number_the_proto_does_not_define_is_refused():
    with pytest.raises(ValueError, match="got 99"):
        from_pb(99)
