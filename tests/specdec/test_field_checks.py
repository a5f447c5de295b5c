import dataclasses

import pytest

from specdec.field_checks import require_at_least_one, require_bytes, require_counts


@dataclasses.dataclass
class _Record:
    num_rows: object = 1
    max_depth: object = 2


def test_values_of_one_and_more_pass():
    require_at_least_one(_Record(), "num_rows", "max_depth")
    require_counts(_Record(), "num_rows", "max_depth")


@pytest.mark.parametrize("value", [0, -3])
def test_the_first_field_below_one_is_named_with_its_value_and_the_prefix(value):
    with pytest.raises(ValueError, match=rf"^tree max_depth must be >= 1, got {value}$"):
        require_at_least_one(_Record(max_depth=value), "num_rows", "max_depth", prefix="tree ")


@pytest.mark.parametrize("value", [0, True, 2.0, "3", None])
def test_a_count_must_be_an_int_of_at_least_one_and_a_bool_is_not_one(value):
    with pytest.raises(ValueError, match=rf"^num_rows must be an int >= 1, got {value!r}$"):
        require_counts(_Record(num_rows=value), "num_rows", "max_depth")


def test_a_payload_must_be_bytes_and_its_type_is_named():
    require_bytes(_Record(num_rows=b"\x00"), "num_rows")
    with pytest.raises(ValueError, match=r"^num_rows must be bytes, got bytearray$"):
        require_bytes(_Record(num_rows=bytearray(1)), "num_rows")
