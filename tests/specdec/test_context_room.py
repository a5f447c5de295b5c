"""specdec.context_room: max_context bounds a request's prompt and output together."""

from __future__ import annotations

import pytest

from specdec.context_room import check_fits, output_room
from specdec.errors import InvalidArgument


def test_a_prompt_one_token_short_of_the_context_has_room_for_one_token():
    assert output_room(15, 16) == 1 and output_room(10, 16) == 6
    check_fits(15, 16, "prompt")
    with pytest.raises(InvalidArgument) as refused:
        check_fits(16, 16, "prompt")
    assert refused.value.field == "prompt" and "at most 15" in refused.value.message
