"""The one request-id limit (it was 128 characters in pb and 256 in the draft pool)."""

from __future__ import annotations

import pytest

from specdec import pb
from specdec.errors import InvalidArgument
from specdec.request_id import MAX_REQUEST_ID_CHARS, check_request_id, tenant_of


def test_ids_of_1_to_128_printable_characters_pass():
    assert MAX_REQUEST_ID_CHARS == 128 and pb.MAX_REQUEST_ID_CHARS is MAX_REQUEST_ID_CHARS
    for request_id in ("r", "alice/order-1", "x" * MAX_REQUEST_ID_CHARS):
        assert check_request_id(request_id) == pb.request_id_from_pb(request_id) == request_id


@pytest.mark.parametrize(
    "request_id, message",
    [
        ("", "request_id: must not be empty"),
        ("x" * (MAX_REQUEST_ID_CHARS + 1), "request_id: must be at most 128 printable characters"),
        ("a\nb", "request_id: must be at most 128 printable characters"),
    ],
)
def test_other_ids_are_refused_naming_the_field(request_id, message):
    for check in (check_request_id, pb.request_id_from_pb):
        with pytest.raises(InvalidArgument) as e:
            check(request_id)
        assert str(e.value) == message


def test_the_tenant_is_the_part_before_the_first_separator():
    assert tenant_of("acme/order-1") == "acme"
    assert tenant_of("acme/a/b") == "acme"
    assert tenant_of("order-1") == ""
