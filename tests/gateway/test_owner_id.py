"""Owner ids: where a gateway is reached and which instance it is."""

from __future__ import annotations

import pytest

from gateway.owner_id import OwnerId, default_advertise_address


def test_an_owner_id_round_trips_through_its_stored_text() -> None:
    owner = OwnerId("10.1.2.3:50050", "9f0c3a7d52e1b486")
    assert str(owner) == "gateway@10.1.2.3:50050#9f0c3a7d52e1b486"
    assert OwnerId.parse(str(owner)) == owner
    assert OwnerId.parse(str(OwnerId("[::1]:50050", "ab"))) == OwnerId("[::1]:50050", "ab")
    assert owner.instance_health_name == "specdec.gateway.instance/9f0c3a7d52e1b486"


@pytest.mark.parametrize("text", ["gw-1", "gateway@host:1", "gateway@#ab", "gateway@host:1#", ""])
def test_an_owner_that_names_no_instance_does_not_parse(text: str) -> None:
    assert OwnerId.parse(text) is None


def test_new_instances_at_one_address_differ_by_nonce() -> None:
    first, second = OwnerId.new("gw:50050"), OwnerId.new("gw:50050")
    assert first != second and len(first.nonce) == 16
    assert second.is_other_instance_at(first)
    assert not second.is_other_instance_at(second)
    assert not second.is_other_instance_at(OwnerId.new("gw:50051"))
    assert not second.is_other_instance_at(None)


def test_an_owner_id_refuses_a_separator_in_its_parts() -> None:
    with pytest.raises(ValueError, match="address"):
        OwnerId("a#b:1", "n")
    with pytest.raises(ValueError, match="nonce"):
        OwnerId("a:1", "")


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        ("0.0.0.0", "gw-7:50050"),
        ("[::]", "gw-7:50050"),
        ("::", "gw-7:50050"),
        ("127.0.0.1", "127.0.0.1:50050"),
        ("10.0.0.5", "10.0.0.5:50050"),
        ("::1", "[::1]:50050"),
        ("[::1]", "[::1]:50050"),
        ("localhost", "localhost:50050"),
    ],
)
def test_the_default_advertised_address_is_the_listening_one_when_concrete(host: str, expected: str) -> None:
    assert default_advertise_address(host, 50050, "gw-7") == expected
